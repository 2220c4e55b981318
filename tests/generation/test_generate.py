"""generate / stream: greedy against an uncached reference, batching, sampling, stopping, errors."""

import pytest
import torch

from tests.generation.helpers import left_pad, reference_greedy, small_model
from tokenloom import GenerationConfig, generate, stream
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.nn import KVCache

GREEDY = dict(do_sample=False)


class Letters:
    """A fake tokenizer: token i is the letter chr(97 + i)."""

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_greedy_matches_uncached_reference(position):
    model = small_model(position=position)
    prompt = torch.randint(0, 40, (6,))
    out = generate(model, prompt[None], GenerationConfig(max_new_tokens=12, **GREEDY))
    assert out.shape == (1, 18)
    assert torch.equal(out[0], reference_greedy(model, prompt, 12))


@pytest.mark.parametrize("kw", [dict(position="learned"), dict(position="rope"), dict(position="alibi"),
                                dict(position="t5"), dict(position="rope", num_kv_heads=2)])
def test_batched_left_padded_equals_one_by_one(kw):
    model = small_model(**kw)
    rows = [torch.randint(0, 40, (n,)) for n in (9, 3, 6)]
    ids, mask = left_pad(rows, pad=7)
    config = GenerationConfig(max_new_tokens=10, **GREEDY)
    out = generate(model, ids, config, attention_mask=mask)
    assert out.shape == (3, 9 + 10)
    assert torch.equal(out[:, :9], ids)  # the prompt comes back as given, padding included
    for i, row in enumerate(rows):
        alone = generate(model, row[None], config)[0]
        assert torch.equal(out[i, 9:], alone[len(row):]), i
        assert torch.equal(alone, reference_greedy(model, row, 10)), i


def test_repetition_penalty_matches_reference_and_padding():
    model = small_model(vocab_size=12)
    rows = [torch.randint(0, 12, (n,)) for n in (8, 4)]
    ids, mask = left_pad(rows, pad=0)
    config = GenerationConfig(max_new_tokens=8, repetition_penalty=10.0, **GREEDY)
    out = generate(model, ids, config, attention_mask=mask)
    for i, row in enumerate(rows):
        assert torch.equal(out[i, 8:], reference_greedy(model, row, 8, repetition_penalty=10.0)[len(row):]), i
    plain = generate(model, ids, GenerationConfig(max_new_tokens=8, **GREEDY), attention_mask=mask)
    assert not torch.equal(out, plain)  # the penalty changed something


def test_padding_is_not_seen_by_the_repetition_penalty():
    """Token 0 is made the clear favourite; padding with id 0 must not get it penalised."""
    model = small_model(vocab_size=12)
    with torch.no_grad():
        direction = torch.randn(32)
        model.final_norm.bias.copy_(direction)
        model.lm_head.weight[0] = direction / direction.square().sum()  # logit 0 = 1 + noise
    rows = [torch.randint(1, 12, (n,)) for n in (6, 3)]
    ids, mask = left_pad(rows, pad=0)
    out = generate(model, ids, GenerationConfig(max_new_tokens=3, repetition_penalty=100.0, **GREEDY),
                   attention_mask=mask)
    assert out[:, 6].tolist() == [0, 0]
    for i, row in enumerate(rows):
        assert torch.equal(out[i, 6:], reference_greedy(model, row, 3, repetition_penalty=100.0)[len(row):]), i


def test_top_k_1_sampling_equals_greedy():
    model = small_model()
    ids = torch.randint(0, 40, (2, 5))
    greedy = generate(model, ids, GenerationConfig(max_new_tokens=15, **GREEDY))
    sampled = generate(model, ids, GenerationConfig(max_new_tokens=15, top_k=1, temperature=1.7, seed=3))
    assert torch.equal(greedy, sampled)


def test_seed_reproducible_and_independent_of_global_rng():
    model = small_model(vocab_size=65)
    ids = torch.randint(0, 65, (2, 4))
    torch.manual_seed(1)
    a = generate(model, ids, GenerationConfig(max_new_tokens=20, seed=123))
    torch.manual_seed(2)
    b = generate(model, ids, GenerationConfig(max_new_tokens=20, seed=123))
    c = generate(model, ids, GenerationConfig(max_new_tokens=20, seed=124))
    assert torch.equal(a, b)
    assert not torch.equal(a[:, 4:], c[:, 4:])


