"""Preference alignment against a frozen reference: DPO, IPO and KTO losses (pure functions of sequence
log-probabilities) and the ``dpo`` task that trains a policy with them.

Shape legend: B pairs (DPO, IPO) or examples (KTO) in a batch.

Every loss takes the summed log-probabilities of the response tokens under the policy and the reference
(:func:`tokenloom.tasks.sequences.sequence_logprobs`) and returns ``(loss, metrics)``: the mean loss (a scalar
with a gradient) and detached scalars ``chosen_reward`` / ``rejected_reward`` (the implicit rewards
``beta * (log pi - log pi_ref)``, averaged), ``reward_acc`` (the fraction of pairs whose chosen reward is the
larger) and ``margin`` (the mean chosen - rejected reward). The formulas follow TRL's trainers
(``trl/trainer/dpo_trainer.py``: ``DPOTrainer.dpo_loss`` with ``loss_type`` ``sigmoid`` and ``ipo``;
``trl/trainer/kto_trainer.py``: ``KTOTrainer.kto_loss``), cross-checked against their source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..checkpoint import load_model, load_tokenizer, load_weights, read_config, resolve_checkpoint
from ..config import check
from ..data.chat import ChatTemplate
from ..data.tokenizers import Tokenizer
from ..devices import device_of
from ..errors import ConfigError
from ..models.factory import create_model
from ..models.registry import MODELS, decoding_of
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
from .sequences import sequence_logprobs
from .vocabulary import config_for_tokenizer

PREFERENCE_LOSSES = ("dpo", "ipo", "kto")


def _pair_metrics(chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, Tensor]:
    """Detached scalar metrics of (B,) implicit rewards."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    return {"chosen_reward": chosen_rewards.mean(), "rejected_reward": rejected_rewards.mean(),
            "reward_acc": (chosen_rewards > rejected_rewards).float().mean(),
            "margin": (chosen_rewards - rejected_rewards).mean()}


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float, label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Direct Preference Optimization (Rafailov et al. 2023, eq. 7) over (B,) sequence log-probabilities::

        h = (log pi(y_w) - log pi(y_l)) - (log pi_ref(y_w) - log pi_ref(y_l))
        loss = mean(-(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h))

    ``label_smoothing`` eps > 0 is conservative DPO (Mitchell 2023, cDPO: the labels are flipped with probability
    eps), exactly TRL's ``loss_type="sigmoid"`` with ``label_smoothing``; eps = 0 is the original DPO. With the
    policy equal to the reference, h = 0 and the loss is log 2."""
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    losses = -F.logsigmoid(beta * h) * (1.0 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    return losses.mean(), _pair_metrics(beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected))


def ipo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Identity Preference Optimization (Azar et al. 2023, eq. 17; ``beta`` is the paper's tau)::

        loss = mean((h - 1 / (2 * beta)) ** 2),  h as in :func:`dpo_loss`

    The regression target 1/(2 beta) keeps the log-ratio gap finite, where DPO's grows without bound on
    deterministic preferences. As TRL does (``concatenated_forward`` divides ``all_logps`` by the completion length
    when ``loss_type == "ipo"``), the IPO task feeds this the *mean* log-probability per response token, not the
    sum; this function takes whichever it is given."""
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    losses = (h - 1.0 / (2.0 * beta)) ** 2
    return losses.mean(), _pair_metrics(beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected))


def kto_reference_point(policy_kl: Tensor, ref_kl: Tensor) -> Tensor:
    """KTO's reference point z0: the batch estimate of KL(pi || pi_ref), the mean log-ratio of (B,) mismatched
    (prompt, completion of another example) pairs, clamped at 0 and detached (no gradient flows through it), as
    in TRL's ``kto_loss`` and the HALOs code it adapts."""
    return (policy_kl - ref_kl).detach().float().mean().clamp(min=0)


