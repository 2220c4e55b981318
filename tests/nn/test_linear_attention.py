"""Linear-time attention: Performer (FAVOR+) converges to softmax attention, its causal prefix-sum form equals
its own estimate under an explicit causal mask, masks and refusals; Linformer shapes, padding and refusals; the
model configs that take them or refuse them."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenloom import GPT, GenerationConfig, GPTConfig, generate
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.models import NATConfig, Seq2SeqConfig, SwinConfig, ViT, ViTConfig
from tokenloom.nn import ATTENTION_BACKENDS, MultiHeadAttention
from tokenloom.nn.linear_attention import (
    LinformerAttention,
    PerformerAttention,
    favor_features,
    orthogonal_random_features,
)
from tokenloom.nn.masks import additive_mask


def qkv(B=2, H=4, T=40, D=16, seed=0, scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=gen) * scale for _ in range(3))


def test_orthogonal_features_are_orthogonal_within_a_block():
    w = orthogonal_random_features(40, 16, torch.Generator().manual_seed(0))
    assert w.shape == (40, 16)
    block = w[:16] / w[:16].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(16), atol=1e-5, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_performer_converges_to_softmax_attention_as_features_grow(causal):
    q, k, v = qkv()
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    errors = []
    for m in (16, 128, 2048):
        runs = []
        for seed in range(3):
            torch.manual_seed(seed)
            out, _ = PerformerAttention(4, 16, features=m)(q, k, v, None, causal, 0.0, False)
            runs.append((out - exact).abs().mean().item())
        errors.append(sum(runs) / len(runs))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.02


@pytest.mark.parametrize("tq,chunk", [(40, 128), (40, 16), (37, 8), (1, 16)])
def test_causal_performer_equals_its_estimate_under_an_explicit_causal_mask(tq, chunk):
    """The prefix-sum form (chunks, a running state rescaled as its stabiliser grows, queries aligned to the last
    keys as with a cache) computes exactly, for each query, phi(q) phi(k)^T over the keys it may see (stabilised by
    their own maximum: a later key has no say), normalised, times v; and so does the one-token step over those
    keys (a decode step over the cache)."""
    torch.manual_seed(0)
    performer = PerformerAttention(4, 16, features=32, chunk=chunk)
    q, k, v = qkv(T=40)
    k[:, :, 30] *= 4  # a late key with a large norm and peak: the stabiliser grows mid-sequence
    q = q[:, :, -tq:]
    out, _ = performer(q, k, v, None, True, 0.0, False)
    qf = favor_features(q * 16 ** -0.25, performer.features, is_query=True)  # the scaling, done outside
    for i in range(tq):
        p = 40 - tq + i  # query i's position: it sees keys 0..p
        kf = favor_features(k[:, :, :p + 1] * 16 ** -0.25, performer.features, is_query=False)
        scores = qf[:, :, i:i + 1] @ kf.transpose(-2, -1)  # (B, H, 1, p + 1)
        explicit = (scores @ v[:, :, :p + 1]) / scores.sum(-1, keepdim=True)
        torch.testing.assert_close(out[:, :, i:i + 1], explicit, atol=1e-5, rtol=1e-4)
        step, _ = performer(q[:, :, i:i + 1], k[:, :, :p + 1], v[:, :, :p + 1], None, False, 0.0, False)
        torch.testing.assert_close(out[:, :, i:i + 1], step, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_performer_key_padding_equals_the_unpadded_sequence(causal):
    torch.manual_seed(0)
    performer = PerformerAttention(4, 16, features=32)
    q, k, v = qkv(B=1, T=12)
    real = torch.ones(1, 12, dtype=torch.bool)
    real[:, 9:] = False  # 3 padding positions at the end
    mask = real[:, None, None, :]
    if causal:  # what GPT passes with padding: causal & padding, additive
        mask = additive_mask(mask & torch.ones(12, 12, dtype=torch.bool).tril(), torch.float32)
    padded, _ = performer(q, k, v, mask, False, 0.0, False)
    alone, _ = performer(q[:, :, :9], k[:, :, :9], v[:, :, :9], None, causal, 0.0, False)
    torch.testing.assert_close(padded[:, :, :9], alone, atol=1e-5, rtol=1e-4)


def test_performer_refuses_what_it_cannot_express():
    performer = PerformerAttention(4, 16)
    q, k, v = qkv(T=6)
    bias = torch.randn(4, 6, 6)  # alibi / t5: a score bias
    with pytest.raises(GenerationError, match="score bias"):
        performer(q, k, v, bias, False, 0.0, False)
    pattern = torch.rand(6, 6) > 0.5
    pattern[:, -1] = True
    with pytest.raises(GenerationError, match="causal and key-padding masks only"):
        performer(q, k, v, pattern, False, 0.0, False)


def test_performer_redraws_features_every_n_training_calls_reproducibly():
    torch.manual_seed(0)
    a = PerformerAttention(4, 16, features=8, redraw=2)
    b = PerformerAttention(4, 16, features=8, redraw=2)
    b.load_state_dict(a.state_dict())
    b.seed = a.seed
    q, k, v = qkv(T=5)
    first = a.features.clone()
    a.eval()(q, k, v, None, False, 0.0, False)
    assert int(a.calls) == 0  # eval: no redraw, no count
    a.train()
    seen = []
    for _ in range(5):
        a(q, k, v, None, False, 0.0, False)
        seen.append(a.features.clone())
    assert torch.equal(seen[0], first) and torch.equal(seen[1], first)  # calls 1, 2
    assert not torch.equal(seen[2], first) and torch.equal(seen[2], seen[3])  # redrawn at call 3
    assert not torch.equal(seen[4], seen[3])
    b.train()
    for _ in range(5):
        b(q, k, v, None, False, 0.0, False)
    assert torch.equal(b.features, a.features)  # the same draws: exact resume


def test_linformer_shapes_padding_and_refusals():
    torch.manual_seed(0)
    lin = LinformerAttention(4, 16, max_len=20, k=8)
    q, k, v = qkv(T=12)
    out, weights = lin(q, k, v, None, False, 0.0, False)
    assert out.shape == q.shape and weights is None
    real = torch.ones(2, 12, dtype=torch.bool)
    real[1, 9:] = False
    mask = real[:, None, None, :]
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 9:], v2[1, :, 9:] = 100.0, -100.0  # whatever sits at padded positions does not matter
    a, _ = lin(q, k, v, mask, False, 0.0, False)
    b, _ = lin(q, k2, v2, mask, False, 0.0, False)
    torch.testing.assert_close(a, b)
    with pytest.raises(ConfigError, match="non-causal"):
        lin(q, k, v, None, True, 0.0, False)
    q, k, v = qkv(T=21)
    with pytest.raises(GenerationError, match="exceeds the linformer projection length 20"):
        lin(q, k, v, None, False, 0.0, False)


def test_backends_are_built_per_layer_and_listed():
    attn = MultiHeadAttention(32, 4, backend="performer", attention_options=dict(features=10))
    assert isinstance(attn.backend, PerformerAttention) and attn.backend.features.shape == (10, 8)
    assert "backend.features" in attn.state_dict()
    assert {"sdpa", "math", "performer", "linformer"} <= set(ATTENTION_BACKENDS.names())
    with pytest.raises(ConfigError, match="performer"):  # an unknown backend lists the known ones
        GPTConfig(attention="perfomer")


def test_configs_refuse_linformer_where_attention_is_causal_and_biases_for_both():
    with pytest.raises(ConfigError, match="non-causal"):
        GPTConfig(attention="linformer")
    with pytest.raises(ConfigError, match="non-causal"):
        Seq2SeqConfig(attention="linformer")
    NATConfig(attention="linformer", kind="nat")  # a parallel decoder: fine
    with pytest.raises(ConfigError, match="score bias"):
        GPTConfig(attention="performer", position="alibi")
    with pytest.raises(ConfigError, match="relative position bias"):
        SwinConfig(attention="performer")
    with pytest.raises(ConfigError, match=r"attention_options\.features must be an integer >= 0, got -1"):
        GPTConfig(attention="performer", attention_options={"features": -1})
    with pytest.raises(ConfigError, match=r"unknown key 'attention_options\.featurs' \(did you mean 'features'"):
        GPTConfig(attention="performer", attention_options={"featurs": 8})
    with pytest.raises(ConfigError, match="attention 'sdpa' takes no options"):
        GPTConfig(attention_options={"k": 8})


def test_old_configs_with_top_level_linear_attention_keys_still_load():
    """Before attention_options, every saved config carried performer_features / performer_redraw /
    linformer_k at the top level; they move into the section of the backend they belong to, and are dropped
    for the others (the unused defaults)."""
    from tokenloom.models.factory import model_config_from_dict

    old = {"family": "gpt", "attention": "performer", "performer_features": 12, "performer_redraw": 3,
           "linformer_k": 64, "num_layers": 1, "num_heads": 2, "embed_dim": 16}
    _, config = model_config_from_dict(old)
    assert config.attention_options == {"features": 12, "redraw": 3}
    _, config = model_config_from_dict({**old, "attention": "sdpa"})
    assert config.attention_options is None
    _, config = model_config_from_dict({**old, "attention_options": {"features": 4}})  # the section wins
    assert config.attention_options == {"features": 4, "redraw": 3}
    model = GPT(config)
    assert model.blocks[0].attn.backend.num_features == 4 and model.blocks[0].attn.backend.redraw == 3


def test_a_performer_gpt_trains_and_decodes_with_the_cache_as_without():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=32,
                          attention="performer", position="rope"))
    ids = torch.randint(0, 30, (2, 10))
    loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        out = generate(model, ids[:, :4], GenerationConfig(max_new_tokens=6, do_sample=False))
        full = model(out)[:, 3:-1].argmax(-1)  # teacher-forced argmax over the generated sequence
    assert torch.equal(full, out[:, 4:])


def test_a_linformer_vit_runs_forward_and_backward():
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=8, patch_size=2, in_channels=1, num_classes=3, embed_dim=32, num_layers=2,
                          num_heads=2, attention="linformer", attention_options={"k": 4}))
    logits = model(torch.randn(2, 1, 8, 8))
    logits.sum().backward()
    assert logits.shape == (2, 3)
    assert model.blocks[0].attn.backend.proj_k.grad is not None
