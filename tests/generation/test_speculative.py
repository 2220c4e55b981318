"""Speculative decoding: greedy equals plain greedy (every position scheme, left-padded batches whose rows advance by
different amounts, an encoder-decoder's decoder), the sampling rule keeps the model's distribution (chi-square),
rewound caches equal caches built from scratch, stopping edges and refusals."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.generation.helpers import POSITIONS, left_pad, small_model
from tests.models.test_seq2seq import VARIANTS
from tests.models.test_seq2seq import make as make_seq2seq
from tokenloom import GenerationConfig, generate, stream
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.generation import DraftTally, ModelDrafter, PromptLookup, check_draft_tokenizer
from tokenloom.generation.drafting import CacheRows, Draft, Drafter
from tokenloom.generation.processors import create_processors
from tokenloom.generation.speculative import accept_sampled
from tokenloom.models import RNNLM, RNNConfig
from tokenloom.nn import KVCache

GREEDY = dict(do_sample=False)
CHI2_DF4 = 18.467  # the chi-square critical value of 4 degrees of freedom at alpha = 0.001


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """The chi-square critical value of ``df`` degrees of freedom at alpha = 0.001 (z: the normal quantile), by the
    Wilson-Hilferty approximation (df 12: 33.1, the table's 32.9)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


class Shifted(ModelDrafter):
    """The model drafting for itself with every proposal moved to the next id: greedy rejects every draft."""

    def propose(self, last, k, history, live):
        draft = super().propose(last, k, history, live)
        return draft._replace(tokens=(draft.tokens + 1) % self.model.config.vocab_size)


class Oracle(Drafter):
    """Knows the plain greedy output ``reference`` (B, T + n); row b's drafts are right with probability
    ``right[b]`` (seeded), so rows accept different numbers of tokens each round."""

    def __init__(self, reference: Tensor, T: int, right: list[float]) -> None:
        self.reference, self.T, self.right = reference, T, right
        self.gen = torch.Generator().manual_seed(0)

    def start(self, prompt, mask):
        self.rows, self.done = list(range(prompt.shape[0])), [0] * prompt.shape[0]

    def propose(self, last, k, history, live):
        tokens = torch.zeros(len(self.rows), k, dtype=torch.long)
        for a, b in enumerate(self.rows):
            truth = self.reference[b, self.T + self.done[b]:][:k]
            truth = torch.cat((truth, truth.new_zeros(k - len(truth))))
            wrong = torch.rand(k, generator=self.gen) >= self.right[b]
            tokens[a] = torch.where(wrong, (truth + 1) % 40, truth)
        return Draft(tokens, torch.full((len(self.rows),), k), None)

    def update(self, kept, emitted):
        for a, b in enumerate(self.rows):
            self.done[b] += len(emitted[a])

    def select(self, index):
        self.rows = [self.rows[i] for i in index.tolist()]


def chi_square(samples: Tensor, probs: Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# ---- greedy: the same tokens as plain decoding ---------------------------------------------------------------------


@pytest.mark.parametrize("position", POSITIONS)
def test_greedy_equals_plain_greedy_for_every_position_scheme(position):
    model, other = small_model(position=position), small_model(position=position, seed=1)
    rows = [torch.randint(0, 40, (n,)) for n in (9, 3, 6)]
    ids, mask = left_pad(rows, pad=7)
    config = GenerationConfig(max_new_tokens=13, num_draft_tokens=3, **GREEDY)
    plain = generate(model, ids, config, attention_mask=mask)
    for name, draft in [("self", model), ("shifted", Shifted(model)), ("other", other), ("lookup", PromptLookup(2))]:
        tally = DraftTally()
        out = generate(model, ids, config, attention_mask=mask, draft=draft, draft_tally=tally)
        assert torch.equal(out, plain), name
        if name == "self":  # 13 tokens = 3 passes of 4 + 1: every draft accepted
            assert tally.acceptance_rate == 1.0 and tally.rounds == 4
        if name == "shifted":
            assert tally.accepted == 0 and tally.rounds == 13
        alone = generate(model, rows[1][None], config, draft=draft)
        assert torch.equal(alone[0, 3:], plain[1, 9:]), name


def test_rows_accepting_different_amounts_shift_and_trim_and_equal_plain(monkeypatch):
    """An oracle right with a different probability per row: rows advance by different amounts every round, their
    padding grows (rewind) and is trimmed when the cache fills; the output is plain greedy's."""
    trims = []
    trim = KVCache.trim
    monkeypatch.setattr(KVCache, "trim", lambda self, n: (trims.append(n), trim(self, n)))
    for position in ("learned", "alibi"):
        model = small_model(position=position)
        rows = [torch.randint(0, 40, (n,)) for n in (9, 3, 6, 2, 5)]
        ids, mask = left_pad(rows, pad=7)
        config = GenerationConfig(max_new_tokens=30, num_draft_tokens=5, repetition_penalty=1.3, **GREEDY)
        plain = generate(model, ids, config, attention_mask=mask)
        tally = DraftTally()
        out = generate(model, ids, config, attention_mask=mask, draft=Oracle(plain, 9, [1.0, 0.0, 0.5, 0.9, 0.3]),
                       draft_tally=tally)
        assert torch.equal(out, plain), position
        assert 0.2 < tally.acceptance_rate < 0.8
    assert trims  # the trim path ran


def test_repetition_penalty_sees_the_earlier_drafts():
    model = small_model(vocab_size=12, seed=2)
    ids = torch.randint(0, 12, (2, 5))
    config = GenerationConfig(max_new_tokens=16, repetition_penalty=5.0, num_draft_tokens=4, **GREEDY)
    plain = generate(model, ids, config)
    assert not torch.equal(plain, generate(model, ids, GenerationConfig(max_new_tokens=16, **GREEDY)))
    tally = DraftTally()
    assert torch.equal(generate(model, ids, config, draft=model, draft_tally=tally), plain)
    assert tally.acceptance_rate == 1.0


def test_prompt_lookup_proposes_the_continuation_of_a_repeated_passage():
    """A model whose next token depends on the last one only (its attention and MLP outputs zeroed) repeats a cycle:
    once the prompt holds the cycle, every lookup proposal is right. On a random model, some are."""
    model = small_model(vocab_size=12, seed=3, position="none")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "out_proj" in name or "fc_out" in name:
                param.zero_()
    start = torch.randint(0, 12, (1, 3))
    prompt = generate(model, start, GenerationConfig(max_new_tokens=20, **GREEDY))  # the cycle, at least once
    config = GenerationConfig(max_new_tokens=20, prompt_lookup=2, num_draft_tokens=4, **GREEDY)
    tally = DraftTally()
    out = generate(model, prompt, config, draft_tally=tally)
    assert torch.equal(out, generate(model, prompt, GenerationConfig(max_new_tokens=20, **GREEDY)))
    assert tally.acceptance_rate == 1.0 and tally.rounds == 4  # 4 passes of 5 tokens
    other = small_model(vocab_size=12, seed=3)
    passage = torch.randint(0, 12, (10,))
    prompt = torch.cat((passage, passage[:4]))[None]
    tally = DraftTally()
    out = generate(other, prompt, config, draft_tally=tally)
    assert torch.equal(out, generate(other, prompt, GenerationConfig(max_new_tokens=20, **GREEDY)))
    assert tally.drafted > 0


def test_prompt_lookup_finds_the_latest_longest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=2, context=[[7, 8, 9, 1, 5]])
    lookup.start(torch.tensor([[1, 2, 3, 9, 1, 2, 4, 1, 2]]), None)
    proposal = lookup.propose(torch.tensor([2]), 3, None, torch.tensor([True]))
    assert proposal.tokens.tolist() == [[4, 1, 2]] and proposal.counts.tolist() == [3]  # (1, 2) latest at 4..5
    lookup.update(torch.tensor([0]), [[9]])  # ... 1 2 9: (2, 9) never seen; (9,) too short for min_ngram 2
    lookup.rows[0].wait = 0  # (the miss made the row back off: matching is what this test checks)
    assert lookup.propose(torch.tensor([9]), 3, None, torch.tensor([True])).counts.tolist() == [0]
    lookup.update(torch.tensor([0]), [[1]])  # ... 2 9 1: (9, 1) at 3..4 in the row, then the source
    assert lookup.propose(torch.tensor([1]), 3, None, torch.tensor([True])).tokens.tolist() == [[2, 4, 1]]
    lookup.update(torch.tensor([0]), [[5]])  # ... 9 1 5: only in the source, at its end: nothing follows
    assert lookup.propose(torch.tensor([5]), 2, None, torch.tensor([True])).counts.tolist() == [0]
    cycle = PromptLookup(max_ngram=3)
    cycle.start(torch.tensor([[0, 0, 5, 6, 5, 6]]), torch.tensor([[0, 1, 1, 1, 1, 1]]))  # (5, 6) ends 2 back
    assert cycle.propose(torch.tensor([6]), 5, None, torch.tensor([True])).tokens.tolist() == [[5, 6, 5, 6, 5]]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_eos_and_max_new_tokens_edges(n):
    model = small_model(seed=5)
    ids = torch.randint(0, 40, (3, 4))
    free = generate(model, ids, GenerationConfig(max_new_tokens=12, **GREEDY))
    for eos in (int(free[0, 4 + min(n, 3) - 1]), int(free[2, 6])):
        config = GenerationConfig(max_new_tokens=n, eos_token_id=eos, pad_token_id=-1, num_draft_tokens=4, **GREEDY)
        plain = generate(model, ids, config)
        for draft in (model, Shifted(model), PromptLookup(1)):
            out = generate(model, ids, config, draft=draft)
            assert torch.equal(out, plain), (eos, draft)
            assert out.shape[1] <= 4 + n


def test_stop_strings_and_stream():
    class Letters:
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)

    model = small_model(vocab_size=26, seed=6)
    ids = torch.randint(0, 26, (2, 5))
    free = generate(model, ids, GenerationConfig(max_new_tokens=12, **GREEDY))
    stop = Letters().decode(free[0, 8:10].tolist())
    config = GenerationConfig(max_new_tokens=12, stop_strings=[stop], num_draft_tokens=3, **GREEDY)
    plain = generate(model, ids, config, tokenizer=Letters())
    out = generate(model, ids, config, tokenizer=Letters(), draft=model)
    assert torch.equal(out, plain) and out.shape[1] < 17
    columns = list(stream(model, ids, config, tokenizer=Letters(), draft=Shifted(model)))
    assert torch.equal(torch.stack(columns, 1), plain[:, 5:])


