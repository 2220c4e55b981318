"""beam_search: exhaustive search on a tiny vocabulary, recomputed scores, batching, n-best, n-gram bans,
greedy equivalence, errors, and parity with transformers' beam search."""

import itertools

import pytest
import torch

from tests.generation.helpers import left_pad, small_model
from tokenloom import GenerationConfig, generate, stream
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.generation import BeamOutput, beam_search
from tokenloom.nn import KVCache

BEAM = dict(do_sample=False)


def peaked_model(vocab_size: int, seed: int = 0, std: float = 0.4, head: float = 3.0, **overrides):
    """A random small GPT with large weights: peaked, varied next-token distributions (no near-ties that float
    noise could decide)."""
    model = small_model(vocab_size=vocab_size, seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_weight = name.endswith("weight") and p.ndim == 1
            p.copy_(torch.randn(p.shape, generator=gen) * std + (1.0 if norm_weight else 0.0))
        model.lm_head.weight.mul_(head)
    return model


@torch.no_grad()
def token_log_probs(model, prompt: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """(T,) prompt, (k, L) continuations -> (k, L) log-probabilities of each new token, by one uncached
    forward pass of prompt + continuation."""
    seqs = torch.cat((prompt.expand(len(new), -1), new), dim=1)
    logp = model(seqs).float().log_softmax(-1)[:, len(prompt) - 1:-1]  # predictions of the new tokens
    return logp.gather(-1, new[..., None])[..., 0]


def exhaustive(model, prompt: torch.Tensor, n: int, vocab: int, eos: int | None, length_penalty: float):
    """Every hypothesis (ends in EOS, or reaches n tokens; EOS only at the end), scored like beam search,
    best first: [(score, tokens)]."""
    everything = torch.tensor(list(itertools.product(range(vocab), repeat=n)))  # (V^n, n)
    prefix_sums = token_log_probs(model, prompt, everything).cumsum(1)  # (V^n, n)
    hyps = {}
    for row, seq in enumerate(everything.tolist()):
        for length in range(1, n + 1):
            head = tuple(seq[:length])
            if eos in head[:-1]:
                break
            if length == n or head[-1] == eos:
                hyps[head] = float(prefix_sums[row, length - 1]) / length ** length_penalty
    return sorted(((s, h) for h, s in hyps.items()), reverse=True)


def new_tokens(out: BeamOutput, T: int, row: int, k: int) -> list[int]:
    return out.sequences[row, k, T:T + int(out.lengths[row, k])].tolist()


def frequent_token(model, ids, mask=None, n: int = 20) -> int:
    """The token that beams without an EOS produce most: as EOS it ends hypotheses at many lengths."""
    free = beam_search(model, ids, GenerationConfig(max_new_tokens=n, num_beams=4, num_return_sequences=4, **BEAM),
                       attention_mask=mask)
    return int(free.sequences[:, :, ids.shape[1]:].flatten().mode().values)


@pytest.mark.parametrize(("eos", "length_penalty", "early_stopping"),
                         [(None, 1.0, False), (4, 1.0, False), (4, 2.0, True), (0, 0.0, "never"), (0, -1.0, False)])
def test_beam_search_equals_exhaustive_search(eos, length_penalty, early_stopping):
    """With num_beams >= V^(n-1) beam search keeps every prefix, so it must find the exact best hypotheses."""
    V, n = 5, 3
    model = peaked_model(V, seed=1, std=0.3, head=1.0)
    prompt = torch.tensor([2, 4])
    config = GenerationConfig(max_new_tokens=n, num_beams=V ** (n - 1), num_return_sequences=6, eos_token_id=eos,
                              pad_token_id=0, length_penalty=length_penalty, early_stopping=early_stopping, **BEAM)
    out = beam_search(model, prompt[None], config)
    want = exhaustive(model, prompt, n, V, eos, length_penalty)[:6]
    assert [new_tokens(out, 2, 0, k) for k in range(6)] == [list(h) for _, h in want]
    torch.testing.assert_close(out.scores[0], torch.tensor([s for s, _ in want]), atol=1e-5, rtol=1e-5)
    if eos is not None:
        assert (out.lengths < n).any(), "no hypothesis ended in EOS: the case tests nothing"


def test_scores_equal_recomputed_log_probs_batched_with_padding():
    """Scores are the new tokens' log-probs summed (one uncached forward pass of the returned sequence) over
    generated_length ** length_penalty; the batched, left-padded run equals one prompt at a time."""
    V, lp = 24, 1.5
    model = peaked_model(V, seed=2, position="rope")
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, V, (k,), generator=gen) for k in (7, 2, 5)]
    ids, mask = left_pad(rows, pad=9)
    eos = frequent_token(model, ids, mask, 12)
    config = GenerationConfig(max_new_tokens=12, num_beams=3, num_return_sequences=3, eos_token_id=eos, pad_token_id=0,
                              length_penalty=lp, **BEAM)
    out = beam_search(model, ids, config, attention_mask=mask)
    assert out.sequences.shape == (3, 3, 7 + int(out.lengths.max()))
    assert torch.equal(out.sequences[:, :, :7], ids[:, None].expand(-1, 3, -1))  # the prompt as given
    assert (out.lengths < 12).any() and (out.sequences[:, :, 7:] == eos).any()
    for i, row in enumerate(rows):
        alone = beam_search(model, row[None], config)
        assert torch.equal(alone.lengths[0], out.lengths[i]), i
        for k in range(3):
            tokens = new_tokens(out, 7, i, k)
            assert tokens == new_tokens(alone, len(row), 0, k), (i, k)
            assert set(out.sequences[i, k, 7 + len(tokens):].tolist()) <= {0}  # pad after the hypothesis
            assert (tokens[-1] == eos) == (len(tokens) < 12) and eos not in tokens[:-1]
            total = token_log_probs(model, row, torch.tensor([tokens])).sum()
            torch.testing.assert_close(out.log_probs[i, k], total, atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(out.scores[i, k], total / len(tokens) ** lp, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(alone.scores[0], out.scores[i], atol=1e-5, rtol=1e-5)
    assert (out.scores[:, :-1] >= out.scores[:, 1:]).all()  # best first


def test_n_best_ordering_and_num_return_sequences():
    model = peaked_model(30, seed=3)
    ids = torch.randint(0, 30, (2, 4))
    kw = dict(max_new_tokens=8, num_beams=5, eos_token_id=7, **BEAM)
    five = beam_search(model, ids, GenerationConfig(num_return_sequences=5, **kw))
    two = beam_search(model, ids, GenerationConfig(num_return_sequences=2, **kw))
    one = generate(model, ids, GenerationConfig(**kw))
    assert (five.scores[:, :-1] >= five.scores[:, 1:]).all()
    assert len({tuple(new_tokens(five, 4, 0, k)) for k in range(5)}) == 5  # distinct hypotheses
    torch.testing.assert_close(two.scores, five.scores[:, :2])
    for k in range(2):
        assert new_tokens(two, 4, 0, k) == new_tokens(five, 4, 0, k)
        assert new_tokens(two, 4, 1, k) == new_tokens(five, 4, 1, k)
    best_len = int(two.lengths[:, 0].max())
    assert torch.equal(one, two.sequences[:, 0, :4 + best_len])  # generate() = the best hypothesis


def test_generate_dispatches_and_beams_beat_greedy():
    model = peaked_model(40, seed=4)
    ids = torch.randint(0, 40, (3, 5))
    greedy = generate(model, ids, GenerationConfig(max_new_tokens=10, **BEAM))
    beams = beam_search(model, ids, GenerationConfig(max_new_tokens=10, num_beams=4, length_penalty=0.0, **BEAM))
    greedy_sums = torch.stack([token_log_probs(model, ids[i], greedy[i:i + 1, 5:]).sum() for i in range(3)])
    assert (beams.scores[:, 0] >= greedy_sums - 1e-5).all()  # without EOS all have length 10: sums compare
    assert (beams.scores[:, 0] > greedy_sums + 1e-3).any(), "beam search found nothing better than greedy"


@pytest.mark.parametrize("kw", [dict(), dict(early_stopping=True), dict(length_penalty=0.0)])
def test_one_beam_equals_greedy(kw):
    """One beam: always the argmax; with EOS it stops like greedy when early_stopping=True or length_penalty=0
    (otherwise HF's rules may continue past a finished hypothesis to look for a better-normalised one)."""
    model = peaked_model(12, seed=5)
    rows = [torch.randint(0, 12, (k,)) for k in (6, 3)]
    ids, mask = left_pad(rows)
    if kw:  # EOS: row 0's third greedy token
        first3 = generate(model, ids, GenerationConfig(max_new_tokens=3, **BEAM), attention_mask=mask)
        kw["eos_token_id"] = int(first3[0, -1])
    config = GenerationConfig(max_new_tokens=10, pad_token_id=0, **BEAM, **kw)
    greedy = generate(model, ids, config, attention_mask=mask)
    out = beam_search(model, ids, config, attention_mask=mask)
    assert torch.equal(out.sequences[:, 0], greedy)
    if kw:
        assert greedy.shape[1] < 16 or (greedy[:, 6:] == 0).any()  # a row stopped early


def test_no_repeat_ngram_size_prevents_repeats():
    """A random tied-embedding model mostly repeats itself; with the ban no new token completes an n-gram
    already in the row (prompt included, padding excluded)."""
    model = small_model(vocab_size=20, seed=6, tie_embeddings=True)
    rows = [torch.tensor([3, 4, 5, 3, 4]), torch.tensor([8, 9])]
    ids, mask = left_pad(rows, pad=3)

    def repeats(out, m):
        """Per row: new tokens that complete an m-gram seen earlier in the row."""
        found = []
        for i, row in enumerate(rows):
            seq = row.tolist() + new_tokens(out, 5, i, 0)
            grams = [tuple(seq[j:j + m]) for j in range(len(seq) - m + 1)]  # grams[j] ends at token j + m - 1
            found.append(sum(grams[j] in grams[:j] for j in range(len(grams)) if j + m - 1 >= len(row)))
        return found

    config = dict(max_new_tokens=15, num_beams=3, **BEAM)
    plain = beam_search(model, ids, GenerationConfig(**config), attention_mask=mask)
    assert all(r > 0 for r in repeats(plain, 3)), "the model does not repeat: the case tests nothing"
    for m in (1, 2, 3):
        out = beam_search(model, ids, GenerationConfig(no_repeat_ngram_size=m, **config), attention_mask=mask)
        assert repeats(out, m) == [0, 0], m
        assert out.lengths.min() == 15


@pytest.mark.parametrize("early_stopping", [True, False])
def test_done_prompts_leave_the_batch_without_changing_results(monkeypatch, early_stopping):
    """A prompt that is done leaves the batch (cache.select drops its rows); the results equal a run whose
    cache cannot drop rows (every prompt decoded to the end, as Hugging Face does)."""
    V = 24
    model = peaked_model(V, seed=3, position="rope")
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, V, (k,), generator=gen) for k in (3, 6, 2, 5, 4)]
    ids, mask = left_pad(rows, pad=9)
    eos = frequent_token(model, ids, mask, 16)
    config = GenerationConfig(max_new_tokens=16, num_beams=3, num_return_sequences=2, eos_token_id=eos,
                              no_repeat_ngram_size=3, early_stopping=early_stopping, **BEAM)
    sizes = []
    select = KVCache.select
    monkeypatch.setattr(KVCache, "select", lambda cache, index: (sizes.append(index.numel()), select(cache, index)))
    dropped = beam_search(model, ids, config, attention_mask=mask)
    assert sizes and sizes[0] < 15 and sizes == sorted(sizes, reverse=True)  # prompts left, a few at a time
    monkeypatch.setattr(KVCache, "select", None)
    kept = beam_search(model, ids, config, attention_mask=mask)
    assert torch.equal(dropped.sequences, kept.sequences) and torch.equal(dropped.lengths, kept.lengths)
    # other batch sizes, other matrix-product blockings: the scores agree to float32 rounding over 16 steps (5e-7
    # seen here), not bit for bit
    torch.testing.assert_close(dropped.scores, kept.scores, atol=1e-5, rtol=1e-5)


