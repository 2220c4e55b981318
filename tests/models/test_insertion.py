"""The Insertion Transformer (kind ``insertion``): the balanced-binary-tree loss against its formula, parallel
insertion with an oracle in log2 rounds, a tiny model overfitting a handful of pairs, padding-invariant decoding."""

from __future__ import annotations

import math

import pytest
import torch
from nat_pairs import batch_of, train_until_decoded  # tests/models is on sys.path (prepend mode)
from torch.nn import functional as F

from tokenloom.errors import ConfigError, GenerationError
from tokenloom.generation.insertion import insert_tokens, insertion_loop
from tokenloom.generation.nat import nat_decode
from tokenloom.models import NATConfig, NonAutoregressiveTransformer
from tokenloom.models.nat_kinds.insertion import TAU, hypotheses, random_kept, slot_logits, tree_loss, tree_weights
from tokenloom.tasks.translation import check_decoding_options

V = 24  # ids: 0 pad, 1 bos, 2 eos, 3..21 words, 22 <mask>, 23 <end-of-slot> (the <blank> id)
END = 23
SOURCES = [[3, 4, 5, 2], [6, 7, 2], [8, 9, 10, 11, 12, 2], [13, 3, 2]]
TARGETS = [[5, 4, 3], [7, 6, 6], [12, 11, 10, 9, 8], [3]]  # "reverse the words" (with a repeat)


def tiny(**overrides) -> NonAutoregressiveTransformer:
    kw = dict(vocab_size=V, encoder_layers=1, decoder_layers=1, num_heads=2, embed_dim=32, max_source_len=12,
              max_target_len=12, dropout=0.0, norm_placement="pre", kind="insertion", mask_id=22, blank_id=END)
    torch.manual_seed(0)
    return NonAutoregressiveTransformer(NATConfig(**{**kw, **overrides}))


def spans_of(kept: list[bool]) -> list[list[int]]:
    """The target positions missing in each slot of a partial hypothesis (slot l: after the l-th kept token)."""
    spans: list[list[int]] = [[]]
    for i, k in enumerate(kept):
        if k:
            spans.append([])
        else:
            spans[-1].append(i)
    return spans


def formula_weights(span: list[int], tau: float) -> list[float]:
    """w(i) = exp(-|(i_l + j_l) / 2 - i| / tau) / sum over the span, written out."""
    centre = (span[0] + span[-1]) / 2
    scores = [math.exp(-abs(centre - i) / tau) for i in span]
    return [s / sum(scores) for s in scores]


# ---- the balanced-binary-tree loss ------------------------------------------------------------------

KEPT = [  # kept patterns over 9 target positions (False past a row's length: padding)
    [False] * 9,  # one span of 9 (odd)
    [True, False, False, False, False, True, True, False, False],  # spans 0, 4 (even), 0, 2
    [True, True, False, False, False, True, False, False, False],  # spans 0, 0, 3 (odd), 3
    [False, True, True, True, True, True, True, True, False],  # spans 1, 0 x 6, 1
]
LENGTHS = [9, 9, 7, 9]


@pytest.mark.parametrize("tau", [TAU, 0.5, 3.0])
def test_tree_weights_equal_the_formula(tau):
    kept = torch.tensor(KEPT)
    real = torch.arange(9)[None] < torch.tensor(LENGTHS)[:, None]
    kept &= real
    slot, weights = tree_weights(kept, real, tau)
    checked = 0
    for b in range(4):
        expected = [0.0] * 9
        spans = spans_of(kept[b, :LENGTHS[b]].tolist())
        for number, span in enumerate(spans):
            if span:
                for i, w in zip(span, formula_weights(span, tau), strict=True):
                    expected[i] = w
                    assert int(slot[b, i]) == number
                    checked += 1
        assert weights[b].tolist() == pytest.approx(expected, abs=1e-6)
    assert checked == 9 + 6 + 4 + 2  # the missing tokens of each row
    if tau == 1.0:  # by hand: an even span's two middle tokens share the top weight, an odd one's centre has it
        e = math.exp(-1.0)
        even = [e / (2 + 2 * e), 1 / (2 + 2 * e), 1 / (2 + 2 * e), e / (2 + 2 * e)]
        assert weights[1, 1:5].tolist() == pytest.approx(even, abs=1e-6)
        assert weights[2, 2:5].tolist() == pytest.approx([e / (1 + 2 * e), 1 / (1 + 2 * e), e / (1 + 2 * e)])


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_tree_loss_equals_the_slot_losses_written_out(label_smoothing):
    torch.manual_seed(0)
    tokens = torch.randint(3, 20, (4, 9)) * (torch.arange(9)[None] < torch.tensor(LENGTHS)[:, None])
    real = tokens != 0
    kept = torch.tensor(KEPT) & real
    slots = int(kept.sum(1).max()) + 1
    logits = torch.randn(4, slots, V)
    loss = tree_loss(logits, tokens, kept, real, END, label_smoothing)
    log_probs = F.log_softmax(logits, -1)
    total, count = 0.0, 0
    for b in range(4):
        for number, span in enumerate(spans_of(kept[b, :LENGTHS[b]].tolist())):
            lp = log_probs[b, number]
            if span:
                nll = -sum(w * lp[int(tokens[b, i])] for i, w in zip(span, formula_weights(span, TAU), strict=True))
            else:
                nll = -lp[END]
            total += (1 - label_smoothing) * float(nll) + label_smoothing * float(-lp.mean())
            count += 1
    assert count == sum(int(k) + 1 for k in kept.sum(1))  # every row's k_i + 1 slots, the empty ones included
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


