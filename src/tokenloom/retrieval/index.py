"""The index directory ``tokenloom index DOCS --out INDEX`` writes and retrieval reads::

    index.json              format, version, the settings (chunking, BM25's k1 and b and its variant), the passage
                            and document counts, and the dense encoder (its checkpoint and tokenizer fingerprint)
                            or null
    passages.jsonl          one passage a line: {"id", "text", "doc_id", "start", "title"}, in index order
    bm25/                   bm25s's files (numpy arrays and JSON, never pickled): tokenloom.retrieval.bm25
    embeddings.safetensors  {"embeddings": (N, C) float32 unit vectors}, only with an encoder

Written to ``INDEX.tmp`` and renamed into place, so a crash leaves no half-written index. Loading checks every part
against ``index.json`` (a missing or damaged part is a one-line :class:`~tokenloom.errors.DataError` naming it), and
an encoder used with the index must have the tokenizer the embeddings were made with
(:func:`check_encoder`: "index built with another tokenizer").
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config import check
from ..errors import DataError
from ..nn.chunking import check_chunking
from .bm25 import BM25, IDF_METHOD, METHOD, BM25Config
from .dense import Encoder
from .passages import Passage, chunk_documents, read_documents
from .terms import terms

FORMAT, VERSION = "tokenloom-retrieval-index", 1
INDEX_FILE, PASSAGES_FILE, BM25_DIR, EMBEDDINGS_FILE = "index.json", "passages.jsonl", "bm25", \
    "embeddings.safetensors"


@dataclass
class IndexConfig:
    """How documents become an index."""

    chunk_size: int = 100  # words per passage at most (longer documents are cut into overlapping passages)
    chunk_overlap: int = 20  # words shared by neighbouring passages of a document, in [0, chunk_size)
    bm25: BM25Config = field(default_factory=BM25Config)  # BM25's k1 and b

    def __post_init__(self) -> None:
        check(isinstance(self.chunk_size, int) and not isinstance(self.chunk_size, bool) and self.chunk_size >= 1,
              f"--chunk-size must be a positive integer, got {self.chunk_size!r}")
        check(isinstance(self.chunk_overlap, int) and 0 <= self.chunk_overlap < self.chunk_size,
              f"--chunk-overlap must be an integer in [0, --chunk-size={self.chunk_size}), got {self.chunk_overlap!r}")
        check_chunking(self.chunk_size, self.chunk_overlap)


@dataclass
class Index:
    """A loaded index: its passages, BM25, the dense embeddings (or None) and ``index.json``'s contents."""

    path: Path  # the index directory
    passages: list[Passage]  # in index order
    bm25: BM25  # the BM25 index over the passages' terms
    embeddings: Tensor | None  # (N, C) float32 unit vectors, or None (no encoder)
    meta: dict[str, Any]  # index.json

    @property
    def encoder(self) -> dict[str, Any] | None:
        """The recorded encoder: {"checkpoint", "tokenizer_fingerprint", "dim"}, or None."""
        return self.meta.get("encoder")


