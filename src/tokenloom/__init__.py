"""tokenloom: the Transformer family, real, fast and practical on an ordinary machine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import TokenloomError

__version__ = "0.1.0"

# The names below are imported on first use (PEP 562), so that importing the command line (tokenloom.cli.main)
# imports no torch: it sets its one-line warning format first, before torch or anything else can warn at import.
_LAZY = {"GenerationConfig": ".generation", "generate": ".generation", "stream": ".generation",
         **dict.fromkeys(["GPT", "EncoderDecoder", "GPTConfig", "Seq2SeqConfig", "Swin", "SwinConfig", "ViT",
                          "ViTConfig"], ".models"),
         "translate": ".tasks.translation"}

__all__ = ["GPT", "EncoderDecoder", "GPTConfig", "GenerationConfig", "Seq2SeqConfig", "Swin", "SwinConfig",
           "TokenloomError", "ViT", "ViTConfig", "__version__", "generate", "stream", "translate"]

if TYPE_CHECKING:  # what type checkers and editors see
    from .generation import GenerationConfig, generate, stream
    from .models import GPT, EncoderDecoder, GPTConfig, Seq2SeqConfig, Swin, SwinConfig, ViT, ViTConfig
    from .tasks.translation import translate


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
