"""Reward models: a causal LM with a sequence-level scalar head (``family: gpt_reward``).

Shape legend: B batch, T positions, C embed_dim.

:class:`GPTReward` is a :class:`~tokenloom.models.gpt.GPT` (the same config, the same parameter names) plus
``score_head`` (C -> 1, no bias: a bias cancels in the pairwise Bradley-Terry loss), read at the final hidden state
of each row's last real token. So ``train.init_from`` a language model's checkpoint (an SFT model, an imported
GPT-2 or Llama) loads the whole backbone and starts only the head fresh (``RewardTask.fresh_weights``), and a
reward checkpoint loads with :func:`tokenloom.checkpoint.load_model` like any other. Its ``forward`` stays the
language model's (it still decodes, as the model it started from); :meth:`GPTReward.score` is the reward::

    rewards = model.score(ids, attention_mask)   # (B,) float32
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .gpt import GPT, GPTConfig
from .registry import MODELS

REWARD_FAMILIES = {"gpt": "gpt_reward"}  # a language-model family -> the reward family sharing its weights


class SequenceScorer(nn.Module):
    """A model that scores whole sequences: ``score(input_ids (B, T), attention_mask (B, T) | None) -> (B,)``.
    The reward task and :func:`tokenloom.tasks.reward.score` take any subclass (declared by inheritance)."""

    def score(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        raise NotImplementedError


def last_token_index(attention_mask: Tensor | None, T: int, B: int, device: torch.device) -> Tensor:
    """(B,) index of each row's last real token: the last 1 of the (B, T) 0/1 ``attention_mask`` (right or left
    padding alike), T - 1 without a mask."""
    if attention_mask is None:
        return torch.full((B,), T - 1, dtype=torch.long, device=device)
    return (T - 1) - attention_mask.long().flip(1).argmax(1)


class GPTReward(GPT, SequenceScorer):
    """GPT backbone -> final hidden state of the last real token -> ``score_head`` -> a scalar per row."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.score_head = nn.Linear(config.embed_dim, 1, bias=False)
        nn.init.normal_(self.score_head.weight, mean=0.0, std=1.0 / (config.embed_dim + 1) ** 0.5)

    def score(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """(B, T) ids and their (B, T) 0/1 mask (padding on either side) -> (B,) float32 rewards. Causal attention
        keeps a row's last real token blind to padding after it; padding before it is masked by ``attention_mask``
        (positions then count real tokens only)."""
        B, T = input_ids.shape
        hidden, _ = self.forward_features(input_ids, attention_mask=attention_mask)  # (B, T, C)
        index = last_token_index(attention_mask, T, B, input_ids.device)
        last = hidden[torch.arange(B, device=input_ids.device), index]  # (B, C)
        return self.score_head(last).squeeze(-1).float()


MODELS.register("gpt_reward")((GPTConfig, GPTReward))


def reward_family(family: str) -> str:
    """The reward family for a model section's ``family``: itself when it is one, the reward family sharing the
    weights of a language-model family (``gpt`` -> ``gpt_reward``); else a one-line error."""
    from ..errors import ConfigError

    if family in REWARD_FAMILIES.values():
        return family
    if family in REWARD_FAMILIES:
        return REWARD_FAMILIES[family]
    raise ConfigError(f"model.family={family!r} has no reward model; reward families: "
                      f"{', '.join(sorted(REWARD_FAMILIES.values()))} (from {', '.join(sorted(REWARD_FAMILIES))})")