def build_index(documents: str | Path, out: str | Path, config: IndexConfig | None = None,
                encoder: Encoder | None = None, force: bool = False) -> Index:
    """Index the documents at ``documents`` (:func:`~tokenloom.retrieval.passages.read_documents`) into the
    directory ``out``; with ``encoder`` also their dense embeddings. A non-empty ``out`` is refused unless
    ``force``."""
    config = config or IndexConfig()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise DataError(f"{out} exists and is not empty: choose another --out, or add --force to replace it")
    docs = read_documents(documents)
    passages = chunk_documents(docs, config.chunk_size, config.chunk_overlap)
    bm25 = BM25.build([terms(p.content) for p in passages], config.bm25)
    embeddings = None if encoder is None else encoder.encode([p.content for p in passages],
                                                               [f"passage {p.id!r}" for p in passages])
    meta = {"format": FORMAT, "version": VERSION, "documents": len(docs), "passages": len(passages),
            "source": str(documents), "chunk_size": config.chunk_size, "chunk_overlap": config.chunk_overlap,
            "chunk_unit": "words",
            "bm25": {"k1": config.bm25.k1, "b": config.bm25.b, "method": METHOD, "idf_method": IDF_METHOD,
                     "terms": "lowercased \\w+ runs"},
            "encoder": None if encoder is None else {
                "checkpoint": encoder.checkpoint, "tokenizer_fingerprint": encoder.fingerprint,
                "dim": encoder.dim, "pooling": "mean of the final hidden states, L2-normalised"}}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with (tmp / PASSAGES_FILE).open("w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps(p.to_dict(), ensure_ascii=False) + "\n")
    bm25.save(tmp / BM25_DIR)
    if embeddings is not None:
        from safetensors.torch import save_file

        save_file({"embeddings": embeddings.contiguous()}, str(tmp / EMBEDDINGS_FILE))
    (tmp / INDEX_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")  # last: the index is whole
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    tmp.rename(out)
    return Index(out, passages, bm25, embeddings, meta)


def load_index(path: str | Path) -> Index:
    """The index in directory ``path``; a missing, foreign or damaged one is a one-line :class:`DataError`."""
    path = Path(path)
    if not (path / INDEX_FILE).is_file():
        what = "not found" if not path.exists() else f"not a retrieval index (no {INDEX_FILE})"
        raise DataError(f"index {what}: {path} (build one with `tokenloom index DOCS --out {path}`)")
    try:
        meta = json.loads((path / INDEX_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path / INDEX_FILE} is damaged ({str(err).splitlines()[0][:120]})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path / INDEX_FILE} is not a tokenloom retrieval index")
    if meta.get("version") != VERSION:
        raise DataError(f"{path} is an index of version {meta.get('version')!r}; this tokenloom reads version "
                        f"{VERSION}: rebuild it with `tokenloom index`")
    passages = _read_passages(path / PASSAGES_FILE)
    count = meta.get("passages")
    if len(passages) != count:
        raise DataError(f"{path / PASSAGES_FILE} holds {len(passages)} passages, {INDEX_FILE} says {count}")
    bm25 = BM25.load(path / BM25_DIR)
    if bm25.num_docs != count:
        raise DataError(f"{path / BM25_DIR} indexes {bm25.num_docs} passages, {INDEX_FILE} says {count}")
    return Index(path, passages, bm25, _read_embeddings(path, meta), meta)


def _read_passages(file: Path) -> list[Passage]:
    if not file.is_file():
        raise DataError(f"the index is missing {file}")
    out = []
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                out.append(Passage.from_dict(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                raise DataError(f"{file}:{number}: not a passage record") from None
    return out


def _read_embeddings(path: Path, meta: dict[str, Any]) -> Tensor | None:
    encoder = meta.get("encoder")
    if encoder is None:
        return None
    file = path / EMBEDDINGS_FILE
    if not file.is_file():
        raise DataError(f"the index is missing {file} (its {INDEX_FILE} names an encoder)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        embeddings = load_file(str(file))["embeddings"]
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise DataError(f"{file} is truncated or corrupt ({str(err).splitlines()[0][:120]})") from None
    expected = (meta.get("passages"), encoder.get("dim"))
    if tuple(embeddings.shape) != expected:
        raise DataError(f"{file} holds embeddings of shape {tuple(embeddings.shape)}, {INDEX_FILE} says {expected}")
    return embeddings.to(torch.float32)


def check_encoder(index: Index, encoder: Encoder) -> None:
    """The one-line :class:`DataError` when ``encoder``'s tokenizer is not the one the index's embeddings were
    made with (or the index has no embeddings)."""
    recorded = require_embeddings(index)
    want, got = recorded.get("tokenizer_fingerprint"), encoder.fingerprint
    if want != got:
        raise DataError(f"index {index.path} built with another tokenizer: its encoder's tokenizer is "
                        f"{str(want)[:12]}, {encoder.checkpoint or 'the encoder given'} has {got[:12]} (rebuild the "
                        "index with this encoder, or use the one it was built with)")
    if recorded.get("dim") != encoder.dim:
        raise DataError(f"index {index.path} holds {recorded.get('dim')}-dimensional embeddings; the encoder "
                        f"{encoder.checkpoint or 'given'} gives {encoder.dim}")


def require_embeddings(index: Index) -> dict[str, Any]:
    """The index's recorded encoder; a one-line :class:`DataError` when it was built without one."""
    if index.encoder is None or index.embeddings is None:
        raise DataError(f"index {index.path} has no dense embeddings (built without --encoder): use the bm25 "
                        "retriever, or rebuild it with --encoder CKPT")
    return index.encoder
