"""Shared pieces of the Hugging Face interop tests: tiny random models, seeded ids, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

# HF classes default to bos/eos ids that may not exist in a tiny vocabulary; say "none" explicitly
NO_SPECIALS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def ids(batch: int = 2, length: int = 16, vocab: int = 100, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def randomise(model: nn.Module, seed: int, std: float = 0.1) -> nn.Module:
    """Random values in every tensor (biases and norm weights too), so every rule of a table is tested.
    Norm scales (1-D ``weight``) stay near 1. Tied tensors are written once."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_weight = name.endswith("weight") and p.ndim == 1
            p.copy_(torch.randn(p.shape, generator=gen) * std + (1.0 if is_norm_weight else 0.0))
    return model


def gpt2_hf(seed: int = 1, std: float = 0.1, **overrides: Any) -> nn.Module:
    """A random eval-mode ``GPT2LMHeadModel``: 2 layers, 4 heads, embed 64, vocab 100 unless overridden."""
    import transformers

    kw = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=32, attn_implementation="eager",
              **NO_SPECIALS)
    kw.update(overrides)
    return randomise(transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw)), seed, std).eval()


def llama_hf(seed: int = 1, std: float = 0.1, cls: str = "LlamaForCausalLM", **overrides: Any) -> nn.Module:
    """A random eval-mode Llama-style model: 2 layers, 4 heads (2 kv), hidden 64, intermediate 100, vocab 100."""
    import transformers

    config_cls = getattr(transformers, cls.replace("ForCausalLM", "Config"))
    kw = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
              intermediate_size=100, vocab_size=100, max_position_embeddings=64, rms_norm_eps=1e-5,
              tie_word_embeddings=False, attn_implementation="eager", **NO_SPECIALS)
    kw.update(overrides)
    return randomise(getattr(transformers, cls)(config_cls(**kw)), seed, std).eval()


def save_hf(model: nn.Module, directory: Path) -> Path:
    """``save_pretrained`` (safetensors) into ``directory``, quietly."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    model.save_pretrained(directory)
    return Path(directory)


def logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a tokenloom model or a transformers model, as float32."""
    with torch.no_grad():
        out = model(input_ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


def assert_same_logits(ours: nn.Module, theirs: nn.Module, input_ids: torch.Tensor, atol: float = 1e-4) -> None:
    a, b = logits(ours, input_ids), logits(theirs, input_ids)
    assert a.abs().max() > 0.5, "logits are near zero: the comparison would prove little"
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4)


def assert_one_line(err: BaseException, *needles: str) -> str:
    """The error's message is one line and contains every needle; returns it."""
    message = str(err)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


DELETE = object()  # edit_json: remove the key


def edit_json(path: Path, **changes: Any) -> dict[str, Any]:
    """Set keys of a JSON object file (value ``DELETE``: remove the key); returns the new mapping."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DELETE:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return data