def test_partial_hypotheses_keep_a_uniform_number_of_tokens_in_order():
    real = torch.arange(6)[None] < torch.tensor([6, 3, 1])[:, None]
    tokens = (torch.arange(6) + 3)[None].expand(3, 6) * real
    generator = torch.Generator().manual_seed(0)
    counts = set()
    for _ in range(300):
        kept = random_kept(real, limit=10, generator=generator)
        assert not (kept & ~real).any()
        counts.add(int(kept[0].sum()))
        hyp = hypotheses(tokens, kept, 1, 2, 0)
        for b in range(3):
            assert [t for t in hyp[b].tolist() if t] == [1, *tokens[b][kept[b]].tolist(), 2]
    assert counts == set(range(7))  # k uniform over 0..n: every count shows up
    assert all(int(random_kept(real, limit=4)[0].sum()) <= 4 for _ in range(50))  # room for BOS and EOS


def test_slot_representation_is_the_linear_map_of_adjacent_states_then_the_output_layer():
    model = tiny()
    hidden = torch.randn(2, 5, 32)
    head = model.kind_heads["slot"]
    with torch.no_grad():
        logits = slot_logits(model, hidden)
        for b in range(2):
            for slot in range(4):
                pair = torch.cat([hidden[b, slot], hidden[b, slot + 1]])
                expected = model.lm_head(head.weight @ pair + head.bias)
                torch.testing.assert_close(logits[b, slot], expected, atol=1e-5, rtol=1e-5)


# ---- parallel insertion ------------------------------------------------------------------------------

