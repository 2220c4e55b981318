from pathlib import Path

import pytest

from tokenloom.data import Tokenizer, create_tokenizer

CORPUS = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="module")
def corpus() -> str:
    return CORPUS.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def char_tok(corpus: str) -> Tokenizer:
    return create_tokenizer("char", corpus)
