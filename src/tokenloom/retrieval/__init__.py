"""Retrieval-augmented generation: documents cut into passages, a BM25 and a dense index over them
(``tokenloom index``), retrieval (bm25 | dense | hybrid), prompts with the retrieved passages, answers with their
citations, and a fact check of the answer against the passages. BM25 needs the ``rag`` extra (bm25s).

Beside :mod:`tokenloom.evaluation`: it uses data, models, nn and generation; nothing below imports it.

Example::

    from tokenloom.retrieval import IndexConfig, Retriever, RagConfig, build_index, rag_generate

    build_index("docs/", "runs/index", IndexConfig(chunk_size=100, chunk_overlap=20))
    retriever = Retriever.open("runs/index")
    result = rag_generate(model, tokenizer, retriever, "Where was Ada born?", RagConfig(top_k=3, fact_check="lexical"))
    result.answer, result.citations, result.fact_check.unsupported
"""

from .bm25 import BM25, BM25Config
from .dense import Encoder
from .factcheck import FactCheck, SpanCheck, fact_check, model_fact_check, split_spans
from .index import Index, IndexConfig, build_index, check_encoder, load_index
from .passages import Document, Passage, chunk_document, chunk_documents, read_documents
from .rag import (
    DEFAULT_PASSAGE_TEMPLATE,
    DEFAULT_TEMPLATE,
    RagAnswer,
    RagConfig,
    build_prompt,
    fit_prompt,
    rag_generate,
)
from .search import RETRIEVERS, Hit, Retriever, hybrid_scores, minmax
from .terms import content_terms, terms

__all__ = [
    "BM25", "BM25Config", "DEFAULT_PASSAGE_TEMPLATE", "DEFAULT_TEMPLATE", "Document", "Encoder", "FactCheck", "Hit",
    "Index", "IndexConfig", "Passage", "RETRIEVERS", "RagAnswer", "RagConfig", "Retriever", "SpanCheck",
    "build_index", "build_prompt", "check_encoder", "chunk_document", "chunk_documents", "content_terms",
    "fact_check", "fit_prompt", "hybrid_scores", "load_index", "minmax", "model_fact_check", "rag_generate",
    "read_documents", "split_spans", "terms",
]