def test_fast_decode_path_equals_module_path():
    """Reordering the cache in place keeps GPT's one-token fast path (plain step functions) valid."""
    model = peaked_model(32, seed=7, position="rope", num_kv_heads=2)
    rows = [torch.randint(0, 32, (k,)) for k in (5, 8)]
    ids, mask = left_pad(rows)
    config = GenerationConfig(max_new_tokens=10, num_beams=4, num_return_sequences=4, eos_token_id=2, **BEAM)
    fast = beam_search(model, ids, config, attention_mask=mask)
    handle = model.blocks[0].mlp.register_forward_hook(lambda module, args, out: None)  # the modules run
    slow = beam_search(model, ids, config, attention_mask=mask)
    handle.remove()
    assert torch.equal(fast.sequences, slow.sequences)
    torch.testing.assert_close(fast.scores, slow.scores, atol=1e-5, rtol=1e-5)


def test_model_mode_restored_and_vocab_limit():
    class Tok:
        vocab_size = 10

        def decode(self, ids):
            return ""

    model = peaked_model(16, seed=8).train()
    config = GenerationConfig(max_new_tokens=6, num_beams=3, num_return_sequences=3, **BEAM)
    out = beam_search(model, torch.tensor([[1, 2, 3]]), config, tokenizer=Tok())
    assert model.training
    assert out.sequences.max() < 10


