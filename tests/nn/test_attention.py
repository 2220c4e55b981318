import pytest
import torch
from torch.nn import functional as F

from tokenloom.nn import ATTENTION_BACKENDS, Context, MultiHeadAttention


def reference(q, k, v, mask):
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_backends_match_explicit_softmax(backend):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True
    out, _ = ATTENTION_BACKENDS.get(backend)(q, k, v, mask, False, 0.0, False)
    assert torch.allclose(out, reference(q, k, v, mask), atol=1e-5)


def test_math_returns_probabilities_and_causal():
    q = k = v = torch.randn(1, 2, 4, 8)
    out, probs = ATTENTION_BACKENDS.get("math")(q, k, v, None, True, 0.0, True)
    assert probs.shape == (1, 2, 4, 4)
    assert torch.allclose(probs.sum(-1), torch.ones(1, 2, 4))
    assert (probs.triu(1) == 0).all()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-5)


def test_grouped_query_matches_repeated_heads():
    attn = MultiHeadAttention(32, num_heads=4, num_kv_heads=2, backend="math")
    x = torch.randn(2, 6, 32)
    out_math, _ = attn(x, Context(is_causal=True))
    attn.backend = ATTENTION_BACKENDS.get("sdpa")
    out_sdpa, _ = attn(x, Context(is_causal=True))
    assert torch.allclose(out_math, out_sdpa, atol=1e-5)


def test_cross_attention_shapes_and_memory_mask():
    attn = MultiHeadAttention(16, num_heads=2, cross=True)
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    out, _ = attn(x, memory=memory)
    assert out.shape == (2, 3, 16)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[:, :, :, 3:] = False
    masked, _ = attn(x, Context(memory_mask=mask), memory=memory)
    memory2 = memory.clone()
    memory2[:, 3:] = 100.0  # changes to masked memory positions change nothing
    masked2, _ = attn(x, Context(memory_mask=mask), memory=memory2)
    assert torch.allclose(masked, masked2, atol=1e-6)


def test_bad_head_counts():
    with pytest.raises(ValueError, match="divisible by num_heads=3"):
        MultiHeadAttention(16, num_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        MultiHeadAttention(16, num_heads=4, num_kv_heads=3)


@pytest.mark.parametrize("causal", [True, False])
def test_bf16_training_path_matches_float_reference(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).tril() if causal else torch.rand(2, 1, 16, 16) > 0.3
    if not causal:
        mask[..., 0] = True
    expected = reference(q, k, v, mask)
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    out, _ = ATTENTION_BACKENDS.get("sdpa")(qb, kb, vb, None if causal else mask, causal, 0.0, False)
    assert out.dtype == torch.bfloat16
    step = 2 ** -8  # one bf16 rounding step, relative: inputs, scores, probabilities and outputs are each rounded
    # measured here 1.3 steps of the largest output away (output), 2.3 (gradient); a few more on other kernels
    assert (out.float() - expected).abs().max() <= 4 * step * expected.abs().max()
    out.float().sum().backward()
    qf = q.clone().requires_grad_()
    reference(qf, k, v, mask).sum().backward()
    assert (qb.grad.float() - qf.grad).abs().max() <= 8 * step * qf.grad.abs().max()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ragged_rows_kernel_matches_sdpa(kv_heads):
    """The one-query kernel of rows at different lengths (Context.ragged) computes sdpa's attention: each row's
    later keys hidden by its mask, grouped-query heads through the fused kernel; a wrong scale, a mask ignored or
    rows mixed fail here."""
    from tokenloom.nn.attention import ragged_rows_attention, sdpa_attention
    from tokenloom.nn.masks import additive_mask

    torch.manual_seed(0)
    B, H, S, D = 3, 4, 7, 8
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, D)
    lengths = torch.tensor([2, 7, 4])
    mask = additive_mask((torch.arange(S)[None] < lengths[:, None])[:, None, None], torch.float32)
    with torch.no_grad():
        got, _ = ragged_rows_attention(q, k, v, mask, False, 0.0, False)
        want, _ = sdpa_attention(q, k, v, mask, False, 0.0, False)
        row0, _ = sdpa_attention(q[:1], k[:1, :, :2], v[:1, :, :2], None, False, 0.0, False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:1], row0, rtol=1e-5, atol=1e-6)  # row 0 sees its first 2 keys only