@pytest.mark.parametrize("variant", ["paper", "modern", "alibi"])
def test_encoder_decoder_greedy_equals_plain(variant):
    model, small = make_seq2seq(**VARIANTS[variant]), make_seq2seq(seed=3, **VARIANTS[variant])
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(3, 50, (3, 7), generator=gen)
    mask = torch.ones_like(src)
    mask[1, 5:] = 0
    bos = torch.ones(3, 1, dtype=torch.long)
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=3, **GREEDY)
    plain = generate(model.decoder_for(src, mask), bos, config)
    for draft in (model.decoder_for(src, mask), small.decoder_for(src, mask),
                  PromptLookup(2, context=src, context_mask=mask)):
        tally = DraftTally()
        assert torch.equal(generate(model.decoder_for(src, mask), bos, config, draft=draft, draft_tally=tally),
                           plain)
    eos = int(plain[0, 3])
    config = GenerationConfig(max_new_tokens=12, eos_token_id=eos, **GREEDY)
    assert torch.equal(generate(model.decoder_for(src, mask), bos, config, draft=model.decoder_for(src, mask)),
                       generate(model.decoder_for(src, mask), bos, config))


# ---- sampling: the model's distribution --------------------------------------------------------------------------


def test_sampling_rule_keeps_p_for_a_sampled_and_a_one_hot_draft():
    """With fixed p and q on 5 tokens, the first emitted token of 20,000 seeded rounds follows p (chi-square at
    alpha 0.001); it does not follow q (the test can fail)."""
    A = 20_000
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.2, 0.3, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.05, 0.1, 0.15, 0.2, 0.5], [0.3, 0.3, 0.2, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, A, replacement=True, generator=gen).T  # (A, 2)
    counts = torch.full((A,), 2)
    kept, nxt = accept_sampled(p.expand(A, 3, 5), drafts, q.expand(A, 2, 5), counts, gen)
    first = torch.where(kept > 0, drafts[:, 0], nxt)
    assert chi_square(first, p[0]) < CHI2_DF4
    assert chi_square(first, q[0]) > CHI2_DF4
    assert chi_square(drafts[:, 0], p[0]) > CHI2_DF4
    # one-hot q (prompt lookup): every row proposes token 0 first
    proposal = torch.zeros(A, 2, dtype=torch.long)
    kept, nxt = accept_sampled(p.expand(A, 3, 5), proposal, None, counts, gen)
    first = torch.where(kept > 0, proposal[:, 0], nxt)
    assert chi_square(first, p[0]) < CHI2_DF4
    assert 0.45 < (kept > 0).double().mean() < 0.55  # accepted with probability p(0) = 0.5


