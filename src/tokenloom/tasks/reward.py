"""The ``reward`` task: a reward model (:class:`~tokenloom.models.reward.GPTReward`) trained on preference pairs with
the Bradley-Terry loss, and the helpers that score replies with a trained one (:func:`score`,
:func:`load_scorer`, used by best-of-n sampling and GRPO's ``reward_model`` reward).

Shape legend: B pairs in a batch, T positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..checkpoint import load_model, load_tokenizer
from ..config import check
from ..data.chat import ChatTemplate, Message, template_for_tokenizer
from ..data.pairs import encode_reply
from ..data.tokenizers import Tokenizer
from ..devices import device_of
from ..errors import CheckpointError, ConfigError
from ..models.factory import create_model
from ..models.reward import SequenceScorer, reward_family
from .preference_data import (
    EncodedItem,
    EpochOrder,
    MetricWindow,
    PreferenceBatch,
    average_metrics,
    encode_splits,
    make_batch,
    split_batches,
)
from .registry import TASKS, Sharded
from .sequences import pad_sequences
from .vocabulary import config_for_tokenizer


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """-mean(log sigmoid(r_chosen - r_rejected)) of (B,) rewards (the pairwise loss of InstructGPT's reward model,
    TRL's ``RewardTrainer``), with detached ``acc`` (the fraction of pairs ranked right), ``margin``,
    ``chosen_score`` and ``rejected_score`` (means)."""
    diff = chosen.float() - rejected.float()
    loss = -F.logsigmoid(diff).mean()
    diff = diff.detach()
    return loss, {"acc": (diff > 0).float().mean(), "margin": diff.mean(),
                  "chosen_score": chosen.detach().float().mean(), "rejected_score": rejected.detach().float().mean()}


@dataclass
class RewardDataConfig:
    path: str = "data/kb/format_dpo.jsonl"  # JSONL: {"prompt": str | messages, "chosen": str, "rejected": str} a line
    val_path: str | None = None  # a validation file of the same format; None = the last val_fraction of path
    val_fraction: float = 0.1  # without val_path: the last fraction of the lines (at least one) validates
    template: str = "auto"  # chat template: auto (the checkpoint's recorded one, else default) | default | a Jinja
    #   string
    max_length: int | None = None  # tokens per prompt + reply (longer: the prompt loses its start); None =
    #   train.seq_len, else model.max_seq_len

    def __post_init__(self) -> None:
        check(0.0 < self.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        check(self.max_length is None or self.max_length >= 2, f"data.max_length must be >= 2, got {self.max_length}")


@TASKS.register("reward")
class RewardTask(Sharded):
    """A reward model on preference pairs: ``score(prompt + chosen) > score(prompt + rejected)`` through the
    Bradley-Terry loss. Starts from ``train.init_from``, a language model's checkpoint (its family's reward family,
    ``gpt`` -> ``gpt_reward``: the backbone loaded, ``score_head`` fresh) or a reward model's."""

    data_config_cls = RewardDataConfig
    default_family = "gpt_reward"
    fresh_weights = ("score_head.",)
    count_unit = "pairs"  # the progress line's pairs/s
    summary_metrics = (("val_loss", 4), ("val_acc", 4), ("val_margin", 4))

    def __init__(self, train: list[EncodedItem], val: list[EncodedItem], pad_id: int | None, *, batch_size: int,
                 eval_batches: int | None, seed: int = 0, template: ChatTemplate | None = None) -> None:
        self.splits = {"train": train, "val": val}
        self.pad_id, self.batch_size, self.eval_batches = pad_id, batch_size, eval_batches
        self.order = EpochOrder(len(train), seed)
        self.template = template  # the chat template the pairs were encoded with
        self.last_metrics: dict[str, float] = {}
        self.window = MetricWindow()  # the training batches' metrics since the last train_metrics()

    @classmethod
    def setup(cls, data: RewardDataConfig, model_section: dict[str, Any], run_dir: Path, *, batch_size: int,
              seq_len: int | None, label_smoothing: float, eval_batches: int | None,
              tokenizer: Tokenizer | None = None, seed: int = 0) -> tuple[RewardTask, nn.Module, Tokenizer,
                                                                          dict[str, Any]]:
        """Reads and encodes the pairs; the reward model (its weights loaded by the caller from ``train.init_from``).
        Returns (task, model, tokenizer, resolved model section)."""
        if tokenizer is None:
            raise ConfigError("task reward needs train.init_from: a language model's checkpoint (an SFT model, an "
                              "imported one) whose backbone the reward model starts from")
        if label_smoothing:
            raise ConfigError(f"train.label_smoothing={label_smoothing} applies to token cross-entropy, not to the "
                              "reward task's pairwise loss")
        family = reward_family(model_section.get("family", cls.default_family))
        family, model_config, section, _ = config_for_tokenizer({**model_section, "family": family}, tokenizer)
        max_length = data.max_length or seq_len or model_config.max_seq_len
        check(max_length <= model_config.max_seq_len,
              f"data.max_length={max_length} exceeds model.max_seq_len={model_config.max_seq_len}")
        train, val, template = encode_splits(data, tokenizer, max_length, kto=False)
        model = create_model(family, model_config)
        task = cls(train, val, tokenizer.pad_id, batch_size=batch_size, eval_batches=eval_batches, seed=seed,
                   template=template)
        return task, model, tokenizer, section

    @classmethod
    def for_checkpoint(cls, data: RewardDataConfig, tokenizer: Tokenizer, *, batch_size: int,
                       max_length: int) -> RewardTask:
        """The task of a trained reward checkpoint for ``tokenloom evaluate`` (its data section)."""
        train, val, template = encode_splits(data, tokenizer, max_length, kto=False)
        return cls(train, val, tokenizer.pad_id, batch_size=batch_size, eval_batches=None, template=template)

    def state_dict(self) -> dict[str, int]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        self.order.load_state_dict(state)

    def get_batch(self, generator: torch.Generator) -> PreferenceBatch:
        """``batch_size`` pairs in the epoch's order (distributed: this rank's slice of the global batch)."""
        indices = self.order.take(self.batch_size * self.world_size)
        if self.world_size > 1:
            indices = indices[self.local(self.batch_size)]
        return make_batch(self.splits["train"], indices, self.pad_id)

    def pair_loss(self, model: nn.Module, batch: PreferenceBatch) -> tuple[Tensor, dict[str, Tensor]]:
        B = batch.index.shape[0]
        rewards = model.score(batch.ids, batch.attention_mask)  # (2B,)
        return bradley_terry_loss(rewards[:B], rewards[B:])

    def loss(self, model: nn.Module, batch: PreferenceBatch) -> tuple[Tensor, int]:
        """(mean pairwise loss, number of pairs)."""
        loss, metrics = self.pair_loss(model, batch)
        self.last_metrics = {k: float(v) for k, v in metrics.items()}
        self.window.add(self.last_metrics)
        return loss, int(batch.index.shape[0])

    def train_metrics(self) -> dict[str, float]:
        """The metrics of the training batches since the last call, averaged (each ``metrics.jsonl`` line of a
        training step, and the progress line, show them): those of :func:`bradley_terry_loss` (``acc``, ``margin``, the
        scores)."""
        return self.window.take()

    def eval_split_batches(self, split: str = "val") -> int:
        return -(-len(self.splits[split]) // (self.batch_size * self.world_size))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, max_batches: int | None = -1, split: str = "val",
                 progress: Callable[[int], object] | None = None) -> dict[str, float]:
        """``{split}_loss``, ``_acc`` (pairs ranked right), ``_margin``, ``_chosen_score``, ``_rejected_score`` over
        the first ``max_batches`` batches (-1: the task's ``eval_batches``; None: the whole split)."""
        max_batches = self.eval_batches if max_batches == -1 else max_batches
        batches = split_batches(self.splits[split], self.batch_size * self.world_size, self.pad_id,
                                device_of(model), max_batches)

        def measure(batch: PreferenceBatch) -> dict[str, Tensor]:
            loss, metrics = self.pair_loss(model, batch)
            return {"loss": loss, **metrics}

        return average_metrics(split, batches, measure, progress)


