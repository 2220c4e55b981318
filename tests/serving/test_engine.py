"""The continuous-batching engine in process: rows joining and leaving between steps give offline results;
the queue bound; cancellation; stop strings."""

import threading

import pytest
import torch

from tests.generation.helpers import small_model
from tokenloom import GenerationConfig, generate
from tokenloom.nn.block import runs_plain
from tokenloom.serving import Engine, QueueFull, Request


class Letters:
    """Token i is chr(97 + i); no EOS."""

    eos_id = None
    vocab_size = 40

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def collect(engine, requests, timeout=60):
    """Submit ``requests`` (their emit replaced); wait for every one, siblings included -> (text, finish reason or
    "error: ...") per request, siblings after their leader."""
    results, done, lock = {}, threading.Event(), threading.Lock()
    everyone = [r for q in requests for r in [q, *q.siblings]]

    def sink(request, texts):
        def emit(event):
            kind, value = event
            if kind == "delta":
                texts.append(value)
                return
            with lock:
                results[id(request)] = ("".join(texts), value if kind == "done" else "error: " + value)
                if len(results) == len(everyone):
                    done.set()
        return emit

    for r in everyone:
        r.emit = sink(r, [])
    for r in requests:
        engine.submit(r)
    assert done.wait(timeout), f"{len(results)} of {len(everyone)} requests finished"
    return [results[id(r)] for r in everyone]


def run_all(engine, jobs):
    """Submit (prompt ids, config, stop strings) jobs; wait; return (text, finish reason) per job."""
    return collect(engine, [Request(ids, config, None, stop_strings=stops) for ids, config, stops in jobs])


def assert_offline(model, jobs, results):
    """Each job's served text is the offline generation's, ended by its length limit."""
    for (ids, config, _), (text, reason) in zip(jobs, results, strict=True):
        out = generate(model, torch.tensor([ids]), config)[0, len(ids):].tolist()
        assert text == Letters().decode(out) and reason == "length"


@pytest.mark.parametrize("position", ["learned", "rope", "alibi"])
def test_requests_joining_and_leaving_the_batch_equal_offline_generation(position):
    model = small_model(position=position)
    engine = Engine(model, Letters(), max_batch=3, max_queue=16).start()  # 7 requests through 3 rows
    try:
        gen = torch.Generator().manual_seed(0)
        jobs = []
        for i in range(7):
            ids = torch.randint(0, 40, (3 + i,), generator=gen).tolist()
            sampled = i % 3 == 2
            jobs.append((ids, GenerationConfig(max_new_tokens=5 + 3 * i, do_sample=sampled, temperature=0.9,
                                               top_k=8 if sampled else None, seed=i), []))
        results = run_all(engine, jobs)
    finally:
        engine.stop()
    assert_offline(model, jobs, results)


def test_stop_strings_cut_the_text_before_them():
    model = small_model()
    ids = [1, 2, 3]
    full = Letters().decode(generate(model, torch.tensor([ids]), GenerationConfig(max_new_tokens=20,
                                                                                  do_sample=False))[0, 3:].tolist())
    stop = full[6:8]
    engine = Engine(model, Letters(), max_batch=2).start()
    try:
        [(text, reason)] = run_all(engine, [(ids, GenerationConfig(max_new_tokens=20, do_sample=False), [stop])])
    finally:
        engine.stop()
    assert text == full[:full.find(stop)] and reason == "stop"


