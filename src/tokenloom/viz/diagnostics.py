"""Checks on captured attention: :func:`causal_check` and per-head :func:`head_diagnostics`.

Shapes: probabilities (B, H, Tq, Tk), as :func:`tokenloom.viz.capture_attention` returns them; queries are
aligned to the last keys (query i is position i + Tk - Tq), as in a causal model with or without a cache.
``query_mask`` (B, Tq) marks real query rows (False = padding, whose rows are not inspected).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

UNIFORM_ENTROPY = 0.9  # mean normalised entropy from which a head counts as near-uniform
COLLAPSED_MASS = 0.9  # mean top probability from which a head counts as collapsed (one key takes it all)


def _rows(probs: Tensor, query_mask: Tensor | None) -> Tensor:
    """(B, Tq) bool: the query rows to inspect."""
    B, _, Tq, _ = probs.shape
    if query_mask is None:
        return torch.ones(B, Tq, dtype=torch.bool, device=probs.device)
    return query_mask.bool()


def above_diagonal(probs: Tensor) -> Tensor:
    """(B, H, Tq) probability mass each query puts on keys after its own position."""
    Tq, Tk = probs.shape[-2:]
    future = torch.ones(Tq, Tk, dtype=torch.bool, device=probs.device).triu(Tk - Tq + 1)
    return (probs * future).sum(-1)


@dataclass
class CausalResult:
    """The causal check of one layer: ``max_mass`` is the largest mass any real query of any head puts on
    later positions (exactly 0.0 in a correctly masked causal layer); ``heads`` lists the heads that leak."""

    layer: int
    max_mass: float
    heads: list[int]

    @property
    def passed(self) -> bool:
        return self.max_mass == 0.0


def causal_check(probs: Tensor, layer: int = 0, query_mask: Tensor | None = None) -> CausalResult:
    """Whether ``probs`` (B, H, Tq, Tk) is strictly causal: no real query attends to a later position."""
    mass = above_diagonal(probs) * _rows(probs, query_mask)[:, None]  # (B, H, Tq)
    per_head = mass.amax(dim=(0, 2))  # (H,)
    leaking = (per_head > 0).nonzero().flatten().tolist()
    return CausalResult(layer=layer, max_mass=float(per_head.max()), heads=leaking)


@dataclass
class HeadStats:
    """Per-head averages over the real query rows that may attend to at least two keys."""

    layer: int
    head: int
    entropy: float  # nats
    normalized_entropy: float  # entropy / ln(keys the row may attend): 1 = uniform, 0 = one-hot
    max_prob: float  # the largest probability of a row
    previous_token: float  # mass on the position just before the query's own
    first_token: float  # mass on the first real key of the row
    diagonal: float  # mass on the query's own position
    flags: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def head_diagnostics(probs: Tensor, layer: int = 0, query_mask: Tensor | None = None,
                     key_mask: Tensor | None = None, causal: bool = False) -> list[HeadStats]:
    """One :class:`HeadStats` per head of ``probs`` (B, H, Tq, Tk). The keys a row may attend: all, or those at
    or before its own position when ``causal``, less the padding in ``key_mask`` (B, Tk) (False = padding).
    Flags: ``uniform`` (normalised entropy >= :data:`UNIFORM_ENTROPY`), ``collapsed`` (mean top probability >=
    :data:`COLLAPSED_MASS`), with the key it collapses onto when previous / first / diagonal takes that mass."""
    probs = probs.float()
    B, H, Tq, Tk = probs.shape
    allowed = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=probs.device)
    if causal:
        allowed = allowed & torch.ones(Tq, Tk, dtype=torch.bool, device=probs.device).tril(Tk - Tq)
    if key_mask is not None:
        allowed = allowed & key_mask.bool()[:, None, None, :]
    count = allowed.sum(-1).expand(B, H, Tq)  # (B, H, Tq) keys each row may attend
    rows = _rows(probs, query_mask)[:, None] & (count >= 2)  # (B, H, Tq)
    weight = rows.float()
    total = weight.sum(dim=(0, 2)).clamp(min=1)  # (H,)

    def mean(x: Tensor) -> Tensor:  # (B, H, Tq) -> (H,) over the inspected rows
        return (x * weight).sum(dim=(0, 2)) / total

    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)  # (B, H, Tq)
    normalized = entropy / count.clamp(min=2).float().log()
    offset = Tk - Tq
    index = torch.arange(Tq, device=probs.device) + offset  # each query's own key position
    diagonal = probs.diagonal(offset=offset, dim1=-2, dim2=-1)  # (B, H, Tq)
    previous = torch.zeros_like(diagonal)
    has_previous = index >= 1
    if has_previous.any():
        previous[..., has_previous] = probs[..., has_previous, :].gather(
            -1, (index[has_previous] - 1).view(1, 1, -1, 1).expand(B, H, -1, 1)).squeeze(-1)
    first_key = allowed.float().argmax(-1, keepdim=True).expand(B, H, Tq, 1)  # the first key each row may attend
    first = probs.gather(-1, first_key).squeeze(-1)
    stats = {name: mean(x) for name, x in dict(entropy=entropy, normalized_entropy=normalized,
                                               max_prob=probs.amax(-1), previous_token=previous,
                                               first_token=first, diagonal=diagonal).items()}
    back = index.view(1, 1, -1) - probs.argmax(-1)  # (B, H, Tq): how far back each row's top key lies
    out = []
    for h in range(H):
        values = {name: float(v[h]) for name, v in stats.items()}
        flags = []
        if values["normalized_entropy"] >= UNIFORM_ENTROPY:
            flags.append("uniform")
        if values["max_prob"] >= COLLAPSED_MASS:
            onto = [name.replace("_", " ") for name in ("previous_token", "first_token", "diagonal")
                    if values[name] >= COLLAPSED_MASS]
            if not onto and rows[:, h].any():  # the usual distance back of the top key, e.g. "2 back"
                distance = int(back[:, h][rows[:, h]].mode().values)
                onto = [f"{distance} back" if distance > 0 else f"{-distance} ahead"]
            flags.append("collapsed" + (f" ({onto[0]})" if onto else ""))
        if not math.isfinite(values["entropy"]):
            flags.append("non-finite")
        out.append(HeadStats(layer=layer, head=h, flags=flags, **values))
    return out