def centre_oracle(targets: list[list[int]]):
    """A stand-in for the model's slot argmax: each slot picks the centre token (the left one of an even span) of
    what is missing there from its sentence's target (distinct ids), or <end-of-slot>."""

    def pick(rows: torch.Tensor, hyps: torch.Tensor) -> torch.Tensor:
        out = torch.full((hyps.shape[0], hyps.shape[1] - 1), END)
        for n, b in enumerate(rows.tolist()):
            target = targets[b]
            where = {t: i for i, t in enumerate(target)}
            hyp = [t for t in hyps[n].tolist() if t != 0]
            places = [-1] + [where[t] for t in hyp[1:-1]] + [len(target)]
            for slot in range(len(hyp) - 1):
                start, end = places[slot] + 1, places[slot + 1] - 1
                if start <= end:
                    out[n, slot] = target[(start + end) // 2]
        return out

    return pick


def run(targets, iterations=100, max_len=100):
    return insertion_loop(centre_oracle(targets), len(targets), bos_id=1, eos_id=2, pad_id=0, end_id=END,
                          iterations=iterations, max_len=max_len)


def test_insert_tokens_places_each_token_in_its_slot():
    hyps = torch.tensor([[1, 5, 2, 0], [1, 6, 7, 2]])
    picks = torch.tensor([[8, 9, 4], [10, 11, 12]])
    insert = torch.tensor([[True, True, False], [False, True, True]])  # row 0's third slot is padding
    out, lengths = insert_tokens(hyps, torch.tensor([3, 4]), picks, insert, 0)
    assert out.tolist() == [[1, 8, 5, 9, 2, 0], [1, 6, 11, 7, 12, 2]] and lengths.tolist() == [5, 6]


def test_the_centre_oracle_rebuilds_a_sequence_in_log2_rounds():
    """Balanced-tree insertion of n tokens needs ceil(log2(n + 1)) rounds (plus one pass where every slot says
    <end-of-slot>); one round fewer leaves it incomplete. All n together in one batch leave it at different rounds,
    with the same results."""
    targets = [list(range(3, 3 + n)) for n in range(1, 21)]
    results, rounds = run(targets)
    assert results == targets
    assert rounds == [math.ceil(math.log2(n + 1)) + 1 for n in range(1, 21)]
    for target in targets:
        needed = math.ceil(math.log2(len(target) + 1))
        assert run([target], iterations=needed) == ([target], [needed])
        if needed > 1:
            short, used = run([target], iterations=needed - 1)
            assert short != [target] and used == [needed - 1]
        assert run([target]) == ([target], [needed + 1])  # one by one == in the batch


def test_decoding_stops_at_the_decoder_positions_keeping_the_leftmost_insertions():
    target = list(range(3, 21))
    results, rounds = run([target], max_len=8)  # room for 6 tokens + BOS + EOS
    # target positions 0..17: round 1 inserts 8, round 2 inserts 3 and 13; round 3 wants 1, 5, 10 and 15 but has
    # room for 3: the leftmost, 1, 5 and 10; then the hypothesis is full
    assert results == [[target[i] for i in (1, 3, 5, 8, 10, 13)]] and rounds == [3]


# ---- a tiny model ------------------------------------------------------------------------------------

def train(model: NonAutoregressiveTransformer, max_steps: int, every: int = 10) -> list[int]:
    """Train with the kind's loss (through the task) on the pairs until decoding reproduces them twice in a row
    (``every`` steps apart) or ``max_steps``; returns the steps of the passing checks."""
    return train_until_decoded(model, SOURCES, TARGETS, max_steps, every=every, iterations=8)


@pytest.fixture(scope="module")
def trained() -> NonAutoregressiveTransformer:
    model = tiny()
    assert len(train(model, 600)) == 2, "the pairs were not decoded exactly twice in a row within 600 steps"
    return model.eval()


def test_a_tiny_model_overfits_a_handful_of_pairs_in_about_log2_rounds(trained):
    source, smask = batch_of(SOURCES)
    rounds: list[int] = []
    with torch.no_grad():
        assert nat_decode(trained, source, smask, rounds=rounds) == TARGETS
    for used, target in zip(rounds, TARGETS, strict=True):  # between a balanced tree and one token a round
        assert math.ceil(math.log2(len(target) + 1)) + 1 <= used <= len(target) + 1
    assert rounds[3] == 2


def test_batched_decoding_equals_one_by_one(trained):
    """Padding (of the sources, and of the hypotheses as sentences of different lengths finish) changes nothing:
    on the trained model and on a lightly trained one, whose outputs run to different lengths and rounds."""
    light = tiny()
    train(light, 20, every=1000)
    sources = SOURCES + [[9, 3, 7, 12, 5, 2], [4, 2], [11, 11, 6, 8, 3, 10, 2]]
    for model in (trained, light.eval()):
        source, smask = batch_of(sources)
        rounds: list[int] = []
        with torch.no_grad():
            batched = nat_decode(model, source, smask, rounds=rounds)
            single_rounds: list[int] = []
            single = [nat_decode(model, *batch_of([s]), rounds=single_rounds)[0] for s in sources]
        assert batched == single and rounds == single_rounds
    assert len({len(t) for t in batched}) > 1


def test_options_and_their_errors():
    model = tiny()
    source, smask = batch_of(SOURCES)
    with pytest.raises(GenerationError, match="^iterations must be >= 1, got 0$"):
        nat_decode(model, source, smask, iterations=0)
    with pytest.raises(ConfigError, match="^iterations must be >= 1, got 0$"):
        check_decoding_options(model, iterations=0)  # translate's check
    assert check_decoding_options(model) == {"iterations": 64}
    with pytest.raises(ConfigError, match="length beam and rescoring do not apply"):
        check_decoding_options(model, length_beam=2)
    with pytest.raises(ConfigError, match=r"^blank_id=-1 is outside the vocabulary \[0, 24\) \(kind insertion"):
        tiny(blank_id=-1)
    assert model.length_head is None and model.config.banned_ids == [0, 1, 2, 22]  # <end-of-slot> is kept
    with pytest.raises(GenerationError, match="no length predictor: its length comes from its insertions$"):
        model.length_logits(torch.zeros(1, 2, 32), torch.ones(1, 2))
