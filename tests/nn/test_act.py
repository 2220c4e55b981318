"""Adaptive Computation Time (tokenloom/nn/act.py): the halting weights sum to one, N, R and the ponder count are
Graves' formulas, and the ponder cost's gradient reaches the probabilities of the steps before halting."""

import pytest
import torch

from tokenloom.nn.act import HaltingUnit, act_step, adaptive_computation


@pytest.mark.parametrize("steps, eps, scale", [(1, 0.01, 1.0), (4, 0.01, 1.0), (6, 0.1, 0.3), (8, 0.01, 0.05)])
def test_halting_weights_sum_to_one_and_weigh_the_states(steps, eps, scale):
    gen = torch.Generator().manual_seed(steps)
    probs = torch.rand(steps, 3, 5, generator=gen) * scale  # scale < 1: many positions reach the last step
    states = torch.randn(steps, 3, 5, 4, generator=gen)
    out = adaptive_computation(probs, states, eps)
    torch.testing.assert_close(out.weights.sum(0), torch.ones(3, 5), atol=1e-6, rtol=0)
    assert (out.weights >= 0).all()
    torch.testing.assert_close(out.output, (out.weights[..., None] * states).sum(0), atol=1e-6, rtol=1e-6)
    # a position takes N steps: weights after its halting step are zero, the steps before have weight p
    n = out.steps.long()
    assert ((n >= 1) & (n <= steps)).all()
    index = torch.arange(steps)[:, None, None]
    assert (out.weights[index >= n] == 0).all()
    torch.testing.assert_close(out.weights[index < n - 1], probs[index < n - 1])
    assert ((out.remainder > 0) & (out.remainder <= 1)).all()
    torch.testing.assert_close(out.ponder, out.steps + out.remainder)


def test_ponder_equals_n_plus_r_on_a_constructed_example():
    # position 0: 0.3 + 0.5 = 0.8 < 0.99, + 0.4 >= 0.99 -> N = 3, R = 1 - 0.8 = 0.2
    # position 1: 0.995 >= 0.99 at once -> N = 1, R = 1
    # position 2: never reaches 0.99 in 4 steps -> N = 4 (the last), R = 1 - 0.3 = 0.7
    probs = torch.tensor([[0.3, 0.995, 0.1], [0.5, 0.2, 0.1], [0.4, 0.9, 0.1], [0.9, 0.9, 0.1]],
                         requires_grad=True)  # (S=4, 3)
    states = torch.arange(4.0)[:, None, None].expand(4, 3, 1)  # state of step n is n (0-indexed)
    out = adaptive_computation(probs, states, eps=0.01)
    torch.testing.assert_close(out.steps, torch.tensor([3.0, 1.0, 4.0]))
    torch.testing.assert_close(out.remainder, torch.tensor([0.2, 1.0, 0.7]))
    torch.testing.assert_close(out.ponder, torch.tensor([3.2, 2.0, 4.7]))
    torch.testing.assert_close(out.weights, torch.tensor([[0.3, 1.0, 0.1], [0.5, 0.0, 0.1], [0.2, 0.0, 0.1],
                                                          [0.0, 0.0, 0.7]]))
    torch.testing.assert_close(out.output[:, 0], torch.tensor([0.5 + 0.4, 0.0, 0.1 + 0.2 + 2.1]))
    # the ponder cost's gradient: d(N + R)/dp = -1 for the steps before halting, 0 elsewhere (N has none)
    out.ponder.sum().backward()
    torch.testing.assert_close(probs.grad, torch.tensor([[-1.0, 0.0, -1.0], [-1.0, 0.0, -1.0], [0.0, 0.0, -1.0],
                                                         [0.0, 0.0, 0.0]]))


def test_act_step_keeps_halted_positions_out_of_later_steps():
    acc = act_step(None, torch.tensor([0.995, 0.2]), torch.ones(2, 3))
    assert acc.running.tolist() == [False, True] and acc.ran.tolist() == [True, True]
    acc = act_step(acc, torch.tensor([0.9, 0.9]), 2 * torch.ones(2, 3), last=True)
    assert acc.ran.tolist() == [False, True] and not acc.running.any()
    torch.testing.assert_close(acc.weight, torch.tensor([0.0, 0.8]))
    torch.testing.assert_close(acc.output[:, 0], torch.tensor([1.0, 0.2 + 1.6]))


def test_halting_unit_starts_at_its_bias():
    unit = HaltingUnit(8, bias=2.0)
    torch.nn.init.zeros_(unit.proj.weight)
    p = unit(torch.randn(3, 5, 8))
    assert p.shape == (3, 5)
    torch.testing.assert_close(p, torch.full((3, 5), torch.sigmoid(torch.tensor(2.0)).item()))
