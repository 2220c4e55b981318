"""Every registered attention backend, through the signature of tokenloom/nn/attention.py::

    backend(q, k, v, attn_mask, is_causal, dropout_p, need_weights) -> (out, weights | None)

Exactness rule (so a new backend is classified by how it is registered): a backend registered as a function is a
pure function of q, k, v and the mask and must equal exact softmax attention; a backend registered as a class
holds state (random features, learned projections: performer, linformer), is built per layer from the
``max_len`` and its own ``attention_options`` (performer ``features`` / ``redraw``, linformer ``k``) and is an
approximation: it is checked for shapes, finiteness, causality where it supports it, ignoring padding, and
gradient flow, not for equality.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import Tensor

from tests.registry.helpers import (
    assert_close,
    cached_logits,
    check_gradients,
    left_pad,
    shrink,
    weighted_loss,
)
from tokenloom.errors import ConfigError
from tokenloom.models.gpt import GPT, GPT_PRESETS, GPTConfig
from tokenloom.models.vit import ViT, ViTConfig
from tokenloom.nn import POSITIONS
from tokenloom.nn.attention import ATTENTION_BACKENDS, backend_options

NAMES = ATTENTION_BACKENDS.names()
EXACT = [n for n in NAMES if not isinstance(ATTENTION_BACKENDS.get(n), type)]
APPROX = [n for n in NAMES if isinstance(ATTENTION_BACKENDS.get(n), type)]
B, H, D = 2, 4, 8

# Known disagreements, found by these tests and reported rather than fixed (the tests are strict xfails: they fail
# loudly once the behaviour is fixed, so the entry can go):
KNOWN: dict[tuple, str] = {}


def known(*values, key: tuple | None = None):
    """``values`` as a pytest.param, a strict xfail when ``key`` (default: the values) is listed in KNOWN."""
    key = key or tuple(v if isinstance(v, str) else ("autograd" if v else "inference") for v in values)
    reason = KNOWN.get(key)
    return pytest.param(*values, marks=pytest.mark.xfail(strict=True, reason=reason) if reason else ())


def reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(D) + mask) v in float64; ``mask`` bool (True = may attend) or additive."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf)
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    return (scores + (0 if mask is None else mask.double())).softmax(-1) @ v.double()


def causal(tq: int, tk: int) -> Tensor:
    """(Tq, Tk) bool: the queries are the last Tq of Tk positions (a cache before them)."""
    return torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)


def padding(tk: int) -> Tensor:
    """(B, 1, 1, Tk) bool: row 1 has its last 3 keys padded."""
    keep = torch.ones(B, 1, 1, tk, dtype=torch.bool)
    keep[1, ..., tk - 3:] = False
    return keep


def additive(allowed: Tensor) -> Tensor:
    """The models' additive form: 0 where allowed, float32's minimum elsewhere (tokenloom.nn.masks)."""
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


BIAS = torch.randn(1, H, 5, 5, generator=torch.Generator().manual_seed(9))  # a score bias (alibi, t5, Swin)

# case -> (Tq, Tk, Hkv, attn_mask, is_causal, the reference's mask)
CASES = {
    "self": (7, 7, H, None, False, None),
    "causal": (7, 7, H, None, True, causal(7, 7)),
    "causal-mask-after-cache": (3, 8, H, causal(3, 8), False, causal(3, 8)),
    "is-causal-after-cache": (3, 8, H, None, True, causal(3, 8)),  # queries are the last Tq of Tk positions
    "padded-bool": (7, 7, H, padding(7), False, padding(7)),
    "padded-additive": (7, 7, H, additive(padding(7)), False, padding(7)),
    "padded-causal": (7, 7, H, padding(7) & causal(7, 7), False, padding(7) & causal(7, 7)),
    "padded-causal-after-cache": (3, 8, H, padding(8) & causal(3, 8), False, padding(8) & causal(3, 8)),
    "padded-causal-after-cache-additive": (3, 8, H, additive(padding(8) & causal(3, 8)), False,
                                           padding(8) & causal(3, 8)),
    "bias-additive": (5, 5, H, BIAS, False, BIAS),
    "grouped-query": (7, 7, 2, None, False, None),
    "grouped-query-causal": (7, 7, 1, None, True, causal(7, 7)),
    "grouped-query-is-causal-after-cache": (3, 8, 2, None, True, causal(3, 8)),
    "grouped-query-padded-causal-after-cache": (3, 8, 2, additive(padding(8) & causal(3, 8)), False,
                                                padding(8) & causal(3, 8)),
    "grouped-query-padded": (7, 7, 2, additive(padding(7)), False, padding(7)),
    "cross": (5, 9, H, None, False, None),
    "cross-padded": (5, 9, H, padding(9), False, padding(9)),
    "cross-grouped-padded": (5, 9, 2, additive(padding(9)), False, padding(9)),
}


def make_qkv(tq: int, tk: int, hkv: int, seed: int = 0, requires_grad: bool = False) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, tq, D, generator=gen)
    k, v = torch.randn(B, hkv, tk, D, generator=gen), torch.randn(B, hkv, tk, D, generator=gen)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def small_options(name: str) -> dict:
    """The backend's own options (its defaults, validated by it), a projection length ``k`` cut to 8."""
    options = backend_options(name, None)
    return {**options, "k": 8} if "k" in options else options


