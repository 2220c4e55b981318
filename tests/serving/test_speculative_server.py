"""Speculative decoding in the server (issue 30): the ragged cache writing T positions per row, the engine's
speculative steps (prompt lookup, a draft model) giving the plain output for rows advancing by different amounts,
the per-request opt-out, the stop conditions inside a multi-token advance, and ``tokenloom serve --prompt-lookup |
--draft`` (also of a quantised checkpoint) answering over HTTP with the offline output."""

import copy
import threading

import pytest
import torch

from tests.generation.helpers import small_model
from tokenloom import GPT, GenerationConfig, GPTConfig, generate
from tokenloom.generation import PromptLookup
from tokenloom.serving import Engine, Request

TINY = dict(embed_dim=16, num_heads=2)  # ~8k parameters


class Letters:
    """Token i is chr(97 + i); ``eos_id`` as given."""

    vocab_size = 40

    def __init__(self, eos_id=None):
        self.eos_id = eos_id

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def run(engine, jobs):
    """Submit (prompt ids, config, stop strings, speculative) jobs at once; wait; return their Requests."""
    done = threading.Semaphore(0)
    requests = []
    for ids, config, stops, speculative in jobs:
        def emit(event, done=done):
            if event[0] != "delta":
                done.release()
        requests.append(Request(ids, config, emit, stop_strings=stops, speculative=speculative))
    for request in requests:
        engine.submit(request)
    for _ in jobs:
        assert done.acquire(timeout=60)
    return requests


def served(model, jobs, tokenizer=None, **options):
    engine = Engine(model, tokenizer or Letters(), max_batch=3, max_queue=16, **options).start()
    try:
        return run(engine, jobs)
    finally:
        engine.stop()


def repetitive_jobs(n=6, seed=0):
    """Prompts of different lengths that repeat a short pattern (prompt lookup finds matches), greedy, each with
    its own max_tokens: rows join, advance by different amounts and leave."""
    gen = torch.Generator().manual_seed(seed)
    jobs = []
    for i in range(n):
        pattern = torch.randint(0, 40, (2 + i % 3,), generator=gen).tolist()
        jobs.append(((pattern * 8)[:3 + 4 * i], GenerationConfig(max_new_tokens=6 + 5 * i, do_sample=False), [],
                     True))
    return jobs


def offline(model, ids, config):
    return generate(model, torch.tensor([ids]), config)[0, len(ids):].tolist()