def test_sampling_follows_the_tempered_distribution():
    """First sampled tokens of 4000 identical rows follow softmax(logits / temperature)."""
    model = small_model(vocab_size=8)
    prompt = torch.randint(0, 8, (1, 3))
    with torch.no_grad():
        probs = (model(prompt)[0, -1] / 0.5).softmax(-1)
    out = generate(model, prompt.expand(4000, -1), GenerationConfig(max_new_tokens=1, temperature=0.5, seed=0))
    freq = torch.bincount(out[:, -1], minlength=8).float() / 4000
    assert (freq - probs).abs().sum() / 2 < 0.04  # total variation distance


def test_eos_stops_rows_and_pads():
    model = small_model()
    ids = torch.randint(0, 40, (2, 4))
    free = generate(model, ids, GenerationConfig(max_new_tokens=12, **GREEDY))[:, 4:]
    eos = free[0, 3].item()  # row 0 produces it at step 3 at the latest
    config = GenerationConfig(max_new_tokens=12, eos_token_id=eos, pad_token_id=-1, **GREEDY)
    out = generate(model, ids, config)
    stops = []
    for row in free.tolist():
        stop = row.index(eos) if eos in row else None
        stops.append(stop)
    expected_len = 12 if None in stops else max(stops) + 1
    assert out.shape == (2, 4 + expected_len)
    for i, stop in enumerate(stops):
        got = out[i, 4:].tolist()
        want = free[i, :expected_len].tolist() if stop is None else \
            free[i, :stop + 1].tolist() + [-1] * (expected_len - stop - 1)
        assert got == want, i


def test_stopped_rows_leave_the_batch_without_changing_results(monkeypatch):
    """Rows that stopped (EOS) leave the batch once they are an eighth of it (cache.select); tokens equal a
    run whose cache cannot drop rows, with padding and the repetition penalty (which reads each row's
    history) in play."""
    model = small_model(vocab_size=24, seed=4, position="rope")
    gen = torch.Generator().manual_seed(2)
    ids, mask = left_pad([torch.randint(0, 24, (k,), generator=gen) for k in (3, 6, 2, 5, 4, 7, 3, 5, 6)])
    free = generate(model, ids, GenerationConfig(max_new_tokens=20, do_sample=False), attention_mask=mask)
    eos = int(free[:, ids.shape[1]:].flatten().mode().values)  # a frequent token: rows stop at many steps
    config = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0,
                              repetition_penalty=1.3)
    sizes = []
    select = KVCache.select
    monkeypatch.setattr(KVCache, "select", lambda cache, index: (sizes.append(index.numel()), select(cache, index)))
    dropped = generate(model, ids, config, attention_mask=mask)
    streamed = torch.stack(list(stream(model, ids, config, attention_mask=mask)), dim=1)
    assert len(sizes) >= 2 and sizes[0] < 9
    monkeypatch.setattr(KVCache, "select", None)
    kept = generate(model, ids, config, attention_mask=mask)
    assert torch.equal(dropped, kept) and torch.equal(streamed, kept[:, ids.shape[1]:])


def test_kv_cache_select_keeps_rows_in_new_storage():
    cache = KVCache(2, 4, 2, 8, 3)
    cache.kv.copy_(torch.randn_like(cache.kv))
    cache.advance(5)
    before = cache.kv.clone()
    cache.select(torch.tensor([3, 1]))
    assert cache.batch_size == 2 and cache.length == 5
    assert torch.equal(cache.kv[:, :, :, :, :5], before[:, :, [3, 1], :, :5])
    assert cache.layer(1)[0].data_ptr() == cache.k[1].data_ptr()  # the layer views follow the new storage
    assert cache.layers[1].k.data_ptr() == cache.k[1].data_ptr()


def test_all_rows_finished_ends_early():
    model = small_model()
    ids = torch.randint(0, 40, (1, 4))
    first = generate(model, ids, GenerationConfig(max_new_tokens=1, **GREEDY))[0, -1].item()
    out = generate(model, ids, GenerationConfig(max_new_tokens=30, eos_token_id=first, **GREEDY))
    assert out.shape == (1, 5) and out[0, -1] == first


def test_stop_strings():
    model = small_model(vocab_size=26)
    ids = torch.randint(0, 26, (2, 4))
    free = generate(model, ids, GenerationConfig(max_new_tokens=16, **GREEDY))[:, 4:]
    texts = [Letters().decode(row) for row in free.tolist()]
    stop = texts[0][4:6]  # two letters completed by row 0's sixth token at the latest
    ends = [t.find(stop) + len(stop) if stop in t else None for t in texts]
    config = GenerationConfig(max_new_tokens=16, stop_strings=[stop], pad_token_id=0, **GREEDY)
    out = generate(model, ids, config, tokenizer=Letters())
    n = 16 if None in ends else max(ends)
    assert out.shape == (2, 4 + n)
    for i, end in enumerate(ends):
        got = Letters().decode(out[i, 4:].tolist())
        want = texts[i][:n] if end is None else texts[i][:end] + "a" * (n - end)  # pad 0 -> "a"
        assert got == want, i


