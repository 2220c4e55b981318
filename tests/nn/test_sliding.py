"""Sliding-window attention: the block-wise computation (Band) against the dense windowed mask, the mask against
its definition, the rolling cache against the uncached forward, and the config checks."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenloom.errors import ConfigError, GenerationError
from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.nn import POSITIONS
from tokenloom.nn import sliding as sliding_module
from tokenloom.nn.attention import math_attention, sdpa_attention
from tokenloom.nn.kv_cache import KVCache, RollingKVCache
from tokenloom.nn.masks import additive_mask
from tokenloom.nn.sliding import Band, Window


def reference(q, k, v, window: Window, valid=None, bias=None):
    """Attention with the (T, T) mask written from the definition, position by position."""
    T = q.shape[2]
    allowed = torch.zeros(T, T, dtype=torch.bool)
    lo, hi = window.reach
    for i in range(T):
        for j in range(T):
            inside = lo <= j - i <= hi
            if window.globals:
                inside |= (j < window.globals and (j <= i or not window.causal)) or \
                    (not window.causal and i < window.globals)
            allowed[i, j] = inside
    allowed = allowed[None, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5 + additive_mask(allowed, q.dtype)
    if bias is not None:
        scores = scores + bias
    return scores.softmax(-1) @ v  # in q's dtype throughout (the math backend's softmax is float32)


def position_of(name: str, heads: int, bidirectional: bool = False):
    kwargs = dict(embed_dim=heads * 8, num_heads=heads, head_dim=8, max_seq_len=512)
    if name in ("alibi", "t5"):
        kwargs["bidirectional"] = bidirectional
    position = POSITIONS.get(name)(**kwargs)
    if name == "t5":
        torch.nn.init.normal_(position.weight.weight)
    return position


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("globals_", [0, 3])
@pytest.mark.parametrize("bias", [None, "alibi", "t5"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_band_equals_the_dense_windowed_mask(causal, globals_, bias, kv_heads):
    torch.manual_seed(0)
    B, H, D, W, T = 2, 4, 8, 8, 150  # T not a multiple of the block (16)
    window = Window(W, causal, globals_)
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, T, D, dtype=torch.float64) for _ in range(2))
    position = position_of(bias, H, not causal).double() if bias else None
    band = Band.plan(window, T, position=position, dtype=torch.float64, device=q.device)
    assert band is not None, "long enough to run block-wise"
    full_bias = position.bias(torch.arange(T), torch.arange(T)).double() if bias else None
    kr, vr = k.repeat_interleave(H // kv_heads, 1), v.repeat_interleave(H // kv_heads, 1)
    expected = reference(q, kr, vr, window, bias=full_bias)
    torch.testing.assert_close(band.attend(sdpa_attention, q, k, v, 0.0), expected)
    torch.testing.assert_close(band.attend(math_attention, q, k, v, 0.0), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_band_with_padding_equals_the_dense_mask(causal):
    torch.manual_seed(1)
    B, H, D, W, T = 3, 2, 8, 6, 120
    window = Window(W, causal, 2)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :5] = False
    valid[2, 30:33] = False
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    band = Band.plan(window, T, valid=valid, dtype=torch.float64, device=q.device)
    assert band is not None
    real = valid[:, None, :, None]  # a padding query's output is never read
    got = band.attend(sdpa_attention, q, k, v, 0.0)
    torch.testing.assert_close(got * real, reference(q, k, v, window, valid) * real)


def test_short_sequences_use_the_dense_mask():
    assert Band.plan(Window(64), 256, dtype=torch.float32, device=torch.device("cpu")) is None
    assert Band.plan(Window(64), 64 * 6, dtype=torch.float32, device=torch.device("cpu")) is not None


def test_band_gradients_equal_the_dense_mask():
    torch.manual_seed(2)
    window = Window(5, True, 1)
    q, k, v = (torch.randn(1, 2, 120, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    band = Band.plan(window, 120, dtype=torch.float64, device=q.device)
    grads = torch.autograd.grad(band.attend(sdpa_attention, q, k, v, 0.0).square().sum(), (q, k, v))
    expected = torch.autograd.grad(reference(q, k, v, window).square().sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def tiny(position="rope", window=8, globals_=0, kv_heads=None, max_seq_len=128, **kw) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, num_layers=2, num_heads=4, num_kv_heads=kv_heads, embed_dim=32,
                       max_seq_len=max_seq_len, position=position, attention_window=window,
                       attention_global=globals_, **kw)
    model = GPT(config).double().eval()
    if position == "t5":
        torch.nn.init.normal_(model.position.weight.weight)
    return model


@pytest.mark.parametrize("position", ["rope", "alibi", "t5", "learned", "sinusoidal", "none"])
def test_model_banded_forward_equals_the_masked_forward(position, monkeypatch):
    model = tiny(position, window=8, globals_=2)
    ids = torch.randint(0, 50, (2, 100))
    with torch.no_grad():
        banded = model(ids)
        monkeypatch.setattr(sliding_module, "MIN_BANDED_BLOCKS", 10**9)
        masked = model(ids)
    torch.testing.assert_close(banded, masked)


def test_window_hides_keys_outside_it():
    """Changing a token more than (layers x (W - 1)) positions back changes nothing; within the window it does."""
    model = tiny("rope", window=4)
    ids = torch.randint(0, 50, (1, 40))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 50
    with torch.no_grad():
        a, b = model(ids), model(changed)
    reach = 10 + 2 * 3  # two layers, each 3 positions back
    torch.testing.assert_close(a[:, reach + 1:], b[:, reach + 1:])
    assert not torch.allclose(a[:, 10:reach + 1], b[:, 10:reach + 1])


def test_window_at_least_the_context_is_full_attention():
    windowed, full = tiny("rope", window=128), tiny("rope", window=None)
    full.load_state_dict(windowed.state_dict())
    ids = torch.randint(0, 50, (2, 128))
    with torch.no_grad():
        torch.testing.assert_close(windowed(ids), full(ids))


def decode_all(model, ids, cache, prefill: int, mask=None):
    """Logits of every position: a prefill of ``prefill`` columns, then one column at a time."""
    out = [model(ids[:, :prefill], cache=cache, attention_mask=None if mask is None else mask[:, :prefill])]
    for t in range(prefill, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], cache=cache,
                         attention_mask=None if mask is None else mask[:, :t + 1]))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("position,globals_,kv_heads", [("rope", 0, None), ("rope", 2, 2), ("alibi", 1, None),
                                                        ("t5", 0, 2), ("learned", 2, None), ("none", 0, None)])
@pytest.mark.parametrize("prefill", [3, 30])
def test_rolling_cache_decode_equals_the_uncached_forward(position, globals_, kv_heads, prefill):
    model = tiny(position, window=6, globals_=globals_, kv_heads=kv_heads)
    ids = torch.randint(0, 50, (2, 48))  # eight windows
    cache = model.create_cache(2, 48)
    assert isinstance(cache, RollingKVCache)
    with torch.no_grad():
        torch.testing.assert_close(decode_all(model, ids, cache, prefill), model(ids))
    assert cache.kv.shape[-2] == 6 + globals_ + 1  # the window (and the global positions), not the sequence


@pytest.mark.parametrize("globals_", [0, 2])
def test_rolling_cache_with_left_padding_equals_each_row_alone(globals_):
    model = tiny("rope", window=5, globals_=globals_)
    rows = [torch.randint(0, 50, (n,)) for n in (30, 22)]
    T = 30
    ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, T - len(row):], mask[i, T - len(row):] = row, 1
    with torch.no_grad():
        got = decode_all(model, ids, model.create_cache(2, T, rolling=True), 12, mask)
        for i, row in enumerate(rows):
            alone = model(row[None])
            torch.testing.assert_close(got[i, T - len(row):], alone[0])


def test_rolling_cache_extends_by_several_positions():
    model = tiny("alibi", window=6, globals_=1)
    ids = torch.randint(0, 50, (1, 40))
    cache = model.create_cache(1, rolling=True)
    with torch.no_grad():
        parts = [model(ids[:, a:b], cache=cache) for a, b in ((0, 10), (10, 13), (13, 14), (14, 40))]
        torch.testing.assert_close(torch.cat(parts, 1), model(ids))


def test_dense_cache_decode_applies_the_window():
    model = tiny("rope", window=6)
    ids = torch.randint(0, 50, (2, 40))
    cache = model.create_cache(2, 40, rolling=False)
    assert isinstance(cache, KVCache)
    with torch.no_grad():
        torch.testing.assert_close(decode_all(model, ids, cache, 10), model(ids))


def test_generation_runs_past_the_context_with_a_window():
    from tokenloom.generation import GenerationConfig, generate

    model = tiny("rope", window=8, max_seq_len=16)
    out = generate(model, torch.randint(0, 50, (1, 4)), GenerationConfig(max_new_tokens=60, do_sample=False))
    assert out.shape == (1, 64)
    with torch.no_grad():  # the last greedy token is the argmax of the uncached windowed forward
        assert int(model(out[:, :-1])[0, -1].argmax()) == int(out[0, -1])
    learned = tiny("learned", window=8, max_seq_len=16)
    with pytest.raises(GenerationError, match="context of 16"):
        generate(learned, torch.randint(0, 50, (1, 4)), GenerationConfig(max_new_tokens=60, do_sample=False))


def test_window_config_errors():
    with pytest.raises(ConfigError, match="attention_window must be a positive integer"):
        GPTConfig(attention_window=0)
    with pytest.raises(ConfigError, match="attention_global=2 needs an attention_window"):
        GPTConfig(attention_global=2)
    with pytest.raises(ConfigError, match="must not exceed attention_window=4"):
        GPTConfig(attention_window=4, attention_global=5)
    with pytest.raises(ConfigError, match="needs attention sdpa or math"):
        GPTConfig(attention_window=4, attention="performer")


def test_sdpa_and_math_agree_with_a_window():
    a = tiny("rope", window=8)
    b = tiny("rope", window=8, attention="math")
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 50, (2, 90))
    with torch.no_grad():
        torch.testing.assert_close(a(ids), b(ids))
    assert F is not None


def test_dense_cache_decodes_past_the_context_with_a_window():
    """A dense cache longer than max_seq_len (rope grows its tables) gives the uncached windowed forward."""
    model = tiny("rope", window=8, max_seq_len=16)
    ids = torch.randint(0, 50, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(decode_all(model, ids, model.create_cache(1, 40, rolling=False), 5), model(ids))
