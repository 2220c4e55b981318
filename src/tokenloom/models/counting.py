"""What the language models (GPT, the Universal Transformer, the RNN) share: their parameter count."""

from __future__ import annotations

from torch import nn


class CountsParameters:
    """Mixin for an ``nn.Module`` with a ``tok_embed`` embedding: :meth:`num_params`."""

    tok_embed: nn.Embedding

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, shared ones once; ``non_embedding`` leaves out the token embedding matrix."""
        n = sum(p.numel() for p in self.parameters())  # type: ignore[attr-defined]
        if non_embedding:
            n -= self.tok_embed.weight.numel()
        return n
