"""Fixtures of the server tests: greedy continuations of the bundled Shakespeare model computed offline (the
server's replies must equal them)."""

from pathlib import Path

import pytest

SHAKES = Path(__file__).resolve().parents[2] / "checkpoints" / "shakespeare-char"


@pytest.fixture(scope="module")
def offline():
    """Greedy continuations computed in this process with tokenloom.generate."""
    import torch

    from tokenloom import GenerationConfig, generate
    from tokenloom.checkpoint import load_model, load_tokenizer

    model, _ = load_model(SHAKES)
    tokenizer = load_tokenizer(SHAKES)
    cache = {}

    def continuation(prompt: str, n: int) -> str:
        if (prompt, n) not in cache:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = generate(model, ids, GenerationConfig(max_new_tokens=n, do_sample=False))
            cache[(prompt, n)] = tokenizer.decode(out[0, ids.shape[1]:].tolist())
        return cache[(prompt, n)]

    return continuation