def perturbed(model, scale=0.3, seed=1):
    """A different model of the same shape: ``model``'s weights plus noise (it agrees with it often, not always)."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return other


# --- the ragged cache strategy, T positions per row -----------------------------------------------------------------

@pytest.mark.parametrize("overrides", [dict(position="learned"), dict(position="rope", num_kv_heads=1),
                                       dict(position="alibi"), dict(position="t5"),
                                       dict(position="rope", attention_window=6)])
def test_the_ragged_cache_with_t_positions_per_row_equals_a_dense_cache_per_row(overrides):
    model = small_model(**TINY, **overrides)
    seqs = [torch.randint(0, 40, (n,)) for n in (7, 3, 11)]
    T = 4
    new = torch.randint(0, 40, (3, T))
    rows = model.create_cache(3, 20, rolling=False)
    with torch.no_grad():
        expected = []
        for b, s in enumerate(seqs):
            cache = model.create_cache(1, 20, rolling=False)
            model(s[None], cache=cache)
            rows.copy_rows(b, cache, 0, len(s))
            expected.append(model(new[b:b + 1], cache=cache)[0])  # the dense cache, row by row
        lengths = torch.tensor([len(s) for s in seqs])
        logits = model(new, positions=lengths[:, None] + torch.arange(T), cache=rows.ragged(3, lengths))
        torch.testing.assert_close(logits, torch.stack(expected), rtol=1e-5, atol=1e-5)
        # a later one-position step sees the T positions each row wrote (the keys written where they belong)
        lengths += T
        step = model(new[:, :1], positions=lengths[:, None], cache=rows.ragged(3, lengths))[:, 0]
        reference = torch.stack([model(torch.cat((s, new[b], new[b, :1]))[None])[0, -1] for b, s in enumerate(seqs)])
    torch.testing.assert_close(step, reference, rtol=1e-5, atol=1e-5)


# --- the engine -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("drafter", ["lookup", "self", "other"])
def test_speculative_greedy_output_equals_plain_and_offline_for_rows_advancing_differently(drafter):
    model = small_model(**TINY, position="rope")
    draft = {"lookup": PromptLookup(3), "self": model, "other": perturbed(model)}[drafter]
    jobs = repetitive_jobs()
    jobs.append(([5, 6, 7, 5, 6, 7, 5], GenerationConfig(max_new_tokens=12, do_sample=False,
                                                         repetition_penalty=1.3), [], True))  # processors
    jobs.append(([1, 2, 1, 2, 1, 2, 1, 2], GenerationConfig(max_new_tokens=10, do_sample=False), [], False))  # opt out
    plain = served(model, jobs)
    tally = []
    spec = served(model, jobs, draft=draft, num_draft_tokens=3, on_draft=lambda d, a: tally.append((d, a)))
    for (ids, config, _, _), a, b in zip(jobs, plain, spec, strict=True):
        assert a.new_ids == b.new_ids == offline(model, ids, config)
        assert a.finish_reason == b.finish_reason == "length"
    assert spec[-1].drafted == 0 and all(r.drafted == 0 for r in plain)  # the request that opted out
    drafted, accepted = sum(r.drafted for r in spec), sum(r.accepted for r in spec)
    assert (drafted, accepted) == tuple(map(sum, zip(*tally, strict=True)))  # what /metrics adds up
    assert drafted > 0
    if drafter == "self":
        assert accepted == drafted  # the model agrees with itself
    elif drafter == "other":
        assert 0 < accepted < drafted


def test_sampled_requests_keep_their_drafts_from_themselves_and_an_opt_out_samples_as_plain():
    model = small_model(**TINY)
    gen = torch.Generator().manual_seed(3)
    jobs = [(torch.randint(0, 40, (3 + 2 * i,), generator=gen).tolist(),
             GenerationConfig(max_new_tokens=8 + 3 * i, do_sample=True, temperature=0.8, top_k=10, seed=i), [],
             i != 1) for i in range(4)]
    plain = served(model, jobs)
    spec = served(model, jobs, draft=model, num_draft_tokens=3)
    # q == p: every draft is kept (u * q < p for u < 1)
    assert sum(r.drafted for r in spec) > 0 and all(r.accepted == r.drafted for r in spec)
    assert spec[1].drafted == 0 and spec[1].new_ids == plain[1].new_ids  # plain decoding, the same seeded sample
    for request, (_, config, _, _) in zip(spec, jobs, strict=True):
        assert len(request.new_ids) == config.max_new_tokens and request.finish_reason == "length"
    looked_up = served(model, jobs, draft=PromptLookup(2), num_draft_tokens=4)
    assert looked_up[1].new_ids == plain[1].new_ids
    assert [len(r.new_ids) for r in looked_up] == [len(r.new_ids) for r in plain]


def test_eos_stop_strings_max_tokens_and_the_context_cut_a_multi_token_advance():
    model = small_model(**TINY, max_seq_len=40)
    ids = [4, 9, 4, 9, 4, 9, 4]
    full = offline(model, ids, GenerationConfig(max_new_tokens=20, do_sample=False))
    at = next(j for j in range(6, 20) if full[j] not in full[:j])  # a token first produced after 6 others
    eos_tokenizer = Letters(eos_id=full[at])
    cut = full[:at]
    text = Letters().decode(full)
    stop = text[5:7]
    jobs = [(ids, GenerationConfig(max_new_tokens=20, do_sample=False), [], True)]  # ends at its EOS
    jobs += [(ids, GenerationConfig(max_new_tokens=n, do_sample=False), [], True) for n in (1, 2, 5)]
    jobs += [([3] * 36, GenerationConfig(max_new_tokens=10, do_sample=False), [], True)]  # 4 tokens fill the context
    for draft in (model, PromptLookup(3)):
        plain = served(model, jobs, eos_tokenizer)
        spec = served(model, jobs, eos_tokenizer, draft=draft, num_draft_tokens=4)
        assert [r.new_ids for r in spec] == [r.new_ids for r in plain]
        assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain] == ["stop"] + ["length"] * 4
        assert spec[0].new_ids == cut and [len(r.new_ids) for r in spec[1:]] == [1, 2, 5, 4]
        stopped = served(model, [(ids, GenerationConfig(max_new_tokens=20, do_sample=False), [stop], True)],
                         draft=draft, num_draft_tokens=4)[0]
        assert stopped.finish_reason == "stop" and Letters().decode(stopped.new_ids).endswith(stop)
        assert len(stopped.new_ids) == len(text[:text.find(stop) + len(stop)])  # no token past the stop string


def test_a_draft_model_that_does_not_fit_is_refused_in_one_line():
    from tokenloom.errors import ConfigError

    model = small_model(**TINY)
    with pytest.raises(ConfigError, match="vocabulary has 30 ids and the model's 40"):
        Engine(model, Letters(), draft=small_model(vocab_size=30, **TINY))
    with pytest.raises(ConfigError, match="context of 16 is shorter than the model's 64"):
        Engine(model, Letters(), draft=small_model(max_seq_len=16, **TINY))
    with pytest.raises(ConfigError, match="--num-draft-tokens must be an integer >= 1, got 0"):
        Engine(model, Letters(), draft=PromptLookup(2), num_draft_tokens=0)


# --- tokenloom serve ------------------------------------------------------------------------------------------------

TEXT = "abcab cabca bcabc aabbcc abcabc\ncab abc bca\n" * 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny char GPT, a perturbed copy (a draft of the same tokenizer), and an int8 copy."""
    pytest.importorskip("fastapi")
    from tokenloom.checkpoint import write_checkpoint
    from tokenloom.cli.main import main
    from tokenloom.data import create_tokenizer
    from tokenloom.models.factory import model_config_to_dict

    root = tmp_path_factory.mktemp("speculative-serve")
    tokenizer = create_tokenizer("char", TEXT)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=2, num_heads=2, embed_dim=16, max_seq_len=48,
                          tie_embeddings=False)).eval()
    for name, weights in (("model", model), ("draft", perturbed(model))):
        write_checkpoint(root / name, weights, {"task": "lm", "model": model_config_to_dict("gpt", model.config)},
                         tokenizer)
    assert main(["quantize", str(root / "model"), "--bits", "8", "--out", str(root / "int8")]) == 0
    return root