def test_stop_strings_need_a_tokenizer():
    model = small_model()
    with pytest.raises(GenerationError, match="stop_strings need a tokenizer"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), GenerationConfig(stop_strings=["x"]))


def test_stream_yields_the_same_tokens_as_generate():
    model = small_model()
    ids, mask = left_pad([torch.randint(0, 40, (n,)) for n in (5, 2)])
    config = GenerationConfig(max_new_tokens=9, top_k=5, seed=11)
    steps = list(stream(model, ids, config, attention_mask=mask))
    assert len(steps) == 9 and all(s.shape == (2,) for s in steps)
    out = generate(model, ids, config, attention_mask=mask)
    assert torch.equal(torch.stack(steps, dim=1), out[:, 5:])


def test_model_mode_restored_and_outputs_usable():
    model = small_model().train()
    out = generate(model, torch.zeros(1, 3, dtype=torch.long), GenerationConfig(max_new_tokens=3, **GREEDY))
    assert model.training
    assert not out.is_inference()  # usable outside inference mode
    assert model.eval() is model
    list(stream(model, torch.zeros(1, 3, dtype=torch.long), GenerationConfig(max_new_tokens=2)))
    assert not model.training


def test_prompt_too_long():
    model = small_model()  # context 64
    with pytest.raises(GenerationError) as err:
        generate(model, torch.zeros(1, 60, dtype=torch.long), GenerationConfig(max_new_tokens=5))
    assert str(err.value) == ("prompt of 60 tokens + max_new_tokens=5 = 65 positions exceeds the model's "
                              "context of 64 (no sliding window: shorten the prompt or lower max_new_tokens)")
    assert generate(model, torch.zeros(1, 60, dtype=torch.long), GenerationConfig(max_new_tokens=4)).shape \
        == (1, 64)


def test_bad_ids_and_empty_prompt():
    model = small_model()  # vocabulary 40
    with pytest.raises(GenerationError, match=r"outside the vocabulary \[0, 40\): -3, 40, 99"):
        generate(model, torch.tensor([[1, 40, 99, -3, 40]]), GenerationConfig())
    with pytest.raises(GenerationError, match="empty prompt"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), GenerationConfig())
    with pytest.raises(GenerationError, match=r"empty prompt: row\(s\) \[1\]"):
        generate(model, torch.ones(2, 3, dtype=torch.long), GenerationConfig(),
                 attention_mask=torch.tensor([[0, 1, 1], [0, 0, 0]]))
    with pytest.raises(GenerationError, match="left-padded"):
        generate(model, torch.ones(1, 3, dtype=torch.long), GenerationConfig(),
                 attention_mask=torch.tensor([[1, 1, 0]]))
    with pytest.raises(GenerationError, match=r"\(batch, length\) integer tensor"):
        generate(model, torch.ones(3, dtype=torch.long), GenerationConfig())
    # ids under padding are never read: anything goes there
    ok = generate(model, torch.tensor([[-5, 1, 2]]), GenerationConfig(max_new_tokens=2),
                  attention_mask=torch.tensor([[0, 1, 1]]))
    assert ok[0, 0] == -5


def test_bad_config_is_a_config_error():
    with pytest.raises(ConfigError, match=r"top_p must be in \(0, 1\] or None, got 1.5"):
        GenerationConfig(top_p=1.5)


def test_ids_past_the_tokenizer_vocabulary_are_never_generated():
    """Imported models often pad the vocabulary past the tokenizer's; those ids have no text."""

    class Small(Letters):
        vocab_size = 10

    model = small_model(vocab_size=40)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():  # the model does favour padded ids here, so the limit is what keeps them out
        free = generate(model, ids, GenerationConfig(max_new_tokens=20, do_sample=False))
    assert (free[0, 3:] >= 10).any()
    for config in (GenerationConfig(max_new_tokens=20, do_sample=False), GenerationConfig(max_new_tokens=20, seed=0)):
        out = generate(model, ids, config, tokenizer=Small())
        assert (out[0, 3:] < 10).all()
