"""Non-autoregressive translation: the ``nat_translation`` task for :mod:`tokenloom.models.nat` (kinds nat, cmlm,
ctc, levenshtein, insertion, ...: :mod:`tokenloom.models.nat_kinds`) on the translation task's data (line-aligned
pairs, token-count batches).

The loss is the model's kind's (``NATKind.loss``; targets are the target tokens without BOS / EOS):

* nat: label-smoothed cross-entropy over every target position, decoder inputs built for the gold length;
* cmlm: the same over the masked positions only, after masking a uniformly random number (1..L) of each
  target's tokens;
* ctc: CTC over the upsampled decoder (no label smoothing). A pair whose target cannot fit the decoder
  (L + adjacent repeats > ctc_upsample x source length) is skipped and counted (``skipped_pairs``, the
  training run's total so far, in each evaluation's metrics), never a crash mid-epoch;
* nat and cmlm add ``length_loss_weight`` x the length predictor's cross-entropy;
* levenshtein: the imitation-learning losses of deletion, placeholder counts and fill; insertion: the
  balanced-binary-tree loss over the slots of a random partial target;
* nat and ctc with ``glancing_ratio`` > 0 glance part of the reference into the decoder inputs (GLAT).

Train on a teacher's outputs (sequence-level distillation, ``tokenloom distill``) by pointing ``data.dir`` at
the distilled corpus; ``data.tokenizer_from`` takes the teacher's tokenizer so the vocabularies match (needed
to rescore length candidates with the teacher).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..checkpoint import load_tokenizer, read_config, resolve_checkpoint
from ..config import check
from ..data.parallel import ParallelBatch
from ..data.tokenizers import Tokenizer
from ..devices import device_of, to_device
from ..errors import CheckpointError, ConfigError, DataError
from ..models.factory import create_model, model_config_from_dict
from ..models.nat import NATConfig
from ..models.nat_kinds import NAT_KINDS
from ..models.nat_kinds.cmlm import random_mask  # noqa: F401 (kind cmlm's training mask, importable from here too)
from .registry import TASKS
from .translation import TranslationDataConfig, TranslationTask, special_ids


@dataclass
class NATDataConfig(TranslationDataConfig):
    tokenizer_from: str | None = None  # a translation run / checkpoint (the AR teacher) whose tokenizer to use
    iterations: int = 10  # decoding iterations for val_bleu (kinds that take them: cmlm)
    length_beam: int = 3  # length candidates for val_bleu (kinds that have them: nat, cmlm)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.iterations >= 1, f"data.iterations must be >= 1, got {self.iterations}")
        check(self.length_beam >= 1, f"data.length_beam must be >= 1, got {self.length_beam}")


def teacher_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of the translation checkpoint at ``path``; one-line errors for a missing checkpoint or one
    of another kind."""
    checkpoint = resolve_checkpoint(path)
    task = read_config(checkpoint).get("task")
    if task not in ("translation", "nat_translation"):
        raise ConfigError(f"data.tokenizer_from={path} is a {task or 'non-translation'} checkpoint; it must be a "
                          "translation run (the autoregressive teacher)")
    try:
        return load_tokenizer(checkpoint)
    except CheckpointError as err:
        raise ConfigError(f"data.tokenizer_from={path}: {err}") from None