def backend_of(name: str, max_len: int = 16):
    """The callable a layer uses: a function as registered, a class built the way MultiHeadAttention builds it."""
    impl = ATTENTION_BACKENDS.get(name)
    if isinstance(impl, type):
        torch.manual_seed(0)
        impl = impl(H, D, max_len=max_len, **small_options(name))
    return impl


def test_the_registry_has_exact_and_approximate_backends():
    # A wrong rule (everything a class, a backend renamed) would skip the equality tests: the reference's own
    # registered form must count as exact.
    assert {"sdpa", "math"} <= set(EXACT), EXACT
    assert set(EXACT) | set(APPROX) == set(NAMES)


@pytest.mark.parametrize("name, case, grad", [known(n, c, g) for n in EXACT for c in CASES for g in (False, True)],
                         ids=[f"{n}-{c}-{'autograd' if g else 'inference'}" for n in EXACT for c in CASES
                              for g in (False, True)])
def test_exact_backend_equals_softmax_attention(name, case, grad):
    # A backend that drops the 1/sqrt(D) scale, repeats kv heads in the wrong order (interleaved vs blocked), reads
    # a bool mask the wrong way round, ignores an additive mask or aligns the causal mask to the first keys instead
    # of the last differs from the reference. "autograd" runs with q/k/v requiring grad: sdpa then takes its
    # explicit CPU training path, which must agree too.
    tq, tk, hkv, mask, is_causal, ref_mask = CASES[case]
    q, k, v = make_qkv(tq, tk, hkv, requires_grad=grad)
    out, weights = ATTENTION_BACKENDS.get(name)(q, k, v, mask, is_causal, 0.0, False)
    assert weights is None  # need_weights=False: nothing is returned (or computed) for the weights
    assert_close(out.double(), reference(q.detach(), k.detach(), v.detach(), ref_mask), atol=1e-5,
                 what=f"{name} {case}")
    if grad:  # gradients flow to every input and are finite
        out.sum().backward()
        for t in (q, k, v):
            assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.any()


@pytest.mark.parametrize("name", EXACT)
def test_exact_backend_weights_are_the_probabilities(name):
    # need_weights: a backend may return None (sdpa), but weights it does return must be the softmax
    # probabilities (rows summing to 1, zero on masked keys), not raw scores or probabilities of other heads.
    tq, tk, hkv, mask, is_causal, ref_mask = CASES["padded-causal"]
    q, k, v = make_qkv(tq, tk, hkv)
    out, weights = ATTENTION_BACKENDS.get(name)(q, k, v, mask, is_causal, 0.0, True)
    if weights is None:
        return
    assert weights.shape == (B, H, tq, tk)
    assert_close((weights.double() @ v.double()), out.double(), atol=1e-5, what="weights @ v")
    assert_close(weights.sum(-1).double(), torch.ones(B, H, tq, dtype=torch.float64), atol=1e-5, what="row sums")
    assert not weights.masked_select(~ref_mask.expand(B, H, tq, tk)).any()


@pytest.mark.parametrize("case", ["self", "padded-bool", "padded-additive", "grouped-query", "cross-padded",
                                  "cross-grouped-padded"])
