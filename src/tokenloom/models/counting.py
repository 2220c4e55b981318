"""What the language models (GPT, the Universal Transformer, the RNN) share: their parameter count."""

from __future__ import annotations

from torch import nn


class CountsParameters:
    """Mixin for an ``nn.Module`` with a ``tok_embed`` embedding: :meth:`num_params`."""

    tok_embed: nn.Embedding

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, shared ones once; ``non_embedding`` leaves out the embedding tables
        (:meth:`embedding_tables`)."""
        n = sum(p.numel() for p in self.parameters())  # type: ignore[attr-defined]
        if non_embedding:
            n -= sum(w.numel() for w in self.embedding_tables())
        return n

    def embedding_tables(self) -> list[nn.Parameter]:
        """The lookup tables (no compute per token): the token embedding matrix; GPT adds its value embeddings."""
        return [self.tok_embed.weight]
