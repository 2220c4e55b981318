"""Sentence-aligned parallel text (translation pairs) as token ids on disk, batched by token count.

Files are UTF-8, one sentence per line, aligned by line (line i of the source file translates line i
of the target file), like Multi30k's ``train.de`` / ``train.en``. :func:`read_parallel` reads a pair
of files; :meth:`ParallelDataset.prepare` encodes every split once into ``cache_dir``:

* ``<split>.source.npy`` / ``<split>.target.npy`` -- the ids of all sentences, flat ``uint32``;
* ``<split>.source_offsets.npy`` / ``<split>.target_offsets.npy`` -- ``int64`` (n + 1,) offsets:
  sentence k is ``ids[offsets[k]:offsets[k + 1]]``;
* ``<split>.lines.npy`` -- the 0-based line number of each pair in the files (empty lines skipped);
* ``parallel_meta.json`` -- per split: both files' path / size / mtime / sha256, the tokenizer's
  fingerprint and the ``empty_lines`` mode. It is updated after a split's arrays are whole.

A later ``prepare`` reuses a split whose files and tokenizer are unchanged (``reused[split]``); a
changed file re-encodes that split only. The cached ids are never filtered or truncated, so changing
``max_source_len`` / ``max_target_len`` needs no re-encoding.

Sentence ids exclude bos / eos; :meth:`ParallelDataset.collate` adds them (fairseq's layout)::

    source     = ids + [eos]          (B, S)  right-padded with pad
    target_in  = [bos] + ids          (B, T)  decoder input
    target_out = ids + [eos]          (B, T)  labels; padding is pad (use ignore_index=pad)

so a pair needs ``len(source ids) + 1 <= max_source_len`` and ``len(target ids) + 1 <=
max_target_len`` positions. Longer pairs are dropped from the training splits (``split_dropped``)
and kept but truncated in evaluation splits (``split_truncated``; :meth:`sentences` still returns
the full text, for BLEU references). Both warn.

:meth:`ParallelDataset.batches` groups pair indices like fairseq's ``--max-tokens``: indices sorted by
(source length, target length), cut greedily so that ``batch size * longest padded side <=
max_tokens``, then (``shuffle=True``) the batch order shuffled per ``(seed, epoch)``.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import ConfigError, DataError, TokenizerError
from ..files import sha256_file, write_atomic
from ..packaged import where_bundled
from .text import read_text
from .tokenizers import Tokenizer

META_FILE = "parallel_meta.json"
FORMAT_VERSION = 1
SIDES = ("source", "target")
EMPTY_LINE_MODES = ("error", "skip")
_SPLIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_ARRAYS = ("source", "source_offsets", "target", "target_offsets", "lines")


# ---- reading files ------------------------------------------------------------------------------


def _lines(path: Path, digests: dict[str, str] | None = None) -> list[str]:
    """The lines of a UTF-8 file split on ``'\\n'`` only, without the newline (and a ``'\\r'`` before it).
    ``digests[str(path)]`` receives the sha256 of the text read."""
    text = read_text(path)
    if digests is not None:
        digests[str(path)] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file ends with a newline
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _check_empty_lines(empty_lines: str) -> None:
    if empty_lines not in EMPTY_LINE_MODES:
        raise ConfigError(f"empty_lines: {empty_lines!r} is not allowed; choose one of "
                          f"{', '.join(repr(m) for m in EMPTY_LINE_MODES)}")


class _Aligned(NamedTuple):
    lines: list[int]  # 0-based line numbers of the kept pairs
    source: list[str]
    target: list[str]
    total: int  # lines in each file
    first_empty: tuple[str, int] | None  # (file, 1-based line) of the first skipped empty line
    digests: dict[str, str]  # str(path) -> sha256 of the text read


def _skip_message(skipped: int, total: int, source_path: Any, target_path: Any, first_empty: Any) -> str:
    return (f"skipped {skipped} of {total} pairs with an empty line in {source_path} / {target_path} "
            f"(the first in {first_empty[0]} at line {first_empty[1]})")


def _read_aligned(source_path: Path, target_path: Path, empty_lines: str) -> _Aligned:
    """The kept pairs of two aligned files (no warning); see :func:`read_parallel`."""
    _check_empty_lines(empty_lines)
    digests: dict[str, str] = {}
    src, tgt = _lines(source_path, digests), _lines(target_path, digests)
    if len(src) != len(tgt):
        raise DataError(f"misaligned parallel files: {source_path} has {len(src)} lines but "
                        f"{target_path} has {len(tgt)} lines")
    keep: list[int] = []
    first_empty: tuple[str, int] | None = None
    for i, (s, t) in enumerate(zip(src, tgt, strict=True)):
        if s.strip() and t.strip():
            keep.append(i)
            continue
        where = (str(source_path if not s.strip() else target_path), i + 1)
        if empty_lines == "error":
            raise DataError(f"empty line in {where[0]} at line {where[1]}; fix the data or pass "
                            f"empty_lines='skip' to drop such pairs")
        first_empty = first_empty or where
    total = len(src)
    if len(keep) < total:
        src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
    return _Aligned(keep, src, tgt, total, first_empty, digests)


def read_parallel(source_path: str | Path, target_path: str | Path, *,
                  empty_lines: str = "error") -> list[tuple[str, str]]:
    """(source, target) sentence pairs of two line-aligned UTF-8 files.

    Only the newline (``\\n`` or ``\\r\\n``) is stripped from each line. Files of different line counts
    raise DataError naming both files and counts. A whitespace-only line raises DataError naming the
    file and its 1-based line number (``empty_lines="error"``) or drops that pair with a warning
    saying how many were skipped (``"skip"``). A missing, empty or non-UTF-8 file raises DataError.
    """
    source_path, target_path = Path(source_path), Path(target_path)
    data = _read_aligned(source_path, target_path, empty_lines)
    if data.first_empty is not None:
        warnings.warn(_skip_message(data.total - len(data.lines), data.total, source_path, target_path,
                                    data.first_empty), stacklevel=2)
    return list(zip(data.source, data.target, strict=True))


# ---- batches ------------------------------------------------------------------------------------


class ParallelBatch(NamedTuple):
    """One collated batch; all tensors are int64 (B = pairs, S / T = padded source / target length)."""

    source: torch.Tensor  # (B, S) ids + eos, right-padded with pad
    source_mask: torch.Tensor  # (B, S) 1 for real tokens, 0 for padding
    target_in: torch.Tensor  # (B, T) bos + ids, right-padded with pad
    target_out: torch.Tensor  # (B, T) ids + eos, right-padded with pad (the loss's ignore_index)
    target_mask: torch.Tensor  # (B, T) 1 for real tokens, 0 for padding
    num_target_tokens: int  # real target tokens (target_mask.sum()), eos included
    indices: torch.Tensor  # (B,) the pair indices of the rows, in the order given to collate

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ParallelBatch:
        """The batch with every tensor moved to ``device``."""
        return self._replace(**{name: getattr(self, name).to(device, non_blocking=non_blocking)
                                for name in ("source", "source_mask", "target_in", "target_out",
                                             "target_mask", "indices")})


def _pad_rows(rows: list[np.ndarray], width: int, pad_id: int) -> torch.Tensor:
    out = np.full((len(rows), width), pad_id, dtype=np.int64)
    for r, row in enumerate(rows):
        out[r, :len(row)] = row
    return torch.from_numpy(out)


def _check_pos_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name}: expected an integer >= {minimum}, got {value!r}")


# ---- the dataset --------------------------------------------------------------------------------


class _Split:
    """The arrays of one split, with the kept pairs' positions and (truncated) lengths."""

    def __init__(self, cache_dir: Path, name: str, entry: dict[str, Any]) -> None:
        self.name, self.entry = name, entry
        n, ns, nt = entry["num_pairs"], entry["num_tokens"]["source"], entry["num_tokens"]["target"]
        expected = {"source": (ns,), "target": (nt,), "source_offsets": (n + 1,), "target_offsets": (n + 1,),
                    "lines": (n,)}
        self.arrays: dict[str, np.ndarray] = {}
        for key in _ARRAYS:
            path = cache_dir / f"{name}.{key}.npy"
            try:
                arr = np.load(path, mmap_mode="r") if expected[key][0] else np.load(path)
            except (OSError, ValueError) as err:
                raise DataError(f"{path} is missing or damaged ({err}); prepare the data again") from None
            if arr.shape != expected[key]:
                raise DataError(f"{path} has shape {arr.shape}, expected {expected[key]}; prepare the data again")
            self.arrays[key] = arr
        self.full_lengths = {side: np.diff(np.asarray(self.arrays[f"{side}_offsets"])) for side in SIDES}
        self.positions = np.arange(n, dtype=np.int64)
        self.lengths = dict(self.full_lengths)
        self.dropped = self.truncated = 0

    def apply_limits(self, max_len: dict[str, int], train: bool) -> None:
        too_long = np.zeros(len(self.positions), dtype=bool)
        for side in SIDES:
            too_long |= self.full_lengths[side] + 1 > max_len[side]
        if train:
            self.positions = np.flatnonzero(~too_long).astype(np.int64)
            self.lengths = {side: self.full_lengths[side][self.positions] for side in SIDES}
            self.dropped = int(too_long.sum())
        else:
            self.lengths = {side: np.minimum(self.full_lengths[side], max_len[side] - 1) for side in SIDES}
            self.truncated = int(too_long.sum())

    def ids(self, side: str, index: int) -> np.ndarray:
        pos = self.positions[index]
        offsets = self.arrays[f"{side}_offsets"]
        start = int(offsets[pos])
        return np.asarray(self.arrays[side][start:start + int(self.lengths[side][index])], dtype=np.int64)


