"""Dense retrieval with a causal language model of the toolkit as the encoder (its own checkpoints or an imported
one): a text's embedding is the mean of the model's final hidden states (``forward_features``) over its tokens,
L2-normalised; a query's score against a passage is the cosine similarity, one matrix product over all passages.

A text longer than the encoder's context is encoded in chunks of the context (overlapping by a quarter of it) by
:mod:`tokenloom.nn.chunking` and pooled by :func:`~tokenloom.nn.chunking.pool_chunks` (the mean of the chunks'
means). Texts are encoded a batch at a time, right-padded: a causal model's states at the real tokens do not see
the padding after them, so no mask is needed and each text encodes as it would alone.

Shapes: N texts, C the model's width, T the longest text's tokens in a batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import ConfigError, TokenizerError
from ..models.registry import decoding_of
from ..nn.chunking import encode_chunks, pool_chunks, split_chunks


@dataclass
class Encoder:
    """A causal LM and its tokenizer used as a text encoder; ``checkpoint`` names where it came from (recorded in
    an index)."""

    model: nn.Module  # a causal language model (decoding kind ``causal_lm``) in eval mode
    tokenizer: object  # its tokenizer (tokenloom.data.Tokenizer)
    checkpoint: str | None = None  # the checkpoint directory it was loaded from (absolute), if any
    batch_size: int = 16  # texts encoded per forward pass

    def __post_init__(self) -> None:
        if decoding_of(self.model) != "causal_lm":
            raise ConfigError(f"a dense retrieval encoder must be a causal language model, got a "
                              f"{type(self.model).__name__} ({decoding_of(self.model)!r})")

    @classmethod
    def load(cls, checkpoint: str | Path, device: str | torch.device = "cpu") -> Encoder:
        """The encoder of a checkpoint directory (float32 weights on ``device``)."""
        from ..checkpoint import load_model, load_tokenizer, resolve_checkpoint

        ckpt = resolve_checkpoint(checkpoint)
        model, _ = load_model(ckpt, device=device)
        return cls(model, load_tokenizer(ckpt), str(ckpt.resolve()))

    @property
    def fingerprint(self) -> str:
        """The tokenizer's fingerprint (an index records it)."""
        return self.tokenizer.fingerprint

    @property
    def dim(self) -> int:
        return int(self.model.config.embed_dim)

    def _ids(self, text: str, what: str) -> list[int]:
        try:
            ids = self.tokenizer.encode(text)
        except TokenizerError as err:
            raise TokenizerError(f"{what}: {err}") from None
        eos = self.tokenizer.eos_id
        return ids or ([eos] if eos is not None else [0])  # an empty text: one stand-in token

    @torch.inference_mode()
    def encode(self, texts: list[str], names: list[str] | None = None) -> Tensor:
        """(N, C) float32 unit vectors, one per text (``names`` label the texts in a tokenizer error)."""
        names = names or [f"text {i}" for i in range(len(texts))]
        rows = [self._ids(text, name) for text, name in zip(texts, names, strict=True)]
        context = int(self.model.config.max_seq_len)
        device = next(self.model.parameters()).device
        out = torch.empty(len(rows), self.dim)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths share a batch
        for i in range(0, len(order), self.batch_size):
            batch = order[i:i + self.batch_size]
            T = max(len(rows[j]) for j in batch)
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            mask = torch.zeros(len(batch), T, dtype=torch.long)
            for r, j in enumerate(batch):
                ids[r, :len(rows[j])] = torch.tensor(rows[j])
                mask[r, :len(rows[j])] = 1
            chunks = split_chunks(ids.to(device), mask.to(device), chunk=context, overlap=context // 4)
            pooled = pool_chunks(encode_chunks(self._states, chunks), chunks, how="mean")  # (B, C)
            out[batch] = pooled.float().cpu()
        return nn.functional.normalize(out, dim=-1)

    def _states(self, ids: Tensor, mask: Tensor | None) -> Tensor:
        """(n, c) chunk ids -> (n, c, C) final hidden states (right padding needs no mask in a causal model)."""
        hidden, _ = self.model.forward_features(ids)
        return hidden


def cosine_scores(embeddings: Tensor, query: Tensor) -> Tensor:
    """(N, C) unit passage vectors and a (C,) unit query vector -> (N,) cosine similarities."""
    return embeddings @ query