def test_the_queue_is_bounded_and_cancelled_requests_are_skipped():
    model = small_model()
    engine = Engine(model, Letters(), max_batch=1, max_queue=2)  # not started: nothing leaves the queue
    events = []
    first = Request([1, 2], GenerationConfig(max_new_tokens=3, do_sample=False), events.append)
    engine.submit(first)
    engine.submit(Request([1], GenerationConfig(max_new_tokens=3, do_sample=False), events.append))
    with pytest.raises(QueueFull, match="queue is full"):
        engine.submit(Request([1], GenerationConfig(max_new_tokens=3, do_sample=False), events.append))
    first.cancel()
    engine.start()
    try:
        import time

        deadline = time.monotonic() + 10
        while not any(e[0] == "done" for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert [e for e in events if e[0] == "done"] == [("done", "length")]  # only the second one ran


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rope", "alibi", "t5", "none"])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_the_ragged_cache_strategy_equals_the_uncached_forward_for_rows_of_different_lengths(position, kv_heads):
    model = small_model(position=position, num_kv_heads=kv_heads)
    seqs = [torch.randint(0, 40, (n,)) for n in (7, 3, 11)]
    rows = model.create_cache(3, 20)
    with torch.no_grad():
        for b, s in enumerate(seqs):  # every row prefilled with all but its last token
            cache = model.create_cache(1, 20)
            model(s[None, :-1], cache=cache)
            rows.copy_rows(b, cache, 0, len(s) - 1)
        lengths = torch.tensor([len(s) - 1 for s in seqs])
        last = torch.stack([s[-1] for s in seqs])[:, None]
        reference = torch.stack([model(s[None])[0, -1] for s in seqs])
        saved = rows.kv.clone()
        plain = model(last, positions=lengths[:, None], cache=rows.ragged(3, lengths))[:, 0]
        rows.kv.copy_(saved)
        handle = model.blocks[0].mlp.register_forward_hook(lambda *a: None)  # the modules run
        view = rows.ragged(3, lengths)
        modules = model(last, positions=lengths[:, None], cache=view)[:, 0]
        handle.remove()
        assert runs_plain(view) is False
    torch.testing.assert_close(modules, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, reference, rtol=1e-5, atol=1e-5)


def test_a_request_that_fails_to_start_fails_alone_and_the_engine_goes_on():
    """An error while a request starts (here a seed past the generator's range, set behind the config's
    validation, as the server's derived seeds once were) fails that request only: the engine thread did exit, and
    every later request hung."""
    model = small_model()
    engine = Engine(model, Letters(), max_batch=2, max_queue=8).start()
    try:
        bad = GenerationConfig(max_new_tokens=3, do_sample=True, seed=1)
        object.__setattr__(bad, "seed", 2 ** 64)  # torch.Generator.manual_seed raises for it
        good = GenerationConfig(max_new_tokens=4, do_sample=False)
        (text, reason), (text2, reason2) = run_all(engine, [([1, 2, 3], bad, []), ([4, 5], good, [])])
        assert reason.startswith("error: generation failed") and text == ""
        expected = generate(model, torch.tensor([[4, 5]]), good)[0, 2:].tolist()
        assert reason2 == "length" and text2 == Letters().decode(expected)
        assert engine.alive
        [(again, why)] = run_all(engine, [([4, 5], good, [])])  # and it keeps serving
        assert (again, why) == (text2, "length")
    finally:
        engine.stop()
    assert not engine.alive


def test_a_universal_transformer_with_act_serves_its_offline_tokens():
    """The engine's ragged key/value cache holds the Universal Transformer's one layer per step (positions halting
    on their own): rows joining and leaving give the offline tokens."""
    from tokenloom.models import UniversalConfig, UniversalTransformer

    torch.manual_seed(0)
    model = UniversalTransformer(UniversalConfig(vocab_size=40, max_steps=3, num_heads=2, embed_dim=32,
                                                 max_seq_len=48, halting_bias=-1.0)).eval()
    engine = Engine(model, Letters(), max_batch=2, max_queue=8).start()
    try:
        gen = torch.Generator().manual_seed(1)
        jobs = [(torch.randint(0, 40, (2 + i,), generator=gen).tolist(),
                 GenerationConfig(max_new_tokens=4 + 2 * i, do_sample=False), []) for i in range(4)]
        results = run_all(engine, jobs)
    finally:
        engine.stop()
    assert_offline(model, jobs, results)
