"""Best-of-n sampling: n completions of one prompt sampled as n rows of one batch, each scored by a reward (a
trained reward model, :func:`tokenloom.tasks.reward.load_scorer`, or any function of the prompt and completion
texts), and the highest-scoring one kept -- the cheap baseline of preference alignment (rejection sampling at
inference time; Stiennon et al. 2020, Nakano et al. 2021)::

    result = best_of_n(model, tokenizer, "Q: 2+2?", n=8, config=GenerationConfig(max_new_tokens=20, seed=0),
                       reward=lambda prompt, completion: float("4" in completion))
    result.text, result.scores  # the best completion, every completion's score

Shape legend: n samples, T prompt length, k new tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ..data.tokenizers import Tokenizer
from ..devices import device_of
from ..errors import GenerationError
from .config import GenerationConfig
from .generate import generate

UNSET = -1  # written after a row stopped (never a token id): completions are read without it

Reward = Callable[[str, str], float]  # (prompt, completion) -> score
BatchReward = Callable[[list[str], list[str]], Sequence[float]]  # (prompts, completions) -> scores


@dataclass
class BestOfN:
    """The n samples of a prompt and their scores; ``text`` is the best (the first of equal best scores)."""

    text: str  # the best completion
    index: int  # its sample number
    completions: list[str]  # every completion, in sample order
    scores: list[float]  # their scores
    sequences: Tensor  # (n, T + k) prompt and new ids per sample (UNSET after a row stopped)


def completion_texts(tokenizer: Tokenizer, sequences: Tensor, prompt_len: int, eos_token_id: int | None,
                     stop_strings: Sequence[str] = ()) -> list[str]:
    """The new text of each (n, T + k) row: its ids after the prompt up to (without) the eos token, decoded, and
    cut before the first stop string (the reply alone, as a reward scores it)."""
    out = []
    for row in sequences[:, prompt_len:].tolist():
        ids = [t for t in row if t != UNSET]
        if eos_token_id is not None and eos_token_id in ids:
            ids = ids[:ids.index(eos_token_id)]
        text = tokenizer.decode(ids)
        cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=len(text))
        out.append(text[:cut])
    return out


@torch.no_grad()
def best_of_n(model: nn.Module, tokenizer: Tokenizer, prompt: str | Sequence[int], n: int,
              config: GenerationConfig | None = None, *, reward: Reward | None = None,
              batch_reward: BatchReward | None = None, prompt_text: str | None = None) -> BestOfN:
    """Sample ``n`` completions of ``prompt`` (text, or its token ids) in one batch of ``n`` rows with ``config``
    (sampling; one seeded generator for the batch: ``n=1`` gives exactly :func:`generate`'s sample with the same
    seed) and keep the best by ``reward(prompt, completion)`` or ``batch_reward(prompts, completions)`` (give one).
    ``prompt_text`` is the prompt the reward sees (default: ``prompt`` itself, or the ids decoded) -- a chat
    prompt's user message rather than its rendered template, for instance."""
    if (reward is None) == (batch_reward is None):
        raise GenerationError("best_of_n needs one reward: reward=(prompt, completion) -> float or "
                              "batch_reward=(prompts, completions) -> scores")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise GenerationError(f"best-of-n needs n >= 1 samples, got {n!r}")
    config = replace(config or GenerationConfig(), pad_token_id=UNSET)
    if config.num_beams > 1 or not config.do_sample or config.temperature == 0:
        raise GenerationError("best-of-n samples its candidates: use do_sample with a temperature > 0 and no beams "
                              "(greedy or beam search would give n equal completions)")
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise GenerationError("the prompt is empty after tokenization")
    if prompt_text is None:
        prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
    batch = torch.tensor([ids] * n, dtype=torch.long, device=device_of(model))  # (n, T)
    sequences = generate(model, batch, config, tokenizer=tokenizer)  # (n, T + k)
    completions = completion_texts(tokenizer, sequences, len(ids), config.eos_token_id, config.stop_strings)
    if reward is not None:
        scores = [float(reward(prompt_text, c)) for c in completions]
    else:
        scores = [float(s) for s in batch_reward([prompt_text] * n, completions)]
        if len(scores) != n:
            raise GenerationError(f"the reward gave {len(scores)} scores for {n} completions")
    ranked = [s if s == s else float("-inf") for s in scores]  # a NaN score never wins
    best = max(range(n), key=lambda i: (ranked[i], -i))
    return BestOfN(completions[best], best, completions, scores, sequences.cpu())