def peaked(model):
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_sampled_tokens_follow_the_models_joint_distribution(drafter):
    """6,000 rows of one prompt, two new tokens each, temperature and a repetition penalty (the second token's
    distribution depends on the first, through the model and the penalty): the pairs follow the model's joint
    distribution p(t1) p(t2 | t1) (chi-square over the 25 cells, those expecting fewer than 5 pooled), and not the
    draft model's."""
    V, R = 5, 6000
    model, other = peaked(small_model(vocab_size=V, seed=7)), peaked(small_model(vocab_size=V, seed=8))
    prompt = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1]])
    config = GenerationConfig(max_new_tokens=2, temperature=1.5, repetition_penalty=1.5, seed=0,
                              num_draft_tokens=2)
    processors = create_processors(config)

    def joint(net):
        with torch.no_grad():
            seqs = torch.cat((prompt.expand(V, -1), torch.arange(V)[:, None]), 1)  # (V, T + 1)
            p1 = processors(prompt, net(prompt)[:, -1]).softmax(-1)[0]
            p2 = processors(seqs, net(seqs)[:, -1]).softmax(-1)  # (V, V): row t1
        return (p1[:, None] * p2).view(-1)

    draft = other if drafter == "model" else PromptLookup(2)
    tally = DraftTally()
    out = generate(model, prompt.expand(R, -1), config, draft=draft, draft_tally=tally)[:, -2:]
    pairs = out[:, 0] * V + out[:, 1]
    target = joint(model)
    assert (target * R >= 5).sum() >= 10  # enough cells with an expectation a chi-square can use
    keep = target * R >= 5
    merged = torch.cat((pairs[keep[pairs]], torch.full((int((~keep[pairs]).sum()),), V * V)))  # small cells pooled
    probs = torch.cat((target[keep], target[~keep].sum()[None]))
    remap = torch.full((V * V + 1,), -1, dtype=torch.long)
    remap[torch.cat((keep.nonzero().view(-1), torch.tensor([V * V])))] = torch.arange(int(keep.sum()) + 1)
    critical = chi2_critical(probs.numel() - 1)
    assert chi_square(remap[merged], probs) < critical
    assert tally.accepted > 0 and tally.accepted < tally.drafted
    if drafter == "model":
        wrong = joint(other)
        assert chi_square(remap[merged], torch.cat((wrong[keep], wrong[~keep].sum()[None])) + 1e-9) > critical


