"""Group Relative Policy Optimization (GRPO; Shao et al. 2024, DeepSeekMath, section 4): the ``grpo`` task.

Shape legend: P prompts per micro-batch, G completions per prompt (``group_size``), N = P * G rows, L positions.

Each training micro-batch (:meth:`GRPOTask.get_batch`) samples G completions for each of P prompts from the
current policy (no gradient, eval mode, :func:`tokenloom.generation.generate` with the chat template's end marker),
scores them with the recipe's rewards (:mod:`tokenloom.tasks.rewards`, a weighted sum) and normalises the rewards
within each group (:func:`group_advantages`)::

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)

(std with Bessel's correction, as TRL's ``GRPOTrainer`` computes it). The loss (:func:`grpo_loss`) is, per
completion token t of row i, the clipped surrogate plus the k3 estimate of KL(policy || reference)::

    ratio = exp(logp - logp_old)
    l_it = -min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps) * A_i) + beta * (exp(ref - logp) - (ref - logp) - 1)

averaged over each row's completion tokens, then over the rows (every group has G rows, so this is the mean over
the groups of the mean over their members): TRL's ``loss_type="grpo"`` normalisation, the paper's eq. 3. One
update per sample batch, so the old policy is the current one (``logp_old = logp.detach()``: the ratio is 1 and
its gradient the policy gradient, TRL's ``num_iterations=1``); the clipped form is kept for generality. The
log-probabilities are those of ``softmax(logits / temperature)`` at the sampling temperature (TRL's convention).
The reference is frozen: the weights the run started from (``train.init_from``), or the initial weights when it
starts from scratch.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..config import check, check_choice
from ..data.chat import DEFAULT_END_TEXT, DEFAULT_HEADERS, ChatTemplate, Message, chat_template_for, check_messages
from ..data.jsonl import read_jsonl, record_errors
from ..data.tokenizers import TOKENIZERS, Tokenizer, create_tokenizer
from ..devices import device_of
from ..errors import DataError
from ..generation.choose import vocabulary_limit
from ..models.factory import create_model
from ..nn.modes import eval_mode
from .policy import k3_kl, model_token_logprobs, policy_kl, sample_completions, token_logprobs
from .registry import TASKS, Sharded
from .rewards import RewardSet, RewardSpec
from .sequences import IGNORE, pad_sequences
from .vocabulary import config_for_tokenizer

ADVANTAGE_EPS = 1e-4  # added to a group's reward std before dividing (TRL's GRPOTrainer)


def group_advantages(rewards: Tensor, group_size: int, eps: float = ADVANTAGE_EPS) -> Tensor:
    """(N,) rewards, N = P * G in groups of ``group_size`` consecutive rows -> (N,) advantages
    ``(r - mean_group) / (std_group + eps)`` (std with Bessel's correction): mean 0 in each group, std ~1, and 0
    for every row of a group whose rewards are all equal."""
    grouped = rewards.float().view(-1, group_size)  # (P, G)
    mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def grpo_loss(logp: Tensor, ref_logp: Tensor, mask: Tensor, advantages: Tensor, *, beta: float, epsilon: float,
              old_logp: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO loss of (N, L) per-token log-probabilities under the policy (with a gradient) and the reference,
    ``mask`` (N, L) 1 on completion tokens, ``advantages`` (N,); ``old_logp`` the sampling policy's (None: the
    policy itself, detached). Returns (scalar loss, detached metrics ``kl`` -- the mean per-token k3 KL -- and
    ``clip_ratio``); see the module docstring for the formula and normalisation."""
    mask = mask.to(logp.dtype)
    old_logp = logp.detach() if old_logp is None else old_logp
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = k3_kl(logp, ref_logp)
    if beta:
        per_token = per_token + beta * kl
    tokens = mask.sum(-1).clamp(min=1)
    loss = ((per_token * mask).sum(-1) / tokens).mean()
    is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon) & (adv > 0))
    metrics = {"kl": ((kl * mask).sum(-1) / tokens).mean().detach(),
               "clip_ratio": ((is_clipped * mask).sum() / mask.sum().clamp(min=1)).detach()}
    return loss, metrics


