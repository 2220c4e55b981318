"""The Universal Transformer LM with ACT (tokenloom/models/universal.py): one shared block, halting per position,
the ponder count as data and in the LM loss, and the causal decoding protocol (cache, padding, generate)."""

import pytest
import torch
from tests.generation.helpers import left_pad
from tests.registry.helpers import assert_close, cached_logits

from tokenloom.errors import ConfigError
from tokenloom.generation import GenerationConfig, generate
from tokenloom.models import GPT, MODELS, GPTConfig, UniversalConfig, UniversalTransformer
from tokenloom.models.registry import decoding_of, ponders
from tokenloom.nn import Context
from tokenloom.nn.act import adaptive_computation
from tokenloom.nn.block import runs_plain
from tokenloom.tasks.lm import LMTask

V = 17
CAUSAL = Context(is_causal=True)  # a whole-sequence causal pass of a block, no cache


def tiny(seed: int = 0, varied: bool = True, **kw) -> UniversalTransformer:
    """A random model of up to 5 steps; ``varied``: a halting unit whose positions halt after different numbers
    of steps (3 to 5 here; the default initialisation halts every position after 2)."""
    torch.manual_seed(seed)
    config = dict(vocab_size=V, embed_dim=32, num_heads=2, max_seq_len=16, max_steps=5, tie_embeddings=False)
    if varied and kw.get("act", True):
        config["halting_bias"] = -3.0
    model = UniversalTransformer(UniversalConfig(**{**config, **kw})).eval()
    if varied and model.halting is not None:
        torch.nn.init.normal_(model.halting.proj.weight, std=0.1)
    return model


def _steps_by_hand(model, ids):
    """The shared block applied step by step outside the model, halted positions frozen, with each step's halting
    probabilities (S, B, T) and states (S, B, T, C); without ACT, all max_steps steps."""
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    x = model.tok_embed(ids) * model.config.embed_dim ** 0.5  # (scale_embeddings)
    signal = model.position.embed(positions)
    probs, states, running = [], [], torch.ones(ids.shape, dtype=torch.bool)
    total = torch.zeros(ids.shape)
    for m in range(model.config.max_steps):
        y, _ = model.block(x + signal + model.timestep[m], CAUSAL)
        states.append(y)
        if model.halting is None:
            x = y
            continue
        p = model.halting(y)
        probs.append(p)
        x = torch.where(running[..., None], y, x)
        halts = running & (total + p >= 1 - model.config.act_eps)
        total = torch.where(running & ~halts, total + p, total)
        running = running & ~halts
    return (torch.stack(probs) if probs else None), torch.stack(states)


def test_registered_as_a_pondering_causal_lm():
    model = tiny()
    assert MODELS.get("universal") == (UniversalConfig, UniversalTransformer)
    assert decoding_of(model) == "causal_lm" and ponders(model) and ponders(UniversalTransformer)
    assert not ponders(GPT) and not ponders(object())
    assert model.create_cache(2, 10).k.shape[0] == model.config.max_steps  # one cache layer per step


@torch.no_grad()
def test_ponder_is_n_plus_r_of_the_steps_halting_probabilities():
    model = tiny()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    logits, ponder = model.forward_ponder(ids)
    probs, states = _steps_by_hand(model, ids)
    S = model.config.max_steps
    for b in range(2):
        for t in range(9):  # Graves' N and R from the probabilities, in plain Python
            p = probs[:, b, t].tolist()
            n = next((k + 1 for k in range(S) if sum(p[:k + 1]) >= 1 - model.config.act_eps), S)
            assert ponder[b, t].item() == pytest.approx(n + 1 - sum(p[:n - 1]), abs=1e-5)
    assert len(set(ponder.ceil().flatten().tolist())) > 1  # the positions halt after different numbers of steps
    act = adaptive_computation(probs, states, model.config.act_eps)
    torch.testing.assert_close(act.weights.sum(0), torch.ones(2, 9), atol=1e-6, rtol=0)
    assert_close(logits, model.lm_head(model.final_norm(act.output)), what="logits vs the weighted states")


@torch.no_grad()
@pytest.mark.parametrize("kw", [dict(max_steps=1), dict(halting_bias=10.0)], ids=["one-step", "halting-bias"])
def test_halting_at_the_first_step_is_one_application_of_the_shared_block(kw):
    model = tiny(varied=False, **kw)
    ids = torch.randint(0, V, (2, 10))
    logits, ponder = model.forward_ponder(ids)
    positions = torch.arange(10)[None].expand(2, 10)
    y, _ = model.block(model.tok_embed(ids) * model.embed_scale + model.position.embed(positions) + model.timestep[0],
                       CAUSAL)
    assert_close(logits, model.lm_head(model.final_norm(y)), what="one step")
    torch.testing.assert_close(ponder, torch.full((2, 10), 2.0))  # N = 1, R = 1


@torch.no_grad()
def test_without_act_the_block_runs_exactly_max_steps_times():
    model = tiny(act=False)
    assert model.halting is None and model.ponder_cost == 0.0
    ids = torch.randint(0, V, (2, 10))
    logits, ponder = model.forward_ponder(ids)
    _, states = _steps_by_hand(model, ids)
    assert_close(logits, model.lm_head(model.final_norm(states[-1])), what="max_steps applications")
    torch.testing.assert_close(ponder, torch.full((2, 10), float(model.config.max_steps)))


