"""Greedy decoding of an imported model matches ``transformers``' ``generate`` token for token: a batch of
prompts of different lengths, left-padded, with an attention mask on both sides."""

from __future__ import annotations

import pytest
import torch

from tests.interop.helpers import gpt2_hf, llama_hf, save_hf
from tokenloom import generate
from tokenloom.generation import GenerationConfig
from tokenloom.interop import from_hf

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 64
PAD = 0
LENGTHS = (5, 11, 8)  # prompt lengths of the batch's 3 rows


def _prompts(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) (3, 11): rows of LENGTHS tokens, left-padded with PAD."""
    gen = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    input_ids = torch.full((len(LENGTHS), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        input_ids[row, T - n:] = torch.randint(1, vocab, (n,), generator=gen)
        mask[row, T - n:] = 1
    return input_ids, mask


def _peaked(hf: torch.nn.Module, head_scale: float) -> torch.nn.Module:
    """Scale the output embedding so the logits of a random model are peaked (no argmax near-ties that float
    noise between two implementations could flip)."""
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(head_scale)
    return hf


def _hf_generate(hf: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = hf.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                      min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=PAD)
    return out[:, input_ids.shape[1]:]


def _ours_generate(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    out = generate(model, input_ids, config, attention_mask=mask)
    assert torch.equal(out[:, :input_ids.shape[1]][mask.bool()], input_ids[mask.bool()])
    return out[:, input_ids.shape[1]:]


def _margin(hf: torch.nn.Module, sequences: torch.Tensor, mask: torch.Tensor) -> float:
    """The smallest gap between the best and second-best logit over the generated steps."""
    full_mask = torch.cat((mask, mask.new_ones(mask.shape[0], NEW_TOKENS)), dim=1)
    position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = hf(sequences, attention_mask=full_mask, position_ids=position_ids).logits
    top2 = logits[:, mask.shape[1] - 1:-1].topk(2, dim=-1).values
    return float((top2[..., 0] - top2[..., 1]).min())


def _check(hf: torch.nn.Module, model: torch.nn.Module, vocab: int) -> None:
    input_ids, mask = _prompts(vocab)
    theirs = _hf_generate(hf, input_ids, mask)
    ours = _ours_generate(model, input_ids, mask)
    assert theirs.shape == ours.shape == (len(LENGTHS), NEW_TOKENS)
    for row in range(len(LENGTHS)):
        assert ours[row].tolist() == theirs[row].tolist(), f"row {row} (prompt of {LENGTHS[row]} tokens)"
    # the comparison means something: no step was decided by float noise, and the text is not one token
    assert _margin(hf, torch.cat((input_ids, theirs), dim=1), mask) > 1e-3
    assert all(len(set(ours[row].tolist())) > 4 for row in range(len(LENGTHS)))


def test_gpt2_greedy_generation_matches_transformers(tmp_path) -> None:
    hf = _peaked(gpt2_hf(seed=11, vocab_size=128, n_positions=96, n_embd=64, n_head=4, std=0.3), 4.0)
    model = from_hf(save_hf(hf, tmp_path))
    _check(hf, model, 128)


def test_llama_greedy_generation_matches_transformers(tmp_path) -> None:
    hf = _peaked(llama_hf(seed=12, vocab_size=128, max_position_embeddings=96, std=0.3, attn_implementation="sdpa",
                          rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), 4.0)
    model = from_hf(save_hf(hf, tmp_path))
    _check(hf, model, 128)
