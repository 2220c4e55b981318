"""Retrieval and RAG: the prompt holds the retrieved passages in rank order with their ids; passages that do not
fit are dropped lowest rank first (the question never cut); citations are the ids of the passages that hold the
answer; dense search finds a passage from its own text; hybrid is the documented blend; an index used with another
tokenizer is a one-line error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.retrieval.conftest import DOCS, QUESTION
from tokenloom.checkpoint import load_model, load_tokenizer
from tokenloom.errors import DataError, GenerationError
from tokenloom.generation import GenerationConfig
from tokenloom.retrieval import (
    Encoder,
    IndexConfig,
    RagConfig,
    Retriever,
    build_index,
    build_prompt,
    fit_prompt,
    hybrid_scores,
    load_index,
    minmax,
    rag_generate,
)
from tokenloom.retrieval.rag import RagAnswer, finish


@pytest.fixture(scope="module")
def index(corpus, checkpoint, tmp_path_factory):
    """The four documents, 12-word passages overlapping by 4, with dense embeddings by the tiny GPT."""
    out = tmp_path_factory.mktemp("index") / "idx"
    build_index(corpus, out, IndexConfig(chunk_size=12, chunk_overlap=4), Encoder.load(checkpoint))
    return out


@pytest.fixture(scope="module")
def lm(checkpoint):
    return load_model(checkpoint)[0], load_tokenizer(checkpoint)


def test_the_prompt_holds_the_retrieved_passages_in_rank_order_with_their_ids(index):
    hits = Retriever.open(index, "hybrid").search(QUESTION, k=3, method="hybrid")
    assert [h.rank for h in hits] == [1, 2, 3] and hits[0].passage.doc_id == "people/curie.txt"
    assert all(a.score >= b.score for a, b in zip(hits, hits[1:], strict=False))
    prompt = build_prompt(QUESTION, hits)
    lines = [f"[{h.passage.id}] {h.passage.content}" for h in hits]
    assert prompt == "\n".join(lines) + f"\n\nQuestion: {QUESTION}\nAnswer:"
    positions = [prompt.index(f"[{h.passage.id}] ") for h in hits]
    assert positions == sorted(positions)  # rank order
    reordered = build_prompt(QUESTION, hits[::-1])  # the order given is the order written
    assert reordered.index(f"[{hits[0].passage.id}]") > reordered.index(f"[{hits[-1].passage.id}]")


def test_templates_fill_once_and_keep_braces(index):
    hits = Retriever.open(index).search(QUESTION, k=2)
    config = RagConfig(template="Q: {question}\nDocs:\n{passages}\nA:", passage_template="<{id}> {text}")
    prompt = build_prompt("What is {passages}?", hits, config)
    assert prompt.startswith("Q: What is {passages}?\nDocs:\n<") and prompt.endswith("\nA:")
    with pytest.raises(Exception, match=r"must hold \{question\} exactly once"):
        RagConfig(template="{passages} only")


def test_passages_that_do_not_fit_are_dropped_lowest_rank_first(index, lm):
    _, tokenizer = lm
    hits = Retriever.open(index, "hybrid").search(QUESTION, k=3, method="hybrid")
    full = len(tokenizer.encode(build_prompt(QUESTION, hits)))
    two = len(tokenizer.encode(build_prompt(QUESTION, hits[:2])))
    prompt, ids, kept, dropped = fit_prompt(tokenizer, QUESTION, hits, context=two + 8, new_tokens=8)
    assert two < full and kept == hits[:2] and dropped == hits[2:] and len(ids) == two
    assert prompt.endswith(f"Question: {QUESTION}\nAnswer:")  # the question whole
    bare = len(tokenizer.encode(build_prompt(QUESTION, [])))
    _, _, kept, dropped = fit_prompt(tokenizer, QUESTION, hits, context=bare + 4, new_tokens=4)
    assert kept == [] and dropped == hits
    with pytest.raises(GenerationError, match="does not fit the model's context"):
        fit_prompt(tokenizer, QUESTION, hits, context=bare + 3, new_tokens=4)


def test_citations_are_the_passages_that_hold_the_answer(index):
    hits = Retriever.open(index, "hybrid").search(QUESTION, k=6, method="hybrid")
    config = RagConfig()
    for answer in ("Warsaw", "She was born in Warsaw.", "in warsaw"):
        result = finish(RagAnswer(QUESTION, answer, [], hits, [], ""), hits, config)
        assert result.citations == [h.passage.id for h in hits if "Warsaw" in h.passage.content]
        assert result.citations and all(c.startswith("people/curie.txt") for c in result.citations)
    assert finish(RagAnswer(QUESTION, "Paris", [], hits, [], ""), hits, config).citations == []
    assert finish(RagAnswer(QUESTION, "", [], hits, [], ""), hits, config).citations == []
    # an answer made of the question's own words: those words are the claim
    borns = finish(RagAnswer(QUESTION, "born", [], hits, [], ""), hits, config).citations
    assert borns == [h.passage.id for h in hits if "born" in h.passage.content.split()]


def test_rag_generate_end_to_end_cites_the_passage_holding_a_learned_answer(index, lm):
    """A tiny GPT taught (overfitted) to answer from the RAG prompt: the answer it generates is cited to the one
    passage in the prompt that holds it."""
    model, tokenizer = lm
    model = type(model)(model.config)
    model.load_state_dict(lm[0].state_dict())
    retriever = Retriever.open(index, "hybrid")
    config = RagConfig(top_k=2, retriever="hybrid", fact_check="lexical")
    prompt = build_prompt(QUESTION, retriever.search(QUESTION, 2, "hybrid"), config)
    ids = torch.tensor([tokenizer.encode(prompt + " Warsaw\n")])
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    model.train()
    for _ in range(60):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    result = rag_generate(model, tokenizer, retriever, QUESTION, config,
                          GenerationConfig(max_new_tokens=12, do_sample=False))
    assert result.answer == "Warsaw", result.answer
    assert result.prompt == prompt and result.dropped == [] and len(result.hits) == 2
    assert result.citations == [h.passage.id for h in result.hits if "Warsaw" in h.passage.content]
    assert result.citations[0].startswith("people/curie.txt")
    assert result.fact_check.supported and result.fact_check.spans[0].passages == result.citations


def test_dense_search_finds_a_passage_from_its_own_text(index, checkpoint):
    retriever = Retriever.open(index, "dense")
    loaded = load_index(index)
    for passage in loaded.passages:
        hit = retriever.search(passage.content, k=1, method="dense")[0]
        assert hit.passage.id == passage.id and hit.score == pytest.approx(1.0, abs=1e-5)
    encoder = Encoder.load(checkpoint)  # embeddings are unit vectors, a text alone == in a batch
    vectors = encoder.encode([p.content for p in loaded.passages])
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(len(vectors)))
    torch.testing.assert_close(vectors, loaded.embeddings, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(encoder.encode([loaded.passages[2].content])[0], vectors[2], atol=1e-5, rtol=1e-5)


def test_dense_encodes_a_text_longer_than_the_context_in_chunks(tmp_path, corpus):
    from tests.retrieval.conftest import EXTRA, tiny_checkpoint

    short = Encoder.load(tiny_checkpoint(tmp_path / "short", "".join(DOCS.values()) + EXTRA, max_seq_len=16))
    long_text = DOCS["turing.md"]
    assert len(short.tokenizer.encode(long_text)) > 16
    vector = short.encode([long_text])[0]
    assert torch.isfinite(vector).all() and vector.norm() == pytest.approx(1.0, abs=1e-5)


def test_hybrid_is_the_documented_blend(index):
    retriever = Retriever.open(index, "hybrid")
    bm25 = retriever.scores(QUESTION, "bm25")
    dense = retriever.scores(QUESTION, "dense")
    for alpha in (0.0, 0.3, 0.5, 1.0):
        got = retriever.scores(QUESTION, "hybrid", alpha)
        expected = alpha * (dense - dense.min()) / (dense.max() - dense.min()) + \
            (1 - alpha) * (bm25 - bm25.min()) / (bm25.max() - bm25.min())
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(got, hybrid_scores(bm25, dense, alpha), rtol=1e-6)
    top = len(retriever.index.passages)
    assert [h.passage.id for h in retriever.search(QUESTION, top, "hybrid", alpha=1.0)] == \
        [h.passage.id for h in retriever.search(QUESTION, top, "dense")]
    matching = [h.passage.id for h in retriever.search(QUESTION, top, "bm25")]  # BM25 > 0 only
    assert matching and [h.passage.id for h in retriever.search(QUESTION, top, "hybrid", alpha=0.0)][
        :len(matching)] == matching
    assert not minmax(np.ones(4)).any()


def test_bm25_returns_only_matching_passages(index):
    hits = Retriever.open(index).search("Enigma", k=5)
    assert [h.passage.doc_id for h in hits] == ["turing.md"] * len(hits) and hits
    assert Retriever.open(index).search("zzz", k=5) == []


def test_an_index_used_with_another_tokenizer_is_one_line(index, other_checkpoint, corpus, tmp_path):
    other = Encoder.load(other_checkpoint)
    recorded = load_index(index).encoder["tokenizer_fingerprint"]
    with pytest.raises(DataError) as err:
        Retriever(load_index(index), other)
    message = str(err.value)
    assert "built with another tokenizer" in message and str(index) in message and "\n" not in message
    assert recorded[:12] in message and other.fingerprint[:12] in message
    with pytest.raises(DataError, match="built with another tokenizer"):
        Retriever.open(index, "dense", encoder=other_checkpoint)
    bare = build_index(corpus, tmp_path / "bare", IndexConfig(chunk_size=12, chunk_overlap=4))
    with pytest.raises(DataError, match="has no dense embeddings"):
        Retriever.open(bare.path, "hybrid")


def test_missing_and_damaged_indexes_are_one_line(index, tmp_path):
    import shutil

    with pytest.raises(DataError, match="index not found"):
        load_index(tmp_path / "none")
    broken = tmp_path / "broken"
    shutil.copytree(index, broken)
    (broken / "embeddings.safetensors").write_bytes(b"xx")
    with pytest.raises(DataError, match="truncated or corrupt"):
        load_index(broken)
    (broken / "passages.jsonl").write_text('{"id": "a"}\n')
    with pytest.raises(DataError, match=r"passages.jsonl:1: not a passage record"):
        load_index(broken)
    (broken / "index.json").write_text("{")
    with pytest.raises(DataError, match="index.json is damaged"):
        load_index(broken)
    with pytest.raises(DataError, match="exists and is not empty"):
        build_index(index, index)
