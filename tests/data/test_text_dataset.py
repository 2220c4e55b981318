"""TextDataset: prepare/open, reuse and staleness, get_batch determinism, iter_batches coverage."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import tokenloom.data.text as text_module
from tokenloom.data import TextDataset, Tokenizer, create_tokenizer
from tokenloom.errors import DataError

CORPUS = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="module")
def shakespeare(char_tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> TextDataset:
    return TextDataset.prepare(CORPUS, char_tok, tmp_path_factory.mktemp("shakespeare"))


def _small(tmp_path: Path, text: str = "hello world\nthis is a small text\n" * 20) -> Path:
    path = tmp_path / "small.txt"
    path.write_text(text, encoding="utf-8")
    return path


def _all_ids(ds: TextDataset) -> np.ndarray:
    return np.concatenate([ds.tokens("train"), ds.tokens("val")])


def test_prepare_sizes_and_split(shakespeare: TextDataset, char_tok: Tokenizer, corpus: str) -> None:
    n = len(corpus)
    assert shakespeare.num_tokens("train") + shakespeare.num_tokens("val") == n
    assert shakespeare.num_tokens("train") == int(n * 0.9)
    assert shakespeare.dtype == np.uint16 and shakespeare.vocab_size == 65
    np.testing.assert_array_equal(_all_ids(shakespeare), char_tok.encode(corpus))
    assert (shakespeare.out_dir / "train.bin").stat().st_size == 2 * shakespeare.num_tokens("train")
    assert not shakespeare.reused


def test_open_matches_prepare(shakespeare: TextDataset) -> None:
    opened = TextDataset.open(shakespeare.out_dir)
    for split in ("train", "val"):
        assert opened.num_tokens(split) == shakespeare.num_tokens(split)
        np.testing.assert_array_equal(opened.tokens(split), shakespeare.tokens(split))


def test_prepare_bpe_equals_encode(tmp_path: Path) -> None:
    text = "Ünïcode — 你好 🙂\n\nword word words\n  indented\n" * 50
    tok = create_tokenizer("bpe", text, vocab_size=300)
    ds = TextDataset.prepare(_small(tmp_path, text), tok, tmp_path / "out", val_fraction=0.25)
    ids = tok.encode(text)
    np.testing.assert_array_equal(_all_ids(ds), ids)
    assert ds.num_tokens("train") == int(len(ids) * 0.75)


def test_large_vocab_uses_uint32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = Tokenizer.train_char("abc")
    monkeypatch.setattr(Tokenizer, "vocab_size", property(lambda self: 70_000))
    ds = TextDataset.prepare(_small(tmp_path, "abcabc"), tok, tmp_path / "out", val_fraction=0.5)
    assert ds.dtype == np.uint32
    np.testing.assert_array_equal(_all_ids(ds), [0, 1, 2, 0, 1, 2])


def _forbid_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: Tokenizer, text: str) -> np.ndarray:
        raise AssertionError("re-encoded although the files were up to date")

    monkeypatch.setattr(Tokenizer, "encode_array", boom)


def test_reuse_when_up_to_date(tmp_path: Path, char_tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    src, out = _small(tmp_path), tmp_path / "out"
    first = TextDataset.prepare(src, char_tok, out)
    bin_mtime = (out / "train.bin").stat().st_mtime_ns
    _forbid_encoding(monkeypatch)
    again = TextDataset.prepare(src, char_tok, out)
    assert again.reused and again.num_tokens("train") == first.num_tokens("train")
    os.utime(src, ns=(1_000_000_000, 1_000_000_000))  # touched, same content: the hash says reuse
    assert TextDataset.prepare(src, char_tok, out).reused
    assert (out / "train.bin").stat().st_mtime_ns == bin_mtime


def test_reprepare_when_source_changes(tmp_path: Path, char_tok: Tokenizer) -> None:
    src, out = _small(tmp_path, "abc\n" * 100), tmp_path / "out"
    TextDataset.prepare(src, char_tok, out)
    src.write_text("abc\n" * 150)
    grown = TextDataset.prepare(src, char_tok, out)
    assert not grown.reused and grown.num_tokens("train") + grown.num_tokens("val") == 600
    src.write_text("cba\n" * 150)  # same size, new content
    os.utime(src, ns=(2_000_000_000, 2_000_000_000))
    changed = TextDataset.prepare(src, char_tok, out)
    assert not changed.reused
    np.testing.assert_array_equal(_all_ids(changed), char_tok.encode("cba\n" * 150))
    assert TextDataset.open(out).tokens("train")[0] == char_tok.encode("c")[0]


def test_reprepare_when_tokenizer_or_split_changes(tmp_path: Path, char_tok: Tokenizer, corpus: str) -> None:
    src, out = _small(tmp_path), tmp_path / "out"
    TextDataset.prepare(src, char_tok, out)
    other = Tokenizer.train_char("".join(set(corpus) - {"Z"}) + "~")  # same size, shifted ids
    assert other.vocab_size == char_tok.vocab_size and other.encode("a") != char_tok.encode("a")
    ds = TextDataset.prepare(src, other, out)
    assert not ds.reused
    np.testing.assert_array_equal(_all_ids(ds), other.encode(src.read_text()))
    assert not TextDataset.prepare(src, other, out, val_fraction=0.5).reused


def test_missing_and_empty_data_file(tmp_path: Path, char_tok: Tokenizer) -> None:
    with pytest.raises(DataError, match="data file not found: .*nope.txt"):
        TextDataset.prepare(tmp_path / "nope.txt", char_tok, tmp_path / "out")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        TextDataset.prepare(tmp_path / "empty.txt", char_tok, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_data_outside_vocabulary(tmp_path: Path, char_tok: Tokenizer) -> None:
    with pytest.raises(DataError, match="outside the vocabulary: 'é'"):
        TextDataset.prepare(_small(tmp_path, "café\n"), char_tok, tmp_path / "out")


def test_open_errors(tmp_path: Path, char_tok: Tokenizer) -> None:
    with pytest.raises(DataError, match="no prepared data"):
        TextDataset.open(tmp_path / "missing")
    out = tmp_path / "out"
    TextDataset.prepare(_small(tmp_path), char_tok, out)
    data = (out / "train.bin").read_bytes()
    (out / "train.bin").write_bytes(data[:-2])
    with pytest.raises(DataError, match="truncated"):
        TextDataset.open(out)
    assert not TextDataset.prepare(_small(tmp_path), char_tok, out).reused  # repaired


def test_bad_split_name(shakespeare: TextDataset) -> None:
    with pytest.raises(ValueError, match="split"):
        shakespeare.num_tokens("test")
    with pytest.raises(ValueError, match="split"):
        shakespeare.get_batch("valid", 2, 8, torch.Generator().manual_seed(0))


def test_get_batch_deterministic_and_shifted(shakespeare: TextDataset) -> None:
    def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return shakespeare.get_batch("train", 4, 32, torch.Generator().manual_seed(seed))

    x, y = batch(0)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.long
    x2, y2 = batch(0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, batch(1)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])
    data = shakespeare.tokens("train")
    for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):  # each row is a real window
        starts = np.flatnonzero(np.lib.stride_tricks.sliding_window_view(data, 32).__eq__(row_x).all(1))
        assert any((data[s + 1: s + 33] == row_y).all() for s in starts)


def test_get_batch_resumes_from_generator_state(shakespeare: TextDataset) -> None:
    gen = torch.Generator().manual_seed(123)
    shakespeare.get_batch("train", 2, 16, gen)
    state = gen.get_state()
    expected = [shakespeare.get_batch("train", 2, 16, gen)[0] for _ in range(3)]
    resumed = torch.Generator()
    resumed.set_state(state)
    got = [shakespeare.get_batch("train", 2, 16, resumed)[0] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_split_too_short(tmp_path: Path, char_tok: Tokenizer) -> None:
    ds = TextDataset.prepare(_small(tmp_path, "abcdefghij" * 2), char_tok, tmp_path / "out")
    assert ds.num_tokens("val") == 2
    with pytest.raises(DataError, match=r"val split has 2 tokens.*seq_len \+ 1 = 9"):
        ds.get_batch("val", 1, 8, torch.Generator().manual_seed(0))
    with pytest.raises(DataError, match="2 tokens"):
        ds.iter_batches("val", 1, 8)
    x, y = ds.get_batch("train", 3, 17, torch.Generator().manual_seed(0))  # exactly one window fits
    assert torch.equal(x[0], torch.from_numpy(ds.tokens("train")[:17].astype(np.int64)))


def test_iter_batches_covers_split_once(shakespeare: TextDataset) -> None:
    seq_len, batch_size = 64, 7
    data = shakespeare.tokens("val").astype(np.int64)
    batches = list(shakespeare.iter_batches("val", batch_size, seq_len))
    num_windows = (len(data) - 1) // seq_len
    assert len(batches) == -(-num_windows // batch_size)
    assert all(x.shape[0] == batch_size for x, _ in batches[:-1]) and batches[-1][0].shape[0] >= 1
    xs = torch.cat([x for x, _ in batches]).flatten().numpy()
    ys = torch.cat([y for _, y in batches]).flatten().numpy()
    np.testing.assert_array_equal(xs, data[: num_windows * seq_len])
    np.testing.assert_array_equal(ys, data[1: num_windows * seq_len + 1])
    again = list(shakespeare.iter_batches("val", batch_size, seq_len))  # deterministic
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, batches, strict=True))


def test_iter_batches_max_batches(shakespeare: TextDataset) -> None:
    first = list(shakespeare.iter_batches("train", 3, 16, max_batches=2))
    assert len(first) == 2
    full = shakespeare.iter_batches("train", 3, 16)
    for a, b in zip(first, full, strict=False):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_crash_while_writing_leaves_no_stale_meta(tmp_path: Path, char_tok: Tokenizer,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    src, out = _small(tmp_path, "abc\n" * 100), tmp_path / "out"
    TextDataset.prepare(src, char_tok, out)
    src.write_text("cab\n" * 150)
    real_write = text_module.write_atomic
    calls = []

    def crash_on_val(path: Path, write: object) -> None:
        calls.append(path.name)
        if path.name == "val.bin":
            raise KeyboardInterrupt
        real_write(path, write)

    monkeypatch.setattr(text_module, "write_atomic", crash_on_val)
    with pytest.raises(KeyboardInterrupt):
        TextDataset.prepare(src, char_tok, out)
    assert calls == ["train.bin", "val.bin"]
    with pytest.raises(DataError, match="no prepared data"):  # new train.bin, old meta: never mixed
        TextDataset.open(out)
    monkeypatch.undo()
    ds = TextDataset.prepare(src, char_tok, out)
    np.testing.assert_array_equal(_all_ids(ds), char_tok.encode("cab\n" * 150))
    assert sorted(p.name for p in out.iterdir()) == ["data_meta.json", "train.bin", "val.bin"]