def test_seeded_sampling_is_reproducible():
    model, other = small_model(seed=9), small_model(seed=10)
    ids = torch.randint(0, 40, (2, 4))
    config = GenerationConfig(max_new_tokens=10, seed=3, top_k=5)
    a = generate(model, ids, config, draft=other)
    assert torch.equal(a, generate(model, ids, config, draft=other))
    assert not torch.equal(a, generate(model, ids, GenerationConfig(max_new_tokens=10, seed=4, top_k=5), draft=other))


# ---- caches -------------------------------------------------------------------------------------------------------


def test_kv_cache_rewind_moves_rows_right_and_trim_moves_them_left():
    cache = KVCache(1, 3, 1, 8, 1)
    cache.kv[..., 0] = torch.arange(8.0)  # position j holds j
    cache.length = 6
    shifts = cache.rewind(torch.tensor([1, 3, 2]))
    assert shifts.tolist() == [0, 2, 1] and cache.length == 5
    assert cache.k[0, 0, 0, :5, 0].tolist() == [0, 1, 2, 3, 4]
    assert cache.k[0, 1, 0, 2:5, 0].tolist() == [0, 1, 2]  # its first 3 positions, 2 to the right
    assert cache.v[0, 2, 0, 1:5, 0].tolist() == [0, 1, 2, 3]
    cache.trim(2)
    assert cache.length == 3 and cache.k[0, 1, 0, :3, 0].tolist() == [0, 1, 2]
    one = KVCache(1, 1, 1, 8, 1)
    one.length = 6
    assert one.rewind(torch.tensor([4])).tolist() == [0] and one.length == 2