@TASKS.register("nat_translation")
class NATTranslationTask(TranslationTask):
    """Translation's data with the non-autoregressive losses; val loss and BLEU by parallel decoding."""

    data_config_cls = NATDataConfig
    default_family = "nat"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skipped_pairs = 0  # training pairs whose target does not fit the decoder (kinds that skip: ctc)

    @classmethod
    def setup(cls, data: NATDataConfig, model_section: dict[str, Any], run_dir: Path, *, batch_size: int,
              seq_len: int | None, label_smoothing: float, eval_batches: int | None,
              tokenizer: Tokenizer | None = None, seed: int = 0,
              scheduled_sampling: Any = None) -> tuple[NATTranslationTask, nn.Module, Tokenizer, dict[str, Any]]:
        if scheduled_sampling is not None:
            raise ConfigError("train.scheduled_sampling is for autoregressive decoders; task nat_translation has "
                              "no previous tokens to sample")
        if tokenizer is None and data.tokenizer_from:
            tokenizer = teacher_tokenizer(data.tokenizer_from)
        tokenizer, dataset = cls.prepare_data(data, run_dir, tokenizer)
        ids = special_ids(tokenizer)
        base = tokenizer.vocab_size  # <mask> and <blank> follow the tokenizer's ids
        section = {"family": "nat", **model_section, **ids, "mask_id": base, "blank_id": base + 1}
        if section["family"] != "nat":
            raise ConfigError(f"task 'nat_translation' needs model family nat, got {section['family']!r}")
        section["vocab_size"] = max(model_section.get("vocab_size") or 0, base + 2)
        section["max_source_len"] = max(model_section.get("max_source_len", 0), data.max_source_len)
        section["max_target_len"] = max(model_section.get("max_target_len", 0), data.max_target_len)
        kind = section.get("kind", NATConfig.kind)
        if kind in NAT_KINDS:  # (an unknown kind: the config's one-line error below)
            section["max_target_len"] = max(section["max_target_len"], NAT_KINDS.get(kind).decoder_positions(section))
        family, model_config = model_config_from_dict(section)
        model = create_model(family, model_config)
        task = cls(dataset, data, tokenizer, seed=seed, label_smoothing=label_smoothing, eval_batches=eval_batches)
        return task, model, tokenizer, {"family": family, **{k: v for k, v in section.items() if k != "family"}}

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "skipped_pairs": self.skipped_pairs}

    def load_state_dict(self, state: dict[str, int]) -> None:
        super().load_state_dict(state)
        self.skipped_pairs = int(state.get("skipped_pairs", 0))

    # ---- losses -------------------------------------------------------------------------------

    def loss(self, model: nn.Module, batch: ParallelBatch) -> tuple[Tensor, int]:
        loss, count, skipped = self.nat_loss(model, batch, self.label_smoothing if model.training else 0.0)
        if model.training:
            self.skipped_pairs += skipped
        return loss, count

    @staticmethod
    def nat_loss(model: nn.Module, batch: ParallelBatch, label_smoothing: float,
                 generator: torch.Generator | None = None) -> tuple[Tensor, int, int]:
        """(mean loss per predicted token, predicted tokens, skipped pairs) of a batch: the model's kind's loss
        (``NATKind.loss``; see the module docstring). ``generator`` draws cmlm's masks (default: torch's global
        generator)."""
        tokens = batch.target_in[:, 1:]  # (B, L) the target tokens, right-padded
        lengths = batch.target_mask.sum(1) - 1  # (B,)
        return NAT_KINDS.get(model.config.kind).loss(model, batch.source, batch.source_mask, tokens, lengths,
                                                     label_smoothing, generator)

    # ---- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: nn.Module, max_batches: int | None = -1, split: str | None = None) -> dict[str, float]:
        """``{split}_loss`` (the training loss without label smoothing; cmlm's masks drawn from a fixed seed)
        and, with ``data.bleu``, ``{split}_bleu`` by parallel decoding (``data.iterations``,
        ``data.length_beam``, as the kind takes them); ``skipped_pairs`` for kinds that skip pairs (ctc)."""
        split = split or self.data.valid
        name = "val" if split == self.data.valid else split
        max_batches = self.eval_batches if max_batches == -1 else max_batches
        total, count = 0.0, 0
        device = device_of(model)
        generator = torch.Generator(device=device).manual_seed(0)
        for i, indices in enumerate(self.dataset.batches(split, self.data.max_tokens, shuffle=False)):
            if max_batches is not None and i >= max_batches:
                break
            batch = to_device(self.dataset.collate(split, indices, **self.ids), device)
            loss, n, _ = self.nat_loss(model, batch, 0.0, generator)
            total, count = total + loss.item() * n, count + n
        if count == 0:
            raise DataError(f"the {split!r} split is empty: nothing to evaluate")
        metrics: dict[str, float] = {f"{name}_loss": total / max(count, 1), "tokens": count}
        kind = NAT_KINDS.get(model.config.kind)
        if kind.skips_pairs:
            metrics["skipped_pairs"] = self.skipped_pairs
        if self.data.bleu:
            from ..evaluation import compute_metrics
            from .translation import translate

            sources = self.dataset.sentences(split, "source")
            references = self.dataset.sentences(split, "target")
            if self.data.bleu_sentences is not None:
                sources, references = sources[:self.data.bleu_sentences], references[:self.data.bleu_sentences]
            options = {option: getattr(self.data, option) for option in kind.options}  # iterations, length_beam
            hypotheses = translate(model, self.tokenizer, sources, max_tokens=self.data.max_tokens, **options)
            metrics[f"{name}_bleu"] = compute_metrics(["bleu"], hypotheses, references).scores["bleu"]
        return metrics

