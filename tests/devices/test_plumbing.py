"""Every registered model preset runs with its weights and inputs on an accelerator, with no CPU tensor mixed in:
forward, backward, and by decoding kind greedy generation, beam search (causal LMs, encoder-decoders) and parallel
decoding (NAT). Without a GPU the accelerator is tests/devices/accelerator.py's stand-in (real CPU data that reports
the meta device; a CPU tensor meeting it raises), so a tensor created without the device of what it meets — a mask,
positions, a RoPE table, a cache, a length predictor's output, beam bookkeeping — fails here. The results must
equal the CPU's: the stand-in runs the same CPU kernels, so an accelerator path that computes something else fails
too. The presets come from the registries (tests/registry/helpers.py), so a new family is covered by being
registered.
"""

from __future__ import annotations

import pytest
import torch

from tests.devices.accelerator import ACCELERATOR, AcceleratorMode, DeviceMismatch, OnDevice, to_accelerator
from tests.registry.helpers import build, collect_presets, outputs, source_batch, weighted_loss
from tokenloom.generation import GenerationConfig, beam_search, generate
from tokenloom.models.registry import MODELS, decoding_of

# families the stand-in cannot run, and why (each test skips them, saying so; a real GPU covers them)
STAND_IN_CANNOT = {"rnn_seq2seq": "its encoder packs the padded sources (pack_padded_sequence), whose lengths and "
                                  "batch sizes stay on the CPU also on CUDA; the stand-in cannot model a fused LSTM "
                                  "over them"}
PRESETS = collect_presets()
IDS = [f"{family}:{name}" for family, name, _ in PRESETS]


def _pair(family: str, preset: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model on the CPU, the same weights on the accelerator), both in eval mode."""
    if family in STAND_IN_CANNOT:
        pytest.skip(STAND_IN_CANNOT[family])
    config_cls, _ = MODELS.get(family)
    fields = {f for f in config_cls.__dataclass_fields__}
    extra = {"drop_path": 0.0} if "drop_path" in fields else {}
    cpu = build(family, preset, **extra).eval()
    moved = build(family, preset, **extra).eval()
    return cpu, to_accelerator(moved)


def _on_accelerator(tensors) -> None:
    for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
        assert isinstance(t, OnDevice) and t.device == ACCELERATOR, f"a result left the accelerator: {t.device}"


def test_the_stand_in_refuses_a_cpu_tensor():
    # The premise of every test below: a CPU tensor meeting an accelerator one raises; a 0-dim one is allowed.
    with AcceleratorMode():
        x = torch.ones(3, device=ACCELERATOR)
        assert x.device == ACCELERATOR and (x + torch.tensor(2.0)).cpu().tolist() == [3.0] * 3
        with pytest.raises(DeviceMismatch):
            x + torch.ones(3)
        assert torch.equal((x * 2).cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize("family, name, preset", PRESETS, ids=IDS)
def test_forward_and_backward_on_the_accelerator(family, name, preset):
    cpu, moved = _pair(family, preset)
    with torch.no_grad():
        want = outputs(family, cpu)
    with AcceleratorMode():
        with torch.no_grad():
            got = outputs(family, moved, device=ACCELERATOR)
        _on_accelerator(got)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)
        moved.train()
        weighted_loss_on = weighted_loss([t.cpu() for t in outputs(family, moved, device=ACCELERATOR)])
        weighted_loss_on.backward()
        grads = [p.grad for p in moved.parameters() if p.requires_grad and p.grad is not None]
    assert grads, "no parameter got a gradient"
    _on_accelerator(grads)


DECODING = [(f, n, p) for f, n, p in PRESETS if decoding_of(MODELS.get(f)[1]) in ("causal_lm", "encoder_decoder")]
PARALLEL = [(f, n, p) for f, n, p in PRESETS if decoding_of(MODELS.get(f)[1]) == "parallel"]


def _prompts(model, gen, device=None):
    """(decoder, (B, T) prompt ids, attention mask | None): a left-padded batch for a causal LM, the BOS for an
    encoder-decoder's decoder over a padded source batch."""
    c = model.config
    if decoding_of(model) == "causal_lm":
        ids = torch.randint(0, c.vocab_size, (3, 5), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        put = (lambda t: t) if device is None else (lambda t: t.to(device))
        return model, put(ids), put(mask)
    src, mask = source_batch(c, gen, device)
    bos = torch.full((src.shape[0], 1), c.bos_id, dtype=torch.long)
    return model.decoder_for(src, mask), bos if device is None else bos.to(device), None


@pytest.mark.parametrize("family, name, preset", DECODING, ids=[f"{f}:{n}" for f, n, _ in DECODING])
def test_cached_greedy_and_beam_search_on_the_accelerator(family, name, preset):
    cpu, moved = _pair(family, preset)
    greedy = GenerationConfig(max_new_tokens=6, do_sample=False)
    beams = GenerationConfig(max_new_tokens=5, do_sample=False, num_beams=3, num_return_sequences=2)
    decoder, ids, mask = _prompts(cpu, torch.Generator().manual_seed(3))
    want_greedy = generate(decoder, ids, greedy, attention_mask=mask)
    want_beam = beam_search(decoder, ids, beams, attention_mask=mask)
    with AcceleratorMode():
        decoder, ids, mask = _prompts(moved, torch.Generator().manual_seed(3), ACCELERATOR)
        got_greedy = generate(decoder, ids, greedy, attention_mask=mask)
        got_beam = beam_search(decoder, ids, beams, attention_mask=mask)
        _on_accelerator([got_greedy, got_beam.sequences, got_beam.scores])
        assert torch.equal(got_greedy.cpu(), want_greedy)
        assert torch.equal(got_beam.sequences.cpu(), want_beam.sequences)
        torch.testing.assert_close(got_beam.scores.cpu(), want_beam.scores)


@pytest.mark.parametrize("family, name, preset", PARALLEL, ids=[f"{f}:{n}" for f, n, _ in PARALLEL])
def test_parallel_decoding_on_the_accelerator(family, name, preset):
    from tokenloom.generation.nat import nat_decode

    cpu, moved = _pair(family, preset)
    src, mask = source_batch(cpu.config, torch.Generator().manual_seed(4))
    options = dict(iterations=3, length_beam=2)
    want = nat_decode(cpu, src, mask, **options)
    with AcceleratorMode():
        got = nat_decode(moved, src.to(ACCELERATOR), mask.to(ACCELERATOR), **options)
    assert got == want
