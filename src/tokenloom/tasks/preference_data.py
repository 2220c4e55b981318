"""Preference examples as token ids, batches of them and their order -- shared by the ``dpo`` and ``reward`` tasks.

Shape legend: B items (pairs, or KTO examples) in a batch, T positions (the longest row of the batch).

Each item holds two sequences: a pair's chosen and rejected reply after the prompt, or (KTO) an example's own reply
and a *mismatched* one -- the reply of another example of the split after this example's prompt -- whose
log-ratio estimates KTO's KL reference point. A batch stacks them as (2B, T) rows, every item's first sequence
then every item's second, right-padded; labels score the reply tokens only (:mod:`tokenloom.tasks.sequences`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..config import check
from ..data.chat import ChatTemplate, chat_template_for
from ..data.pairs import Preference, encode_reply, read_preferences
from ..data.tokenizers import Tokenizer
from ..devices import to_device
from ..errors import DataError
from .sequences import pad_sequences


@dataclass
class EncodedItem:
    """One training item: two (ids, trained) sequences (see the module docstring) and its label."""

    first: list[int]  # chosen reply (pair) / the example's own reply (KTO), after the prompt
    first_trained: list[bool]  # the reply's tokens (and end marker)
    second: list[int]  # rejected reply (pair) / another example's reply after this prompt (KTO)
    second_trained: list[bool]
    desirable: bool = True  # KTO's label (pairs: True)
    where: str = ""  # "path:line"


class PreferenceBatch(NamedTuple):
    """(2B, T) rows: ``ids[:B]`` the items' first sequences, ``ids[B:]`` their second ones."""

    ids: Tensor  # (2B, T) right-padded token ids
    labels: Tensor  # (2B, T) aligned labels, -100 off the reply tokens
    attention_mask: Tensor  # (2B, T) 1 on tokens, 0 on padding
    index: Tensor  # (B,) the items' indices in their split
    desirable: Tensor  # (B,) bool, KTO's labels (pairs: all True)


def read_splits(path: str, val_path: str | None, val_fraction: float, *,
                unpaired: bool) -> tuple[list[Preference], list[Preference]]:
    """(train, validation) lines: ``val_path``'s, or the last ``val_fraction`` of ``path``'s (at least one line)."""
    lines = read_preferences(path, unpaired=unpaired)
    if val_path:
        return lines, read_preferences(val_path, unpaired=unpaired)
    if len(lines) < 2:
        raise DataError(f"{path}: {len(lines)} line, too few to hold out a validation line (add lines or set "
                        "data.val_path)")
    n_val = min(len(lines) - 1, max(1, round(len(lines) * val_fraction)))
    return lines[:-n_val], lines[-n_val:]


def encode_items(lines: Sequence[Preference], template: ChatTemplate, tokenizer: Tokenizer, max_length: int, *,
                 kto: bool) -> list[EncodedItem]:
    """Token ids of every line. Pairs become one item each; with ``kto`` every pair becomes a desirable (chosen) and
    an undesirable (rejected) example, and every example's second sequence is the reply of the next example with
    another prompt (in file order, wrapping around) after its own prompt: a fixed mismatch, so its reference
    log-probability is computed once like the others."""
    def encode(line: Preference, reply: str) -> tuple[list[int], list[bool]]:
        return encode_reply(template, tokenizer, line.prompt, reply, max_length, line.where)

    if not kto:
        items = []
        for line in lines:
            if not line.paired:  # (read_preferences refuses these unless unpaired)
                raise DataError(f"{line.where}: a pair needs \"chosen\" and \"rejected\"")
            items.append(EncodedItem(*encode(line, line.chosen), *encode(line, line.rejected), True, line.where))
        return items
    examples: list[tuple[Preference, str, bool]] = []
    for line in lines:
        if line.paired:
            examples += [(line, line.chosen, True), (line, line.rejected, False)]
        else:
            examples.append((line, line.chosen, bool(line.desirable)))
    items = []
    n = len(examples)
    for i, (line, reply, label) in enumerate(examples):
        others = (examples[(i + k) % n] for k in range(1, n))
        partner = next((other[1] for other in others if other[0].prompt != line.prompt), examples[(i + 1) % n][1])
        items.append(EncodedItem(*encode(line, reply), *encode(line, partner), label, line.where))
    return items