@pytest.mark.parametrize("name", APPROX)
def test_approximate_backend_shapes_finite_and_gradients(name, case):
    # An approximation that mis-shapes its output for grouped-query or cross inputs, overflows (exp without the
    # stabilising shift) or cuts the gradient to q, k or v (or to its own learned projections) fails here.
    tq, tk, hkv, mask, is_causal, _ = CASES[case]
    backend = backend_of(name)
    q, k, v = make_qkv(tq, tk, hkv, requires_grad=True)
    out, weights = backend(q * 3, k * 3, v, mask, is_causal, 0.0, False)  # * 3: scores beyond exp's comfort
    assert out.shape == (B, H, tq, D) and weights is None
    assert torch.isfinite(out).all()
    loss = weighted_loss([out])
    if isinstance(backend, torch.nn.Module) and any(p.requires_grad for p in backend.parameters()):
        check_gradients(backend, loss)
    else:
        loss.backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.any()


def other_keys(k: Tensor, v: Tensor, where: tuple) -> tuple[Tensor, Tensor]:
    """k and v with the positions ``where`` replaced by other draws of the same (unit-scale) distribution."""
    gen = torch.Generator().manual_seed(77)
    k2, v2 = k.clone(), v.clone()
    k2[where] = torch.randn(k2[where].shape, generator=gen)
    v2[where] = torch.randn(v2[where].shape, generator=gen)
    return k2, v2


@pytest.mark.parametrize("mask_form", ["bool", "additive"])
@pytest.mark.parametrize("name", [known(n, key=(n, "padding")) for n in APPROX])
def test_approximate_backend_ignores_padded_keys(name, mask_form):
    # Padding that still enters the random-feature sums, their stabilising shift or the sequence projections would
    # let the padded keys' values change the output.
    mask = padding(9) if mask_form == "bool" else additive(padding(9))
    backend = backend_of(name)
    q, k, v = make_qkv(5, 9, H)
    k2, v2 = other_keys(k, v, (1, slice(None), slice(-3, None)))
    with torch.no_grad():
        a, _ = backend(q, k, v, mask, False, 0.0, False)
        b, _ = backend(q, k2, v2, mask, False, 0.0, False)
    assert_close(a, b, atol=1e-5, what="padded keys changed the output")
    assert not torch.allclose(a[1], backend(q, k2, v2, None, False, 0.0, False)[0][1], atol=1e-3)  # they matter


def left_padding(tk: int) -> Tensor:
    """(B, 1, 1, Tk) bool: row 1 has its first 2 keys padded (a left-padded prompt)."""
    keep = torch.ones(B, 1, 1, tk, dtype=torch.bool)
    keep[1, ..., :2] = False
    return keep


@pytest.mark.parametrize("tq", [8, 3])  # 3: the queries are the last 3 of 8 positions (a cache before them)
@pytest.mark.parametrize("name", [known(n, key=(n, "causal")) for n in APPROX])
def test_approximate_backend_is_causal_or_refuses(name, tq):
    # With is_causal, changing keys/values at position >= 6 must not change outputs of the queries before it (a
    # causal form that sums over all keys, or stabilises its features by their maximum over all keys, leaks the
    # future). A backend that cannot be causal must say so with a ConfigError, not return non-causal outputs.
    backend = backend_of(name)
    q, k, v = make_qkv(tq, 8, H)
    try:
        with torch.no_grad():
            a, _ = backend(q, k, v, None, True, 0.0, False)
    except ConfigError as err:
        assert "causal" in str(err) and "\n" not in str(err)
        return
    k2, v2 = other_keys(k, v, (Ellipsis, slice(6, None), slice(None)))
    before = 6 - (8 - tq)  # the queries at positions < 6
    with torch.no_grad():
        b, _ = backend(q, k2, v2, None, True, 0.0, False)
        masked, _ = backend(q, k, v, causal(tq, 8), False, 0.0, False)  # the same causal pattern as a mask
    assert_close(a[..., :before, :], b[..., :before, :], atol=1e-5, what="future keys changed earlier outputs")
    assert not torch.allclose(a[..., before:, :], b[..., before:, :], atol=1e-3)
    assert_close(masked, a, atol=1e-5, what="is_causal vs the causal bool mask")


