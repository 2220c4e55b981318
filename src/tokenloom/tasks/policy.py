"""A policy's own samples and what is measured on them: completions of chat prompts (:func:`sample_completions`),
per-token log-probabilities (:func:`token_logprobs`), the k3 per-token KL estimate (:func:`k3_kl`) and the
sequence-level KL between a policy and its reference (:func:`policy_kl`) -- shared by the ``grpo`` task, the
preference tasks' reports and the demos.

Shape legend: N rows (prompt + completion), L positions, V vocabulary size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..data.chat import ChatTemplate, Message
from ..data.tokenizers import Tokenizer
from ..devices import device_of
from ..generation import GenerationConfig, generate
from ..generation.choose import vocabulary_limit
from ..nn.modes import eval_mode
from .sequences import IGNORE, pad_sequences

UNSET = -1  # the id generation writes after a row has stopped (never a real token: completions are read without it)


@dataclass
class Rollouts:
    """Completions sampled for prompts, row by row: ``prompt_ids[i] + completion_ids[i]`` is row i's sequence."""

    prompt_ids: list[list[int]]  # the prompt's ids, ending in the assistant header
    completion_ids: list[list[int]]  # the generated ids, its end marker (eos id / stop-string tokens) included
    texts: list[str]  # the reply: the completion decoded, cut before the end marker
    ended: list[bool]  # whether the completion ended with the end marker (False: cut at max_new_tokens)

    def rows(self) -> tuple[list[list[int]], list[list[bool]]]:
        """(ids, trained) per row for :func:`~tokenloom.tasks.sequences.pad_sequences`: the completion's tokens are
        the trained ones."""
        ids = [p + c for p, c in zip(self.prompt_ids, self.completion_ids, strict=True)]
        trained = [[False] * len(p) + [True] * len(c) for p, c in zip(self.prompt_ids, self.completion_ids,
                                                                       strict=True)]
        return ids, trained