class ParallelDataset:
    """Token ids of line-aligned translation pairs per split; see the module docstring."""

    def __init__(self, cache_dir: Path, splits: dict[str, _Split], max_source_len: int, max_target_len: int,
                 reused: dict[str, bool]) -> None:
        self.cache_dir = cache_dir
        self._splits = splits
        self.max_source_len = max_source_len
        self.max_target_len = max_target_len
        self.reused = reused  # split -> True when prepare() found up-to-date arrays and skipped encoding

    # ---- building -------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, pairs_by_split: Mapping[str, tuple[str | Path, str | Path]], tokenizer: Tokenizer,
                cache_dir: str | Path, *, max_source_len: int, max_target_len: int, empty_lines: str = "error",
                train_splits: Collection[str] = ("train",)) -> ParallelDataset:
        """Encode each split's ``(source_path, target_path)`` into ``cache_dir`` (or reuse it) and open it.

        ``max_source_len`` / ``max_target_len`` count positions (ids + eos, bos + ids). Splits named in
        ``train_splits`` drop longer pairs; the others keep them truncated. Both warn with the count.
        """
        _check_empty_lines(empty_lines)
        _check_pos_int("max_source_len", max_source_len, 2)
        _check_pos_int("max_target_len", max_target_len, 2)
        if not pairs_by_split:
            raise ConfigError("pairs_by_split: name at least one split, e.g. {'train': (src, tgt)}")
        for name in pairs_by_split:
            if not isinstance(name, str) or not _SPLIT_NAME.fullmatch(name):
                raise ConfigError(f"split name {name!r}: use letters, digits, '_', '.' or '-'")
        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        meta = _read_meta(cache_dir)
        splits: dict[str, _Split] = {}
        reused: dict[str, bool] = {}
        for name, (src_path, tgt_path) in pairs_by_split.items():
            files = {"source": Path(src_path), "target": Path(tgt_path)}
            for path in files.values():
                if not path.is_file():
                    raise DataError(f"data file not found: {path}{where_bundled(path)}")
            wanted = {"tokenizer": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
                      "empty_lines": empty_lines}
            split = _reuse(cache_dir, meta, name, files, wanted)
            reused[name] = split is not None
            if split is None:
                split = _encode_split(cache_dir, meta, name, files, wanted, tokenizer)
            splits[name] = split
        limits = {"source": max_source_len, "target": max_target_len}
        for name, split in splits.items():
            entry = split.entry
            if entry["skipped"]:
                warnings.warn(_skip_message(entry["skipped"], entry["num_pairs"] + entry["skipped"],
                                            entry["files"]["source"]["path"], entry["files"]["target"]["path"],
                                            entry["first_empty"]), stacklevel=2)
            split.apply_limits(limits, train=name in train_splits)
            total = entry["num_pairs"]
            what = (f"source longer than max_source_len={max_source_len} or target longer than "
                    f"max_target_len={max_target_len} positions (ids + eos / bos)")
            if split.dropped:
                warnings.warn(f"dropped {split.dropped} of {total} pairs from {name!r} with a {what}", stacklevel=2)
            if split.truncated:
                warnings.warn(f"{split.truncated} of {total} pairs in {name!r} have a {what}; they are kept "
                              f"but truncated (sentences() keeps the full text)", stacklevel=2)
        return cls(cache_dir, splits, max_source_len, max_target_len, reused)

    # ---- properties -----------------------------------------------------------------------------

    @property
    def splits(self) -> list[str]:
        return list(self._splits)

    @property
    def split_dropped(self) -> dict[str, int]:
        """Pairs dropped from each training split by the length limits (0 for evaluation splits)."""
        return {name: s.dropped for name, s in self._splits.items()}

    @property
    def split_truncated(self) -> dict[str, int]:
        """Pairs truncated in each evaluation split by the length limits (0 for training splits)."""
        return {name: s.truncated for name, s in self._splits.items()}

    @property
    def split_skipped(self) -> dict[str, int]:
        """Pairs skipped for an empty line (``empty_lines="skip"``) in each split."""
        return {name: int(s.entry["skipped"]) for name, s in self._splits.items()}

    def _split(self, split: str) -> _Split:
        try:
            return self._splits[split]
        except KeyError:
            raise ValueError(f"unknown split {split!r}; this dataset has {', '.join(self._splits)}") from None

    def num_pairs(self, split: str) -> int:
        """Pairs in ``split`` after empty-line skipping and (training splits) length filtering."""
        return len(self._split(split).positions)

    def __len__(self) -> int:
        """Pairs in all splits together."""
        return sum(len(s.positions) for s in self._splits.values())

    def source_lengths(self, split: str) -> np.ndarray:
        """Ids per source sentence (no eos; after truncation), indexed like :meth:`batches`."""
        return self._split(split).lengths["source"]

    def target_lengths(self, split: str) -> np.ndarray:
        """Ids per target sentence (no bos / eos; after truncation), indexed like :meth:`batches`."""
        return self._split(split).lengths["target"]

    def line_numbers(self, split: str) -> np.ndarray:
        """0-based line number in the files of each pair."""
        s = self._split(split)
        return np.asarray(s.arrays["lines"])[s.positions]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={len(s.positions)}" for name, s in self._splits.items())
        return f"ParallelDataset({str(self.cache_dir)!r}, {sizes})"

    # ---- reading --------------------------------------------------------------------------------

    def sentences(self, split: str, side: str) -> list[str]:
        """Raw text of ``side`` (``"source"`` / ``"target"``) for each pair of ``split``, untruncated."""
        if side not in SIDES:
            raise ValueError(f"side must be 'source' or 'target', got {side!r}")
        s = self._split(split)
        recorded = s.entry["files"][side]
        path = Path(recorded["path"])
        if not path.is_file():
            raise DataError(f"data file not found: {path}{where_bundled(path)}")
        stat = path.stat()
        if (stat.st_size, stat.st_mtime_ns) != (recorded["size"], recorded["mtime_ns"]):
            raise DataError(f"{path} changed after the data was prepared; prepare it again")
        lines = _lines(path)
        return [lines[i] for i in self.line_numbers(split).tolist()]

    def batches(self, split: str, max_tokens: int, *, shuffle: bool, seed: int = 0,
                epoch: int = 0, max_sentences: int | None = None) -> list[list[int]]:
        """Pair indices of ``split`` grouped into batches by token count (fairseq's ``--max-tokens``).

        Indices are sorted by (source length, target length) -- after a random permutation when
        ``shuffle`` so that pairs of equal lengths mix -- and cut greedily so that ``len(batch) *
        max(padded source, padded target length) <= max_tokens`` (and ``len(batch) <= max_sentences``);
        a pair longer than ``max_tokens`` alone forms its own batch. With ``shuffle`` the batch order is
        then shuffled; both random steps use ``numpy.random.default_rng([seed, epoch])``, so each
        ``(seed, epoch)`` gives one fixed order. Without ``shuffle`` batches keep length order. Every
        index appears exactly once.
        """
        _check_pos_int("max_tokens", max_tokens)
        if max_sentences is not None:
            _check_pos_int("max_sentences", max_sentences)
        s = self._split(split)
        src = s.lengths["source"].astype(np.int64) + 1  # + eos
        tgt = s.lengths["target"].astype(np.int64) + 1  # bos + / + eos
        n = len(src)
        if shuffle:
            rng = np.random.default_rng([int(seed), int(epoch)])
            perm = rng.permutation(n)
            order = perm[np.lexsort((tgt[perm], src[perm]))]  # lexsort is stable
        else:
            order = np.lexsort((tgt, src))
        size = np.maximum(src, tgt)[order].tolist()
        cap = max_sentences if max_sentences is not None else n + 1
        batches: list[list[int]] = []
        batch: list[int] = []
        longest = 0
        for idx, length in zip(order.tolist(), size, strict=True):
            wider = max(longest, length)
            if batch and ((len(batch) + 1) * wider > max_tokens or len(batch) >= cap):
                batches.append(batch)
                batch, wider = [], length
            batch.append(idx)
            longest = wider
        if batch:
            batches.append(batch)
        if shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches)).tolist()]
        return batches

    def collate(self, split: str, indices: Iterable[int], pad_id: int, bos_id: int, eos_id: int) -> ParallelBatch:
        """Tensors of the pairs ``indices`` of ``split``, in that order; see :class:`ParallelBatch`."""
        for name, value in (("pad_id", pad_id), ("bos_id", bos_id), ("eos_id", eos_id)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be a token id (an integer >= 0), got {value!r}; does the "
                                 f"tokenizer have <pad>, <s> and </s>?")
        s = self._split(split)
        idx = [int(i) for i in indices]
        if not idx:
            raise ValueError("collate needs at least one pair index")
        n = len(s.positions)
        bad = [i for i in idx if not 0 <= i < n]
        if bad:
            raise IndexError(f"pair indices outside [0, {n}) of split {split!r}: {bad[:10]}")
        src = [s.ids("source", i) for i in idx]
        tgt = [s.ids("target", i) for i in idx]
        eos, bos = np.array([eos_id], dtype=np.int64), np.array([bos_id], dtype=np.int64)
        width_s = max(len(x) for x in src) + 1
        width_t = max(len(y) for y in tgt) + 1
        source = _pad_rows([np.concatenate([x, eos]) for x in src], width_s, pad_id)
        target_in = _pad_rows([np.concatenate([bos, y]) for y in tgt], width_t, pad_id)
        target_out = _pad_rows([np.concatenate([y, eos]) for y in tgt], width_t, pad_id)
        src_len = torch.tensor([len(x) + 1 for x in src])
        tgt_len = torch.tensor([len(y) + 1 for y in tgt])
        source_mask = (torch.arange(width_s)[None, :] < src_len[:, None]).long()
        target_mask = (torch.arange(width_t)[None, :] < tgt_len[:, None]).long()
        return ParallelBatch(source, source_mask, target_in, target_out, target_mask,
                             int(tgt_len.sum()), torch.tensor(idx, dtype=torch.int64))