@pytest.mark.parametrize("position", ["learned", "alibi", "rope"])
def test_rewound_cache_equals_a_cache_built_on_the_kept_tokens(position):
    """Two left-padded rows verify 4 drafts, then keep 3 and 1 of the 5 positions: their cached keys and values
    equal those of the kept tokens cached alone, and so do the next logits."""
    model = small_model(position=position)
    rows = [torch.randint(0, 40, (n,)) for n in (6, 3)]
    ids, mask = left_pad(rows)
    drafts = torch.randint(0, 40, (2, 5))
    keep = [3, 1]
    nxt = torch.randint(0, 40, (2, 1))
    with torch.no_grad():
        spec = CacheRows(model, model.create_cache(2, 20), 20, 2, ids.device)
        spec.prefill(ids, mask)
        spec.feed(drafts)
        spec.rewind(torch.tensor([5 - keep[0], 5 - keep[1]]))
        logits = spec.feed(nxt)[:, -1]
        for b, row in enumerate(rows):
            tokens = torch.cat((row, drafts[b, :keep[b]], nxt[b]))[None]
            fresh = model.create_cache(1, 20)
            alone = model(tokens, cache=fresh)[0, -1]
            n, L = tokens.shape[1], spec.cache.length
            torch.testing.assert_close(spec.cache.kv[:, :, b, :, L - n:L], fresh.kv[:, :, 0, :, :n], atol=1e-5,
                                       rtol=1e-5)
            assert int(spec.count[b]) == n
            torch.testing.assert_close(logits[b], alone, atol=1e-4, rtol=1e-4)


# ---- refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("num_draft_tokens", 0), ("num_draft_tokens", 1.5), ("prompt_lookup", -1)])
def test_bad_draft_settings_are_one_line_config_errors(field, value):
    with pytest.raises(ConfigError, match=rf"^{field} must be .*got {value}$"):
        GenerationConfig(**{field: value})


