"""Kind levenshtein (the Levenshtein Transformer): its expert alignment, one decoding round, training to an exact
fit, padding-independent decoding and the decoding options."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from nat_pairs import batch_of, train_until_decoded  # tests/models is on sys.path (prepend mode)

from tokenloom.errors import ConfigError, GenerationError
from tokenloom.generation.levenshtein import levenshtein_round
from tokenloom.generation.nat import nat_decode
from tokenloom.models import NATConfig, NonAutoregressiveTransformer
from tokenloom.models.nat_kinds.levenshtein import edit_labels, placeholder_row, random_keep

V, PLH = 20, 18  # ids: 0 pad, 1 bos, 2 eos, 3..17 words, 18 <plh> (mask_id), 19 <blank>
SOURCES = [[3, 4, 5, 2], [6, 7, 2], [8, 9, 10, 11, 2], [12, 3, 2]]
TARGETS = [[5, 4, 3], [7, 6, 6], [11, 10, 9, 8], [3, 12]]  # "reverse the words" (with a repeat)


def tiny(**overrides) -> NonAutoregressiveTransformer:
    kw = dict(vocab_size=V, encoder_layers=1, decoder_layers=1, num_heads=2, embed_dim=32, max_source_len=16,
              max_target_len=16, dropout=0.0, kind="levenshtein", mask_id=PLH, blank_id=19)
    torch.manual_seed(0)
    return NonAutoregressiveTransformer(NATConfig(**{**kw, **overrides}))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    """Tiny models run fastest on one thread (the suite's fixture sets two before each test)."""
    torch.set_num_threads(1)


def train(model: NonAutoregressiveTransformer, steps: int, every: int = 0) -> list[int]:
    """Up to ``steps`` Adam steps of the kind's loss on the four pairs; with ``every``, stop once two checks in a
    row (``every`` steps apart) decode every pair exactly, returning their steps."""
    return train_until_decoded(model, SOURCES, TARGETS, steps, every=every, label_smoothing=0.1, iterations=10)


@pytest.fixture(scope="module")
def trained() -> tuple[NonAutoregressiveTransformer, list[int]]:
    """A model after 80 steps on the four pairs (lightly trained: varied outputs on other sources), and the steps
    of the two passing checks of the same model trained on until it decodes the pairs exactly (at most 500 in all;
    measured: 120-130)."""
    torch.set_num_threads(1)  # (set before the function-scoped fixtures: see _one_thread)
    model = tiny()
    train(model, 80)
    light = copy.deepcopy(model)
    return light, train(model, 420, every=10)


# ---- the expert --------------------------------------------------------------------------------------

def brute_force_distance(hypothesis: list[int], target: list[int]) -> int:
    """The fewest deletions + insertions turning ``hypothesis`` into ``target``: over every subset of hypothesis
    tokens to keep that is a subsequence of the target."""
    def is_subsequence(kept: list[int]) -> bool:
        rest = iter(target)
        return all(token in rest for token in kept)

    n, m = len(hypothesis), len(target)
    return min((n - len(kept_positions)) + (m - len(kept_positions))
               for size in range(n + 1) for kept_positions in itertools.combinations(range(n), size)
               if is_subsequence([hypothesis[i] for i in kept_positions]))


def apply_labels(hypothesis: list[int], keep: list[bool], counts: list[int], target: list[int]) -> list[int]:
    """The sequence the labels make of ``hypothesis``: the kept tokens, with counts[s] new tokens (taken in order
    from ``target``, the only source of inserted tokens) in front of the s-th kept one (the last slot: at the
    end); asserts each kept token lands where the target has it."""
    kept = [t for t, k in zip(hypothesis, keep, strict=True) if k]
    assert len(counts) == len(kept) + 1 and min(counts) >= 0
    out: list[int] = []
    for slot, count in enumerate(counts):
        out += target[len(out):len(out) + count]
        if slot < len(kept):
            out.append(kept[slot])
    return out


def test_edit_labels_are_an_optimal_insertion_deletion_script():
    rng = random.Random(0)
    for _ in range(400):
        alphabet = rng.randint(1, 4)  # small alphabets: many repeats and ties
        hypothesis = [rng.randint(3, 2 + alphabet) for _ in range(rng.randint(0, 7))]
        target = [rng.randint(3, 2 + alphabet) for _ in range(rng.randint(0, 7))]
        keep, counts = edit_labels(hypothesis, target)
        assert keep == edit_labels(hypothesis, target)[0]  # deterministic
        assert (len(keep) - sum(keep)) + sum(counts) == brute_force_distance(hypothesis, target)
        assert apply_labels(hypothesis, keep, counts, target) == target


def test_placeholder_row_puts_each_target_token_under_its_placeholder():
    rng = random.Random(1)
    for _ in range(100):
        target = [rng.randint(3, 6) for _ in range(rng.randint(0, 8))]
        kept = [t for t in target if rng.random() < 0.5]
        _, counts = edit_labels(kept, target)
        tokens, targets = placeholder_row(kept, counts, target, 64, 1, 2, PLH, 0)
        assert tokens.count(PLH) == len(target) - len(kept) and len(tokens) == len(targets)
        assert [g if t == PLH else t for t, g in zip(tokens, targets, strict=True)] == [1, *target, 2]
    tokens, targets = placeholder_row([5], [3, 1], [3, 4, 6, 5, 7], 2, 1, 2, PLH, 0)  # at most 2 per slot
    assert tokens == [1, PLH, PLH, 5, PLH, 2] and targets == [0, 3, 4, 0, 7, 0]


def test_random_keep_keeps_a_uniformly_random_number_of_tokens():
    real = torch.arange(6)[None] < torch.tensor([6, 3, 1, 0])[:, None]
    generator = torch.Generator().manual_seed(0)
    kept_counts = set()
    for _ in range(300):
        keep = random_keep(real, generator)
        assert not (keep & ~real).any()
        kept_counts.add(int(keep[0].sum()))
    assert kept_counts == set(range(7))  # uniform over 0..L: every count shows up


# ---- decoding ----------------------------------------------------------------------------------------

def hand_round(model: NonAutoregressiveTransformer, row: list[int], memory: torch.Tensor,
               source_mask: torch.Tensor) -> tuple[list[int], int, int]:
    """One round on one unpadded sequence, each prediction computed from the decoder states and applied with
    lists -> (new sequence, tokens deleted, placeholders inserted)."""
    c = model.config

    def states(seq: list[int]) -> torch.Tensor:  # (T, C)
        ids = torch.tensor([seq])
        inputs = model.tgt_embed(ids) * model.embed_scale
        return model.decode_hidden(inputs, torch.ones_like(ids), memory, source_mask)[0]

    heads = model.kind_heads
    h = states(row)
    delete = (h @ heads["deletion"].weight.T + heads["deletion"].bias).argmax(-1).tolist()
    kept = [row[0]] + [t for t, d in zip(row[1:-1], delete[1:-1], strict=True) if d == 0] + [row[-1]]
    h = states(kept)
    pairs = torch.cat([h[:-1], h[1:]], -1)
    counts = (pairs @ heads["placeholders"].weight.T + heads["placeholders"].bias).argmax(-1).tolist()
    room, seq = c.max_target_len - len(kept), [kept[0]]
    for count, token in zip(counts, kept[1:], strict=True):
        take = min(count, room)
        room -= take
        seq += [PLH] * take + [token]
    h = states(seq)
    logits = h @ model.lm_head.weight.T + (model.lm_head.bias if model.lm_head.bias is not None else 0)
    logits[:, c.banned_ids] = float("-inf")
    out = [fill if t == PLH else t for t, fill in zip(seq, logits.argmax(-1).tolist(), strict=True)]
    return out, len(row) - len(kept), seq.count(PLH)


def edit_happy(max_target_len: int) -> NonAutoregressiveTransformer:
    """An untrained model whose deletion and placeholder heads have large random weights: it deletes and inserts
    a lot, in every round."""
    model = tiny(max_target_len=max_target_len).eval()
    with torch.no_grad():
        for name, scale in (("deletion", 2.0), ("placeholders", 0.5)):
            model.kind_heads[name].weight.normal_(0.0, scale)
    return model


def test_one_round_applies_the_heads_predictions_as_predicted():
    model = edit_happy(24)
    rows = [[1, 5, 6, 7, 8, 2], [1, 3, 2], [1, 9, 9, 4, 10, 11, 12, 2], [1, 2]]
    source, smask = batch_of(SOURCES)
    tokens, _ = batch_of(rows)
    with torch.no_grad():
        memory = model.encode(source, smask)
        new = levenshtein_round(model, tokens, memory, smask, model.memory_kv(memory), delete=True)
        deleted = inserted = 0
        for b, row in enumerate(rows):
            width = int(smask[b].sum())
            expected, d, i = hand_round(model, row, memory[b:b + 1, :width], smask[b:b + 1, :width])
            deleted, inserted = deleted + d, inserted + i
            assert new[b, :len(expected)].tolist() == expected and (new[b, len(expected):] == 0).all()
    assert deleted > 0 and inserted > 0  # both edits happened (so the comparison covers them)


def test_a_tiny_model_overfits_a_handful_of_pairs(trained):
    _, passed = trained
    assert len(passed) == 2, "the four pairs were not decoded exactly twice in a row within 500 steps"


@pytest.mark.parametrize("which", ["lightly trained", "edit-happy"])
def test_decoding_at_batch_one_equals_decoding_in_a_padded_batch(trained, which):
    """64 sentences of 1-9 source tokens decoded together (padded, leaving the batch at different rounds; the
    edit-happy model also deletes and hits the length cap) and one by one: the same outputs and rounds."""
    model = trained[0] if which == "lightly trained" else edit_happy(16)
    rng = random.Random(0)
    sources = [[rng.randint(3, 17) for _ in range(rng.randint(1, 9))] + [2] for _ in range(64)]
    source, smask = batch_of(sources)
    batched_rounds: list[int] = []
    with torch.no_grad():
        batched = nat_decode(model, source, smask, iterations=6, rounds=batched_rounds)
        single_rounds: list[int] = []
        single = [nat_decode(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long), iterations=6,
                             rounds=single_rounds)[0] for s in sources]
    assert batched == single and batched_rounds == single_rounds
    assert len({tuple(out) for out in batched}) > 4 and len({len(out) for out in batched}) > 1  # non-trivial
    assert all(1 <= r <= 6 for r in batched_rounds)
    assert which == "lightly trained" or len(set(batched_rounds)) > 1  # (the trained one: 2 rounds for all)


