import math

import pytest
import torch

from tokenloom.nn import POSITIONS, apply_rotary
from tokenloom.nn.positions import alibi_slopes, sinusoid_table, t5_bucket


def test_rope_scores_depend_only_on_offset():
    rope = POSITIONS.get("rope")(embed_dim=32, num_heads=2, head_dim=16, max_seq_len=64)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        cq, sq = rope.rotary(torch.tensor([[i]]))
        ck, sk = rope.rotary(torch.tensor([[j]]))
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum().item()

    assert score(5, 2) == pytest.approx(score(40, 37), abs=1e-4)
    assert score(10, 10) == pytest.approx((q * k).sum().item(), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)


def test_rope_preserves_norm():
    rope = POSITIONS.get("rope")(embed_dim=32, num_heads=2, head_dim=16, max_seq_len=64)
    x = torch.randn(2, 2, 7, 16)
    cos, sin = rope.rotary(torch.arange(7)[None].expand(2, 7))
    assert torch.allclose(apply_rotary(x, cos, sin).norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_sinusoid_table_formula():
    t = sinusoid_table(50, 16)
    pos, i = 7, 3
    assert t[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / 16)), abs=1e-6)
    assert t[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / 16)), abs=1e-6)


def test_alibi_slopes_match_paper():
    assert alibi_slopes(8).tolist() == pytest.approx([2 ** -(i + 1) for i in range(8)])
    assert len(alibi_slopes(6)) == 6


def test_alibi_bias_is_linear_in_distance():
    alibi = POSITIONS.get("alibi")(embed_dim=16, num_heads=4, head_dim=4, max_seq_len=16)
    idx = torch.arange(6)
    b = alibi.bias(idx, idx)
    assert b.shape == (1, 4, 6, 6)
    assert b[0, 0, 5, 2].item() == pytest.approx(-0.25 * 3)  # slope of head 0 with 4 heads: 2^-2


def test_t5_buckets_exact_then_log():
    rel = torch.arange(0, -200, -1)
    b = t5_bucket(rel, bidirectional=False, num_buckets=32, max_distance=128)
    assert b[:16].tolist() == list(range(16))
    assert b[-1].item() == 31 and (b.diff() >= 0).all()
    both = t5_bucket(torch.tensor([-3, 3]), bidirectional=True, num_buckets=32, max_distance=128)
    assert both[0] != both[1]