def test_refusals():
    model = small_model()
    ids = torch.randint(0, 40, (1, 4))
    greedy = GenerationConfig(max_new_tokens=4, **GREEDY)
    with pytest.raises(GenerationError, match="vocabulary has 30 ids and the model's 40"):
        generate(model, ids, greedy, draft=small_model(vocab_size=30))
    with pytest.raises(GenerationError, match="RollingKVCache cannot: a sliding-window"):
        generate(small_model(position="rope", attention_window=4), ids, greedy, draft=PromptLookup())
    with pytest.raises(GenerationError, match="SegmentMemory cannot: a Transformer-XL"):
        generate(small_model(position="xl", memory_len=4), ids, greedy, draft=PromptLookup())
    rnn = RNNLM(RNNConfig(vocab_size=40, num_layers=1, embed_dim=16, max_seq_len=32)).eval()
    with pytest.raises(GenerationError, match="RecurrentState cannot: a recurrent state"):
        generate(rnn, ids, greedy, draft=PromptLookup())
    with pytest.raises(GenerationError, match="the draft model: speculative .* RollingKVCache"):
        generate(model, ids, greedy, draft=small_model(position="rope", attention_window=4))
    with pytest.raises(ConfigError, match="prompt_lookup=2: .*beam search"):
        GenerationConfig(prompt_lookup=2, num_beams=2, **GREEDY)
    with pytest.raises(GenerationError, match="beam search"):
        generate(model, ids, GenerationConfig(num_beams=2, **GREEDY), draft=model)
    with pytest.raises(GenerationError, match="compile"):
        generate(model, ids, GenerationConfig(compile=True), draft=model)
    with pytest.raises(GenerationError, match="exit_threshold"):
        generate(model, ids, GenerationConfig(exit_threshold=0.5), draft=model)
    with pytest.raises(GenerationError, match="two drafters"):
        generate(model, ids, GenerationConfig(prompt_lookup=2), draft=model)
    with pytest.raises(GenerationError, match="draft_tally applies to speculative decoding"):
        generate(model, ids, greedy, draft_tally=DraftTally())
    with pytest.raises(GenerationError, match="min_ngram=3 exceeds max_ngram=2"):
        PromptLookup(max_ngram=2, min_ngram=3)

    class Tok:
        def __init__(self, fingerprint):
            self.fingerprint = fingerprint

    check_draft_tokenizer(Tok("a"), Tok("a"))
    with pytest.raises(GenerationError, match="tokenizer differs"):
        check_draft_tokenizer(Tok("a"), Tok("b"))


def test_model_modes_are_restored():
    model, other = small_model(), small_model(seed=1)
    model.train()
    other.train()
    generate(model, torch.randint(0, 40, (1, 4)), GenerationConfig(max_new_tokens=6, **GREEDY), draft=other)
    assert model.training and other.training


def test_prompt_lookup_backs_off_after_misses_and_resumes_after_a_hit():
    from tokenloom.generation.drafting import LOOKUP_MAX_WAIT, LookupRow

    row = LookupRow([1, 2, 3, 1, 2, 3, 1, 2], [], 1, 3)
    assert row.propose(4) == [3, 1, 2, 3]  # the period-3 pattern goes on
    row.extend([9, 9])  # nothing kept: a miss; after 1 miss, 3 rounds without proposals
    assert (row.misses, row.wait) == (1, 3)
    assert row.propose(4) == [] and row.propose(4) == [] and row.propose(4) == [] and row.wait == 0
    row.extend([5])  # no proposal outstanding: the back-off state stays
    assert (row.misses, row.wait) == (1, 0)
    waits = []
    for _ in range(8):  # misses in a row: the wait doubles, capped
        row.wait, row.pending = 0, [4, 4, 4, 4]
        row.extend([8])
        waits.append(row.wait)
    assert waits == sorted(waits) and waits[-1] == LOOKUP_MAX_WAIT and waits[0] >= 1
    row.wait, row.pending = 0, [6, 6, 6, 6]
    row.extend([6, 6, 5])  # two of four kept: a hit resets the back-off
    assert (row.misses, row.wait) == (0, 0)