@pytest.mark.parametrize("mask_form", ["bool", "additive"])
@pytest.mark.parametrize("tq", [8, 3])
@pytest.mark.parametrize("name", APPROX)
def test_approximate_backend_causal_and_padded_equals_each_row_alone(name, tq, mask_form):
    # Causal attention over a left-padded batch (what a model passes: the padding & causal mask, after a cache when
    # tq < 8) must give each row what the row alone gives with is_causal: padded keys excluded from every sum and
    # every stabiliser, the causal pattern aligned to the last keys. A backend that cannot be causal refuses.
    backend = backend_of(name)
    q, k, v = make_qkv(tq, 8, H)
    allowed = left_padding(8) & causal(tq, 8)
    try:
        with torch.no_grad():
            out, _ = backend(q, k, v, allowed if mask_form == "bool" else additive(allowed), False, 0.0, False)
    except ConfigError as err:
        assert "causal" in str(err) and "\n" not in str(err)
        return
    n = min(tq, 6)  # row 1's queries that see a real key
    with torch.no_grad():
        row0, _ = backend(q[:1], k[:1], v[:1], None, True, 0.0, False)
        row1, _ = backend(q[1:, :, tq - n:], k[1:, :, 2:], v[1:, :, 2:], None, True, 0.0, False)
    assert_close(out[:1], row0, atol=1e-5, what="an unpadded row in a padded batch")
    assert_close(out[1:, :, tq - n:], row1, atol=1e-5, what="a left-padded row vs the row alone")


def small_gpt(**kw) -> GPTConfig:
    return GPTConfig(**shrink(GPTConfig, GPT_PRESETS["tiny"], **kw))


@pytest.mark.parametrize("name", NAMES)
def test_backend_inside_a_causal_gpt(name):
    # Every backend either builds a GPT whose forward/backward work and whose cached decoding equals the full
    # forward (a backend ignoring the cache position or the one-token mask breaks that), or is refused when the
    # config is made, in one line naming the field: not at the first forward, not with a traceback from inside.
    try:
        config = small_gpt(attention=name)
    except ConfigError as err:
        message = str(err)
        assert "attention" in message and name in message and "\n" not in message, message
        return
    torch.manual_seed(0)
    model = GPT(config)
    ids = torch.randint(0, config.vocab_size, (2, 10))
    model.train()
    logits = model(ids)
    assert logits.shape == (2, 10, config.vocab_size) and torch.isfinite(logits).all()
    check_gradients(model, weighted_loss([logits]))
    model.eval()
    with torch.no_grad():
        full = model(ids)
    assert_close(cached_logits(model, ids, prefill=3), full, what=f"{name} cached vs full")


@pytest.mark.parametrize("position", POSITIONS.names())
@pytest.mark.parametrize("name", NAMES)
def test_backend_decodes_a_left_padded_batch_in_chunks_as_each_row_alone(name, position):
    # Causal + padded + queries fewer than keys, through a model, for every backend and position scheme: a
    # left-padded batch decoded in multi-token chunks over the cache (a prefill of 4, then chunks of 3 queries over
    # 7 and 9 keys) gives each row the logits of the row alone, uncached. A causal mask aligned to the first keys,
    # padded keys read by a stabiliser or a position counted from the padded start differ. A combination the
    # configs refuse (linformer in a causal model; alibi / t5 biases with performer) is refused in one line.
    try:
        config = small_gpt(attention=name, position=position)
    except ConfigError as err:
        assert "\n" not in str(err) and (name in str(err) or position in str(err)), str(err)
        return
    torch.manual_seed(0)
    model = GPT(config).eval()
    with torch.no_grad():  # scores far from uniform: a stabiliser reading a padded key moves the output visibly
        for block in model.blocks:
            block.attn.qkv_proj.weight.mul_(8)
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in (9, 4, 7)]
    ids, mask = left_pad(rows, pad=3)
    T = ids.shape[1]
    cache = model.create_cache(len(rows), T)
    with torch.no_grad():
        got = torch.cat([model(ids[:, a:b], cache=cache, attention_mask=mask[:, :b]) for a, b in ((0, 4), (4, 7),
                                                                                                  (7, T))], dim=1)
        for i, row in enumerate(rows):
            assert_close(got[i, T - len(row):], model(row[None])[0], atol=1e-5, what=f"{name} {position} row {i}")


@pytest.mark.parametrize("name", NAMES)
def test_backend_inside_a_bidirectional_vit(name):
    # The non-causal side: a backend refused by causal models (linformer) must still work where attention is
    # bidirectional, so no backend can pass both tests by being refused everywhere.
    fields = {f.name for f in dataclasses.fields(ViTConfig)}
    preset = dict(image_size=16, patch_size=4, in_channels=1, num_classes=5, embed_dim=32, num_layers=2, num_heads=4,
                  attention=name, **({"attention_options": small_options(name) or None}
                                     if "attention_options" in fields else {}))
    torch.manual_seed(0)
    model = ViT(ViTConfig(**preset)).train()
    logits = model(torch.randn(2, 1, 16, 16))
    assert logits.shape == (2, 5) and torch.isfinite(logits).all()
    check_gradients(model, weighted_loss([logits]))
