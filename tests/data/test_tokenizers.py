"""Char and byte-level BPE tokenizers: round trips, save/load, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tokenloom.data.tokenizers as tokenizers_module
from tokenloom.data import TOKENIZERS, Tokenizer, create_tokenizer
from tokenloom.data.tokenizers import split_for_encoding
from tokenloom.errors import CheckpointError, ConfigError, RegistryError, TokenizerError

CORPUS = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare" / "input.txt"
UNICODE_TEXT = ("naïve café — déjà vu; 你好，世界！ Привет, мир. 🙂🚀 ∑x² ≤ ∞\n"
                "\tTabs\tand  double  spaces\r\nWindows line\n\n\nthree newlines <|endoftext|>done\n")
TRICKY = "a\n\nb\n c\n\t\nd \n e\n\n\n  f\ng\nh'\n's\n7\n8!\n?\n\u00a0\nx\u2028\ny\n<|endoftext|>\nz\n"


@pytest.fixture(scope="module")
def bpe_tok(corpus: str) -> Tokenizer:
    return create_tokenizer("bpe", corpus[:200_000] + UNICODE_TEXT, vocab_size=400)


def test_registry_names() -> None:
    assert TOKENIZERS.names() == ["bpe", "char"]


def test_char_vocab_matches_nanogpt(char_tok: Tokenizer, corpus: str) -> None:
    assert char_tok.kind == "char"
    assert char_tok.vocab_size == 65
    assert char_tok.eos_id is None
    chars = sorted(set(corpus))
    assert char_tok.encode("".join(chars)) == list(range(65))
    assert char_tok.encode("\n") == [0] and char_tok.encode(" ") == [1]


def test_char_round_trip_on_corpus(char_tok: Tokenizer, corpus: str) -> None:
    ids = char_tok.encode(corpus)
    assert len(ids) == len(corpus)
    assert char_tok.decode(ids) == corpus
    np.testing.assert_array_equal(char_tok.encode_array(corpus), ids)
    sample = corpus[:20_000]  # the HF backend (what other tools use) gives the same ids
    assert char_tok.backend.encode(sample).ids == ids[:20_000]


def test_char_round_trip_whitespace() -> None:
    text = " a\n\n\t b\r\n  c \u00a0d\u2028é"
    tok = Tokenizer.train_char(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.backend.decode(tok.backend.encode(text).ids) == text


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_load_round_trip(kind: str, char_tok: Tokenizer, bpe_tok: Tokenizer, corpus: str,
                              tmp_path: Path) -> None:
    tok = char_tok if kind == "char" else bpe_tok
    path = tok.save(tmp_path / "tokenizer.json")
    assert json.loads(path.read_text())["model"]["type"] in ("WordLevel", "BPE")
    for loaded in (Tokenizer.from_file(path), Tokenizer.from_file(tmp_path)):
        assert loaded.kind == kind
        assert loaded.vocab_size == tok.vocab_size
        assert loaded.eos_id == tok.eos_id
        assert loaded.fingerprint == tok.fingerprint
        sample = corpus[:5000]
        assert loaded.encode(sample) == tok.encode(sample)
        assert loaded.decode(tok.encode(sample)) == sample
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp file left


def test_bpe_round_trip_unicode_and_vocab_size(bpe_tok: Tokenizer) -> None:
    assert bpe_tok.kind == "bpe"
    assert bpe_tok.vocab_size == 400
    assert bpe_tok.eos_id == bpe_tok.backend.token_to_id("<|endoftext|>")
    unseen = "Ωμέγα ∂f/∂x — 日本語テキスト 👩‍👩‍👧 \x00\x7f\r\n\t end"
    for text in (UNICODE_TEXT, unseen, TRICKY, ""):
        ids = bpe_tok.encode(text)
        assert all(0 <= i < bpe_tok.vocab_size for i in ids)
        assert bpe_tok.decode(ids) == text
    assert bpe_tok.eos_id in bpe_tok.encode("a<|endoftext|>b")


def test_bpe_small_text_stays_within_vocab_size() -> None:
    tok = Tokenizer.train_bpe("tiny text, tiny vocab", vocab_size=300)
    assert 257 <= tok.vocab_size <= 300
    assert tok.decode(tok.encode("anything at all: ü")) == "anything at all: ü"


def test_split_for_encoding_keeps_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    # trained on whitespace runs, so merges like "\n\n" and " \n" exist and a careless cut shows
    tok = Tokenizer.train_bpe(TRICKY * 50 + UNICODE_TEXT * 5, vocab_size=320)
    assert len(tok.encode("\n\n")) == len(tok.encode(" \n")) == 1
    text = TRICKY * 3 + UNICODE_TEXT
    pieces = list(split_for_encoding(text, chunk_chars=1))
    assert "".join(pieces) == text and len(pieces) > 5
    full = tok.encode(text)
    assert [i for p in pieces for i in tok.encode(p)] == full
    original = tokenizers_module.split_for_encoding
    monkeypatch.setattr(tokenizers_module, "split_for_encoding", lambda t: original(t, chunk_chars=1))
    np.testing.assert_array_equal(tok.encode_array(text), full)


def test_oov_characters_are_named(char_tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError) as info:
        char_tok.encode("Hello é and € and é")
    msg = str(info.value)
    assert "'é', '€'" in msg and "65 characters" in msg and "\n" not in msg
    with pytest.raises(TokenizerError, match="'é'"):
        char_tok.encode_array("Hello é")


def test_decode_bad_ids(char_tok: Tokenizer, bpe_tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match=r"\[0, 65\): 65, -1"):
        char_tok.decode([0, 65, 1, -1])
    with pytest.raises(TokenizerError, match="400"):
        bpe_tok.decode([1, 400])


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="tokenizer file not found"):
        Tokenizer.from_file(tmp_path / "nope.json")
    with pytest.raises(CheckpointError, match="tokenizer file not found"):
        Tokenizer.from_file(tmp_path)  # a directory without tokenizer.json


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_model"])
def test_corrupt_tokenizer_file(damage: str, char_tok: Tokenizer, tmp_path: Path) -> None:
    path = char_tok.save(tmp_path / "tokenizer.json")
    data = path.read_text()
    if damage == "truncate":
        path.write_text(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    else:
        spec = json.loads(data)
        spec["model"] = {"type": "NoSuchModel", "vocab": {"a": 0}}
        path.write_text(json.dumps(spec))
    with pytest.raises(CheckpointError) as info:
        Tokenizer.from_file(path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)
    assert info.value.__cause__ is None


def test_create_tokenizer_errors() -> None:
    with pytest.raises(RegistryError, match="did you mean 'char'"):
        create_tokenizer("chr", "abc")
    with pytest.raises(ConfigError, match="vocab_size"):
        create_tokenizer("bpe", "abc")
    with pytest.raises(ConfigError, match="at least 257"):
        create_tokenizer("bpe", "abc", vocab_size=100)
