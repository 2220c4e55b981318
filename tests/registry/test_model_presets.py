"""Every registered model preset, shrunk: forward, backward, and for decoding models cached == uncached.

The presets are collected from the registries (``MODELS`` and each family's ``*_PRESETS`` dict; a family without
presets contributes its default config), so a new preset or family is tested by being registered. Each preset
keeps its distinctive options (position, norm, mlp, kv-head ratio, norm placement, windows...) with tiny sizes
(tests/registry/helpers.py:shrink).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.registry.helpers import (
    assert_close,
    build,
    cached_logits,
    check_gradients,
    collect_presets,
    left_pad,
    outputs,
    shrink,
    source_batch,
    weighted_loss,
)
from tokenloom.models.registry import MODELS, decoding_of

PRESETS = collect_presets()
IDS = [f"{family}:{name}" for family, name, _ in PRESETS]
DECODING = [(f, n, p) for f, n, p in PRESETS if decoding_of(MODELS.get(f)[1]) in ("causal_lm", "encoder_decoder")]
DECODING_IDS = [f"{family}:{name}" for family, name, _ in DECODING]


def test_every_family_and_preset_dict_is_collected():
    # Broken collection (a registry renamed, the *_PRESETS lookup matching nothing) would silently parametrize
    # over nothing: every registered family must appear, and every preset a from_name accepts must build.
    assert {f for f, _, _ in PRESETS} == set(MODELS.names())
    for family, name, fields in PRESETS:
        config_cls, _ = MODELS.get(family)
        if name != "default":
            assert config_cls.from_name(name) == config_cls(**fields), (family, name)


@pytest.mark.parametrize("family, name, preset", PRESETS, ids=IDS)
def test_shrunk_preset_keeps_its_options(family, name, preset):
    # A shrink that dropped the preset's own options (position, norm, mlp, ...) would test the defaults instead:
    # every non-size field the preset sets must survive, and the grouped-query ratio must be kept.
    config_cls, _ = MODELS.get(family)
    small = config_cls(**shrink(config_cls, preset))
    sizes = {"vocab_size", "num_layers", "encoder_layers", "decoder_layers", "num_heads", "num_kv_heads",
             "embed_dim", "max_seq_len", "max_source_len", "max_target_len", "num_classes", "image_size", "depths",
             "mlp_hidden_dim", "attention_options", "max_length_offset"}
    for key, value in preset.items():
        if key not in sizes:
            assert getattr(small, key) == value, (key, getattr(small, key), value)
    kv = preset.get("num_kv_heads")
    if kv is not None:
        assert small.num_heads // small.num_kv_heads == preset["num_heads"] // kv


@pytest.mark.parametrize("family, name, preset", PRESETS, ids=IDS)
def test_forward_is_finite_and_shaped(family, name, preset):
    # A broken block (a NaN from a fully masked row, a wrong reshape) gives non-finite values or a wrong shape
    # (shapes are asserted per family in helpers.outputs).
    model = build(family, preset).eval()
    with torch.no_grad():
        for out in outputs(family, model):
            assert torch.isfinite(out).all()
            assert out.std() > 0  # a constant output (all heads zeroed, an identity cut) is broken too


@pytest.mark.parametrize("family, name, preset", PRESETS, ids=IDS)
def test_backward_reaches_every_parameter(family, name, preset):
    # A parameter the forward never reads (a module built but bypassed, e.g. a fast path skipping a norm) has no
    # gradient; one detached from the loss gets zeros; an unstable op gives inf/NaN. Stochastic depth is switched
    # off: a whole block dropped for every sample would legitimately zero its gradients.
    config_cls, _ = MODELS.get(family)
    fields = {f.name for f in dataclasses.fields(config_cls)}
    model = build(family, preset, **({"drop_path": 0.0} if "drop_path" in fields else {})).train()
    check_gradients(model, weighted_loss(outputs(family, model)))


def _decoder_and_reference(model, T):
    """(decoder with the protocol, ids (B, T), full-forward logits (B, T, V), the source pieces or None)."""
    c = model.config
    gen = torch.Generator().manual_seed(2)
    if decoding_of(model) == "causal_lm":
        ids = torch.randint(0, c.vocab_size, (3, T), generator=gen)
        return model, ids, model(ids), None
    src, mask = source_batch(c, gen)
    ids = torch.randint(3, c.vocab_size, (src.shape[0], T), generator=gen)
    ids[:, 0] = c.bos_id
    return model.decoder_for(src, mask), ids, model(src, ids, mask), (src, mask)


@pytest.mark.parametrize("family, name, preset", DECODING, ids=DECODING_IDS)
@pytest.mark.parametrize("prefill", [1, 4])
def test_cached_decoding_equals_full_forward(family, name, preset, prefill):
    # A cache written at the wrong position, a stale rotary/bias offset, a wrong mask in the one-token fast path or
    # cross-attention keys computed from the wrong memory rows all change the incremental logits.
    model = build(family, preset).eval()
    T = 9
    with torch.no_grad():
        decoder, ids, full, _ = _decoder_and_reference(model, T)
    got = cached_logits(decoder, ids, prefill=prefill)
    assert_close(got, full, what=f"{family}:{name} cached vs full")


@pytest.mark.parametrize("family, name, preset", DECODING, ids=DECODING_IDS)
def test_padded_batch_equals_rows_alone(family, name, preset):
    # Padding that leaks into attention (keys not masked, positions counted from the padded start) makes a padded
    # row differ from the same row run alone. GPT prompts are left-padded with an attention_mask over cached + new
    # positions (GPT.forward_features); encoder-decoder prompts cannot be padded (they start with BOS), so there
    # the padded part is the right-padded source.
    model = build(family, preset).eval()
    c = model.config
    gen = torch.Generator().manual_seed(3)
    if decoding_of(model) == "causal_lm":
        rows = [torch.randint(0, c.vocab_size, (n,), generator=gen) for n in (10, 5, 8)]
        ids, mask = left_pad(rows, pad=7)
        got = cached_logits(model, ids, prefill=6, attention_mask=mask)
        with torch.no_grad():
            batched = model(ids, attention_mask=mask)
        T = ids.shape[1]
        for i, row in enumerate(rows):
            with torch.no_grad():
                alone = model(row[None])[0]
            assert_close(got[i, T - len(row):], alone, what=f"row {i} cached")
            assert_close(batched[i, T - len(row):], alone, what=f"row {i} uncached")
        return
    src, mask = source_batch(c, gen)
    ids = torch.randint(3, c.vocab_size, (src.shape[0], 7), generator=gen)
    ids[:, 0] = c.bos_id
    got = cached_logits(model.decoder_for(src, mask), ids, prefill=3)
    for i in range(src.shape[0]):
        n = int(mask[i].sum())
        with torch.no_grad():
            alone = model(src[i:i + 1, :n], ids[i:i + 1])[0]
        assert_close(got[i], alone, what=f"row {i} ({n} source tokens)")
    assert int(mask.sum(1).min()) < src.shape[1]  # the batch really has a padded row