def kto_loss(policy: Tensor, ref: Tensor, desirable: Tensor, policy_kl: Tensor, ref_kl: Tensor, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024, eq. 7) over (B,) unpaired examples: ``policy`` and
    ``ref`` the response log-probabilities, ``desirable`` (B,) bool, ``policy_kl`` / ``ref_kl`` (B,) those of
    mismatched pairs for the reference point z0 (:func:`kto_reference_point`)::

        r = log pi(y|x) - log pi_ref(y|x)
        desirable:   lambda_D * (1 - sigmoid(beta * (r - z0)))
        undesirable: lambda_U * (1 - sigmoid(beta * (z0 - r)))
        loss = mean over the batch

    (TRL's ``kto_loss``: the same per-example losses, concatenated and averaged.) Metrics: ``chosen_reward`` /
    ``rejected_reward`` the mean ``beta * r`` of the desirable / undesirable examples (0 where there are none),
    ``margin`` their difference, ``reward_acc`` the fraction of examples on the right side of ``beta * z0``
    (desirable above, undesirable below) and ``kl`` the reference point z0."""
    desirable = desirable.bool()
    z0 = kto_reference_point(policy_kl, ref_kl)
    logratio = policy - ref
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (logratio - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratio))))
    rewards = (beta * logratio).detach().float()

    def mean_of(mask: Tensor) -> Tensor:
        return rewards[mask].mean() if bool(mask.any()) else rewards.new_zeros(())

    chosen, rejected = mean_of(desirable), mean_of(~desirable)
    right = torch.where(desirable, rewards > beta * z0, rewards < beta * z0)
    return losses.mean(), {"chosen_reward": chosen, "rejected_reward": rejected, "reward_acc": right.float().mean(),
                           "margin": chosen - rejected, "kl": z0}


# ---- the dpo task ---------------------------------------------------------------------------------------------

@dataclass
class PreferenceDataConfig:
    path: str = "data/kb/format_dpo.jsonl"  # JSONL: {"prompt": str | messages, "chosen": str, "rejected": str} a line
    #   (data.loss kto also takes {"prompt", "completion", "label": true | false})
    val_path: str | None = None  # a validation file of the same format; None = the last val_fraction of path
    val_fraction: float = 0.1  # without val_path: the last fraction of the lines (at least one) validates
    loss: str = "dpo"  # dpo (Rafailov et al. 2023) | ipo (Azar et al. 2023) | kto (Ethayarajh et al. 2024)
    beta: float = 0.1  # the KL strength: dpo/kto's inverse temperature, ipo's tau (target margin 1 / (2 beta))
    label_smoothing: float = 0.0  # dpo only: conservative DPO, the probability that a pair's label is flipped
    desirable_weight: float = 1.0  # kto only: lambda_D, the weight of the desirable examples' losses
    undesirable_weight: float = 1.0  # kto only: lambda_U, the weight of the undesirable examples' losses
    template: str = "auto"  # chat template: auto (the checkpoint's recorded one, else default) | default | a Jinja
    #   string
    max_length: int | None = None  # tokens per prompt + reply (longer: the prompt loses its start); None =
    #   train.seq_len, else model.max_seq_len
    reference: str | None = None  # the frozen reference checkpoint; None = train.init_from (the policy's start)
    reference_cache: bool = True  # compute the reference log-probabilities once per example, then free the
    #   reference model; false: run the reference on every batch (slower, for comparison)

    def __post_init__(self) -> None:
        check(self.loss in PREFERENCE_LOSSES, f"data.loss must be one of {', '.join(PREFERENCE_LOSSES)}, "
                                              f"got {self.loss!r}")
        check(self.beta > 0, f"data.beta must be positive, got {self.beta}")
        check(0.0 <= self.label_smoothing < 0.5, f"data.label_smoothing must be in [0, 0.5), got "
                                                 f"{self.label_smoothing}")
        check(self.label_smoothing == 0.0 or self.loss == "dpo",
              f"data.label_smoothing (conservative DPO) applies to data.loss dpo, not {self.loss!r}")
        check(0.0 < self.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        for name in ("desirable_weight", "undesirable_weight"):
            check(getattr(self, name) > 0, f"data.{name} must be positive, got {getattr(self, name)}")
        check(self.max_length is None or self.max_length >= 2, f"data.max_length must be >= 2, got {self.max_length}")


def reference_checkpoint(data_reference: str | None, init_from: str | None, task: str) -> Path:
    """The frozen reference: ``data.reference``, else ``train.init_from``; neither is a one-line ConfigError."""
    path = data_reference or init_from
    if not path:
        raise ConfigError(f"task {task} needs train.init_from (the checkpoint the policy starts from, normally an SFT "
                          "model, which is also the frozen reference) or data.reference")
    return resolve_checkpoint(path)


def causal_lm_section(model_section: dict[str, Any], tokenizer: Tokenizer, task: str) -> tuple[str, Any]:
    """(family, config) of a model section for a fine-tuning task over a causal LM with the tokenizer's ids."""
    family, config, _, _ = config_for_tokenizer(model_section, tokenizer)
    kind = decoding_of(MODELS.get(family)[1])
    if kind != "causal_lm":
        raise ConfigError(f"task {task} trains a causal language model; model.family={family!r} is "
                          f"{kind or 'not a decoder'}")
    return family, config


@TASKS.register("dpo")
class PreferenceTask(Sharded):
    """DPO, IPO or KTO (``data.loss``) of a policy against a frozen reference: the weights of ``data.reference`` or
    ``train.init_from`` (an SFT checkpoint, normally), kept even when the run resumes (the reference is read from that
    checkpoint again, never from the resumed policy). Log-probabilities are those of the reply tokens only.

    The reference runs in eval mode. With ``data.reference_cache`` (the default) its log-probabilities of every
    item's two sequences are computed once, on the first batch or evaluation (on the policy's device, in batches of
    ``2 x batch_size`` rows), and the reference model is then freed: each training step runs the policy alone.
    Batches: ``batch_size`` items (pairs, or KTO examples) in a fresh random order each epoch."""

    data_config_cls = PreferenceDataConfig
    default_family = "gpt"
    needs_reference = True
    count_unit = "items"  # the progress line's rate: pairs (dpo, ipo) or examples (kto) a second
    summary_metrics = (("val_loss", 4), ("val_reward_acc", 4), ("val_margin", 4))

    def __init__(self, train: list[EncodedItem], val: list[EncodedItem], data: PreferenceDataConfig,
                 reference: Path, pad_id: int | None, *, batch_size: int, eval_batches: int | None,
                 seed: int = 0, template: ChatTemplate | None = None) -> None:
        self.splits = {"train": train, "val": val}
        self.template = template  # the chat template the items were encoded with
        self.data, self.reference_path, self.pad_id = data, reference, pad_id
        self.batch_size, self.eval_batches = batch_size, eval_batches
        self.order = EpochOrder(len(train), seed)
        self.reference_model: nn.Module | None = None  # loaded on first use
        self.cache: dict[str, tuple[Tensor, Tensor]] = {}  # split -> ((N, 2) log-prob sums, (N, 2) token counts)
        self.last_metrics: dict[str, float] = {}  # the last training batch's metrics
        self.window = MetricWindow()  # the training batches' metrics since the last train_metrics()

    # -- setup --------------------------------------------------------------------------------------------------
    @classmethod
    def setup(cls, data: PreferenceDataConfig, model_section: dict[str, Any], run_dir: Path, *, batch_size: int,
              seq_len: int | None, label_smoothing: float, eval_batches: int | None,
              tokenizer: Tokenizer | None = None, seed: int = 0,
              reference: str | None = None) -> tuple[PreferenceTask, nn.Module, Tokenizer, dict[str, Any]]:
        """Reads and encodes the preference lines, makes the policy's model. ``reference`` is ``train.init_from``
        (the policy's start, whose weights the caller loads, and the reference unless ``data.reference`` names
        another); without it the policy starts from ``data.reference``'s weights and tokenizer. Returns (task,
        model, tokenizer, resolved model section)."""
        if label_smoothing:
            raise ConfigError(f"train.label_smoothing={label_smoothing} smooths token cross-entropy; conservative "
                              "DPO's label smoothing is data.label_smoothing")
        init_from = reference
        reference_dir = reference_checkpoint(data.reference, init_from, "dpo")
        if tokenizer is None:  # no train.init_from: the policy starts from the reference
            tokenizer = load_tokenizer(reference_dir)
            model_section = {**read_config(reference_dir).get("model", {}), **model_section}
        elif data.reference and load_tokenizer(reference_dir).backend.to_str() != tokenizer.backend.to_str():
            raise ConfigError(f"data.reference={data.reference} has another tokenizer than the policy's: their "
                              "log-probabilities would score different ids")
        family, model_config = causal_lm_section(model_section, tokenizer, "dpo")
        max_length = data.max_length or seq_len or model_config.max_seq_len
        check(max_length <= model_config.max_seq_len,
              f"data.max_length={max_length} exceeds model.max_seq_len={model_config.max_seq_len}")
        train, val, template = encode_splits(data, tokenizer, max_length, kto=data.loss == "kto")
        model = create_model(family, model_config)
        if not init_from:  # (a resumed run's weights replace these)
            load_weights(model, reference_dir)
        task = cls(train, val, data, reference_dir, tokenizer.pad_id, batch_size=batch_size,
                   eval_batches=eval_batches, seed=seed, template=template)
        section = {**model_section, "vocab_size": model_config.vocab_size}
        return task, model, tokenizer, {"family": family, **section}

    @classmethod
    def for_checkpoint(cls, data: PreferenceDataConfig, tokenizer: Tokenizer, init_from: str | None, *,
                       batch_size: int, max_length: int) -> PreferenceTask:
        """The task of a trained checkpoint for ``tokenloom evaluate``: its data section and the reference its
        ``data.reference`` / ``train.init_from`` name."""
        reference = reference_checkpoint(data.reference, init_from, "dpo")
        train, val, template = encode_splits(data, tokenizer, max_length, kto=data.loss == "kto")
        return cls(train, val, data, reference, tokenizer.pad_id, batch_size=batch_size, eval_batches=None,
                   template=template)

    def state_dict(self) -> dict[str, int]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        self.order.load_state_dict(state)

    # -- the reference ------------------------------------------------------------------------------------------
    def _reference(self, policy: nn.Module) -> nn.Module:
        """The reference model, loaded on first use on the policy's device and in its dtype (bf16 training: bf16),
        in eval mode."""
        if self.reference_model is None:
            weight = next(iter(policy.parameters()))
            self.reference_model, _ = load_model(self.reference_path, device=weight.device, dtype=weight.dtype)
            self.reference_model.requires_grad_(False)
        return self.reference_model

    @torch.no_grad()
    def fill_reference_cache(self, policy: nn.Module) -> None:
        """Reference log-probability sums and token counts of both sequences of every item of both splits."""
        reference = self._reference(policy)
        device = device_of(reference)
        for split, items in self.splits.items():
            sums, counts = [], []
            for batch in split_batches(items, max(1, self.batch_size), self.pad_id, device):
                s, n = sequence_logprobs(reference, batch.ids, batch.labels)  # (2b,)
                b = len(batch.index)
                sums.append(torch.stack([s[:b], s[b:]], 1).float().cpu())
                counts.append(torch.stack([n[:b], n[b:]], 1).cpu())
            self.cache[split] = (torch.cat(sums), torch.cat(counts))
        self.reference_model = None  # frozen and fully cached: its memory goes back
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def reference_logprobs(self, split: str, batch: PreferenceBatch, policy: nn.Module) -> tuple[Tensor, Tensor]:
        """(2B,) reference log-probability sums and (2B,) token counts of the batch's rows (``policy``: where and in
        which dtype the reference runs)."""
        device = batch.ids.device
        if not self.data.reference_cache:
            with torch.no_grad():
                return sequence_logprobs(self._reference(policy), batch.ids, batch.labels)
        if split not in self.cache:
            self.fill_reference_cache(policy)
        sums, counts = self.cache[split]
        index = batch.index.cpu()
        return (torch.cat([sums[index, 0], sums[index, 1]]).to(device),
                torch.cat([counts[index, 0], counts[index, 1]]).to(device))

    # -- training -----------------------------------------------------------------------------------------------
    def get_batch(self, generator: torch.Generator) -> PreferenceBatch:
        """``batch_size`` items in the epoch's order (distributed: this rank's slice of the global batch)."""
        indices = self.order.take(self.batch_size * self.world_size)
        if self.world_size > 1:
            indices = indices[self.local(self.batch_size)]
        return make_batch(self.splits["train"], indices, self.pad_id)

    def objective(self, policy: Tensor, policy_counts: Tensor, ref: Tensor, ref_counts: Tensor,
                  desirable: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of ``data.loss`` from (2B,) log-probability sums and counts of the policy and the reference."""
        d = self.data
        B = desirable.shape[0]
        if d.loss == "ipo":  # TRL's IPO: mean log-probability per reply token
            policy, ref = policy / policy_counts.clamp(min=1), ref / ref_counts.clamp(min=1)
        if d.loss == "kto":
            return kto_loss(policy[:B], ref[:B], desirable, policy[B:], ref[B:], d.beta,
                            d.desirable_weight, d.undesirable_weight)
        if d.loss == "ipo":
            return ipo_loss(policy[:B], policy[B:], ref[:B], ref[B:], d.beta)
        return dpo_loss(policy[:B], policy[B:], ref[:B], ref[B:], d.beta, d.label_smoothing)

    def policy_logprobs(self, model: nn.Module, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """(2B,) sums and counts under the policy. KTO's mismatched second half only sets the detached reference
        point, so it runs without a gradient (as in TRL)."""
        if self.data.loss != "kto":
            return sequence_logprobs(model, batch.ids, batch.labels)
        B = batch.index.shape[0]
        first, n_first = sequence_logprobs(model, batch.ids[:B], batch.labels[:B])
        with torch.no_grad():
            second, n_second = sequence_logprobs(model, batch.ids[B:], batch.labels[B:])
        return torch.cat([first, second]), torch.cat([n_first, n_second])

    def loss(self, model: nn.Module, batch: PreferenceBatch) -> tuple[Tensor, int]:
        """(mean loss over the batch's items, number of items)."""
        ref, ref_counts = self.reference_logprobs("train", batch, model)
        policy, counts = self.policy_logprobs(model, batch)
        loss, metrics = self.objective(policy, counts, ref, ref_counts, batch.desirable)
        self.last_metrics = {k: float(v) for k, v in metrics.items()}
        self.window.add(self.last_metrics)
        return loss, int(batch.index.shape[0])

    def train_metrics(self) -> dict[str, float]:
        """The metrics of the training batches since the last call, averaged (each ``metrics.jsonl`` line of a
        training step, and the progress line, show them): ``chosen_reward``, ``rejected_reward``,
        ``reward_acc``, ``margin`` (KTO: and ``kl``), the implicit rewards of :meth:`objective`."""
        return self.window.take()

    # -- evaluation ---------------------------------------------------------------------------------------------
    def eval_split_batches(self, split: str = "val") -> int:
        return -(-len(self.splits[split]) // (self.batch_size * self.world_size))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, max_batches: int | None = -1, split: str = "val",
                 progress: Callable[[int], object] | None = None) -> dict[str, float]:
        """``{split}_loss``, ``_reward_acc``, ``_margin``, ``_chosen_reward``, ``_rejected_reward`` (implicit rewards
        beta * log-ratio), ``_chosen_logp`` / ``_rejected_logp`` (mean summed reply log-probability of the chosen /
        rejected replies, KTO: desirable / undesirable) and, for KTO, ``_kl`` (the reference point), averaged over
        the first ``max_batches`` batches (-1: the task's ``eval_batches``; None: the whole split)."""
        max_batches = self.eval_batches if max_batches == -1 else max_batches
        batches = split_batches(self.splits[split], self.batch_size * self.world_size, self.pad_id,
                                device_of(model), max_batches)

        def measure(batch: PreferenceBatch) -> dict[str, Any]:
            ref, ref_counts = self.reference_logprobs(split, batch, model)
            policy, counts = sequence_logprobs(model, batch.ids, batch.labels)
            loss, metrics = self.objective(policy, counts, ref, ref_counts, batch.desirable)
            B = batch.index.shape[0]
            chosen = batch.desirable if self.data.loss == "kto" else torch.ones_like(batch.desirable)
            rejected = policy[:B][~chosen] if self.data.loss == "kto" else policy[B:]
            return {"loss": loss, **metrics, "chosen_logp": policy[:B][chosen].mean() if chosen.any() else 0.0,
                    "rejected_logp": rejected.mean() if rejected.numel() else 0.0}

        return average_metrics(split, batches, measure, progress)
