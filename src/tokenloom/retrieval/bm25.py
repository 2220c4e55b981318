"""BM25 over the passages' :func:`~tokenloom.retrieval.terms.terms`, through ``bm25s`` (a sparse, precomputed score
matrix; the ``rag`` extra).

The variant is Okapi BM25 as Robertson wrote it, the one ``rank_bm25.BM25Okapi`` computes::

    score(q, d) = sum over the query's terms t (repeats counted) of
                  idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t) = max(0, ln((N - df(t) + 0.5) / (df(t) + 0.5)))

with N passages, df(t) the passages holding t, |d| a passage's terms and avgdl their mean (bm25s's ``method="atire"``
term-frequency part with its ``idf_method="robertson"``). A term in more than half the passages scores 0 (bm25s's
floor), where ``rank_bm25`` gives it ``epsilon`` times the mean idf instead: the two agree exactly wherever every
query term is in at most half the passages (``tests/retrieval/test_bm25.py``). Scores are float32.

The index is bm25s's own files (``data / indices / indptr .csc.index.npy``, ``vocab.index.json``,
``params.index.json``), written and read with ``allow_pickle=False``: nothing is unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import check
from ..errors import ConfigError, DataError
from .terms import terms

METHOD, IDF_METHOD = "atire", "robertson"  # bm25s's names for the tf part and the idf of Okapi BM25 (see above)
PARAMS_FILE = "params.index.json"


@dataclass
class BM25Config:
    """BM25's two constants."""

    k1: float = 1.5  # term-frequency saturation (> 0); 1.5 as rank_bm25 and bm25s
    b: float = 0.75  # length normalisation in [0, 1]; 0.75 as rank_bm25 and bm25s

    def __post_init__(self) -> None:
        check(isinstance(self.k1, (int, float)) and self.k1 > 0, f"bm25 k1 must be > 0, got {self.k1!r}")
        check(isinstance(self.b, (int, float)) and 0 <= self.b <= 1, f"bm25 b must be in [0, 1], got {self.b!r}")


def bm25s_module():
    """``bm25s``, or a one-line :class:`ConfigError` naming the extra that brings it."""
    try:
        import bm25s
    except ImportError:
        raise ConfigError("BM25 retrieval needs bm25s: pip install 'tokenloom[rag]'") from None
    return bm25s


class BM25:
    """A BM25 index of N passages: :meth:`scores` of a query against every passage."""

    def __init__(self, model, num_docs: int) -> None:  # noqa: ANN001 - a bm25s.BM25
        self.model = model
        self.num_docs = num_docs

    @classmethod
    def build(cls, corpus: list[list[str]], config: BM25Config | None = None) -> BM25:
        """The index of ``corpus``: each passage's terms."""
        config = config or BM25Config()
        bm25s = bm25s_module()
        model = bm25s.BM25(k1=float(config.k1), b=float(config.b), method=METHOD, idf_method=IDF_METHOD)
        model.index(corpus, show_progress=False)
        return cls(model, len(corpus))

    def scores(self, query: str | list[str]) -> np.ndarray:
        """(N,) float32: the BM25 score of every passage for ``query`` (text, or its terms); all 0 when no term of
        it is in the index."""
        words = terms(query) if isinstance(query, str) else list(query)
        ids = self.model.get_tokens_ids(words)
        if not ids:
            return np.zeros(self.num_docs, dtype=np.float32)
        return np.asarray(self.model.get_scores_from_ids(ids), dtype=np.float32)

    def save(self, directory: Path) -> None:
        self.model.save(str(directory), allow_pickle=False, show_progress=False)

    @classmethod
    def load(cls, directory: Path) -> BM25:
        """The index saved in ``directory``; a missing or damaged one is a one-line :class:`DataError`."""
        bm25s = bm25s_module()
        try:
            params = json.loads((directory / PARAMS_FILE).read_text(encoding="utf-8"))
            model = bm25s.BM25.load(str(directory), load_corpus=False, mmap=False, allow_pickle=False)
            num_docs = int(params["num_docs"])
            indptr = model.scores["indptr"]
            if (params.get("method"), params.get("idf_method")) != (METHOD, IDF_METHOD) or \
                    int(indptr[-1]) != len(model.scores["data"]) or max(model.vocab_dict.values()) >= len(indptr):
                raise ValueError("its parts do not agree")
        except FileNotFoundError as err:
            raise DataError(f"{directory}: the BM25 index is missing {Path(err.filename).name}") from None
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as err:
            raise DataError(f"{directory}: the BM25 index is damaged ({str(err).splitlines()[0][:120]})") from None
        return cls(model, num_docs)
