"""Retrieval: the top-k passages of an :class:`~tokenloom.retrieval.index.Index` for a query, by BM25, by the dense
encoder's cosine similarity, or by both.

``hybrid`` scores every passage by a weighted sum of the two scores, each min-max normalised over all N passages::

    hybrid = alpha * (d - min d) / (max d - min d) + (1 - alpha) * (s - min s) / (max s - min s)

with d the cosine similarities and s the BM25 scores (a constant score vector normalises to 0): ``alpha`` = 1 is
dense alone, 0 BM25 alone, 0.5 (the default) an even blend. Ties rank the earlier passage (index order) first.
``bm25`` returns only passages that share a term with the query (a score above 0), so fewer than k at times.

Shapes: N passages, C the encoder's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import check
from ..errors import ConfigError, DataError
from .dense import Encoder, cosine_scores
from .index import Index, check_encoder, require_embeddings
from .passages import Passage

RETRIEVERS = ("bm25", "dense", "hybrid")  # --retriever choices
DEFAULT_ALPHA = 0.5  # hybrid: the dense score's weight


@dataclass(frozen=True)
class Hit:
    """One retrieved passage."""

    passage: Passage  # the passage
    score: float  # the retriever's score (BM25, cosine, or the hybrid blend)
    rank: int  # 1 for the best


def minmax(scores: np.ndarray) -> np.ndarray:
    """(N,) scores scaled to [0, 1] by their minimum and maximum; all 0 when they are equal."""
    low, high = float(scores.min()), float(scores.max())
    if high - low <= 0:
        return np.zeros_like(scores, dtype=np.float64)
    return (scores.astype(np.float64) - low) / (high - low)


def hybrid_scores(bm25: np.ndarray, dense: np.ndarray, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
    """(N,) alpha * minmax(dense) + (1 - alpha) * minmax(bm25) (the module docstring)."""
    return alpha * minmax(dense) + (1 - alpha) * minmax(bm25)


def top_k(scores: np.ndarray, k: int) -> list[int]:
    """The indices of the ``k`` highest scores, best first; ties in index order."""
    order = np.lexsort((np.arange(len(scores)), -scores.astype(np.float64)))  # by -score, then by index
    return order[:k].tolist()


class Retriever:
    """Searches an index; ``encoder`` (checked to match the index's tokenizer) for the dense and hybrid methods."""

    def __init__(self, index: Index, encoder: Encoder | None = None) -> None:
        if encoder is not None:
            check_encoder(index, encoder)
        self.index = index
        self.encoder = encoder

    @classmethod
    def open(cls, path: str | Path, method: str = "bm25", encoder: Encoder | str | Path | None = None,
             device: str = "cpu") -> Retriever:
        """The retriever of the index at ``path`` for ``method``: dense and hybrid need an encoder, ``encoder`` (an
        :class:`Encoder` or a checkpoint) or else the one the index records."""
        from .index import load_index

        check_method(method)
        index = load_index(path)
        if method == "bm25":
            return cls(index, encoder if isinstance(encoder, Encoder) else None)
        if encoder is None:
            encoder = require_embeddings(index).get("checkpoint")
            if encoder is None or not Path(encoder).exists():
                raise DataError(f"index {index.path}: its encoder checkpoint {encoder} is not found; give the "
                                "encoder (--rag-encoder CKPT)")
        if not isinstance(encoder, Encoder):
            encoder = Encoder.load(encoder, device)
        return cls(index, encoder)

    def scores(self, query: str, method: str = "bm25", alpha: float = DEFAULT_ALPHA) -> np.ndarray:
        """(N,) every passage's score for ``query`` by ``method``."""
        check_method(method)
        check(isinstance(alpha, (int, float)) and 0 <= alpha <= 1, f"alpha must be in [0, 1], got {alpha!r}")
        if method == "bm25":
            return self.index.bm25.scores(query).astype(np.float64)
        dense = self.dense_scores(query)
        if method == "dense":
            return dense
        return hybrid_scores(self.index.bm25.scores(query), dense, alpha)

    def dense_scores(self, query: str) -> np.ndarray:
        """(N,) cosine similarities of the query's embedding with every passage's."""
        if self.encoder is None:
            raise ConfigError("dense and hybrid retrieval need an encoder (the index's, or --rag-encoder CKPT)")
        require_embeddings(self.index)
        query_vector = self.encoder.encode([query], ["the query"])[0]  # (C,)
        return cosine_scores(self.index.embeddings, query_vector).double().numpy()

    def search(self, query: str, k: int = 3, method: str = "bm25", alpha: float = DEFAULT_ALPHA) -> list[Hit]:
        """The ``k`` best passages for ``query``, best first: fewer when the index has fewer, or (bm25) when fewer
        share a term with the query."""
        check(isinstance(k, int) and not isinstance(k, bool) and k >= 1, f"top-k must be an integer >= 1, got {k!r}")
        scores = self.scores(query, method, alpha)
        best = top_k(scores, k)
        if method == "bm25":  # a passage sharing no term with the query is not a match
            best = [i for i in best if scores[i] > 0]
        return [Hit(self.index.passages[i], float(scores[i]), rank) for rank, i in enumerate(best, 1)]


def check_method(method: str) -> None:
    check(method in RETRIEVERS, f"--retriever must be one of {', '.join(RETRIEVERS)}, got {method!r}")