def test_decoding_options_and_config_errors_are_one_line():
    from tokenloom.data.tokenizers import Tokenizer
    from tokenloom.tasks.translation import translate

    model = tiny().eval()
    tokenizer = Tokenizer.train_char("abc")
    with pytest.raises(ConfigError, match="^iterations must be >= 1, got 0$"):
        translate(model, tokenizer, ["abc"], iterations=0)
    with pytest.raises(ConfigError, match="^a levenshtein model has no length candidates"):
        translate(model, tokenizer, ["abc"], length_beam=2)
    source, smask = batch_of(SOURCES)
    with pytest.raises(GenerationError, match="^iterations must be >= 1, got 0$"):
        nat_decode(model, source, smask, iterations=0)
    with pytest.raises(GenerationError, match="its length comes from its insertions and deletions$"):
        model.length_logits(model.encode(source, smask), smask)
    with pytest.raises(ConfigError, match=r"^mask_id=-1 is outside the vocabulary \[0, 20\) \(kind levenshtein"):
        tiny(mask_id=-1)


def test_the_loss_is_the_papers_imitation_objective_written_out():
    """The training loss on a fixed batch, written out here from Gu et al. 2019 (section 3.2) with the deletions of
    fairseq's roll-in: each target y (tokens distinct here, so its alignment to a subsequence is unique) loses a
    uniformly random number k in 0..|y| of its tokens, chosen uniformly, giving y'; then (a) the placeholder
    classifier over each adjacent pair of [BOS] y' [EOS] is trained towards the number of target tokens between
    them, and the output layer at each placeholder of y' with its placeholders inserted towards the token it stands
    for; (b) the placeholders are filled with the model's own argmax, and the deletion classifier over each token
    of that sequence is trained to delete what an optimal alignment to y does not keep (the expert, edit_labels,
    tested for optimality above). The loss is the sum of the three mean cross-entropies."""
    from nat_pairs import pair_batch
    from torch.nn import functional as F

    from tokenloom.models.nat_kinds.levenshtein import (
        decoder_states,
        deletion_logits,
        placeholder_logits,
        token_logits,
    )
    from tokenloom.tasks.nat import NATTranslationTask

    targets = [[5, 4, 3], [7, 6, 9], [11, 10, 9, 8], [3, 12]]  # no token twice in a target
    model = tiny().train()
    loss, count, _ = NATTranslationTask.nat_loss(model, pair_batch(SOURCES, targets), 0.0,
                                                 torch.Generator().manual_seed(5))

    gen = torch.Generator().manual_seed(5)  # the roll-in's draws, in the loss's order: counts, then scores
    L = max(len(t) for t in targets)
    u, scores = torch.rand(len(targets), generator=gen), torch.rand(len(targets), L, generator=gen)
    source, smask = batch_of(SOURCES)
    memory = model.encode(source, smask)
    placeholder_terms, token_terms, deletion_terms = [], [], []
    for i, y in enumerate(targets):
        k = min(int(u[i] * (len(y) + 1)), len(y))
        kept_at = sorted(sorted(range(len(y)), key=lambda j: float(scores[i, j]))[:k])
        bounds = [-1, *kept_at, len(y)]
        gaps = [bounds[s + 1] - bounds[s] - 1 for s in range(len(bounds) - 1)]  # target tokens between neighbours
        mem, sm = memory[i:i + 1], smask[i:i + 1]
        deleted = torch.tensor([[1, *(y[j] for j in kept_at), 2]])
        pair = placeholder_logits(model, decoder_states(model, deleted, mem, sm))[0].float()
        placeholder_terms += [F.cross_entropy(pair[s:s + 1], torch.tensor([g])) for s, g in enumerate(gaps)]
        with_plh = [1]
        for s, gap in enumerate(gaps):
            with_plh += [PLH] * gap + ([y[kept_at[s]]] if s < len(kept_at) else [])
        with_plh.append(2)
        where = torch.tensor([[t == PLH for t in with_plh]])
        logits = token_logits(model, decoder_states(model, torch.tensor([with_plh]), mem, sm), where).float()
        wanted = [y[j] for j in range(len(y)) if j not in kept_at]
        token_terms += [F.cross_entropy(logits[p:p + 1], torch.tensor([w])) for p, w in enumerate(wanted)]
        fill = logits.detach().clone()
        fill[:, model.config.banned_ids] = float("-inf")
        filled = torch.tensor([with_plh]).masked_scatter(where, fill.argmax(-1))
        keep, _ = edit_labels(filled[0, 1:-1].tolist(), y)
        delete = deletion_logits(model, decoder_states(model, filled, mem, sm))[0, 1:-1].float()
        deletion_terms += [F.cross_entropy(delete[p:p + 1], torch.tensor([int(not kept)]))
                           for p, kept in enumerate(keep)]
    expected = sum(torch.stack(terms).mean() for terms in (placeholder_terms, token_terms, deletion_terms))
    assert count == sum(len(y) for y in targets)
    assert torch.allclose(loss, expected, atol=1e-5)