@pytest.mark.parametrize(("kw", "field"), [
    (dict(num_beams=0), "num_beams"), (dict(num_beams=2.0), "num_beams"),
    (dict(length_penalty=float("nan")), "length_penalty"), (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(early_stopping=1), "early_stopping"), (dict(num_return_sequences=3, num_beams=2), "num_return_sequences"),
    (dict(num_return_sequences=0), "num_return_sequences"), (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
    (dict(num_beams=4, do_sample=True), "do_sample"),
    (dict(num_beams=4, do_sample=False, repetition_penalty=1.3), "repetition_penalty"),
    (dict(num_beams=4, do_sample=False, stop_strings=["x"]), "stop_strings"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError) as err:
        GenerationConfig(**kw)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_request_errors():
    model = small_model()
    config = GenerationConfig(max_new_tokens=4, num_beams=2, **BEAM)
    with pytest.raises(GenerationError, match="stream"):
        stream(model, torch.tensor([[1, 2]]), config)
    with pytest.raises(GenerationError, match="no_repeat_ngram_size"):
        generate(model, torch.tensor([[1, 2]]), GenerationConfig(max_new_tokens=4, no_repeat_ngram_size=2, **BEAM))
    with pytest.raises(GenerationError, match="context"):
        beam_search(model, torch.zeros(1, 62, dtype=torch.long), config)
    with pytest.raises(GenerationError, match="vocabulary"):
        beam_search(model, torch.tensor([[1, 99]]), config)
    with pytest.raises(GenerationError, match="left-padded"):
        beam_search(model, torch.tensor([[1, 2]]), config, attention_mask=torch.tensor([[1, 0]]))
    config.do_sample = True  # changed after validation
    with pytest.raises(GenerationError, match="do_sample"):
        beam_search(model, torch.tensor([[1, 2]]), config)


# --- parity with transformers' beam search ------------------------------------------------------------------

def _hf_pair(seed: int, vocab: int = 64):
    pytest.importorskip("transformers")
    from tokenloom.interop import to_hf

    model = peaked_model(vocab, seed=seed, mlp="gelu_tanh")
    return model, to_hf(model)


def _hf_beam(hf, ids, mask, n_best, **kw):
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, num_return_sequences=n_best,
                      output_scores=True, return_dict_in_generate=True, **kw)
    B = ids.shape[0]
    return out.sequences.view(B, n_best, -1), out.sequences_scores.view(B, n_best)


HF_CASES = [dict(length_penalty=1.0, early_stopping=False), dict(length_penalty=2.0, early_stopping=True),
            dict(length_penalty=0.5, early_stopping="never"), dict(length_penalty=-0.5, early_stopping=False),
            dict(length_penalty=1.0, early_stopping=False, no_repeat_ngram_size=2)]


@pytest.mark.parametrize("seed", [0, 2])
@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_transformers_beam_search(seed, case):
    model, hf = _hf_pair(seed)
    ids = torch.randint(2, 64, (3, 5), generator=torch.Generator().manual_seed(seed))
    ones = torch.ones_like(ids)
    # EOS: the token the unconstrained beams produce most, so hypotheses end at many lengths
    free = beam_search(model, ids, GenerationConfig(max_new_tokens=20, num_beams=4, num_return_sequences=4, **BEAM))
    eos = int(free.sequences[:, :, 5:].flatten().mode().values)
    # pad 1, not 0: transformers 5.24 fills finished rows with `pad_token_id or eos_token_id`
    theirs, their_scores = _hf_beam(hf, ids, ones, 3, num_beams=4, eos_token_id=eos, pad_token_id=1, **case)
    ours = beam_search(model, ids, GenerationConfig(max_new_tokens=20, num_beams=4, num_return_sequences=3,
                                                    eos_token_id=eos, pad_token_id=1, **case, **BEAM))
    assert torch.equal(ours.sequences, theirs)
    torch.testing.assert_close(ours.scores, their_scores, atol=1e-4, rtol=1e-5)
    assert (ours.scores[:, :-1] - ours.scores[:, 1:]).abs().min() > 1e-4  # no near-tie decided the order
    assert len(set(ours.lengths.flatten().tolist())) > 1  # hypotheses of different lengths
    best = generate(model, ids, GenerationConfig(max_new_tokens=20, num_beams=4, eos_token_id=eos, pad_token_id=1,
                                                 **case, **BEAM))
    assert torch.equal(best, hf.generate(ids, attention_mask=ones, do_sample=False, max_new_tokens=20, num_beams=4,
                                         eos_token_id=eos, pad_token_id=1, **case))


def test_matches_transformers_left_padded_batch():
    model, hf = _hf_pair(4)
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randint(2, 64, (k,), generator=gen) for k in (9, 3, 6)]
    ids, mask = left_pad(rows, pad=1)
    kw = dict(num_beams=4, eos_token_id=frequent_token(model, ids, mask), pad_token_id=1, length_penalty=1.0)
    theirs, their_scores = _hf_beam(hf, ids, mask, 4, **kw)
    ours = beam_search(model, ids, GenerationConfig(max_new_tokens=20, num_return_sequences=4, **kw, **BEAM),
                       attention_mask=mask)
    assert torch.equal(ours.sequences, theirs)
    torch.testing.assert_close(ours.scores, their_scores, atol=1e-4, rtol=1e-5)
    assert len(set(ours.lengths.flatten().tolist())) > 2  # hypotheses of different lengths