@torch.no_grad()
@pytest.mark.parametrize("act", [True, False])
def test_causality(act):
    model = tiny(act=act)
    ids = torch.randint(0, V, (2, 12))
    changed = ids.clone()
    changed[:, 7] = (ids[:, 7] + 1) % V
    (a, pa), (b, pb) = model.forward_ponder(ids), model.forward_ponder(changed)
    assert_close(b[:, :7], a[:, :7], what="earlier logits")
    assert_close(pb[:, :7], pa[:, :7], what="earlier ponder counts")
    assert not torch.allclose(b[:, 7:], a[:, 7:], atol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("act, position", [(True, "sinusoidal"), (False, "sinusoidal"), (True, "rope")])
def test_cached_decoding_equals_the_full_forward(act, position):
    model = tiny(act=act, position=position)
    ids = torch.randint(0, V, (3, 11))
    full, ponder = model.forward_ponder(ids)
    for prefill in (1, 4):
        assert_close(cached_logits(model, ids, prefill), full, what=f"prefill {prefill}")
    cache = model.create_cache(3, 11)  # the ponder counts too: each position halts on its own, cache or not
    parts = [model.forward_ponder(ids[:, :4], cache=cache)] + [model.forward_ponder(ids[:, t:t + 1], cache=cache)
                                                               for t in range(4, 11)]
    assert_close(torch.cat([p.ponder for p in parts], 1), ponder, what="cached ponder")
    assert runs_plain(cache)  # the one-token steps ran the shared block as plain functions


@torch.no_grad()
def test_left_padded_batch_equals_rows_alone():
    model = tiny()
    rows = [torch.randint(0, V, (n,)) for n in (10, 5, 8)]
    ids, mask = left_pad(rows, pad=3)
    got = cached_logits(model, ids, prefill=6, attention_mask=mask)
    batched = model(ids, attention_mask=mask)
    T = ids.shape[1]
    for i, row in enumerate(rows):
        alone = model(row[None])[0]
        assert_close(got[i, T - len(row):], alone, what=f"row {i} cached")
        assert_close(batched[i, T - len(row):], alone, what=f"row {i} uncached")


@torch.no_grad()
def test_generate_greedy_and_beam_with_the_cache():
    model = tiny()
    prompt = torch.randint(0, V, (2, 4))
    out = generate(model, prompt, GenerationConfig(max_new_tokens=6, do_sample=False))
    seq = prompt.clone()
    for _ in range(6):  # the reference: the argmax of a full recompute at every step
        seq = torch.cat((seq, model(seq)[:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(out, seq)
    beam = generate(model, prompt, GenerationConfig(max_new_tokens=6, do_sample=False, num_beams=3))
    assert beam.shape == (2, 10) and torch.equal(beam[:, :4], prompt)


@torch.no_grad()
def test_attention_weights_per_step():
    model = tiny(attention="math")
    ids = torch.randint(0, V, (2, 7))
    hidden, weights = model.forward_features(ids, need_weights=True)
    assert hidden.shape == (2, 7, 32) and len(weights) == model.config.max_steps
    for w in weights:
        assert w.shape == (2, 2, 7, 7)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 7))
        assert (w.triu(1) == 0).all()  # causal


@torch.no_grad()
def test_runs_in_bfloat16():
    model = tiny().to(torch.bfloat16)
    logits, ponder = model.forward_ponder(torch.randint(0, V, (2, 6)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert ponder.dtype == torch.float32 and (ponder > 1).all()


@pytest.mark.parametrize("fields, message", [
    (dict(max_steps=0), "max_steps must be >= 1, got 0"),
    (dict(ponder_cost=-1), r"ponder_cost \(tau\) must be >= 0, got -1"),
    (dict(act_eps=1.0), r"act_eps must be in \(0, 1\), got 1.0"),
    (dict(act_eps=0), r"act_eps must be in \(0, 1\), got 0"),
    (dict(position="xl"), "position 'xl'"),
])
def test_bad_config_is_a_one_line_error(fields, message):
    with pytest.raises(ConfigError, match=message) as info:
        UniversalConfig(**fields)
    assert "\n" not in str(info.value)


class _OneBatch:
    """A stand-in dataset: ``iter_batches`` yields the one (x, y) batch."""

    def __init__(self, x, y):
        self.batch = (x, y)

    def iter_batches(self, split, rows, seq_len, max_batches):
        yield self.batch


def test_lm_task_adds_the_ponder_cost_and_training_lowers_the_loss():
    torch.manual_seed(0)
    model = tiny(varied=False, ponder_cost=0.05, max_steps=3).train()
    data = (torch.arange(13)[None] + torch.arange(8)[:, None]) % V  # (8, 13): each token is the last one + 1
    x, y = data[:, :-1], data[:, 1:]
    task = LMTask(_OneBatch(x, y), batch_size=8, seq_len=12)
    loss, n = task.loss(model, (x, y))
    with torch.no_grad():
        logits, ponder = model.forward_ponder(x)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    assert n == y.numel()
    assert loss.item() == pytest.approx((ce + 0.05 * ponder.mean()).item(), abs=1e-5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, foreach=False)  # (foreach: seconds of set-up)
    first = loss.item()
    for _ in range(20):
        optimizer.zero_grad()
        loss, _ = task.loss(model, (x, y))
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first
    metrics = task.evaluate(model.eval(), max_batches=1)
    assert set(metrics) == {"val_loss", "val_ppl", "val_ponder", "tokens"}
    assert 1.0 < metrics["val_ponder"] <= model.config.max_steps + 1
    plain = GPT(GPTConfig(vocab_size=V, num_layers=1, num_heads=2, embed_dim=16, max_seq_len=16))
    assert "val_ponder" not in task.evaluate(plain, max_batches=1)  # a model that does not ponder
