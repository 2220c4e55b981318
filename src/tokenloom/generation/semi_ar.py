"""Semi-autoregressive decoding (Wang, Zhang & Chen 2018): K target tokens per step, greedy inside each group.

Shape legend: B batch, A rows still decoding, S source length, K group_size, n positions decoded, V vocab_size.

:func:`semi_ar_decode` encodes the sources once and runs the model's decoder
(:meth:`~tokenloom.models.seq2seq.EncoderDecoder.decoder_for`: the encoder-decoder's cache of self-attention keys
and values plus the precomputed cross-attention ones) one group at a time: step 0 feeds K BOS tokens at positions
[0, K); step s feeds the K tokens step s - 1 chose at positions [sK, sK + K), the cache growing by K positions per
step. The K queries of a step see the whole cache and each other (group-causal attention; with a dense cache every
key), and each takes its argmax over the whole vocabulary, as greedy autoregressive decoding does (nothing
banned). A sentence ends at the first EOS of its output (the tokens after it dropped) and leaves the batch; decoding
stops when every sentence has ended or after ``ceil(max_new_tokens / K)`` steps (at most ``max_target_len // K``,
the positions the decoder holds), its output cut to ``max_new_tokens`` tokens. With K = 1 this is greedy decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import GenerationError
from ..models.semi_ar import SemiAutoregressiveTransformer
from ..nn.modes import eval_mode


@dataclass
class SemiAROutput:
    """What :func:`semi_ar_decode` returns."""

    tokens: list[list[int]]  # each sentence's tokens before its first EOS (no BOS / EOS), at most max_new_tokens
    ids: Tensor  # (B, n) every decoded position's argmax, n a multiple of K; pad_id after a sentence ended
    logits: Tensor | None  # (B, n, V) float32 logits of each decoded position (return_logits); NaN after it ended
    steps: list[int]  # the decoder steps (groups of K) each sentence ran


def semi_ar_decode(model: SemiAutoregressiveTransformer, source: Tensor, source_mask: Tensor | None = None, *,
                   max_new_tokens: int, return_logits: bool = False) -> SemiAROutput:
    """Translate a batch of (B, S) right-padded sources (``source_mask`` (B, S), 1 = token) K tokens per step;
    see the module docstring. ``return_logits`` keeps every step's logits (for tests and inspection)."""
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    c = model.config
    K, B, device = c.group_size, source.shape[0], source.device
    steps = min(math.ceil(max_new_tokens / K), c.max_target_len // K)  # K <= max_target_len (SemiARConfig)
    with eval_mode(model), torch.inference_mode():
        decoder = model.decoder_for(source, source_mask)
        cache = decoder.create_cache(B, steps * K)
        ids = torch.full((B, steps * K), c.pad_id, dtype=torch.long, device=device)  # (B, n)
        logits_out = torch.full((B, steps * K, c.vocab_size), float("nan"), device=device) if return_logits else None
        rows = torch.arange(B, device=device)  # the batch rows still decoding
        steps_run = torch.full((B,), steps, dtype=torch.long, device=device)  # (B,) decoder steps per sentence
        group = torch.full((B, K), c.bos_id, dtype=torch.long, device=device)  # (A, K) the next step's inputs
        for step in range(steps):
            logits = decoder(group, cache=cache).float()  # (A, K, V)
            group = logits.argmax(-1)  # (A, K)
            at = slice(step * K, (step + 1) * K)
            ids[rows, at] = group
            if logits_out is not None:
                logits_out[rows, at] = logits
            ended = (group == c.eos_id).any(-1)  # (A,)
            steps_run[rows[ended]] = step + 1
            if bool(ended.all()):
                break
            if bool(ended.any()):  # the ended sentences leave the batch (and the cache)
                keep = (~ended).nonzero().view(-1)
                cache.select(keep)
                rows, group = rows[keep], group[keep]
    n = (step + 1) * K
    tokens = []
    for row in ids[:, :min(n, max_new_tokens)].tolist():
        tokens.append(row[:row.index(c.eos_id)] if c.eos_id in row else row)
    return SemiAROutput(tokens, ids[:, :n], None if logits_out is None else logits_out[:, :n], steps_run.tolist())