def serve_app(monkeypatch, *argv):
    """The app ``tokenloom serve ARGV`` would run (uvicorn.run replaced)."""
    import uvicorn

    from tokenloom.cli.main import main

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_: apps.append(app))
    assert main(["serve", *map(str, argv)]) == 0
    return apps[0]


def completions(client, prompts, **extra):
    r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 12, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def draft_counters(client):
    text = client.get("/metrics").text
    values = {line.split()[0]: int(line.split()[1]) for line in text.splitlines()
              if line.startswith("tokenloom_draft_tokens")}
    return values["tokenloom_draft_tokens_total"], values["tokenloom_draft_tokens_accepted_total"]


PROMPTS = ["abcab", "cab abc bca\nabc", "aabbcc a", "bcabc aabbcc abcabc\nca"]


@pytest.mark.parametrize("flags", [("--prompt-lookup", 3), ("--draft", "model", "--num-draft-tokens", 3),
                                   ("--draft", "draft")])
def test_serve_with_a_drafter_answers_the_offline_greedy_text(checkpoints, monkeypatch, flags):
    from fastapi.testclient import TestClient

    from tokenloom.checkpoint import load_model, load_tokenizer

    flags = tuple(checkpoints / f if f in ("model", "draft") else f for f in flags)
    app = serve_app(monkeypatch, checkpoints / "model", "--max-batch", 3, *flags)
    model, _ = load_model(checkpoints / "model")
    tokenizer = load_tokenizer(checkpoints / "model")
    expected = [tokenizer.decode(offline(model.eval(), tokenizer.encode(p),
                                         GenerationConfig(max_new_tokens=12, do_sample=False))) for p in PROMPTS]
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert completions(client, PROMPTS) == expected  # 4 requests through 3 rows, each at its own length
        drafted, accepted = draft_counters(client)
        assert drafted > 0
        if flags[-1] == 3 and "--draft" in flags:
            assert accepted == drafted  # the model drafting for itself
        assert completions(client, PROMPTS[:2], speculative=False) == expected[:2]
        assert draft_counters(client) == (drafted, accepted)  # no drafts for the requests that opted out
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "abc"}],
                                                         "max_tokens": 5, "temperature": 0, "speculative": None})
        assert chat.status_code == 200  # null: the default
        for bad in ("no", 1, [True]):
            r = client.post("/v1/completions", json={"prompt": "abc", "speculative": bad})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "speculative", r.text
            assert error["message"].startswith("'speculative' must be bool") and "\n" not in error["message"]
    schema = app.openapi()["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert schema["schema"]["properties"]["speculative"]["type"] == ["boolean", "null"]


def test_serve_loads_a_quantised_checkpoint_and_speculates_over_it(checkpoints, monkeypatch):
    from fastapi.testclient import TestClient

    from tokenloom.checkpoint import load_tokenizer
    from tokenloom.cli.loading import load_inference_model
    from tokenloom.nn.quantized import QuantizedLinear

    app = serve_app(monkeypatch, checkpoints / "int8", "--prompt-lookup", 2, "--precision", "auto")
    model = app.state.server.model
    assert isinstance(model.blocks[0].mlp.fc_in, QuantizedLinear)
    reference, _ = load_inference_model(checkpoints / "int8", "auto", "cpu")
    tokenizer = load_tokenizer(checkpoints / "int8")
    expected = [tokenizer.decode(offline(reference, tokenizer.encode(p),
                                         GenerationConfig(max_new_tokens=12, do_sample=False))) for p in PROMPTS[:3]]
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert completions(client, PROMPTS[:3]) == expected
        assert draft_counters(client)[0] > 0


@pytest.mark.parametrize("argv, message", [
    (["--num-draft-tokens", "3"], "--num-draft-tokens applies to speculative decoding"),
    (["--prompt-lookup", "2", "--draft", "DRAFT"], "--draft and --prompt-lookup are two drafters"),
    (["--prompt-lookup", "-1"], "--prompt-lookup must be an integer >= 0, got -1"),
    (["--prompt-lookup", "2", "--num-draft-tokens", "0"], "--num-draft-tokens must be an integer >= 1, got 0"),
])
def test_serve_refuses_bad_speculative_flags_in_one_line(checkpoints, capsys, argv, message):
    from tokenloom.cli.main import main

    argv = [str(checkpoints / "draft") if a == "DRAFT" else a for a in argv]
    assert main(["serve", str(checkpoints / "model"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
