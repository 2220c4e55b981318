"""What the non-autoregressive kinds' tests share (imported by module name: tests/models is on sys.path in pytest's
prepend import mode): padding a few pairs into a batch, and training a tiny model on them until it decodes them."""

from __future__ import annotations

import torch

from tokenloom.data.parallel import ParallelBatch
from tokenloom.generation.nat import nat_decode
from tokenloom.models import NonAutoregressiveTransformer
from tokenloom.tasks.nat import NATTranslationTask


def batch_of(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids right-padded with 0 -> (ids (B, T), mask (B, T))."""
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    return ids, (ids != 0).long()


def pair_batch(sources: list[list[int]], targets: list[list[int]]) -> ParallelBatch:
    """The pairs as the translation task batches them (targets after BOS = 1)."""
    source, smask = batch_of(sources)
    target_in, tmask = batch_of([[1] + t for t in targets])
    return ParallelBatch(source, smask, target_in, target_in, tmask, int(tmask.sum()), torch.arange(len(sources)))


def train_until_decoded(model: NonAutoregressiveTransformer, sources: list[list[int]], targets: list[list[int]],
                        max_steps: int, *, every: int = 0, label_smoothing: float = 0.0, **decode: int) -> list[int]:
    """Up to ``max_steps`` AdamW steps of the model's kind's loss (through the task) on the pairs; with ``every``,
    stop once two checks in a row (``every`` steps apart) decode every pair exactly (``nat_decode`` with the
    options ``decode``), returning the steps of those checks. Stopping on success instead of after a fixed number
    of steps keeps the verdict off the trajectory's details (which differ with the CPU's kernels). The model is
    left in eval mode."""
    batch = pair_batch(sources, targets)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    passed: list[int] = []
    for step in range(1, max_steps + 1):
        model.train()
        loss, _, skipped = NATTranslationTask.nat_loss(model, batch, label_smoothing)
        assert torch.isfinite(loss) and skipped == 0
        opt.zero_grad()
        loss.backward()
        opt.step()
        if every and step % every == 0:
            model.eval()
            with torch.no_grad():
                out = nat_decode(model, batch.source, batch.source_mask, **decode)
            passed = passed + [step] if out == targets else []
            if len(passed) == 2:
                break
    model.eval()
    return passed
