"""Parallel (translation) data: aligned reading, joint BPE, token-count batches, collation, cache."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenloom.data import ParallelDataset, Tokenizer, read_parallel, train_joint_bpe
from tokenloom.errors import ConfigError, DataError

DE = ["Zwei junge weiße Männer sind im Freien.", "Ein Mädchen klettert über den Zaun.",
      "Größere Hunde laufen durch das Gras.", "Eine Frau trägt einen grünen Hut.",
      "Männer spielen Fußball auf der Straße.", "Ein Kind isst ein Eis."]
EN = ["Two young white males are outside.", "A girl climbs over the fence.",
      "Bigger dogs run through the grass.", "A woman wears a green hat.",
      "Men play soccer in the street.", "A child eats ice cream."]
WORDS = "der die das Hund Katze läuft über Straße Männer Mädchen a the dog cat runs over street men girl".split()


def write(path: Path, lines: list[str], end: str = "\n") -> Path:
    path.write_bytes("".join(line + end for line in lines).encode("utf-8"))
    return path


def write_pair(tmp_path: Path, name: str, src: list[str], tgt: list[str]) -> tuple[Path, Path]:
    return write(tmp_path / f"{name}.de", src), write(tmp_path / f"{name}.en", tgt)


def random_pairs(n: int, seed: int, max_words: int = 12) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    src = [" ".join(rng.choices(WORDS, k=rng.randint(1, max_words))) for _ in range(n)]
    tgt = [" ".join(rng.choices(WORDS, k=rng.randint(1, max_words))) for _ in range(n)]
    return src, tgt


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    src, tgt = random_pairs(50, seed=0)
    return train_joint_bpe(DE + EN + src + tgt, vocab_size=320)


def prepare(tmp_path: Path, tok: Tokenizer, splits: dict[str, tuple[list[str], list[str]]],
            **kwargs) -> ParallelDataset:
    files = {name: write_pair(tmp_path, name, *pair) for name, pair in splits.items()}
    kwargs.setdefault("max_source_len", 256)
    kwargs.setdefault("max_target_len", 256)
    return ParallelDataset.prepare(files, tok, tmp_path / "cache", **kwargs)


# ---- reading ------------------------------------------------------------------------------------


def test_read_parallel_strips_only_newlines(tmp_path: Path) -> None:
    src = write(tmp_path / "a.de", ["  Zwei  Männer ", "Größe\tTab"], end="\r\n")
    tgt = write(tmp_path / "a.en", ["Two  men", "size x\u2028y"])
    assert read_parallel(src, tgt) == [("  Zwei  Männer ", "Two  men"), ("Größe\tTab", "size x\u2028y")]
    (tmp_path / "b.en").write_text("Two  men\nsize", encoding="utf-8")  # no final newline
    assert read_parallel(src, tmp_path / "b.en")[1] == ("Größe\tTab", "size")


def test_misaligned_files_name_both_files_and_counts(tmp_path: Path) -> None:
    src = write(tmp_path / "x.de", DE)
    tgt = write(tmp_path / "x.en", EN[:4])
    with pytest.raises(DataError, match=r"misaligned") as err:
        read_parallel(src, tgt)
    assert f"{src} has 6 lines" in str(err.value) and f"{tgt} has 4 lines" in str(err.value)


def test_empty_line_error_names_file_and_line(tmp_path: Path) -> None:
    src = write(tmp_path / "x.de", DE[:4])
    tgt = write(tmp_path / "x.en", [EN[0], EN[1], "   ", EN[3]])
    with pytest.raises(DataError, match=rf"empty line in {tgt} at line 3"):
        read_parallel(src, tgt)
    with pytest.raises(DataError, match=rf"empty line in {tgt} at line 3"):
        ParallelDataset.prepare({"train": (src, tgt)}, Tokenizer.train_char("ab"), tmp_path / "c",
                                max_source_len=8, max_target_len=8)


def test_skip_mode_warns_and_drops(tmp_path: Path) -> None:
    src = write(tmp_path / "x.de", [DE[0], "", DE[2], DE[3]])
    tgt = write(tmp_path / "x.en", [EN[0], EN[1], EN[2], "\t"])
    with pytest.warns(UserWarning, match=rf"skipped 2 of 4 pairs .* first in {src} at line 2"):
        pairs = read_parallel(src, tgt, empty_lines="skip")
    assert pairs == [(DE[0], EN[0]), (DE[2], EN[2])]


def test_missing_file_and_bad_mode(tmp_path: Path) -> None:
    src = write(tmp_path / "x.de", DE)
    with pytest.raises(DataError, match=r"not found: .*nope\.en"):
        read_parallel(src, tmp_path / "nope.en")
    with pytest.raises(ConfigError, match="empty_lines"):
        read_parallel(src, src, empty_lines="drop")


# ---- tokenizer ----------------------------------------------------------------------------------


def test_joint_bpe_specials_and_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.eos_token) == (0, 1, 2, "</s>")
    assert tok.kind == "bpe" and tok.vocab_size <= 320
    text = "Größere Übermäßig schöne Bäume — «Straße» ÄÖÜ äöü ß  doppelt\tTab"
    assert tok.decode(tok.encode(text)) == text
    assert all(i > 3 for i in tok.encode(text))
    loaded = Tokenizer.from_file(tok.save(tmp_path / "tokenizer.json"), eos_token="</s>")
    assert loaded.encode(text) == tok.encode(text) and loaded.fingerprint == tok.fingerprint
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_id) == (0, 1, 2)
    assert tok.encode_batch([DE[0], text]) == [tok.encode(DE[0]), tok.encode(text)]


def test_joint_bpe_errors_and_helpers_on_other_tokenizers() -> None:
    with pytest.raises(ConfigError, match="at least 260"):
        train_joint_bpe(DE, vocab_size=259)
    with pytest.raises(DataError, match="empty"):
        train_joint_bpe([], vocab_size=300)
    char = Tokenizer.train_char("abc")
    assert (char.pad_id, char.bos_id, char.token_to_id("b"), char.token_to_id("z")) == (None, None, 1, None)


# ---- collate ------------------------------------------------------------------------------------


def test_collate_exact(tmp_path: Path, tok: Tokenizer) -> None:
    ds = prepare(tmp_path, tok, {"train": (DE, EN)})
    pad, bos, eos = 0, 1, 2
    b = ds.collate("train", [5, 0], pad, bos, eos)
    s5, s0, t5, t0 = tok.encode(DE[5]), tok.encode(DE[0]), tok.encode(EN[5]), tok.encode(EN[0])
    assert len(s0) > len(s5) and len(t0) > len(t5)
    S, T = len(s0) + 1, len(t0) + 1
    assert b.source.shape == b.source_mask.shape == (2, S)
    assert b.target_in.shape == b.target_out.shape == b.target_mask.shape == (2, T)
    assert all(x.dtype == torch.int64 for x in (b.source, b.source_mask, b.target_in, b.target_out, b.target_mask))
    pad_s, pad_t = [pad] * (S - len(s5) - 1), [pad] * (T - len(t5) - 1)
    assert b.source.tolist() == [s5 + [eos] + pad_s, s0 + [eos]]
    assert b.target_in.tolist() == [[bos] + t5 + pad_t, [bos] + t0]
    assert b.target_out.tolist() == [t5 + [eos] + pad_t, t0 + [eos]]
    assert b.source_mask.tolist() == [[1] * (len(s5) + 1) + [0] * len(pad_s), [1] * S]
    assert b.target_mask.tolist() == [[1] * (len(t5) + 1) + [0] * len(pad_t), [1] * T]
    assert b.num_target_tokens == len(t5) + len(t0) + 2 == int(b.target_mask.sum())
    assert b.indices.tolist() == [5, 0]
    with pytest.raises(IndexError):
        ds.collate("train", [6], pad, bos, eos)
    with pytest.raises(ValueError, match="bos_id"):
        ds.collate("train", [0], pad, None, eos)  # type: ignore[arg-type]


def test_sentences_and_sizes(tmp_path: Path, tok: Tokenizer) -> None:
    ds = prepare(tmp_path, tok, {"train": (DE, EN), "val": (DE[:2], EN[:2])})
    assert ds.sentences("train", "source") == DE and ds.sentences("val", "target") == EN[:2]
    assert (ds.num_pairs("train"), ds.num_pairs("val"), len(ds)) == (6, 2, 8)
    assert ds.source_lengths("train").tolist() == [len(tok.encode(s)) for s in DE]
    assert ds.target_lengths("val").tolist() == [len(tok.encode(s)) for s in EN[:2]]
    assert ds.splits == ["train", "val"]
    with pytest.raises(ValueError, match="unknown split"):
        ds.num_pairs("test")


# ---- batches ------------------------------------------------------------------------------------


@pytest.fixture
def big(tmp_path: Path, tok: Tokenizer) -> ParallelDataset:
    src, tgt = random_pairs(300, seed=1, max_words=20)
    src[7] = " ".join(["Straße"] * 60)  # one pair longer than the token budget below
    return prepare(tmp_path, tok, {"train": (src, tgt)})


def _check_batches(ds: ParallelDataset, batches: list[list[int]], max_tokens: int) -> None:
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(ds.num_pairs("train")))
    src, tgt = ds.source_lengths("train") + 1, ds.target_lengths("train") + 1
    for b in batches:
        width = max(int(src[b].max()), int(tgt[b].max()))
        assert len(b) * width <= max_tokens or len(b) == 1


def test_batches_no_shuffle_sorted_and_within_budget(big: ParallelDataset) -> None:
    batches = big.batches("train", 100, shuffle=False)
    _check_batches(big, batches, 100)
    assert [7] in batches and big.source_lengths("train")[7] + 1 > 100
    flat = [i for b in batches for i in b]
    keys = [(int(big.source_lengths("train")[i]), int(big.target_lengths("train")[i])) for i in flat]
    assert keys == sorted(keys)
    assert big.batches("train", 100, shuffle=False, seed=5, epoch=3) == batches
    assert len(big.batches("train", 10_000, shuffle=False)) < len(batches)
    assert all(len(b) <= 4 for b in big.batches("train", 10_000, shuffle=False, max_sentences=4))
    with pytest.raises(ConfigError, match="max_tokens"):
        big.batches("train", 0, shuffle=False)


def test_batches_shuffle_deterministic_per_seed_and_epoch(big: ParallelDataset) -> None:
    a = big.batches("train", 100, shuffle=True, seed=1, epoch=1)
    _check_batches(big, a, 100)
    assert big.batches("train", 100, shuffle=True, seed=1, epoch=1) == a
    assert big.batches("train", 100, shuffle=True, seed=1, epoch=2) != a
    assert big.batches("train", 100, shuffle=True, seed=2, epoch=1) != a
    assert a != big.batches("train", 100, shuffle=False)


# ---- length limits ------------------------------------------------------------------------------


def test_length_filter_drops_train_and_truncates_eval(tmp_path: Path, tok: Tokenizer) -> None:
    long_de = " ".join(["Straße"] * 30)
    src, tgt = DE + [long_de], EN + ["short."]
    src_len = [len(tok.encode(s)) for s in src]
    tgt_len = [len(tok.encode(t)) for t in tgt]
    max_s = max(src_len[:6]) + 1  # every pair but the last fits
    max_t = max(tgt_len) + 1
    with pytest.warns(UserWarning) as record:
        ds = prepare(tmp_path, tok, {"train": (src, tgt), "val": (src, tgt)},
                     max_source_len=max_s, max_target_len=max_t)
    messages = [str(w.message) for w in record]
    assert any("dropped 1 of 7 pairs from 'train'" in m for m in messages)
    assert any("1 of 7 pairs in 'val'" in m and "truncated" in m for m in messages)
    assert ds.split_dropped == {"train": 1, "val": 0} and ds.split_truncated == {"train": 0, "val": 1}
    assert ds.num_pairs("train") == 6 and ds.num_pairs("val") == 7
    assert ds.sentences("train", "source") == DE and ds.sentences("val", "source")[6] == long_de
    b = ds.collate("val", [6], 0, 1, 2)
    assert b.source.shape == (1, max_s) and b.source[0].tolist() == tok.encode(long_de)[:max_s - 1] + [2]
    # the target side alone also triggers the filter
    with pytest.warns(UserWarning, match="dropped 1 of 7"):
        ds = ParallelDataset.prepare({"train": (tmp_path / "train.en", tmp_path / "train.de")}, tok,
                                     tmp_path / "cache", max_source_len=max_t, max_target_len=max_s)
    assert ds.line_numbers("train").tolist() == [0, 1, 2, 3, 4, 5]


# ---- cache --------------------------------------------------------------------------------------


def test_cache_reused_then_invalidated(tmp_path: Path, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    first = prepare(tmp_path, tok, {"train": (DE, EN), "val": (DE[:3], EN[:3])})
    assert first.reused == {"train": False, "val": False}
    cache = tmp_path / "cache"
    mtimes = {p.name: p.stat().st_mtime_ns for p in cache.glob("*.npy")}
    assert len(mtimes) == 10
    files = {s: (tmp_path / f"{s}.de", tmp_path / f"{s}.en") for s in ("train", "val")}

    def fail(*args, **kwargs):
        raise AssertionError("re-encoded")

    with monkeypatch.context() as m:
        m.setattr(Tokenizer, "encode_batch", fail)
        again = ParallelDataset.prepare(files, tok, cache, max_source_len=256, max_target_len=256)
    assert again.reused == {"train": True, "val": True}
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("*.npy")} == mtimes
    assert again.collate("train", [0, 1], 0, 1, 2).source.tolist() == first.collate("train", [0, 1], 0, 1, 2)\
        .source.tolist()

    write(tmp_path / "val.de", DE[:4])  # a changed split is encoded again, the others reused
    write(tmp_path / "val.en", EN[:4])
    with pytest.raises(DataError, match="changed after the data was prepared"):
        again.sentences("val", "source")
    third = ParallelDataset.prepare(files, tok, cache, max_source_len=256, max_target_len=256)
    assert third.reused == {"train": True, "val": False} and third.num_pairs("val") == 4
    assert third.sentences("val", "target") == EN[:4]

    other = train_joint_bpe(DE + EN, vocab_size=280)  # another tokenizer: everything again
    fourth = ParallelDataset.prepare(files, other, cache, max_source_len=256, max_target_len=256)
    assert fourth.reused == {"train": False, "val": False}
    assert fourth.collate("train", [0], 0, 1, 2).source[0].tolist() == other.encode(DE[0]) + [2]


def test_cache_skip_mode_warns_on_reuse_and_error_mode_reencodes(tmp_path: Path, tok: Tokenizer) -> None:
    files = {"train": write_pair(tmp_path, "train", [DE[0], "", DE[2]], EN[:3])}
    for reused in (False, True):
        with pytest.warns(UserWarning, match="skipped 1 of 3"):
            ds = ParallelDataset.prepare(files, tok, tmp_path / "c", max_source_len=64, max_target_len=64,
                                         empty_lines="skip")
        assert ds.reused["train"] is reused and ds.split_skipped == {"train": 1}
        assert ds.sentences("train", "target") == [EN[0], EN[2]]
        assert ds.line_numbers("train").tolist() == [0, 2]
    with pytest.raises(DataError, match="at line 2"):
        ParallelDataset.prepare(files, tok, tmp_path / "c", max_source_len=64, max_target_len=64)


def test_no_warnings_on_clean_data(tmp_path: Path, tok: Tokenizer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = prepare(tmp_path, tok, {"train": (DE, EN)})
    assert ds.split_dropped == {"train": 0} and ds.split_skipped == {"train": 0}
    assert np.asarray(ds.line_numbers("train")).tolist() == list(range(6))
