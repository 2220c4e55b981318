"""Glancing training (GLAT) for the single-pass kinds nat and ctc: zero glances is plain training, the glance
count and positions follow the definition, glancing CTC's alignment is the most probable one, and a glancing
model still learns."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from nat_pairs import batch_of, pair_batch  # tests/models is on sys.path (prepend mode)
from test_nat import SOURCES, TARGETS, _train_until_decoded, tiny
from torch.nn import functional as F

from tokenloom.errors import ConfigError
from tokenloom.models.nat_kinds import NAT_KINDS
from tokenloom.models.nat_kinds.ctc import ctc_collapse
from tokenloom.models.nat_kinds.glancing import choose_positions, ctc_best_alignment, glance_counts
from tokenloom.tasks.nat import NATTranslationTask


def _loss_and_grads(model, batch) -> tuple[float, list[torch.Tensor]]:
    model.train()
    model.zero_grad()
    loss, _, _ = NATTranslationTask.nat_loss(model, batch, 0.1, torch.Generator().manual_seed(3))
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["nat", "ctc"])
def test_glancing_zero_tokens_equals_plain_training(kind):
    """A ratio so small that floor(ratio * d) is 0 for every sentence runs the whole glancing path (first
    pass, counts, positions, input replacement) and must give plain training's loss and gradients exactly; a ratio
    that glances does not."""
    batch = pair_batch(SOURCES, TARGETS)
    plain, plain_grads = _loss_and_grads(tiny(kind), batch)
    zero, zero_grads = _loss_and_grads(tiny(kind, glancing_ratio=1e-6), batch)
    assert zero == plain
    assert len(zero_grads) == len(plain_grads)
    for a, b in zip(zero_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    glancing, _ = _loss_and_grads(tiny(kind, glancing_ratio=1.0), batch)
    assert glancing != plain  # an untrained model is wrong almost everywhere: it glances


def test_glance_counts_follow_the_definition():
    torch.manual_seed(0)
    for ratio in (0.0, 0.3, 0.5, 1.0):
        predicted = torch.randint(0, 4, (6, 9))
        reference = torch.randint(0, 4, (6, 9))
        lengths = torch.randint(1, 10, (6,))
        real = torch.arange(9)[None] < lengths[:, None]
        counts = glance_counts(predicted, reference, real, ratio)
        for b in range(6):
            d = sum(int(predicted[b, t] != reference[b, t]) for t in range(int(lengths[b])))
            assert int(counts[b]) == math.floor(ratio * d)


def test_choose_positions_takes_exactly_the_count_uniformly_among_real_positions():
    real = torch.tensor([[True] * 5 + [False] * 3, [True] * 8, [True] * 2 + [False] * 6])
    counts = torch.tensor([2, 8, 5])  # the last asks for more than it has: all of them
    generator = torch.Generator().manual_seed(0)
    tally = torch.zeros(3, 8)
    draws = 3000
    for _ in range(draws):
        chosen = choose_positions(real, counts, generator)
        assert not (chosen & ~real).any()
        assert chosen.sum(1).tolist() == [2, 8, 2]
        tally += chosen.float()
    frequency = tally / draws
    torch.testing.assert_close(frequency[0, :5], torch.full((5,), 0.4), atol=0.04, rtol=0)  # 2 of 5 each


def test_nat_glanced_positions_read_their_target_and_leave_the_loss():
    """Kind nat: the training inputs at glanced positions are the target embeddings, elsewhere the uniform copy;
    glanced targets become padding; as many are glanced as the definition says, counted from an independent
    first pass."""
    model = tiny("nat", glancing_ratio=0.5).train()
    batch = pair_batch(SOURCES, TARGETS)
    source, smask = batch.source, batch.source_mask
    tokens = batch.target_in[:, 1:]
    lengths = batch.target_mask.sum(1) - 1
    copy_inputs, decoder_mask = model.decoder_inputs(source, smask, lengths)
    memory = model.encode(source, smask)
    with torch.no_grad():
        predicted = model.decode_parallel(copy_inputs, decoder_mask, memory, smask).argmax(-1)
    real = decoder_mask.bool()
    inputs, mask, targets = NAT_KINDS.get("nat").training_inputs(model, source, smask, tokens, lengths,
                                                                 torch.Generator().manual_seed(1), memory)
    chosen = (targets == model.config.pad_id) & real
    embedded = model.scale_embeddings(model.tgt_embed(tokens))
    for b in range(len(TARGETS)):
        d = int(((predicted[b] != tokens[b]) & real[b]).sum())
        assert int(chosen[b].sum()) == math.floor(0.5 * d)
        for t in range(int(lengths[b])):
            expected = embedded[b, t] if chosen[b, t] else copy_inputs[b, t]
            torch.testing.assert_close(inputs[b, t], expected)
    assert torch.equal(mask, decoder_mask)
    assert torch.equal(targets[~chosen], tokens[~chosen])


def _path_score(log_probs: torch.Tensor, path: list[int]) -> float:
    return sum(float(log_probs[t, label]) for t, label in enumerate(path))


@pytest.mark.parametrize("seed", range(6))
def test_ctc_best_alignment_is_the_most_probable_path(seed):
    """Viterbi against brute force: every path over {blank, the target's tokens} of the row's length that
    collapses to the target, the best one's score; the returned path collapses to the target and scores it."""
    generator = torch.Generator().manual_seed(seed)
    blank, V = 5, 6
    targets = [[1, 2], [3, 3], [4], [2, 1, 2]]  # a repeat needs a blank between
    lengths = [5, 5, 3, 6]
    T = max(lengths)
    log_probs = F.log_softmax(torch.randn(len(targets), T, V, generator=generator), dim=-1)
    padded, _ = batch_of(targets)
    path = ctc_best_alignment(log_probs, torch.tensor(lengths), padded, torch.tensor([len(t) for t in targets]),
                              blank)
    for b, (target, length) in enumerate(zip(targets, lengths, strict=True)):
        labels = sorted(set(target)) + [blank]
        best = max(_path_score(log_probs[b], list(p)) for p in itertools.product(labels, repeat=length)
                   if ctc_collapse(list(p), blank) == target)
        found = path[b, :length].tolist()
        assert ctc_collapse(found, blank) == target
        assert _path_score(log_probs[b], found) == pytest.approx(best, abs=1e-5)
        assert (path[b, length:] == blank).all()


@pytest.mark.parametrize("kind,max_steps", [("nat", 400), ("ctc", 500)])
def test_a_glancing_model_overfits_a_handful_of_pairs(kind, max_steps):
    passed = _train_until_decoded(tiny(kind, glancing_ratio=0.5), max_steps)
    assert len(passed) == 2, f"glancing {kind}: not decoded exactly twice in a row within {max_steps} steps"


def test_glancing_ratio_errors_name_the_field_and_the_kinds():
    with pytest.raises(ConfigError, match=r"glancing_ratio must be in \[0, 1\], got 1.5"):
        tiny("nat", glancing_ratio=1.5)
    with pytest.raises(ConfigError, match=r"glancing_ratio=0.5 applies to kinds .*ctc.*nat.*this model is cmlm"):
        tiny("cmlm", glancing_ratio=0.5)
