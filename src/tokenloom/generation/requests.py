"""What generate, stream and beam search check of a request before decoding, in one place."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from ..errors import GenerationError


class Tokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def check_attention_mask(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """The (B, T) 0/1 mask as long, or None when there is no padding; rejects right padding."""
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise GenerationError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                              f"{tuple(input_ids.shape)}")
    mask = attention_mask.long()
    if ((mask != 0) & (mask != 1)).any():
        raise GenerationError("attention_mask must hold only 0 (padding) and 1 (token)")
    if mask.all():
        return None
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise GenerationError("attention_mask must be left-padded (padding first, then the prompt); "
                              "a row has padding after a token")
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise GenerationError(f"empty prompt: row(s) {empty} of attention_mask are all padding")
    return mask


def check_sampling_request(config, tokenizer: Tokenizer | None) -> None:
    """The checks of a one-token-at-a-time request (plain and speculative decoding): no beam-search-only setting, and
    a tokenizer where stop strings must be read. ``config`` is a :class:`~.config.GenerationConfig`."""
    if config.no_repeat_ngram_size:
        raise GenerationError(f"no_repeat_ngram_size={config.no_repeat_ngram_size} applies to beam search only "
                              "(num_beams > 1, or beam_search() with num_beams=1)")
    if config.stop_strings and tokenizer is None:
        raise GenerationError("stop_strings need a tokenizer (an object with .decode(ids) -> str) to "
                              "read the generated text")


def check_prompt(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                 max_new_tokens: int) -> Tensor | None:
    """The request checks every decoding shares (generate, stream, beam search): ``input_ids`` a non-empty (B, T)
    integer tensor, the mask (:func:`check_attention_mask`), every real token id inside the model's vocabulary
    and T + ``max_new_tokens`` within its context (where its ``config`` gives them). Returns the (B, T) mask or
    None (no padding)."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise GenerationError(f"input_ids must be a (batch, length) integer tensor, got "
                              f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    B, T = input_ids.shape
    if B == 0 or T == 0:
        raise GenerationError(f"empty prompt: input_ids has shape {tuple(input_ids.shape)}; give at least "
                              "one token per row")
    mask = check_attention_mask(input_ids, attention_mask)
    model_config = getattr(model, "config", None)
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is not None:
        real = mask.bool() if mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        bad = input_ids[real & ((input_ids < 0) | (input_ids >= vocab))].unique()
        if bad.numel():
            shown = ", ".join(str(i) for i in bad[:10].tolist()) + (", ..." if bad.numel() > 10 else "")
            raise GenerationError(f"prompt holds token ids outside the vocabulary [0, {vocab}): {shown}")
    context = getattr(model_config, "max_seq_len", None)
    # a sliding-window model whose positions extrapolate has no limit (max_positions None)
    limit = getattr(model_config, "max_positions", context)
    if limit is not None and T + max_new_tokens > limit:
        hint = "shorten the prompt or lower max_new_tokens"
        if getattr(model_config, "attention_window", None):
            hint += f"; position {model_config.position!r} has a table of {limit} positions"
        else:
            hint = "no sliding window: " + hint
        raise GenerationError(f"prompt of {T} tokens + max_new_tokens={max_new_tokens} = {T + max_new_tokens} "
                              f"positions exceeds the model's context of {limit} ({hint})")
    return mask


def prompt_rows(input_ids: Tensor, mask: Tensor | None, n: int, copies: int = 1
                ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """What decoding feeds the model for (B, T) prompts and ``n`` new tokens: the prompt with its padding replaced
    by a stand-in (the row's first token: valid for the embedding and, already in the row, neutral for the
    repetition penalty), the positions and the mask (None: no padding) of every row over T + n (each prompt's
    row repeated ``copies`` times: row b*copies + k is copy k of prompt b, a beam), and each prompt's real
    length (B,)."""
    B, T = input_ids.shape
    device = input_ids.device
    if mask is None:
        positions = torch.arange(T + n, device=device).expand(B * copies, -1).contiguous()  # (B*copies, T + n)
        return input_ids, positions, None, torch.full((B,), T, device=device)
    real_len = mask.sum(-1)  # (B,)
    first = input_ids.gather(1, (T - real_len)[:, None])
    prompt = torch.where(mask.bool(), input_ids, first)
    positions = torch.cat(((mask.cumsum(-1) - 1).clamp(min=0), real_len[:, None] + torch.arange(n, device=device)),
                          dim=1)  # (B, T + n)
    full_mask = torch.cat((mask, mask.new_ones(B, n)), dim=1)  # (B, T + n)
    if copies != 1:
        positions, full_mask = positions.repeat_interleave(copies, dim=0), full_mask.repeat_interleave(copies, dim=0)
    return prompt, positions, full_mask, real_len


class StopStrings:
    """Per-row stop-string detection over a tail window of each row's new tokens."""

    def __init__(self, stop_strings: list[str], tokenizer: Tokenizer, batch_size: int) -> None:
        self.stop_strings, self.tokenizer = stop_strings, tokenizer
        # a stop string of L characters spans at most L tokens of >= 1 character; slack for empty ones
        self.window = max(len(s) for s in stop_strings) + 8
        self.new_ids: list[list[int]] = [[] for _ in range(batch_size)]

    def update(self, tokens: Tensor, finished: Tensor) -> None:
        """Append this step's (B,) ``tokens``; mark rows whose new text now holds a stop string in the
        (B, 1) ``finished``."""
        done = finished.view(-1).tolist()
        for row, (token, stopped) in enumerate(zip(tokens.tolist(), done, strict=True)):
            if not stopped and self.append(row, token):
                finished[row] = True

    def append(self, row: int, token: int) -> bool:
        """Append one new token to ``row``; True when its new text now holds a stop string."""
        ids = self.new_ids[row]
        ids.append(token)
        text = self.tokenizer.decode(ids[-self.window:])
        return any(s in text for s in self.stop_strings)