def encode_splits(data: Any, tokenizer: Tokenizer, max_length: int, *,
                  kto: bool) -> tuple[list[EncodedItem], list[EncodedItem], ChatTemplate]:
    """(train items, validation items, chat template) of a preference data section (``path``, ``val_path``,
    ``val_fraction``, ``template``): the template is ``data.template`` resolved against the one the tokenizer's
    checkpoint records, and set on the tokenizer so the run's checkpoints record it."""
    template = chat_template_for(tokenizer, tokenizer.chat_template, data.template, bos_token=tokenizer.bos_token)
    tokenizer.chat_template = template.recorded
    train_lines, val_lines = read_splits(data.path, data.val_path, data.val_fraction, unpaired=kto)
    return (encode_items(train_lines, template, tokenizer, max_length, kto=kto),
            encode_items(val_lines, template, tokenizer, max_length, kto=kto), template)


def make_batch(items: Sequence[EncodedItem], indices: Sequence[int], pad_id: int | None) -> PreferenceBatch:
    """The :class:`PreferenceBatch` of ``items[indices]``."""
    chosen = [items[i] for i in indices]
    rows = [it.first for it in chosen] + [it.second for it in chosen]
    trained = [it.first_trained for it in chosen] + [it.second_trained for it in chosen]
    ids, labels, mask = pad_sequences(rows, trained, pad_id)
    return PreferenceBatch(ids, labels, mask, torch.as_tensor(list(indices), dtype=torch.long),
                           torch.as_tensor([it.desirable for it in chosen], dtype=torch.bool))


class EpochOrder:
    """Items in a fresh random order each epoch (a permutation seeded by ``seed`` and the epoch), read ``rows`` at a
    time; the state is (epoch, position), so a resumed run continues with the same items."""

    def __init__(self, size: int, seed: int) -> None:
        check(size >= 1, f"a preference split needs at least one item, got {size}")
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order: tuple[int, list[int]] | None = None

    def _permutation(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**63)
            self._order = (self.epoch, torch.randperm(self.size, generator=gen).tolist())
        return self._order[1]

    def take(self, rows: int) -> list[int]:
        """The next ``rows`` item indices (across epoch boundaries)."""
        out: list[int] = []
        while len(out) < rows:
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
            order = self._permutation()
            part = order[self.position:self.position + rows - len(out)]
            out += part
            self.position += len(part)
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        state = state or {}
        self.epoch, self.position = int(state.get("epoch", 0)), int(state.get("position", 0))


def split_batches(items: Sequence[EncodedItem], rows: int, pad_id: int | None, device: torch.device,
                  max_batches: int | None = None) -> Iterator[PreferenceBatch]:
    """The items in order as batches of ``rows`` (the last one shorter) on ``device``: the first ``max_batches``
    (None: all)."""
    for b, start in enumerate(range(0, len(items), rows)):
        if max_batches is not None and b >= max_batches:
            return
        yield to_device(make_batch(items, range(start, min(start + rows, len(items))), pad_id), device)


class MetricWindow:
    """The training batches' metrics since the last :meth:`take` (a task's ``train_metrics``): each name's mean over
    the batches that had it."""

    def __init__(self) -> None:
        self.batches: list[dict[str, float]] = []

    def add(self, metrics: dict[str, float]) -> None:
        self.batches.append(metrics)

    def take(self) -> dict[str, float]:
        names = dict.fromkeys(name for metrics in self.batches for name in metrics)
        out = {name: round(sum(values) / len(values), 6) for name in names
               if (values := [m[name] for m in self.batches if name in m])}
        self.batches = []
        return out


def average_metrics(split: str, batches: Iterator[PreferenceBatch],
                    measure: Callable[[PreferenceBatch], dict[str, Any]],
                    progress: Callable[[int], object] | None = None) -> dict[str, float]:
    """``{split}_{name}``: each of ``measure(batch)``'s values averaged over the batches' items (weighted by each
    batch's size); a split without items is a one-line :class:`DataError`."""
    totals: dict[str, float] = {}
    count = 0
    for batch in batches:
        B = batch.index.shape[0]
        for key, value in measure(batch).items():
            totals[key] = totals.get(key, 0.0) + float(value) * B
        count += B
        if progress is not None:
            progress(B)
    if count == 0:
        raise DataError(f"the {split} split has no preference items to evaluate")
    return {f"{split}_{key}": value / count for key, value in totals.items()}
