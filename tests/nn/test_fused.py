"""Fused inference kernels, the eval-mode residual form of blocks, class-token-only last layers, the explicit
float32 training attention and the one-buffer gradient of q/k/v views: each equal to the plain computation."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenloom.nn import ATTENTION_BACKENDS, Context, MultiHeadAttention, create_block, fused
from tokenloom.nn.attention import EXPLICIT_TRAINING_MAX_KEYS, explicit_training, partition_views
from tokenloom.nn.fused import ACTIVATIONS, decode_linear, fusable, linear_act, linear_add
from tokenloom.nn.windows import permute_tokens, window_order, window_partition

PLAIN = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}
MIN_ROWS = fused.FUSED_MIN_ROWS


@pytest.fixture(autouse=True)
def fuse_small_inputs(monkeypatch):
    """The fused kernels on these tests' small inputs too (in use they start at ``FUSED_MIN_ROWS`` rows)."""
    monkeypatch.setattr(fused, "FUSED_MIN_ROWS", 1)


def test_small_inputs_take_the_plain_ops(monkeypatch):
    monkeypatch.setattr(fused, "FUSED_MIN_ROWS", MIN_ROWS)
    w = torch.randn(8, 8)
    with torch.no_grad():
        assert not fusable(torch.randn(MIN_ROWS - 1, 8), w)  # a decoder pass at batch 1: plain ops are faster
        assert not fusable(torch.randn(1, MIN_ROWS - 1, 8), w)
        assert fusable(torch.randn(2, MIN_ROWS // 2, 8), w) == (torch.backends.mkldnn.is_available()
                                                               and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_linear_act_and_add_equal_the_plain_ops(act):
    torch.manual_seed(0)
    x, w, b, r = torch.randn(3, 7, 16), torch.randn(24, 16), torch.randn(24), torch.randn(3, 7, 24)
    with torch.no_grad():
        assert torch.allclose(linear_act(x, w, b, act), PLAIN[act](F.linear(x, w, b)), atol=1e-5)
        assert torch.allclose(linear_act(x, w, None, act), PLAIN[act](F.linear(x, w)), atol=1e-5)
        out = linear_add(x, w, b, r)
        assert torch.allclose(out, r + F.linear(x, w, b), atol=1e-5)
        assert out.data_ptr() != r.data_ptr()  # the residual is not overwritten


def test_fused_kernels_step_aside_for_autograd_autocast_and_other_dtypes():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    assert not fusable(x, w)  # autograd records here
    with torch.no_grad():
        assert fusable(x, w) == (torch.backends.mkldnn.is_available()
                                 and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
        assert not fusable(x.double(), w.double())
        assert not fusable(x, w.bfloat16())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not fusable(x, w)
    wg = w.clone().requires_grad_()
    out = linear_add(x, wg, None, torch.zeros(4, 8))
    out.sum().backward()  # the plain ops carry the gradient
    assert torch.allclose(wg.grad, x.sum(0).expand(8, 8))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_decode_linear_equals_linear_and_follows_weight_updates(dtype, rows, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    run = decode_linear(layer.weight, layer.bias, rows=rows)
    x = torch.randn(rows, 48, dtype=dtype)
    def reference() -> torch.Tensor:  # in float32, from the same (possibly bf16) weights and inputs
        bias_ = layer.bias.float() if bias else None
        return F.linear(x.float(), layer.weight.float(), bias_)

    def tolerance(exact: torch.Tensor) -> float:
        # fp32: summation order; bf16: both kernels accumulate in float32 and round the output once to bf16, so
        # they are within one bf16 step (2^-8 relative) of the float32 result whatever kernel the CPU runs
        return 1e-5 if dtype == torch.float32 else 2 ** -8 * exact.abs().max().item()

    with torch.inference_mode():
        exact = reference()
        assert (run(x).float() - exact).abs().max() <= tolerance(exact)
    with torch.no_grad():  # a training step / load_state_dict: the prepared copy must follow
        layer.weight.mul_(-2.0)
    with torch.inference_mode():
        exact = reference()
        assert (run(x).float() - exact).abs().max() <= tolerance(exact)
    again = decode_linear(layer.weight, layer.bias, rows=rows)  # a new plan reuses the prepared weight
    with torch.inference_mode():
        assert torch.equal(again(x), run(x))


def test_decode_linear_runs_plain_linear_for_autograd_and_autocast():
    layer = torch.nn.Linear(16, 8)
    run = decode_linear(layer.weight, layer.bias, rows=4)
    x = torch.randn(4, 16)
    run(x).sum().backward()  # autograd records: F.linear, which carries the gradient
    assert torch.allclose(layer.weight.grad, x.sum(0).expand(8, 16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert run(x).dtype == torch.bfloat16  # autocast applies as it does to F.linear


def blocks():
    for placement in ("pre", "post"):
        for mlp in ("gelu", "gelu_tanh", "relu", "relu2", "silu", "swiglu"):
            for cross in (False, True):
                yield placement, mlp, cross


@pytest.mark.parametrize("placement,mlp,cross", list(blocks()))
def test_eval_residual_form_equals_the_training_form(placement, mlp, cross):
    torch.manual_seed(0)
    block = create_block(placement, 32, 4, hidden_dim=48, mlp=mlp, cross_attention=cross)
    x, memory = torch.randn(2, 6, 32), torch.randn(2, 5, 32)
    kwargs = dict(memory=memory) if cross else {}
    with torch.no_grad():
        plain, _ = block.train()(x, **kwargs)  # dropout 0: the same function, unfused
        fused, _ = block.eval()(x, **kwargs)
    assert torch.allclose(fused, plain, atol=1e-5)


def test_hooks_see_the_sublayers_in_eval_mode():
    block = create_block("pre", 16, 2, hidden_dim=32).eval()
    seen = []
    block.mlp.fc_in.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        block(torch.randn(1, 3, 16))
    assert seen == [(1, 3, 32)]


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("training", [False, True])
def test_queries_computes_the_first_positions_only(placement, training):
    torch.manual_seed(0)
    block = create_block(placement, 32, 4, hidden_dim=48).train(training)
    x = torch.randn(3, 9, 32, requires_grad=True)
    mask = torch.rand(3, 1, 9, 9) > 0.2
    mask[..., 0] = True
    full, _ = block(x, Context(mask))
    first, _ = block(x, Context(mask), queries=2)
    assert first.shape == (3, 2, 32)
    assert torch.allclose(first, full[:, :2], atol=1e-5)
    (g_first,) = torch.autograd.grad(first.sum(), x)
    (g_full,) = torch.autograd.grad(full[:, :2].sum(), x)
    assert torch.allclose(g_first, g_full, atol=1e-5)


@pytest.mark.parametrize("masked", [None, "bool", "causal", "additive"])
def test_float32_training_attention_is_explicit_for_short_keys_and_exact(masked):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 8, requires_grad=True) for _ in range(3))
    assert explicit_training(q, 12) and not explicit_training(q, EXPLICIT_TRAINING_MAX_KEYS + 1)
    mask = {None: None, "causal": None, "bool": torch.rand(2, 1, 12, 12) > 0.3,
            "additive": torch.randn(4, 12, 12)}[masked]
    if masked == "bool":
        mask[..., 0] = True
    out, _ = ATTENTION_BACKENDS.get("sdpa")(q, k, v, mask, masked == "causal", 0.0, False)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=masked == "causal")
    assert torch.allclose(out, ref, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g, r, atol=1e-4)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_partition_views_gradient_equals_autograds(num_kv_heads):
    torch.manual_seed(0)
    H, D = 4, 8
    x = torch.randn(2, 5, (H + 2 * num_kv_heads) * D, requires_grad=True)

    def views(t):
        return t.unflatten(-1, (H + 2 * num_kv_heads, D)).transpose(1, 2).split((H, num_kv_heads, num_kv_heads), 1)

    weights = [torch.randn(2, h, 5, D) for h in (H, num_kv_heads, num_kv_heads)]
    for used in ((0, 1, 2), (0, 2)):  # an unused view gets a zero gradient
        ours = torch.autograd.grad(sum((partition_views(x, views)[i] * weights[i]).sum() for i in used), x)[0]
        ref = torch.autograd.grad(sum((views(x)[i] * weights[i]).sum() for i in used), x)[0]
        assert torch.equal(ours, ref)


def test_gqa_attention_trains_the_same_through_partition_views():
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, num_heads=4, num_kv_heads=2)
    x = torch.randn(2, 7, 32)
    out, _ = attn(x, Context(is_causal=True))
    out.square().sum().backward()
    grad = attn.qkv_proj.weight.grad.clone()
    attn.zero_grad()
    attn.backend = ATTENTION_BACKENDS.get("math")
    ref, _ = attn(x, Context(is_causal=True))
    ref.square().sum().backward()
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(grad, attn.qkv_proj.weight.grad, atol=1e-4)


@pytest.mark.parametrize("shift", [0, 2])
def test_window_order_is_roll_then_partition_and_permute_tokens_differentiates(shift):
    H, W, M, C = 8, 12, 4, 3
    x = torch.randn(2, H * W, C, requires_grad=True)
    rolled = torch.roll(x.view(2, H, W, C), shifts=(-shift, -shift), dims=(1, 2))
    expected = window_partition(rolled, M).reshape(2, H * W, C)
    order = window_order(H, W, M, shift)
    assert sorted(order.tolist()) == list(range(H * W))
    got = permute_tokens(x, order)
    assert torch.equal(got, expected)
    weight = torch.randn_like(got)
    (g,) = torch.autograd.grad((got * weight).sum(), x)
    (r,) = torch.autograd.grad((expected * weight).sum(), x)
    assert torch.equal(g, r)
