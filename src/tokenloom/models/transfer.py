"""Starting a model from a checkpoint of another family (``train.init_from`` across families), as the
non-autoregressive literature starts its students from the autoregressive teacher.

A family declares which families it can start from, and how, once where it is defined::

    declare_start("nat", WeightMap("seq2seq", vocab_rows=VOCABULARY_TENSORS, fresh=("length_head.", "kind_heads.")))

:func:`transfer_weights` then copies the teacher's tensors into the student by name:

* a tensor of the same name and shape is copied (the encoder, the decoder blocks, the norms);
* a vocabulary tensor (``vocab_rows``: the embeddings and the output projection, indexed by token id) whose
  student has more rows than the teacher -- a non-autoregressive model's ``<mask>`` and ``<blank>`` follow the
  tokenizer's ids -- gets the teacher's rows; the rows past them keep their initial values;
* a student tensor the teacher lacks keeps its initial values only where the map declares it fresh (``fresh``:
  name prefixes, the heads the teacher has no counterpart of: a length predictor, the edit classifiers); any other
  is an error, so a renamed or missing stack never starts silently from random weights;
* a teacher tensor the student has no place for (a deeper teacher's extra layers) is reported as unused.

Any other difference of shape is a one-line :class:`~tokenloom.errors.CheckpointError` naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import CheckpointError

VOCABULARY_TENSORS = ("tgt_embed.weight", "src_embed.weight", "lm_head.weight")  # an encoder-decoder's, by token id


@dataclass(frozen=True)
class WeightMap:
    """How a family's model starts from a checkpoint of ``teacher`` (a family name in ``MODELS``)."""

    teacher: str
    vocab_rows: tuple[str, ...] = ()  # tensors indexed by token id whose extra rows (the student's ids) start fresh
    fresh: tuple[str, ...] = ()  # name prefixes of the student's tensors the teacher has no counterpart of


@dataclass
class Transfer:
    """What :func:`transfer_weights` did, by tensor name."""

    copied: list[str] = field(default_factory=list)  # equal to the teacher's
    rows: list[tuple[str, int, int]] = field(default_factory=list)  # (name, teacher rows copied, student rows)
    fresh: list[str] = field(default_factory=list)  # initial values: no counterpart in the teacher
    unused: list[str] = field(default_factory=list)  # the teacher's, with no place in the student

    def summary(self) -> str:
        """One line for the run's log."""
        parts = [f"copied {len(self.copied)} tensors"]
        parts += [f"{name}: the teacher's {n} of {total} rows" for name, n, total in self.rows]
        parts.append(f"fresh: {', '.join(self.fresh) if self.fresh else 'none'}")
        if self.unused:
            parts.append(f"unused from the teacher: {', '.join(self.unused)}")
        return "; ".join(parts)


_STARTS: dict[str, dict[str, WeightMap]] = {}  # student family -> teacher family -> map


def declare_start(family: str, weight_map: WeightMap) -> None:
    """``family``'s models can start from checkpoints of ``weight_map.teacher``, mapped as it says."""
    _STARTS.setdefault(family, {})[weight_map.teacher] = weight_map


def weight_map(family: str, teacher: str, source: str) -> WeightMap | None:
    """The declared map from ``teacher`` checkpoints to ``family`` models. A family that declares maps starts from
    those families only (another is a one-line error); one that declares none gets None: it loads a checkpoint of
    the same layout by name, as fine-tuning does (a reward model from a language model: its new head fresh)."""
    starts = _STARTS.get(family)
    if starts is None:
        return None
    if teacher not in starts:
        known = ", ".join(sorted(starts))
        raise CheckpointError(f"{source} is a {teacher!r} checkpoint; a {family!r} model starts from {known} "
                              "checkpoints only (tokenloom.models.transfer)")
    return starts[teacher]


def transfer_weights(student: nn.Module, teacher: dict[str, torch.Tensor], mapping: WeightMap,
                     source: str) -> Transfer:
    """Copy ``teacher`` (a state dict with tied names included, as ``nn.Module.state_dict`` gives it) into
    ``student`` as ``mapping`` says (the module docstring); errors name ``source`` and the tensor. Nothing is
    written to ``student`` unless every tensor maps."""
    target = student.state_dict()
    plan: list[tuple[str, torch.Tensor, int | None]] = []  # (name, teacher tensor, rows or None for all)
    result = Transfer()
    for name, tensor in target.items():
        if name not in teacher:
            if not name.startswith(mapping.fresh):
                raise CheckpointError(f"{source} has no {name} for the {type(student).__name__} model (a "
                                      f"{mapping.teacher!r} checkpoint with another layout: a different number of "
                                      "layers or another block type)")
            result.fresh.append(name)
            continue
        given = teacher[name]
        if given.shape == tensor.shape:
            plan.append((name, given, None))
            result.copied.append(name)
        elif (name in mapping.vocab_rows and given.dim() == tensor.dim() and given.shape[1:] == tensor.shape[1:]
              and given.shape[0] < tensor.shape[0]):
            plan.append((name, given, given.shape[0]))
            result.rows.append((name, given.shape[0], tensor.shape[0]))
        else:
            rows_differ = name in mapping.vocab_rows and given.shape[1:] == tensor.shape[1:]
            what = "rows (token ids: another vocabulary)" if rows_differ else "shape"
            raise CheckpointError(f"{source}: {name} has shape {tuple(given.shape)}, the model needs "
                                  f"{tuple(tensor.shape)}: its {what} cannot map")
    result.unused = [name for name in teacher if name not in target]
    with torch.no_grad():
        for name, given, rows in plan:
            (target[name] if rows is None else target[name][:rows]).copy_(given)
    return result
