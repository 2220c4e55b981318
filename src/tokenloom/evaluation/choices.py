"""Multiple-choice scoring by continuation log-likelihood, offline, the way lm-evaluation-harness scores a
``multiple_choice`` task (``lm_eval`` 0.4.x, ``TemplateLM._encode_pair`` and ``ConfigurableTask.process_results``),
so that its numbers can be checked against an ``lm_eval --model local-completions`` run on ``tokenloom serve``::

    model, _ = load_model("checkpoints/shakespeare-char")
    tokenizer = load_tokenizer("checkpoints/shakespeare-char")
    results = score_choices(model, tokenizer, [{"context": "...", "choices": ["...", ...], "label": 0}, ...])
    results[0]["loglikelihoods"], results[0]["is_greedy"], results[0]["pred"], results[0]["acc"]
    choice_accuracy(results)        # {"acc": 61.5, "acc_norm": 65.5, ...}: 0-100, as the other metrics

Per request ``(context, target_delimiter + choice)``, as lm-eval does for a causal model:

* trailing whitespace of the context moves to the start of the continuation;
* ``whole = encode(context + continuation)``, ``context_ids = encode(context)``, and the continuation's ids are
  ``whole[len(context_ids):]`` (the whole text encoded once, then split where the context's tokens end);
* the input is the last ``max_length - 1`` ids of ``context_ids + continuation_ids`` (lm-eval keeps one position for
  the token its API request generates; ``max_length`` is its model argument, here the model's context by default);
* the log-likelihood is the sum over the continuation's tokens of ``log_softmax`` (float32) of the logits at the
  position before each (teacher forcing), summed as Python floats in order; ``is_greedy`` is whether each token's
  log-probability equals the largest at its position (lm-eval's test on an API reply: ``token_logprob ==
  max(top_logprobs.values())``, so a tie counts as greedy).

Per item: ``pred`` = argmax of the sums (``acc``), ``pred_norm`` = argmax of sum / ``len(choice)`` in characters
(``acc_norm``; the choice without the delimiter), ``pred_bytes`` = argmax of sum / UTF-8 bytes of the choice
(``acc_bytes``); argmax takes the first of equal values, as ``numpy.argmax``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import DataError


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's ``TemplateLM._encode_pair`` makes them for a causal model."""
    if not context:
        raise DataError("an empty context needs a prefix token (lm-eval uses BOS or EOS), which this scorer does "
                        "not add")
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = list(tokenizer.encode(context + continuation))
    context_ids = list(tokenizer.encode(context))
    return context_ids, whole[len(context_ids):]


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first of equal maxima


@torch.no_grad()
def continuation_scores(model: nn.Module, requests: Sequence[tuple[list[int], list[int]]],
                        max_length: int | None = None) -> list[tuple[float, bool, list[float]]]:
    """(sum of log-probabilities, is_greedy, per-token log-probabilities) of each (context ids, continuation ids),
    teacher-forced. The requests run as one right-padded batch (a causal model: padding after a row changes none of
    its positions)."""
    if max_length is None:
        max_length = int(model.config.max_seq_len)
    window = max_length - 1
    rows, starts = [], []
    for context_ids, continuation_ids in requests:
        if not continuation_ids:
            raise DataError("a continuation with no tokens has no log-likelihood")
        if len(continuation_ids) >= window:
            raise DataError(f"a continuation of {len(continuation_ids)} tokens leaves no context in a window of "
                            f"{window} tokens")
        ids = (list(context_ids) + list(continuation_ids))[-window:]
        rows.append(ids)
        starts.append(len(ids) - len(continuation_ids))  # lm-eval's ctxlen, after left truncation
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    for i, ids in enumerate(rows):
        batch[i, :len(ids)] = torch.tensor(ids)
    logp = torch.log_softmax(model(batch.to(device)).float(), dim=-1).cpu()
    out = []
    for i, (ids, start) in enumerate(zip(rows, starts, strict=True)):
        targets = torch.tensor(ids[start:])
        positions = logp[i, start - 1:len(ids) - 1]  # position j - 1 predicts token j
        chosen = positions.gather(1, targets[:, None])[:, 0]
        values = chosen.tolist()
        greedy = bool((chosen == positions.max(dim=-1).values).all())
        out.append((sum(values), greedy, values))
    return out


def score_choices(model: nn.Module, tokenizer: Any, items: Iterable[dict], target_delimiter: str = "",
                  max_length: int | None = None) -> list[dict]:
    """Score each item (``context``, ``choices``, ``label``) as lm-eval's ``multiple_choice`` does; see the module
    docstring. Each result: ``loglikelihoods``, ``is_greedy`` and ``lengths`` (continuation tokens) per choice,
    ``pred``, ``pred_norm``, ``pred_bytes``, ``label``, and ``acc``, ``acc_norm``, ``acc_bytes`` (1.0 or 0.0)."""
    was_training = model.training
    model.eval()
    results = []
    try:
        for n, item in enumerate(items):
            context, choices, label = item["context"], list(item["choices"]), item["label"]
            if not choices or not 0 <= int(label) < len(choices):
                raise DataError(f"item {n}: label {label!r} is not the index of one of its {len(choices)} choices")
            pairs = [encode_pair(tokenizer, context, target_delimiter + c) for c in choices]
            scored = continuation_scores(model, pairs, max_length)
            lls = [s[0] for s in scored]
            pred = _argmax(lls)
            pred_norm = _argmax([ll / len(c) for ll, c in zip(lls, choices, strict=True)])
            pred_bytes = _argmax([ll / len(c.encode("utf-8")) for ll, c in zip(lls, choices, strict=True)])
            results.append({"loglikelihoods": lls, "is_greedy": [s[1] for s in scored],
                            "lengths": [len(p[1]) for p in pairs], "label": int(label), "pred": pred,
                            "pred_norm": pred_norm, "pred_bytes": pred_bytes, "acc": float(pred == label),
                            "acc_norm": float(pred_norm == label), "acc_bytes": float(pred_bytes == label)})
    finally:
        model.train(was_training)
    return results


def choice_accuracy(results: Sequence[dict]) -> dict[str, float]:
    """``acc``, ``acc_norm``, ``acc_bytes`` over ``score_choices``'s results, on the 0-100 scale of the other
    metrics (lm-eval reports the same means on 0-1), and ``count``."""
    if not results:
        raise DataError("no results to average")
    n = len(results)
    return {**{k: 100.0 * sum(r[k] for r in results) / n for k in ("acc", "acc_norm", "acc_bytes")}, "count": n}
