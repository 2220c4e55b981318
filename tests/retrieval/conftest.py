"""Fixtures of the retrieval tests: a few small documents, and tiny random GPT checkpoints over a character tokenizer
(two of them with different vocabularies, for the "index built with another tokenizer" error)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("bm25s", reason="the rag extra (bm25s) is not installed")

DOCS = {
    "ada.txt": "Ada Lovelace was born in London in 1815. She wrote the first published program.",
    "turing.md": "Alan Turing was born in Maida Vale. He broke the Enigma cipher at Bletchley Park during the war.",
    "people/curie.txt": "Marie Curie was born in Warsaw. She won two Nobel prizes, in physics and in chemistry.",
    "people/hopper.txt": "Grace Hopper was born in New York. She wrote the first compiler and popularised COBOL.",
}
QUESTION = "Where was Marie Curie born?"
EXTRA = "[]#/?:.,_-0123456789QAWNabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n"


def write_docs(root: Path) -> Path:
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def tiny_checkpoint(path: Path, text: str, seed: int = 0, max_seq_len: int = 512) -> Path:
    from tokenloom import GPT, GPTConfig
    from tokenloom.checkpoint import write_checkpoint
    from tokenloom.data import create_tokenizer
    from tokenloom.models.factory import model_config_to_dict

    tokenizer = create_tokenizer("char", text)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=2, num_heads=2, embed_dim=32,
                          max_seq_len=max_seq_len))
    write_checkpoint(path, model, {"task": "lm", "model": model_config_to_dict("gpt", model.config)}, tokenizer)
    return path


@pytest.fixture(scope="package")
def corpus(tmp_path_factory) -> Path:
    """A directory of the four documents."""
    return write_docs(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="package")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random GPT whose character vocabulary covers the documents, the ids and the template."""
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "gpt", "".join(DOCS.values()) + EXTRA)


@pytest.fixture(scope="package")
def other_checkpoint(tmp_path_factory) -> Path:
    """The same architecture over another character vocabulary (one extra character): another tokenizer."""
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt2") / "gpt", "".join(DOCS.values()) + EXTRA + "~", seed=1)