def as_messages(prompt: str | Sequence[Message]) -> list[Message]:
    """A prompt as chat messages: a string is one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


@torch.no_grad()
def sample_completions(model: nn.Module, tokenizer: Tokenizer, template: ChatTemplate,
                       prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
                       top_p: float | None = None, seed: int | None = None, batch_size: int | None = None) -> Rollouts:
    """One completion per row of ``prompt_ids`` (repeat a prompt for several), decoded in batches of ``batch_size``
    rows (None: all at once) with the template's end marker (its eos id and stop strings) ending each row;
    ``temperature`` 0 is greedy. ``seed`` fixes the samples (None: the global generator)."""
    device = device_of(model)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature,
                              top_p=top_p, eos_token_id=template.stop_token_id, pad_token_id=UNSET,
                              stop_strings=list(template.stop_strings), seed=seed)
    rows = [list(p) for p in prompt_ids]
    step = batch_size or max(1, len(rows))
    completions: list[list[int]] = []
    for start in range(0, len(rows), step):
        chunk = rows[start:start + step]
        width = max(len(r) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, r in enumerate(chunk):  # left padding: every prompt ends where generation starts
            ids[i, width - len(r):] = torch.as_tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
        out = generate(model, ids.to(device), config, attention_mask=mask.to(device), tokenizer=tokenizer)
        for row in out[:, width:].tolist():
            completions.append([t for t in row if t != UNSET])  # (UNSET only ever trails a stopped row)
    texts, ended = [], []
    eos = template.stop_token_id
    for ids in completions:
        body = ids[:-1] if eos is not None and ids and ids[-1] == eos else ids
        text = tokenizer.decode(body)
        reply = template.reply(text)
        texts.append(reply)
        ended.append(len(body) < len(ids) or len(reply) < len(text))
    return Rollouts([list(r) for r in rows], completions, texts, ended)


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0, vocab_limit: int | None = None) -> Tensor:
    """(N, L) log-probability of each aligned label (``labels[:, t]`` the target of ``logits[:, t]``) under
    ``softmax(logits / temperature)`` in float32, over the first ``vocab_limit`` ids when given (those a sampler can
    emit); 0 where the label is -100."""
    logits = logits.float()
    if vocab_limit is not None:
        logits = logits[..., :vocab_limit]
    if temperature != 1.0:
        logits = logits / temperature
    scored = labels != IGNORE
    picked = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return picked * scored


def model_token_logprobs(model: nn.Module, ids: Tensor, labels: Tensor, temperature: float = 1.0,
                         vocab_limit: int | None = None) -> Tensor:
    """:func:`token_logprobs` of ``model(ids)`` (right-padded rows: a causal model needs no mask)."""
    return token_logprobs(model(ids), labels, temperature, vocab_limit)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference) on tokens sampled from the policy (Schulman 2020, "Approximating
    KL divergence"; the GRPO paper's eq. 4): ``exp(ref - logp) - (ref - logp) - 1``, >= 0, 0 exactly where the two
    log-probabilities agree; unbiased in expectation over the policy's samples."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


KL_ESTIMATORS = ("k3", "k1")  # policy_kl's estimators of the sequence KL (see its docstring)


@torch.no_grad()
def policy_kl(policy: nn.Module, reference: nn.Module, tokenizer: Tokenizer,
              prompts: Sequence[str | Sequence[Message]], template: ChatTemplate, samples_per_prompt: int = 4, *,
              max_new_tokens: int = 64, seed: int = 0, batch_size: int | None = 64, estimator: str = "k3",
              details: dict[str, Any] | None = None) -> float:
    """KL(policy || reference) in nats per sequence, estimated by Monte Carlo over the policy's own samples:
    ``samples_per_prompt`` completions per prompt drawn from the policy at temperature 1 (seeded), each contributing
    a sum over its completion tokens (the end marker included), then averaged over every sample. Two estimators,
    both unbiased for the KL of the completion distribution when no completion is cut at ``max_new_tokens`` (a cut
    one counts its first ``max_new_tokens`` tokens):

    - ``k3`` (the default): ``sum_t k3_kl(logp_t, ref_t)`` = ``sum_t exp(r_t) - r_t - 1`` with ``r_t = log pi_ref -
      log pi``, each term >= 0 and, given the prefix, of expectation the KL of that token's distribution; so the
      estimate is never negative, 0 exactly when the two models agree on every sampled token, and of lower variance
      when the models are close (Schulman 2020; the estimator of GRPO's loss, TRL and DeepSeekMath).
    - ``k1``: ``sum_t log pi - log pi_ref``, the plain log-ratio: unbiased too, but a single sample's value is
      negative whenever the reference likes the sample more than the policy does, so on few samples of two close
      models the mean can come out below 0 (what a ``val_kl`` of -0.003 was).

    ``details``, when given, receives ``kl_std`` (the chosen estimator's standard deviation over the samples),
    ``samples``, and both estimates (``kl_k3``, ``kl_k1``)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")
    ids_list = [template.encode_prompt(tokenizer, as_messages(p)) for p in prompts]
    repeated = [ids for ids in ids_list for _ in range(samples_per_prompt)]
    rollouts = sample_completions(policy, tokenizer, template, repeated, max_new_tokens=max_new_tokens,
                                  temperature=1.0, seed=seed, batch_size=batch_size)
    rows, trained = rollouts.rows()
    limit = vocabulary_limit(tokenizer, getattr(getattr(policy, "config", None), "vocab_size", None))
    step = batch_size or len(rows)
    values: dict[str, list[Tensor]] = {"k3": [], "k1": []}
    with eval_mode(policy), eval_mode(reference):
        for start in range(0, len(rows), step):
            ids, labels, _ = pad_sequences(rows[start:start + step], trained[start:start + step], tokenizer.pad_id)
            logp = model_token_logprobs(policy, ids.to(device_of(policy)), labels.to(device_of(policy)),
                                        vocab_limit=limit)
            ref = model_token_logprobs(reference, ids.to(device_of(reference)), labels.to(device_of(reference)),
                                       vocab_limit=limit).to(logp.device)
            scored = (labels != IGNORE).to(logp.device)
            values["k3"].append((k3_kl(logp, ref) * scored).sum(-1).cpu())
            values["k1"].append((logp - ref).sum(-1).cpu())
    per_sample = {name: torch.cat(parts) for name, parts in values.items()}
    kl = per_sample[estimator]
    if details is not None:
        details.update(kl_std=float(kl.std()) if kl.numel() > 1 else 0.0, samples=int(kl.numel()),
                       **{f"kl_{name}": float(v.mean()) for name, v in per_sample.items()})
    return float(kl.mean())


def kl_per_token(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """(N,) mean k3 KL over each row's completion tokens (``mask`` (N, L) 1 on them)."""
    mask = mask.to(logp.dtype)
    return (k3_kl(logp, ref_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1)


