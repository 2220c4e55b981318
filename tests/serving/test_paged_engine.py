"""The paged engine: preemption by recompute, prefix caching, chunked prefill, n samples sharing blocks, log-
probabilities and echo give the offline results, and every block comes back."""

import time

import pytest
import torch

from tests.generation.helpers import small_model
from tests.serving.test_engine import Letters, assert_offline, collect, run_all
from tokenloom import GenerationConfig, generate
from tokenloom.serving import Engine, Request


def all_blocks_back(engine, timeout=5.0):
    """Whether every block is free again (the engine releases a finished request's blocks just after its last
    event)."""
    end = time.monotonic() + timeout
    while engine.blocks.used and time.monotonic() < end:
        time.sleep(0.01)
    return engine.blocks.used == 0


def greedy(n):
    return GenerationConfig(max_new_tokens=n, do_sample=False)


def offline(model, ids, config):
    return Letters().decode(generate(model, torch.tensor([ids]), config)[0, len(ids):].tolist())


def prompts(count, low, high, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 40, (int(torch.randint(low, high + 1, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


def run(engine):
    return engine.start()


@pytest.mark.parametrize("position", ["learned", "rope", "alibi"])
def test_preemption_by_recompute_leaves_the_outputs_unchanged(position):
    """A cache of 12 blocks of 4 for 6 requests of up to 40 positions: requests give their blocks back and are
    prefilled again, and every output still equals offline generation."""
    model = small_model(position=position)
    engine = run(Engine(model, Letters(), max_batch=6, block_size=4, kv_blocks=12, prefill_tokens=8))
    try:
        jobs = [(ids, greedy(14 + 3 * i), []) for i, ids in enumerate(prompts(6, 5, 20))]
        results = run_all(engine, jobs)
        assert engine.preemptions > 0
        assert all_blocks_back(engine)
    finally:
        engine.stop()
    assert_offline(model, jobs, results)


def test_prefix_caching_reuses_blocks_and_gives_the_cold_outputs():
    model = small_model(position="rope")
    shared = prompts(1, 30, 30)[0]
    asks = [shared + tail for tail in prompts(5, 2, 6, seed=1)]
    engine = run(Engine(model, Letters(), max_batch=4, block_size=4))
    try:
        first = collect(engine, [Request(asks[0], greedy(8), None)])
        later = [Request(ids, greedy(8), None) for ids in asks[1:]]
        texts = collect(engine, later)
        stats = engine.cache_stats()
    finally:
        engine.stop()
    assert [r.cached_tokens for r in later] == [28] * 4  # 7 full blocks of the shared 30 tokens
    assert stats["hit_tokens"] >= 4 * 28
    for ids, (text, reason) in zip(asks, first + texts, strict=True):
        assert (text, reason) == (offline(model, ids, greedy(8)), "length")


def test_a_prefix_hit_gives_bitwise_the_logits_of_a_cold_prefill_in_the_same_chunks():
    """A 33-token prompt in chunks of 32: the cold request's second chunk (its last token) and the warm request's
    only chunk (the 32 tokens before it cached) run the same computation over the same blocks: their first tokens'
    log-probabilities agree exactly."""
    model = small_model(position="rope")
    ids = prompts(1, 33, 33, seed=3)[0]
    cold = Engine(model, Letters(), max_batch=2, block_size=4, prefill_tokens=32).start()
    try:
        a = Request(ids, greedy(1), None, logprobs=3)
        collect(cold, [a])
        b = Request(ids, greedy(1), None, logprobs=3)
        collect(cold, [b])
    finally:
        cold.stop()
    assert b.cached_tokens == 32 and a.cached_tokens == 0
    assert a.new_ids == b.new_ids and a.token_logprobs == b.token_logprobs  # bitwise: the same floats


def test_chunked_prefill_equals_one_shot_prefill():
    model = small_model(position="alibi")
    asks = prompts(4, 20, 50, seed=4)
    outs = []
    for budget in (512, 5):
        engine = run(Engine(model, Letters(), max_batch=4, block_size=4, prefill_tokens=budget,
                            prefix_caching=False))
        try:
            requests = [Request(ids, greedy(6), None, echo=True, logprobs=2) for ids in asks]
            outs.append((collect(engine, requests), requests))
        finally:
            engine.stop()
    (texts_a, reqs_a), (texts_b, reqs_b) = outs
    assert texts_a == texts_b
    for a, b in zip(reqs_a, reqs_b, strict=True):
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        torch.testing.assert_close(torch.tensor([e[1] for e in a.prompt_logprobs[1:]]),
                                   torch.tensor([e[1] for e in b.prompt_logprobs[1:]]), atol=1e-5, rtol=0)


def test_logprobs_and_echo_equal_the_offline_log_softmax():
    model = small_model(position="learned")
    ids = prompts(1, 12, 12, seed=5)[0]
    engine = run(Engine(model, Letters(), max_batch=2, block_size=4, prefill_tokens=5))
    try:
        request = Request(ids, greedy(6), None, echo=True, logprobs=3)
        collect(engine, [request])
    finally:
        engine.stop()
    full = ids + request.new_ids
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([full]))[0].float(), -1)  # (T, V)
    assert len(request.prompt_logprobs) == len(ids) and len(request.token_logprobs) == 6
    for j, entry in enumerate(request.prompt_logprobs[1:] + request.token_logprobs, 1):
        token, value, top = entry
        assert token == full[j]
        assert value == pytest.approx(float(logp[j - 1, token]), abs=1e-5)
        expected = logp[j - 1].topk(3)
        assert [t for t, _ in top] == expected.indices.tolist()
        assert [v for _, v in top] == pytest.approx(expected.values.tolist(), abs=1e-5)


def test_score_only_prefills_and_ends_without_a_token():
    model = small_model()
    ids = prompts(1, 9, 9, seed=6)[0]
    engine = run(Engine(model, Letters(), max_batch=2, block_size=4))
    try:
        request = Request(ids, greedy(1), None, echo=True, score_only=True, logprobs=0)
        [(text, reason)] = collect(engine, [request])
        assert all_blocks_back(engine)
    finally:
        engine.stop()
    assert (text, reason, request.new_ids) == ("", "length", [])
    assert len(request.prompt_logprobs) == 9


def test_n_samples_share_the_prompt_blocks_and_diverge_with_their_own_seeds():
    model = small_model(position="rope")
    ids = prompts(1, 10, 10, seed=7)[0]  # 2 full blocks of 4 and a partial one: copied on the first write
    configs = [GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.0, seed=s) for s in range(4)]
    engine = run(Engine(model, Letters(), max_batch=8, block_size=4))
    seen = []
    try:
        leader = Request(ids, configs[0], None, siblings=[Request(ids, c, None) for c in configs[1:]])
        original = engine._fork

        def fork(slot, request):  # the forks' tables at birth: the leader's blocks
            out = original(slot, request)
            seen.append((list(slot.table), list(out.table)))
            return out

        engine._fork = fork
        results = collect(engine, [leader])
        assert all_blocks_back(engine)
    finally:
        engine.stop()
    assert len(seen) == 3 and all(a == b for a, b in seen)
    for config, (text, _) in zip(configs, results, strict=True):
        assert text == offline(model, ids, config)
    assert len({text for text, _ in results}) > 1


def test_the_slot_layout_is_block_size_equal_to_the_context_and_gives_the_same_outputs():
    model = small_model(position="rope")
    asks = prompts(5, 5, 30, seed=8)
    outs = []
    for block_size, prefix in ((64, False), (4, True)):
        engine = run(Engine(model, Letters(), max_batch=3, block_size=block_size, prefix_caching=prefix))
        try:
            outs.append(collect(engine, [Request(ids, greedy(10), None) for ids in asks]))
        finally:
            engine.stop()
    assert outs[0] == outs[1]


def test_a_prompt_larger_than_the_whole_cache_fails_alone():
    model = small_model()
    engine = run(Engine(model, Letters(), max_batch=2, block_size=4, kv_blocks=3))
    try:
        big, small = Request(list(range(20)), greedy(2), None), Request([1, 2, 3], greedy(2), None)
        results = collect(engine, [big, small])
    finally:
        engine.stop()
    assert results[0][1].startswith("error: the prompt of 20 tokens does not fit in the KV cache")
    assert results[1] == (offline(model, [1, 2, 3], greedy(2)), "length")


def test_a_constrained_request_keeps_to_its_regex_and_stops_once_complete():
    pytest.importorskip("outlines_core")
    import re

    from tokenloom.checkpoint import load_tokenizer
    from tokenloom.generation.constraints import build_constraint

    tokenizer = load_tokenizer("checkpoints/shakespeare-char")
    model = small_model(vocab_size=65, position="rope")
    pattern = "(to|be)( (or|not|to|be)){3}"
    engine = run(Engine(model, tokenizer, max_batch=2, block_size=4, draft=None))
    try:
        config = GenerationConfig(max_new_tokens=40, do_sample=True, seed=3)
        request = Request(tokenizer.encode("ROMEO:"), config, None,
                          constraint=build_constraint(tokenizer, 65, regex=pattern, eos_id=tokenizer.eos_id))
        free = Request(tokenizer.encode("ROMEO:"), config, None)
        [(text, reason), (other, _)] = collect(engine, [request, free])
    finally:
        engine.stop()
    assert re.fullmatch(pattern, text) and reason == "stop"
    assert not re.fullmatch(pattern, other)  # the same seed unconstrained: random characters


@pytest.mark.parametrize("when", ["queued", "prefilling"])
def test_siblings_go_on_when_the_first_sample_is_cancelled(when):
    """n samples whose leader is cancelled before its prompt is cached: the first live sibling takes its place (its
    slot and blocks, when prefilling) and every other sample still finishes with its offline text."""
    model = small_model(position="rope")
    ids = prompts(1, 20, 20, seed=9)[0]
    configs = [GenerationConfig(max_new_tokens=6, do_sample=True, seed=s) for s in range(3)]
    engine = Engine(model, Letters(), max_batch=4, block_size=4, prefill_tokens=4)  # driven by hand: not started
    siblings = [Request(ids, c, None) for c in configs[1:]]
    leader = Request(ids, configs[0], lambda e: None, siblings=list(siblings))
    events = {id(r): [] for r in siblings}
    for r in siblings:
        r.emit = events[id(r)].append
    engine.submit(leader)
    with torch.inference_mode():
        engine._pull()
        if when == "prefilling":
            engine._admit()
            engine._step()  # the first 4 of its 20 prompt tokens
            assert engine.slots[0].length == 4
        leader.cancel()
        for _ in range(100):
            engine._pull()
            engine._admit()
            if not engine.slots:
                break
            engine._step()
    for r, config in zip(siblings, configs[1:], strict=True):
        text = "".join(v for k, v in events[id(r)] if k == "delta")
        assert events[id(r)][-1] == ("done", "length") and text == offline(model, ids, config)
    assert engine.blocks.used == 0
