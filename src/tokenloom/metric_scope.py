"""How much of the validation split a training-time figure covers, written into its name.

During training the Trainer evaluates the first ``train.eval_batches`` batches of the validation split, while
``tokenloom evaluate`` reads the whole split, so the two ``val_loss`` figures of one checkpoint can differ. Each
evaluation record (a ``metrics.jsonl`` line, the run's summary, ``last_eval`` in a trainer state) keeps its keys
(``val_loss``, ``val_acc``, ...) and adds ``eval_batches`` (the batches it read) and, where the task counts them,
``eval_split_batches`` (the batches the whole split holds). Everything shown to a person names the figure by its
scope::

    val_loss[20 of 28 batches]    the first 20 of the split's 28 batches
    val_loss[whole split]         train.eval_batches covers the split: the figure `tokenloom evaluate` reports
    val_loss[up to 20 batches]    a task that does not count its split's batches

``*_bleu`` figures are computed on ``data.bleu_sentences`` sentences, not on the evaluation batches: their names
stay as they are, as do those of records written before the fields existed. (``val_loss@N`` in a sweep's results
is another figure: the loss with windows of N tokens.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BATCHES, SPLIT_BATCHES = "eval_batches", "eval_split_batches"  # the record's fields
NOT_BATCHED = ("_bleu",)  # figures over sentences, whatever eval_batches is


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def scope(record: Mapping[str, Any]) -> str | None:
    """``20 of 28 batches`` / ``whole split`` / ``up to 20 batches``, or None when the record does not say."""
    batches, total = _count(record.get(BATCHES)), _count(record.get(SPLIT_BATCHES))
    if batches is None:
        return None
    if total is None:
        return f"up to {batches} batches"
    return "whole split" if batches >= total else f"{batches} of {total} batches"


def scoped_name(key: str, record: Mapping[str, Any]) -> str:
    """``key`` as shown to a person: a validation figure of ``record`` with its scope (``val_loss[whole split]``),
    any other key as it is."""
    where = scope(record) if key.startswith("val_") and "@" not in key and not key.endswith(NOT_BATCHED) else None
    return key if where is None else f"{key}[{where}]"


def scope_fields(eval_batches: int, split_batches: int | None) -> dict[str, int]:
    """The fields an evaluation record gets: the batches read (at most the split's) and the split's."""
    if split_batches is None:
        return {BATCHES: eval_batches}
    return {BATCHES: min(eval_batches, split_batches), SPLIT_BATCHES: split_batches}
