import pytest
import torch
from torch.nn import functional as F

from tokenloom.tasks import cross_entropy


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothing_matches_formula_and_torch(eps):
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 5))
    logp = logits.log_softmax(-1)
    nll = -logp.gather(-1, targets[..., None]).squeeze(-1)
    uniform = -logp.mean(-1)
    formula = ((1 - eps) * nll + eps * uniform).mean()
    got = cross_entropy(logits, targets, label_smoothing=eps)
    assert torch.allclose(got, formula, atol=1e-6)
    assert torch.allclose(got, F.cross_entropy(logits.view(-1, 11), targets.view(-1), label_smoothing=eps))


def test_ignore_index_excluded():
    logits = torch.randn(2, 4, 7)
    targets = torch.randint(0, 7, (2, 4))
    targets[1, 2:] = -100
    keep = targets != -100
    expected = F.cross_entropy(logits[keep], targets[keep])
    assert torch.allclose(cross_entropy(logits, targets), expected)
