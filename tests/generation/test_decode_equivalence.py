"""The model side of decoding: cached == uncached, sdpa == math, causality, padded == alone."""

import pytest
import torch

from tests.generation.helpers import POSITIONS, left_pad, small_model
from tokenloom.nn.block import runs_plain


def cached_logits(model, ids, prefill, attention_mask=None):
    """Logits of ``ids`` (B, T): ``prefill`` positions in one call, then one position per call."""
    B, T = ids.shape
    cache = model.create_cache(B, T)
    chunks = [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]
    out = []
    with torch.no_grad():
        for start, end in chunks:
            mask = attention_mask[:, :end] if attention_mask is not None else None
            out.append(model(ids[:, start:end], attention_mask=mask, cache=cache))
    assert cache.length == T
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("kv_heads", [None, 2])
@pytest.mark.parametrize("position", POSITIONS)
def test_cached_equals_uncached(position, kv_heads):
    model = small_model(position=position, num_kv_heads=kv_heads)
    ids = torch.randint(0, 40, (2, 14))
    with torch.no_grad():
        full = model(ids)
    cached, cache = cached_logits(model, ids, prefill=5)
    assert runs_plain(cache), "one-token steps should take the fast decode path"
    assert torch.allclose(cached, full, atol=1e-5), (cached - full).abs().max()


@pytest.mark.parametrize("kw", [dict(norm_placement="post"), dict(mlp="swiglu", norm="rmsnorm", bias=False),
                                dict(mlp="gelu_tanh", attention="math"), dict(mlp="relu", num_kv_heads=1)])
def test_cached_equals_uncached_variants(kw):
    model = small_model(position="rope", **kw)
    ids = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        full = model(ids)
    cached, _ = cached_logits(model, ids, prefill=3)
    assert torch.allclose(cached, full, atol=1e-5), (cached - full).abs().max()


def test_fast_step_equals_module_path():
    """A forward hook switches the fast decode path off; both paths must give the same logits."""
    model = small_model(position="rope", num_kv_heads=2)
    ids = torch.randint(0, 40, (3, 12))
    fast, cache = cached_logits(model, ids, prefill=4)
    assert runs_plain(cache)
    handle = model.blocks[0].mlp.register_forward_hook(lambda module, args, out: None)
    slow, cache = cached_logits(model, ids, prefill=4)
    handle.remove()
    assert runs_plain(cache) is False
    assert torch.allclose(fast, slow, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [None, 2])
@pytest.mark.parametrize("position", POSITIONS)
def test_left_padded_batch_equals_rows_alone(position, kv_heads):
    """Cached logits of a left-padded batch match each row run alone (uncached), at every real position."""
    model = small_model(position=position, num_kv_heads=kv_heads)
    rows = [torch.randint(0, 40, (n,)) for n in (12, 7, 9)]
    ids, mask = left_pad(rows, pad=5)
    cached, _ = cached_logits(model, ids, prefill=8, attention_mask=mask)
    T = ids.shape[1]
    for i, row in enumerate(rows):
        with torch.no_grad():
            alone = model(row[None])[0]  # (len, V)
        got = cached[i, T - len(row):]
        assert torch.allclose(got, alone, atol=1e-5), (position, i, (got - alone).abs().max())


@pytest.mark.parametrize("position", ["learned", "rope", "alibi", "t5"])
def test_sdpa_equals_math(position):
    sdpa = small_model(position=position, attention="sdpa")
    math_model = small_model(position=position, attention="math")
    math_model.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 40, (2, 11))
    with torch.no_grad():
        assert torch.allclose(sdpa(ids), math_model(ids), atol=1e-5)
    a, _ = cached_logits(sdpa, ids, prefill=4)
    b, _ = cached_logits(math_model, ids, prefill=4)
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("position", POSITIONS)
def test_causality_cached(position):
    """Changing a later token changes no earlier logit, also when decoding with the cache."""
    model = small_model(position=position)
    ids = torch.randint(0, 40, (1, 12))
    changed = ids.clone()
    changed[0, 8] = (ids[0, 8] + 1) % 40
    a, _ = cached_logits(model, ids, prefill=3)
    b, _ = cached_logits(model, changed, prefill=3)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-4)


def test_cache_reorder_keeps_rows_consistent():
    """After ``cache.reorder(index)`` decoding continues as if the batch had been built in that order."""
    model = small_model(position="rope", num_kv_heads=2)
    ids = torch.randint(0, 40, (3, 9))
    index = torch.tensor([2, 2, 0])
    cache = model.create_cache(3, 9)
    with torch.no_grad():
        model(ids[:, :6], cache=cache)
        cache.reorder(index)
        got = torch.cat([model(ids[index, t:t + 1], cache=cache) for t in range(6, 9)], dim=1)
        want = model(ids[index])[:, 6:]
    assert torch.allclose(got, want, atol=1e-5)
