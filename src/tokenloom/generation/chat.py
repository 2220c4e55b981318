"""Chat replies: a conversation rendered with a chat template (:mod:`tokenloom.data.chat`) up to the assistant
header, decoded until the template's end marker (its eos id or stop text), and the reply alone returned."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from ..data.chat import ChatTemplate, Message
from ..data.tokenizers import Tokenizer
from ..devices import device_of
from ..errors import GenerationError
from .config import GenerationConfig
from .generate import generate


def chat_config(template: ChatTemplate, config: GenerationConfig) -> GenerationConfig:
    """``config`` that also stops at the template's end of a reply (its stop strings, and its eos id unless
    ``config`` names one)."""
    stops = list(dict.fromkeys([*config.stop_strings, *template.stop_strings]))
    eos = config.eos_token_id if config.eos_token_id is not None else template.stop_token_id
    return replace(config, stop_strings=stops, eos_token_id=eos)


def chat_prompt_ids(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message],
                    context: int | None = None) -> list[int]:
    """The prompt ids of ``messages`` (ending in the assistant header); a one-line :class:`GenerationError` when
    they leave no room in a model's ``context``."""
    ids = template.encode_prompt(tokenizer, messages)
    if not ids:
        raise GenerationError("the chat prompt is empty after tokenization")
    if context is not None and len(ids) >= context:
        raise GenerationError(f"chat prompt of {len(ids)} tokens leaves no room in the model's context of {context}")
    return ids


def generate_reply(model: nn.Module, tokenizer: Tokenizer, template: ChatTemplate, messages: Sequence[Message],
                   config: GenerationConfig, **decoding: object) -> str:
    """The assistant's reply to ``messages`` (the text before the end marker), decoded with ``config`` (greedy or
    sampling; ``decoding`` goes to :func:`~tokenloom.generation.generate`)."""
    ids = chat_prompt_ids(template, tokenizer, messages, getattr(model.config, "max_seq_len", None))
    config = chat_config(template, config)
    out = generate(model, torch.tensor([ids], device=device_of(model)), config, tokenizer=tokenizer, **decoding)
    new = out[0, len(ids):].tolist()
    if config.eos_token_id is not None and config.eos_token_id in new:
        new = new[:new.index(config.eos_token_id)]
    return template.reply(tokenizer.decode(new))