# ---- cache --------------------------------------------------------------------------------------


def _read_meta(cache_dir: Path) -> dict[str, Any]:
    try:
        meta = json.loads((cache_dir / META_FILE).read_text())
    except (OSError, ValueError):
        meta = None
    if not (isinstance(meta, dict) and meta.get("format") == FORMAT_VERSION and isinstance(meta.get("splits"), dict)):
        meta = {"format": FORMAT_VERSION, "splits": {}}
    return meta


def _write_meta(cache_dir: Path, meta: dict[str, Any]) -> None:
    write_atomic(cache_dir / META_FILE, lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))


def _stat(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _reuse(cache_dir: Path, meta: dict[str, Any], name: str, files: dict[str, Path],
           wanted: dict[str, Any]) -> _Split | None:
    """The cached split when its files and settings are unchanged (same stat, or same size and sha256)."""
    entry = meta["splits"].get(name)
    if not isinstance(entry, dict) or any(entry.get(k) != v for k, v in wanted.items()):
        return None
    new_stats, restat = {}, False
    for side, path in files.items():
        old, new = entry.get("files", {}).get(side, {}), _stat(path)
        if all(old.get(k) == new[k] for k in ("path", "size", "mtime_ns")):
            new_stats[side] = {**new, "sha256": old.get("sha256")}
        elif old.get("size") == new["size"] and old.get("sha256") == sha256_file(path):
            new_stats[side], restat = {**new, "sha256": old["sha256"]}, True  # same content, new path / mtime
        else:
            return None
    try:
        split = _Split(cache_dir, name, entry)
    except (DataError, KeyError, TypeError):
        return None  # damaged: encode again
    if restat:
        entry["files"] = new_stats
        _write_meta(cache_dir, meta)
    return split


def _encode_split(cache_dir: Path, meta: dict[str, Any], name: str, files: dict[str, Path],
                  wanted: dict[str, Any], tokenizer: Tokenizer) -> _Split:
    stats = {side: _stat(path) for side, path in files.items()}  # before reading: a later edit re-encodes
    data = _read_aligned(files["source"], files["target"], wanted["empty_lines"])
    arrays: dict[str, np.ndarray] = {"lines": np.asarray(data.lines, dtype=np.int64)}
    num_tokens = {}
    for side, texts in (("source", data.source), ("target", data.target)):
        try:
            encoded = tokenizer.encode_batch(texts)
        except TokenizerError as err:  # named by the file's line (data.lines: the kept pairs' 0-based lines)
            bad = tokenizer.first_unencodable(texts)
            where = f"{files[side]}:{data.lines[bad] + 1}" if bad is not None else str(files[side])
            raise (type(err) if isinstance(err, DataError) else DataError)(f"{where}: {err}") from None
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        flat = np.fromiter((i for e in encoded for i in e), dtype=np.uint32, count=int(offsets[-1]))
        arrays[side], arrays[f"{side}_offsets"] = flat, offsets
        num_tokens[side] = int(offsets[-1])
    meta["splits"].pop(name, None)  # arrays and meta never disagree
    _write_meta(cache_dir, meta)
    for key in _ARRAYS:
        write_atomic(cache_dir / f"{name}.{key}.npy", lambda tmp, arr=arrays[key]: _save_npy(tmp, arr))
    for side, path in files.items():
        stats[side]["sha256"] = data.digests[str(path)]
    entry = {**wanted, "files": stats, "num_pairs": len(data.lines), "num_tokens": num_tokens,
             "skipped": data.total - len(data.lines), "first_empty": data.first_empty}
    meta["splits"][name] = entry
    _write_meta(cache_dir, meta)
    return _Split(cache_dir, name, entry)


def _save_npy(path: Path, arr: np.ndarray) -> None:
    with path.open("wb") as f:  # a file object: np.save would append ".npy" to a path
        np.save(f, arr)
