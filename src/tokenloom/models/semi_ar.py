"""The semi-autoregressive Transformer (Wang, Zhang & Chen 2018, "Semi-Autoregressive Neural Machine Translation").

Shape legend: B batch, S source length, T target positions, C embed_dim, V vocab_size, K group_size.

The target is cut into groups of K positions: the K tokens of a group are predicted in parallel, the groups one
after another. Two changes to the encoder-decoder (:class:`~tokenloom.models.seq2seq.EncoderDecoder`, whose
encoder, decoder blocks, embeddings, caches and parameter names this model keeps, so an autoregressive checkpoint
initialises it):

* short-distance prediction: the decoder input at position i is the target token at i - K (the first K inputs are
  BOS), so the K positions of a group all read the previous group (:func:`shift_inputs`, from the autoregressive
  input [BOS] y the translation task builds);
* group-causal self-attention: position i (group i // K) sees every position of its own and earlier groups, never
  one of a later group (:func:`tokenloom.nn.masks.attention_mask` with ``group=K``).

With K = 1 both are the autoregressive model's. Decoding (greedy inside each group, K tokens per step over the
KV cache) is :func:`tokenloom.generation.semi_ar.semi_ar_decode`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import check
from .options import LINEAR_ATTENTION
from .registry import MODELS, declare_decoding
from .seq2seq import EncoderDecoder, Seq2SeqConfig
from .transfer import VOCABULARY_TENSORS, WeightMap, declare_start


@dataclass
class SemiARConfig(Seq2SeqConfig):
    """A semi-autoregressive encoder-decoder (``model:`` with ``family: semi_ar``): the encoder-decoder's settings
    plus the group size K."""

    group_size: int = 2  # K: target tokens predicted in parallel per decoding step (1 = autoregressive)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(isinstance(self.group_size, int) and 1 <= self.group_size <= self.max_target_len,
              f"group_size must be an integer from 1 to max_target_len={self.max_target_len}, got {self.group_size!r}")
        check(self.group_size == 1 or self.attention not in LINEAR_ATTENTION,
              f"attention {self.attention!r} has no group-causal mask (group_size={self.group_size}); use sdpa or math")


def shift_inputs(target_in: Tensor, group_size: int, bos_id: int) -> Tensor:
    """(B, T) autoregressive decoder inputs [BOS] y (right-padded) -> (B, T') semi-autoregressive ones, T' = T
    rounded up to whole groups of K: K - 1 more BOS in front, so input i is target_out[i - K] (y, then EOS) and the
    first K are BOS. The last group is whole, as in decoding (cut at T, the longest rows' last targets would see
    fewer inputs of their group than decoding gives them). Padding moves right with the tokens: a row of L targets
    (y + EOS) has real inputs up to position L + K - 2, so its padding sits in a group after that of every target."""
    if group_size == 1:
        return target_in
    B, T = target_in.shape
    bos = torch.full((B, group_size - 1), bos_id, dtype=target_in.dtype, device=target_in.device)
    return torch.cat([bos, target_in], dim=1)[:, :-(-T // group_size) * group_size]  # T' <= T + K - 1


@declare_decoding("semi_autoregressive")
class SemiAutoregressiveTransformer(EncoderDecoder):
    """The encoder-decoder with inputs shifted by K and group-causal decoder self-attention (see the module
    docstring); :meth:`decode` takes the shifted inputs, :meth:`forward` the task's autoregressive ones."""

    config: SemiARConfig

    def __init__(self, config: SemiARConfig) -> None:
        super().__init__(config)
        self.decoder_group = config.group_size

    def forward(self, source: Tensor, target_in: Tensor, source_mask: Tensor | None = None) -> Tensor:
        """Teacher forcing: (B, S) sources and (B, T) autoregressive decoder inputs ([BOS] + target) -> (B, T, V)
        logits for the targets (target + EOS), each position predicted from the inputs up to K positions back."""
        c = self.config
        inputs = shift_inputs(target_in, c.group_size, c.bos_id)  # (B, T'), whole groups
        return self.decode(inputs, self.encode(source, source_mask), source_mask)[:, :target_in.shape[1]]


MODELS.register("semi_ar")((SemiARConfig, SemiAutoregressiveTransformer))
# train.init_from an autoregressive teacher (family seq2seq): every tensor copied (the same layout; only the decoder's
# inputs and its self-attention mask change)
declare_start("semi_ar", WeightMap("seq2seq", vocab_rows=VOCABULARY_TENSORS))