# ---- scoring with a trained reward model ---------------------------------------------------------------------

class RewardScorer:
    """Scores (prompt, reply) pairs with a reward model: the chat template renders the prompt (a string is one
    user turn, or a list of messages) and the reply as in training, the rows are right-padded in batches of
    ``batch_size`` and read at their last real token. ``scorer(prompts, replies) -> list[float]``."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, template: ChatTemplate, *, batch_size: int = 16,
                 max_length: int | None = None) -> None:
        if not isinstance(model, SequenceScorer):
            raise ConfigError(f"{type(model).__name__} is not a reward model (train one with task: reward)")
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.batch_size = batch_size
        self.max_length = max_length or model.config.max_seq_len

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str | Sequence[Message]], replies: Sequence[str]) -> list[float]:
        if len(prompts) != len(replies):
            raise ValueError(f"{len(prompts)} prompts but {len(replies)} replies")
        rows = [encode_reply(self.template, self.tokenizer, _messages(p), r, self.max_length)[0]
                for p, r in zip(prompts, replies, strict=True)]
        device = device_of(self.model)
        out: list[float] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(rows), self.batch_size):
                ids, _, mask = pad_sequences(rows[start:start + self.batch_size], None, self.tokenizer.pad_id)
                out += self.model.score(ids.to(device), mask.to(device)).tolist()
        finally:
            self.model.train(was_training)
        return out


def _messages(prompt: str | Sequence[Message]) -> list[Message]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


def score(model: nn.Module, tokenizer: Tokenizer, prompt: str | Sequence[Message], response: str,
          template: ChatTemplate | None = None) -> float:
    """The reward model's scalar score of ``response`` to ``prompt`` (``template``: the chat template it was trained
    with; None: the one the tokenizer carries from its checkpoint, ``tokenizer.chat_template``, else the default)."""
    template = template or template_for_tokenizer(tokenizer, setting="tokenizer.chat_template")
    return RewardScorer(model, tokenizer, template, batch_size=1)([prompt], [response])[0]


def load_scorer(path: str | Path, device: str | torch.device = "cpu", *, batch_size: int = 16) -> RewardScorer:
    """A :class:`RewardScorer` over the reward-model checkpoint at ``path`` with the chat template it was trained
    with (the ``tokenizer.chat_template`` it records; the default without one); a checkpoint that is not a reward
    model is a one-line error."""
    model, config = load_model(path, device=device)
    if not isinstance(model, SequenceScorer):
        family = (config.get("model") or {}).get("family")
        raise CheckpointError(f"{path} holds a {family!r} model, not a reward model (train one with task: reward)")
    tokenizer = load_tokenizer(path)
    template = template_for_tokenizer(tokenizer, setting=f"{path}: tokenizer.chat_template")
    return RewardScorer(model, tokenizer, template, batch_size=batch_size)