@dataclass
class GRPODataConfig:
    path: str = "data/kb/format_grpo.jsonl"  # JSONL: one {"prompt": str | [{"role", "content"}, ...], ...} per line;
    #   the other fields (e.g. "answer") reach the rewards as the example
    val_path: str | None = None  # validation prompts (same format); None = the last val_fraction of path
    val_fraction: float = 0.1  # without val_path: the last fraction of the prompts (at least one) is validation
    template: str = "auto"  # chat template: auto (the checkpoint's, else default) | default | a Jinja string
    tokenizer: str = "char"  # without train.init_from: the tokenizer trained on the prompts' text (char | bpe)
    vocab_size: int | None = None  # bpe only: the size of the learned vocabulary
    rewards: list[RewardSpec] = field(default_factory=list)  # the reward: a weighted sum of named rewards
    #   ({name, weight, options}: regex | exact | contains | length | reward_model, tokenloom.tasks.rewards)
    group_size: int = 8  # G: completions sampled per prompt, their rewards normalised together (>= 2)
    prompts_per_step: int | None = None  # prompts per micro-batch (each with G completions); None = train.batch_size
    max_new_tokens: int = 64  # the longest completion, in tokens
    temperature: float = 1.0  # sampling temperature of the completions (and of the log-probabilities trained)
    top_p: float | None = None  # nucleus sampling of the completions; None = the whole distribution
    beta: float = 0.04  # KL coefficient: weight of the per-token k3 estimate of KL(policy || reference); 0 = off
    epsilon: float = 0.2  # the ratio's clip range [1 - epsilon, 1 + epsilon]
    eval_temperature: float = 0.0  # evaluation completions: 0 = greedy, > 0 = sampled with eval_seed
    eval_seed: int = 0  # the seed of evaluation's sampling (eval_temperature > 0, and the KL estimate)
    kl_samples: int = 2  # policy samples per validation prompt for val_kl (sequence-level KL, the k3 estimator
    #   summed over the tokens: >= 0); 0 = not measured

    def __post_init__(self) -> None:
        check_choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        check(isinstance(self.template, str) and bool(self.template),
              f"data.template must be 'auto', 'default' or a Jinja chat template, got {self.template!r}")
        check(0.0 < self.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        check(bool(self.rewards), "data.rewards must list at least one reward, e.g. [{name: regex, options: "
                                  "{pattern: ...}}]")
        check(self.group_size >= 2, f"data.group_size must be >= 2 (advantages compare completions of one prompt), "
                                    f"got {self.group_size}")
        check(self.prompts_per_step is None or self.prompts_per_step >= 1,
              f"data.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        check(self.max_new_tokens >= 1, f"data.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check(self.temperature > 0, f"data.temperature must be > 0 (completions are sampled), got {self.temperature}")
        check(self.top_p is None or 0 < self.top_p <= 1, f"data.top_p must be in (0, 1] or null, got {self.top_p}")
        check(self.beta >= 0, f"data.beta must be >= 0, got {self.beta}")
        check(0 < self.epsilon < 1, f"data.epsilon must be in (0, 1), got {self.epsilon}")
        check(self.eval_temperature >= 0, f"data.eval_temperature must be >= 0, got {self.eval_temperature}")
        check(0 <= self.eval_seed < 2**63, f"data.eval_seed must be in [0, 2^63), got {self.eval_seed}")
        check(self.kl_samples >= 0, f"data.kl_samples must be >= 0, got {self.kl_samples}")
        if self.tokenizer == "bpe":
            check(self.vocab_size is not None and self.vocab_size >= 257,
                  f"data.vocab_size must be set to at least 257 for a bpe tokenizer, got {self.vocab_size}")


@dataclass
class Prompt:
    """One line of a prompt file: the prompt as messages, the whole JSON object (the example the rewards read) and
    where it came from."""

    messages: list[Message]  # the conversation so far; the completion is the next assistant turn
    example: dict[str, Any]  # the line's JSON object
    where: str  # "path:line"

    @property
    def text(self) -> str:
        """The prompt as the rewards see it: the last user turn's content."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


def read_prompts(path: str | Path) -> list[Prompt]:
    """Every prompt of a JSONL file; a one-line :class:`DataError` naming ``path:line`` for a bad line."""
    prompts: list[Prompt] = []
    for where, obj in read_jsonl(path, "prompt"):
        if not isinstance(obj, dict) or "prompt" not in obj:
            keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{where}: expected a JSON object with a \"prompt\" (a string or a list of messages); "
                            f"got {keys or 'no keys'}")
        prompt = obj["prompt"]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt:
            # (an assistant turn stands in for the completion, so the roles and contents are checked alike)
            messages = check_messages(prompt + [{"role": "assistant", "content": ""}], where)[:-1]
        else:
            raise DataError(f"{where}: \"prompt\" must be a string or a non-empty list of messages, got "
                            f"{json.dumps(prompt)[:60]}")
        prompts.append(Prompt(messages, obj, where))
    if not prompts:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return prompts


class GRPOBatch(NamedTuple):
    """One micro-batch of sampled completions (rows grouped by prompt, G consecutive rows each)."""

    ids: Tensor  # (N, L) prompt + completion ids, right-padded
    labels: Tensor  # (N, L) aligned targets: the completion tokens, -100 elsewhere
    advantages: Tensor  # (N,) group-normalised rewards
    ref_logp: Tensor  # (N, L) the reference's log-probabilities of the labels (0 where -100)


@TASKS.register("grpo")
class GRPOTask(Sharded):
    """GRPO over a prompt file with programmatic or learned rewards (module docstring). Per-step metrics (averaged
    over the steps of each ``metrics.jsonl`` line, :meth:`train_metrics`): ``reward``, ``reward_std`` (the mean
    within-group std), ``kl`` (per token), ``completion_length`` (tokens), ``zero_std_groups`` (the fraction of
    groups whose rewards are all equal: no policy gradient from them), ``clip_ratio``. Evaluation
    (:meth:`evaluate`): ``val_reward``, ``val_satisfied`` (the fraction of completions at the highest total the
    rewards allow, when they are bounded), ``val_length`` and ``val_kl`` (:func:`~tokenloom.tasks.policy.policy_kl`'s
    k3 estimate, nats per sequence, never negative). ``tokenloom train`` ends with ``val_reward``, ``val_satisfied``
    and ``val_kl`` (:attr:`summary_metrics`)."""

    data_config_cls = GRPODataConfig
    default_family = "gpt"
    summary_metrics = (("val_reward", 4), ("val_satisfied", 4), ("val_kl", 4))  # no val_loss: what the run reached
    needs_reference = True  # setup() gets train.init_from: the frozen reference's weights

    def __init__(self, policy: nn.Module, reference: nn.Module, tokenizer: Tokenizer, template: ChatTemplate,
                 train: list[Prompt], val: list[Prompt], rewards: RewardSet, data: GRPODataConfig, *,
                 prompts_per_step: int, eval_batches: int | None = 20, seed: int = 0) -> None:
        self.policy, self.reference = policy, reference.requires_grad_(False).eval()
        self.tokenizer, self.template, self.rewards, self.data = tokenizer, template, rewards, data
        self.splits = {"train": train, "val": val}
        self.prompt_ids = {name: [_encode_prompt(template, tokenizer, p) for p in prompts]
                           for name, prompts in self.splits.items()}
        self.prompts_per_step, self.eval_batches, self.seed = prompts_per_step, eval_batches, seed
        self.vocab_limit = vocabulary_limit(tokenizer, getattr(getattr(policy, "config", None), "vocab_size", None))
        self.epoch, self.position = 0, 0  # the pass over the training prompts and the next prompt of its order
        self._order: Tensor | None = None
        self._metrics: dict[str, list[float]] = {}

    # -- data position --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        state = state or {}
        self.epoch, self.position = int(state.get("epoch", 0)), int(state.get("position", 0))
        self._order = None

    def _next_prompts(self, count: int) -> list[int]:
        """The next ``count`` training prompts: passes over a random order (seeded by the run's seed and the pass)."""
        n = len(self.splits["train"])
        picked: list[int] = []
        while len(picked) < count:
            if self._order is None or self.position >= n:
                if self._order is not None:
                    self.epoch, self.position = self.epoch + 1, 0
                gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**63)
                self._order = torch.randperm(n, generator=gen)
            take = min(count - len(picked), n - self.position)
            picked += self._order[self.position:self.position + take].tolist()
            self.position += take
        return picked

    # -- training ---------------------------------------------------------------------------------
    def get_batch(self, generator: torch.Generator) -> GRPOBatch:
        """Sample G completions for each of this rank's prompts (the global batch's slice), score them and compute
        their advantages and the reference's log-probabilities (on the policy's device)."""
        P, G = self.prompts_per_step, self.data.group_size
        chosen = self._next_prompts(P * self.world_size)[self.local(P)]
        prompts = [self.splits["train"][i] for i in chosen]
        rows = [self.prompt_ids["train"][i] for i in chosen for _ in range(G)]
        rollouts = sample_completions(self.policy, self.tokenizer, self.template, rows,
                                      max_new_tokens=self.data.max_new_tokens, temperature=self.data.temperature,
                                      top_p=self.data.top_p)
        examples = [p for p in prompts for _ in range(G)]
        self.rewards.prepare(device_of(self.policy))
        totals, _ = self.rewards.score([p.text for p in examples], rollouts.texts, [p.example for p in examples])
        rewards = torch.tensor(totals, dtype=torch.float32)
        advantages = group_advantages(rewards, G)
        ids, labels, _ = pad_sequences(*rollouts.rows(), self.tokenizer.pad_id)
        device = device_of(self.policy)
        ids, labels = ids.to(device), labels.to(device)
        ref_logp = self._reference_logprobs(ids, labels, device)
        grouped = rewards.view(-1, G)
        self._record(reward=float(rewards.mean()), reward_std=float(grouped.std(dim=1).mean()),
                     zero_std_groups=float((grouped.max(dim=1).values == grouped.min(dim=1).values).float().mean()),
                     completion_length=sum(map(len, rollouts.completion_ids)) / len(rows),
                     ended=sum(rollouts.ended) / len(rows))
        return GRPOBatch(ids, labels, advantages.to(device), ref_logp)

    @torch.no_grad()
    def _reference_logprobs(self, ids: Tensor, labels: Tensor, device: torch.device) -> Tensor:
        if device_of(self.reference) != device:
            self.reference.to(device)
        return model_token_logprobs(self.reference, ids, labels, self.data.temperature, self.vocab_limit).float()

    def loss(self, model: nn.Module, batch: GRPOBatch) -> tuple[Tensor, int]:
        """(the GRPO loss, the number of completion tokens)."""
        logits = model(batch.ids)  # (N, L, V)
        logp = token_logprobs(logits, batch.labels, self.data.temperature, self.vocab_limit)
        mask = batch.labels != IGNORE
        loss, metrics = grpo_loss(logp, batch.ref_logp, mask, batch.advantages, beta=self.data.beta,
                                  epsilon=self.data.epsilon)
        self._record(**{name: float(value) for name, value in metrics.items()})
        return loss, int(mask.sum())

    def _record(self, **values: float) -> None:
        for name, value in values.items():
            self._metrics.setdefault(name, []).append(value)

    def train_metrics(self) -> dict[str, float]:
        """The per-step metrics averaged over the micro-batches since the last call (then forgotten)."""
        out = {name: round(sum(v) / len(v), 6) for name, v in self._metrics.items() if v}
        self._metrics = {}
        return out

    # -- evaluation -------------------------------------------------------------------------------
    def eval_split_batches(self, split: str = "val") -> int:
        """Batches of ``prompts_per_step`` prompts in the whole of ``split``."""
        return -(-len(self.splits[split]) // self.prompts_per_step)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, max_batches: int | None = -1, split: str = "val",
                 progress: Callable[[int], object] | None = None) -> dict[str, float]:
        """Completions (greedy, or sampled with ``data.eval_seed``) for the first ``max_batches`` batches of
        ``prompts_per_step`` prompts of ``split`` (-1: ``train.eval_batches``; None: all): ``{split}_reward`` (mean
        total reward), ``{split}_satisfied`` (fraction at the highest total, bounded rewards only),
        ``{split}_length`` (completion tokens), ``{split}_ended`` (fraction ending with the end marker) and
        ``{split}_kl`` (KL(policy || reference) in nats per sequence on ``kl_samples`` samples per prompt: the k3
        estimator summed over each completion's tokens, >= 0)."""
        check(split in self.splits, f"split must be one of {', '.join(self.splits)}, got {split!r}")
        max_batches = self.eval_batches if max_batches == -1 else max_batches
        prompts = self.splits[split]
        count = len(prompts) if max_batches is None else min(len(prompts), max_batches * self.prompts_per_step)
        prompts, ids = prompts[:count], self.prompt_ids[split][:count]
        d = self.data
        with eval_mode(model):
            rollouts = sample_completions(model, self.tokenizer, self.template, ids, max_new_tokens=d.max_new_tokens,
                                          temperature=d.eval_temperature, top_p=d.top_p, seed=d.eval_seed,
                                          batch_size=self.prompts_per_step * d.group_size)
        self.rewards.prepare(device_of(model))
        totals, parts = self.rewards.score([p.text for p in prompts], rollouts.texts, [p.example for p in prompts])
        out = {f"{split}_reward": sum(totals) / count,
               f"{split}_length": sum(map(len, rollouts.completion_ids)) / count,
               f"{split}_ended": sum(rollouts.ended) / count}
        best = self.rewards.best
        if best is not None:
            out[f"{split}_satisfied"] = sum(t >= best - 1e-6 for t in totals) / count
        if len(parts) > 1:
            for i, (name, values) in enumerate(zip(self.rewards.names, parts, strict=True)):
                out[f"{split}_reward_{i}_{name}"] = sum(values) / count
        if d.kl_samples:
            if device_of(self.reference) != device_of(model):
                self.reference.to(device_of(model))
            out[f"{split}_kl"] = policy_kl(model, self.reference, self.tokenizer, [p.messages for p in prompts],
                                           self.template, d.kl_samples, max_new_tokens=d.max_new_tokens,
                                           seed=d.eval_seed, batch_size=self.prompts_per_step * d.group_size)
        if progress is not None:
            progress(count)
        return out

    # -- setup ------------------------------------------------------------------------------------
    @classmethod
    def setup(cls, data: GRPODataConfig, model_section: dict[str, Any], run_dir: Path, *, batch_size: int,
              seq_len: int | None, label_smoothing: float, eval_batches: int | None,
              tokenizer: Tokenizer | None = None, seed: int = 0,
              reference: str | Path | None = None) -> tuple[GRPOTask, nn.Module, Tokenizer, dict[str, Any]]:
        """Prompts, tokenizer (trained on the prompts' text unless given), chat template, rewards, the policy and
        its frozen reference (the weights of checkpoint ``reference`` -- ``train.init_from`` -- else a copy of the
        policy's initial weights). Returns (task, policy, tokenizer, resolved model section)."""
        train = read_prompts(data.path)
        if data.val_path:
            val = read_prompts(data.val_path)
        else:
            cut = len(train) - max(1, int(len(train) * data.val_fraction))
            if cut < 1:
                raise DataError(f"{data.path}: {len(train)} prompt(s) cannot be split into training and validation; "
                                "add prompts or set data.val_path")
            train, val = train[:cut], train[cut:]
        rewards = RewardSet(data.rewards)
        for prompt in train + val:
            rewards.check_example(prompt.example, prompt.where)
        if tokenizer is None:
            tokenizer = create_tokenizer(data.tokenizer, _tokenizer_text(train + val), data.vocab_size)
        template = chat_template_for(tokenizer, tokenizer.chat_template, data.template, setting="data.template",
                                     bos_token=tokenizer.bos_token)
        tokenizer.chat_template = template.recorded  # checkpoints record the template used
        family, model_config, section, _ = config_for_tokenizer(model_section, tokenizer)
        model = create_model(family, model_config)
        reference_model = copy.deepcopy(model)
        if reference is not None:
            from ..checkpoint import load_weights

            load_weights(reference_model, reference)
        rewards.prepare()
        task = cls(model, reference_model, tokenizer, template, train, val, rewards, data,
                   prompts_per_step=data.prompts_per_step or batch_size, eval_batches=eval_batches, seed=seed)
        limit = model_config.max_seq_len
        for split, prompts in task.splits.items():
            longest = max(range(len(prompts)), key=lambda i: len(task.prompt_ids[split][i]))
            need = len(task.prompt_ids[split][longest]) + data.max_new_tokens
            if need > limit:
                raise DataError(f"{prompts[longest].where}: the prompt is {need - data.max_new_tokens} tokens; with "
                                f"data.max_new_tokens={data.max_new_tokens} it needs {need} positions, more than "
                                f"model.max_seq_len={limit}")
        return task, model, tokenizer, {"family": family, **section}


def _encode_prompt(template: ChatTemplate, tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    """The prompt's ids with the generation prompt; an encoding error names its ``path:line``."""
    with record_errors(prompt.where):
        return template.encode_prompt(tokenizer, prompt.messages)


def _tokenizer_text(prompts: list[Prompt]) -> str:
    """The text a tokenizer trained for a fresh run learns: the default template's headers and end, every message and
    every string of the examples (the answers)."""
    parts = [*DEFAULT_HEADERS.values(), DEFAULT_END_TEXT]
    for prompt in prompts:
        parts += [m["content"] for m in prompt.messages]
        parts += [v for v in prompt.example.values() if isinstance(v, str)]
        parts += [x for v in prompt.example.values() if isinstance(v, list) for x in v if isinstance(x, str)]
    return "\n".join(parts)
