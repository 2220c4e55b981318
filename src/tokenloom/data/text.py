"""Token ids of a text file, kept on disk as numpy memmaps with a train/val split (like nanoGPT).

:meth:`TextDataset.prepare` encodes a text file once and writes, into ``out_dir``:

* ``train.bin`` / ``val.bin`` -- the raw ids (``uint16`` when ``vocab_size < 65536``, else
  ``uint32``); the first ``int(n * (1 - val_fraction))`` tokens are train, the rest val;
* ``data_meta.json`` -- dtype, sizes, the tokenizer's kind / vocab size / fingerprint and the source
  file's path, size, mtime and sha256. It is written last, so its presence means both bins are whole.

Every file is written to a temporary name and renamed. A later ``prepare`` with the same source
content, tokenizer and ``val_fraction`` reuses the files without re-encoding.

Batches (B = batch size, T = sequence length): ``get_batch`` draws B random windows of T + 1 tokens
from a ``torch.Generator`` (so a saved generator state resumes the exact stream); ``iter_batches``
walks non-overlapping windows in order, for evaluation. Both return ``x, y`` as int64 (B, T)
tensors with ``y[:, t] == x[:, t + 1]`` inside the window.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DataError, TokenizerError
from ..files import sha256_file, write_atomic
from ..packaged import where_bundled
from .tokenizers import Tokenizer

META_FILE = "data_meta.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")


def read_text(path: str | Path) -> str:
    """The exact content of a UTF-8 text file (no newline translation); one-line DataErrors."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}{where_bundled(path)}")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DataError(f"cannot read data file {path}: {err.strerror or err}") from None
    if not raw:
        raise DataError(f"data file is empty: {path}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"data file {path} is not UTF-8 text (bad byte at offset {err.start})") from None


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")


def _check_sizes(batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got batch_size={batch_size}, "
                         f"seq_len={seq_len}")


class TextDataset:
    """Train/val token ids of one text file, read through memmaps; see the module docstring."""

    def __init__(self, out_dir: str | Path, meta: dict[str, Any], reused: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.meta = meta
        self.reused = reused  # True when prepare() found up-to-date files and skipped encoding
        self.dtype = np.dtype(meta["dtype"])
        self._arrays: dict[str, np.ndarray] = {}
        for split in SPLITS:
            path = self.out_dir / f"{split}.bin"
            expected = int(meta["num_tokens"][split]) * self.dtype.itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise DataError(f"{path} is missing or truncated (expected {expected} bytes); "
                                f"prepare the data again")

    # ---- building -------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, text_path: str | Path, tokenizer: Tokenizer, out_dir: str | Path,
                val_fraction: float = 0.1) -> TextDataset:
        """Encode ``text_path`` into ``out_dir`` (or reuse up-to-date files there) and open it."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        text_path, out_dir = Path(text_path), Path(out_dir)
        if not text_path.is_file():
            raise DataError(f"data file not found: {text_path}{where_bundled(text_path)}")
        stat = text_path.stat()
        if stat.st_size == 0:
            raise DataError(f"data file is empty: {text_path}")
        source = {"path": str(text_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        wanted = {"format": FORMAT_VERSION, "val_fraction": val_fraction,
                  "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
                                "fingerprint": tokenizer.fingerprint}}

        old = cls._read_meta(out_dir)
        if old is not None and all(old.get(k) == v for k, v in wanted.items()):
            old_source = old.get("source", {})
            same_stat = all(old_source.get(k) == source[k] for k in ("path", "size", "mtime_ns"))
            if same_stat or (old_source.get("size") == source["size"]
                             and old_source.get("sha256") == sha256_file(text_path)):
                try:
                    dataset = cls(out_dir, old, reused=True)
                except DataError:
                    pass  # a bin is damaged: encode again below
                else:
                    if not same_stat:  # same content, new path or mtime: remember the new stat
                        old["source"] = {**source, "sha256": old_source["sha256"]}
                        cls._write_meta(out_dir, old)
                    return dataset

        text = read_text(text_path)
        source["sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
        try:
            ids = tokenizer.encode_array(text)
        except TokenizerError as err:
            raise _located(err, text_path, text, tokenizer) from None
        del text
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size < 65536 else np.uint32)
        num_train = int(len(ids) * (1.0 - val_fraction))
        parts = {"train": ids[:num_train], "val": ids[num_train:]}

        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / META_FILE).unlink(missing_ok=True)  # bins and meta never disagree
        for split, part in parts.items():
            write_atomic(out_dir / f"{split}.bin", lambda tmp, p=part: p.astype(dtype).tofile(tmp))
        meta = {**wanted, "dtype": dtype.name, "source": source,
                "num_tokens": {split: int(len(part)) for split, part in parts.items()}}
        cls._write_meta(out_dir, meta)
        return cls(out_dir, meta, reused=False)

    @classmethod
    def open(cls, out_dir: str | Path) -> TextDataset:
        """Open data written by :meth:`prepare`; missing or damaged files raise DataError."""
        out_dir = Path(out_dir)
        meta = cls._read_meta(out_dir)
        if meta is None:
            raise DataError(f"no prepared data in {out_dir} ({META_FILE} missing or unreadable)")
        return cls(out_dir, meta)

    @staticmethod
    def _read_meta(out_dir: Path) -> dict[str, Any] | None:
        try:
            meta = json.loads((out_dir / META_FILE).read_text())
        except (OSError, ValueError):
            return None
        ok = (isinstance(meta, dict) and meta.get("format") == FORMAT_VERSION
              and isinstance(meta.get("num_tokens"), dict) and "dtype" in meta)
        return meta if ok else None

    @staticmethod
    def _write_meta(out_dir: Path, meta: dict[str, Any]) -> None:
        write_atomic(out_dir / META_FILE, lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))

    # ---- reading --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer that produced the ids."""
        return int(self.meta["tokenizer"]["vocab_size"])

    def tokens(self, split: str) -> np.ndarray:
        """The ids of ``split`` as a read-only 1-D memmap (an empty array for an empty split)."""
        _check_split(split)
        if split not in self._arrays:
            n = self.num_tokens(split)
            path = self.out_dir / f"{split}.bin"
            self._arrays[split] = (np.memmap(path, dtype=self.dtype, mode="r", shape=(n,)) if n
                                   else np.zeros(0, dtype=self.dtype))
        return self._arrays[split]

    def num_tokens(self, split: str) -> int:
        """Number of tokens in ``split`` (``"train"`` or ``"val"``)."""
        _check_split(split)
        return int(self.meta["num_tokens"][split])

    def _need(self, split: str, seq_len: int) -> int:
        n = self.num_tokens(split)
        if n < seq_len + 1:
            raise DataError(f"the {split} split has {n} tokens, too few for one window of "
                            f"seq_len + 1 = {seq_len + 1} tokens; use more data or a shorter seq_len")
        return n

    def _windows(self, split: str, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y (B, T) int64 from window start offsets (B,)."""
        index = starts[:, None] + np.arange(seq_len + 1)  # (B, T + 1)
        chunk = torch.from_numpy(np.asarray(self.tokens(split)[index], dtype=np.int64))
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def get_batch(self, split: str, batch_size: int, seq_len: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """B random windows: x (B, T), y (B, T) = x shifted by one; offsets come from ``generator``."""
        _check_sizes(batch_size, seq_len)
        n = self._need(split, seq_len)
        starts = torch.randint(n - seq_len, (batch_size,), generator=generator,
                               device=generator.device if generator is not None else None)
        return self._windows(split, starts.cpu().numpy().astype(np.int64), seq_len)

    def iter_batches(self, split: str, batch_size: int, seq_len: int,
                     max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Non-overlapping windows in order from the start of ``split``: all of them once (the last
        batch may be smaller), or the first ``max_batches`` batches. Yields x, y (B, T)."""
        _check_sizes(batch_size, seq_len)
        num_windows = (self._need(split, seq_len) - 1) // seq_len
        num_batches = -(-num_windows // batch_size)
        if max_batches is not None:
            num_batches = min(num_batches, max(0, max_batches))
        return self._iter(split, batch_size, seq_len, num_windows, num_batches)

    def iter_strided(self, split: str, batch_size: int, seq_len: int, stride: int,
                     max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Overlapping windows for strided (sliding-window) evaluation: windows of ``seq_len`` tokens starting
        every ``stride`` tokens (the last one moved back to end at the split's end), each scoring only the targets
        no earlier window scored: all of the first window's, then its last ``stride`` (fewer at the end). So every
        target of the split is scored exactly once, each with at least ``seq_len - stride`` tokens of context
        (all before it, near the start). ``stride == seq_len`` is :meth:`iter_batches` plus the split's tail.
        Yields x, y (B, T) and ``scored`` (B, T) bool."""
        _check_sizes(batch_size, seq_len)
        if not 1 <= stride <= seq_len:
            raise DataError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
        targets = self._need(split, seq_len) - 1
        starts = list(range(0, targets - seq_len + 1, stride))
        if starts[-1] + seq_len < targets:
            starts.append(targets - seq_len)  # the tail, in a window that ends at the split's end
        first_new = [0] + [prev + seq_len - start for prev, start in zip(starts, starts[1:], strict=False)]
        num_batches = -(-len(starts) // batch_size)
        if max_batches is not None:
            num_batches = min(num_batches, max(0, max_batches))
        positions = np.arange(seq_len)
        for b in range(num_batches):
            rows = slice(b * batch_size, (b + 1) * batch_size)
            x, y = self._windows(split, np.asarray(starts[rows], dtype=np.int64), seq_len)
            scored = torch.from_numpy(positions[None, :] >= np.asarray(first_new[rows])[:, None])
            yield x, y, scored

    def streams(self, split: str, rows: int, seq_len: int, offset: int = 0) -> int:
        """How many consecutive segments of ``seq_len`` each of ``rows`` contiguous streams of ``split`` holds, its
        first ``offset`` tokens skipped (the stream layout of :meth:`stream_batch`)."""
        _check_sizes(rows, seq_len)
        per_row = (self._need(split, seq_len) - 1) // rows
        if per_row - offset < seq_len:
            raise DataError(f"the {split} split has {self.num_tokens(split)} tokens, too few for {rows} streams of "
                            f"at least seq_len + 1 = {seq_len + 1} tokens; use fewer rows or a shorter seq_len")
        return (per_row - offset) // seq_len

    def stream_batch(self, split: str, rows: int, seq_len: int, segment: int,
                     offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment ``segment`` (taken modulo :meth:`streams`) of ``rows`` contiguous streams: the split cut into
        ``rows`` equal parts, row r reading part r from ``offset`` tokens into it, ``seq_len`` tokens per segment, so
        consecutive segments continue each row's text (what segment-level recurrence, Transformer-XL, needs).
        x, y (B, T)."""
        count = self.streams(split, rows, seq_len, offset)
        per_row = (self.num_tokens(split) - 1) // rows
        starts = np.arange(rows, dtype=np.int64) * per_row + offset + (segment % count) * seq_len
        return self._windows(split, starts, seq_len)

    def _iter(self, split: str, batch_size: int, seq_len: int, num_windows: int,
              num_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for b in range(num_batches):
            first = b * batch_size
            starts = np.arange(first, min(first + batch_size, num_windows), dtype=np.int64) * seq_len
            yield self._windows(split, starts, seq_len)

    def __repr__(self) -> str:
        return (f"TextDataset({str(self.out_dir)!r}, train={self.num_tokens('train')}, "
                f"val={self.num_tokens('val')}, dtype={self.dtype.name})")


def _located(err: TokenizerError, path: Path, text: str, tokenizer: Tokenizer) -> DataError:
    """The encoding error of a text file as a one-line :class:`DataError` naming ``path:line`` (the first line the
    tokenizer cannot encode; ``path`` alone when no single line fails), of the error's own class where that is
    a data error too (:class:`~tokenloom.errors.VocabularyError`)."""
    lines = text.split("\n")
    bad = tokenizer.first_unencodable([line + "\n" for line in lines[:-1]] + lines[-1:])
    where = f"{path}:{bad + 1}" if bad is not None else str(path)
    cls = type(err) if isinstance(err, DataError) else DataError
    return cls(f"{where}: {err}")

