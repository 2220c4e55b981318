"""BM25 scores equal the reference library's (rank_bm25.BM25Okapi) on the same tokenised corpus, survive a save and
load unchanged (without unpickling), and a damaged index is a one-line error."""

from __future__ import annotations

import numpy as np
import pytest

from tokenloom.errors import DataError
from tokenloom.retrieval import BM25, BM25Config, terms

rank_bm25 = pytest.importorskip("rank_bm25", reason="the rag extra (rank-bm25) is not installed")

CORPUS = [
    "The cat sat on the mat, and the cat slept.",
    "Dogs chase cats; cats chase mice.",
    "A bird in the hand is worth two in the bush.",
    "The quick brown fox jumps over the lazy dog.",
    "Quantum chromodynamics describes the strong interaction between quarks and gluons.",
    "The mat was red.",
    "Foxes and dogs are canids; cats are felids.",
    "Gluons carry the colour charge.",
]
QUERIES = ["cat mat", "fox dog", "gluons quarks colour", "bird bush bush", "felids", "nothing matches this", "red"]


def test_terms_lowercase_words_with_repeats():
    assert terms("The cat's MAT, mat-2!") == ["the", "cat", "s", "mat", "mat", "2"]


@pytest.mark.parametrize("k1, b", [(1.5, 0.75), (1.2, 0.3), (2.0, 1.0)])
def test_scores_equal_rank_bm25_okapi(k1, b):
    corpus = [terms(text) for text in CORPUS]
    ours = BM25.build(corpus, BM25Config(k1=k1, b=b))
    reference = rank_bm25.BM25Okapi(corpus, k1=k1, b=b)
    document_frequency = {t: sum(t in doc for doc in corpus) for t in {t for doc in corpus for t in doc}}
    checked = 0
    for query in QUERIES:
        words = terms(query)
        # the two agree where every query term is in at most half the passages (rank_bm25 lifts rarer-than-useless
        # terms to epsilon x the mean idf, bm25s floors them at 0: tokenloom.retrieval.bm25)
        assert all(document_frequency.get(t, 0) <= len(corpus) / 2 for t in words)
        np.testing.assert_allclose(ours.scores(query), reference.get_scores(words), rtol=1e-6, atol=1e-6)
        checked += bool(reference.get_scores(words).any())
    assert checked >= 5  # the queries do hit passages


def test_a_term_in_most_passages_scores_zero():
    corpus = [terms(t) for t in ["the a", "the b", "the c", "d e"]]
    assert not BM25.build(corpus).scores("the").any()  # df 3 of 4: idf floored at 0


def test_save_and_load_give_the_same_scores_without_pickle(tmp_path):
    ours = BM25.build([terms(text) for text in CORPUS])
    ours.save(tmp_path)
    for array in tmp_path.glob("*.npy"):
        np.load(array, allow_pickle=False)  # plain arrays: readable with pickling refused
    loaded = BM25.load(tmp_path)
    for query in QUERIES:
        np.testing.assert_array_equal(loaded.scores(query), ours.scores(query))


def test_a_damaged_bm25_index_is_one_line(tmp_path):
    BM25.build([terms(text) for text in CORPUS]).save(tmp_path)
    (tmp_path / "indptr.csc.index.npy").write_bytes(b"not numpy")
    with pytest.raises(DataError, match="damaged") as err:
        BM25.load(tmp_path)
    assert "\n" not in str(err.value)
    (tmp_path / "params.index.json").unlink()
    with pytest.raises(DataError, match="missing params.index.json"):
        BM25.load(tmp_path)


def test_bad_constants_name_the_setting():
    with pytest.raises(Exception, match="k1 must be > 0"):
        BM25Config(k1=0)
    with pytest.raises(Exception, match=r"b must be in \[0, 1\]"):
        BM25Config(b=1.5)
