"""Every cache strategy (tokenloom/nn/kv_cache.py) behind the one protocol, under every registered position scheme:
prefill, then one-token steps through the strategy, equal the uncached forward at every position; through the
plain step functions and through the modules (a forward hook switches the plain ones off). A strategy that wrote
at the wrong position, attended past the written keys or masked the wrong ones would differ by O(1)."""

from __future__ import annotations

import pytest
import torch

from tokenloom import GPT, GPTConfig
from tokenloom.nn import POSITIONS, KVCache, StaticKVCache
from tokenloom.nn.block import runs_plain


def _dense(model, ids, prefill):
    cache = model.create_cache(ids.shape[0], 24)
    out = [model(ids[:, :prefill], cache=cache)]
    for t in range(prefill, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], cache=cache))
    return torch.cat(out, dim=1), cache


def _static(model, ids, prefill):
    cache = StaticKVCache(model.create_cache(ids.shape[0], 24))
    out = [model(ids[:, :prefill], cache=cache)]
    pos = torch.zeros(1, dtype=torch.long)
    view = cache.static(pos, None)
    for t in range(prefill, ids.shape[1]):
        pos.fill_(t)
        positions = torch.full((ids.shape[0], 1), t)
        out.append(model(ids[:, t:t + 1], positions=positions, cache=view))
    return torch.cat(out, dim=1), view


def _ragged(model, ids, prefill):
    """Row b starts ``b`` tokens later (rows at different lengths), as a server's running batch does."""
    B, T = ids.shape
    rows: KVCache = model.create_cache(B, 24)
    for b in range(B):
        one = model.create_cache(1, 24)
        model(ids[b:b + 1, :prefill + b], cache=one)
        rows.copy_rows(b, one, 0, prefill + b)
    lengths = torch.tensor([prefill + b for b in range(B)])
    view = rows.ragged(B, lengths)
    out = [[] for _ in range(B)]
    for _ in range(T - prefill - B + 1):
        tokens = ids[torch.arange(B), lengths][:, None]
        logits = model(tokens, positions=lengths[:, None].clone(), cache=view)
        for b in range(B):
            out[b].append((int(lengths[b]), logits[b, 0]))
        lengths += 1
    return out, view


STRATEGIES = {"dense": _dense, "static": _static, "ragged": _ragged}


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "modules"])
@pytest.mark.parametrize("position", POSITIONS.names())
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_strategy_decodes_what_the_uncached_forward_computes(strategy, position, hooked):
    _check_strategy(strategy, hooked, position=position)


# model options that act inside attention or on the head: every strategy and both step paths must apply them
OPTIONS = {"qk_norm": dict(position="rope", qk_norm=True), "qk_norm-learned": dict(qk_norm=True, norm="rmsnorm"),
           "softcap": dict(position="rope", logit_softcap=0.5), "relu2": dict(mlp="relu2"),
           "value_embeddings": dict(position="rope", value_embeddings=1),
           "unet_skips-learned": dict(unet_skips=True, value_embeddings=2)}


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "modules"])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_strategy_decodes_what_the_uncached_forward_computes_with_model_options(strategy, options, hooked):
    _check_strategy(strategy, hooked, **OPTIONS[options])


def _check_strategy(strategy: str, hooked: bool, **options) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=41, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=32,
                          tie_embeddings=False, **options)).eval()
    ids = torch.randint(0, 41, (3, 12))
    handle = model.blocks[1].attn.register_forward_hook(lambda *a: None) if hooked else None
    with torch.no_grad():
        full = model(ids)
        result, cache = STRATEGIES[strategy](model, ids, prefill=4)
    if handle is not None:
        handle.remove()
    if strategy == "ragged":
        for b, steps in enumerate(result):
            for t, logits in steps:
                torch.testing.assert_close(logits, full[b, t], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(result, full, atol=1e-5, rtol=1e-5)
    if strategy != "static":  # the static strategy runs the modules (it is compiled)
        assert runs_plain(cache) is (not hooked)
