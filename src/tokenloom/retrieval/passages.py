"""Documents and the passages retrieval returns.

Documents come from a directory of ``.txt`` / ``.md`` files (each file one document, its id the path relative to the
directory, ``/``-separated; a single file is one document named by its file name), or from a JSONL file of
``{"id": str, "text": str, "title": str (optional)}`` objects, one a line (blank lines skipped).

A document longer than ``chunk_size`` words is cut into overlapping passages by the long-sequence layout of
:func:`tokenloom.nn.chunking.chunk_starts`: windows of ``chunk_size`` words whose starts advance by
``chunk_size - chunk_overlap``, the last one aligned to end at the document's last word, so every word is in some
passage. Words, not model tokens: an index is built once and serves any model's tokenizer. A word is a maximal run
of non-space characters; a passage's text is the document's text from its first word's start to its last word's
end (line breaks inside it kept). Passage ids: the document's id when it is one passage, else ``"<doc id>#<k>"``,
k = 0, 1, ... in order; they stay the same as long as the document and the two settings do.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..data.jsonl import read_jsonl
from ..errors import DataError
from ..nn.chunking import check_chunking, chunk_starts

DOCUMENT_SUFFIXES = (".txt", ".md")  # the files a documents directory contributes
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Document:
    """One source document."""

    id: str  # its id: a relative path, or the JSONL "id"
    text: str  # its text
    title: str | None = None  # an optional title (JSONL "title"), shown with each of its passages


@dataclass(frozen=True)
class Passage:
    """A retrievable piece of a document."""

    id: str  # the document's id, or "<doc id>#<k>" for its k-th chunk
    text: str  # the chunk's text
    doc_id: str  # the document it comes from
    start: int  # its first word's index in the document
    title: str | None = None  # the document's title

    @property
    def content(self) -> str:
        """What is indexed, encoded, shown in the prompt and checked against: the title (if any) on its own line,
        then the text."""
        return self.text if self.title is None else f"{self.title}\n{self.text}"

    def to_dict(self) -> dict:
        return {"id": self.id, "text": self.text, "doc_id": self.doc_id, "start": self.start, "title": self.title}

    @classmethod
    def from_dict(cls, row: dict) -> Passage:
        return cls(str(row["id"]), str(row["text"]), str(row["doc_id"]), int(row["start"]),
                   None if row.get("title") is None else str(row["title"]))


def read_documents(path: str | Path) -> list[Document]:
    """The documents of a directory of .txt / .md files (searched recursively, in path order), of one such file, or
    of a ``.jsonl`` file; a missing, empty or malformed source is a one-line :class:`DataError`."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"documents not found: {path}")
    if path.is_file() and path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.is_file():
        if path.suffix not in DOCUMENT_SUFFIXES:
            raise DataError(f"{path}: documents are .txt or .md files, a directory of them, or a .jsonl file of "
                            '{"id", "text"} objects')
        return [Document(path.name, _read_text(path))]
    files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in DOCUMENT_SUFFIXES),
                   key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise DataError(f"{path} holds no {' or '.join(DOCUMENT_SUFFIXES)} files")
    return [Document(p.relative_to(path).as_posix(), _read_text(p)) for p in files]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror}") from None


def _read_jsonl(path: Path) -> list[Document]:
    docs: list[Document] = []
    seen: dict[str, int] = {}
    for where, row in read_jsonl(path, "document"):
        if not isinstance(row, dict):
            raise DataError(f'{where}: each line must be a JSON object with "id" and "text"')
        doc_id, text, title = row.get("id"), row.get("text"), row.get("title")
        if not isinstance(doc_id, str) or not doc_id.strip():
            raise DataError(f'{where}: "id" must be a non-empty string, got {json.dumps(doc_id)[:40]}')
        if not isinstance(text, str):
            raise DataError(f'{where}: "text" must be a string, got {json.dumps(text)[:40]}')
        if title is not None and not isinstance(title, str):
            raise DataError(f'{where}: "title" must be a string or absent, got {json.dumps(title)[:40]}')
        if doc_id in seen:
            raise DataError(f"{where}: id {doc_id!r} repeats line {seen[doc_id]}")
        seen[doc_id] = int(where.rsplit(":", 1)[1])
        docs.append(Document(doc_id, text, title))
    if not docs:
        raise DataError(f"{path} holds no documents")
    return docs


def chunk_document(doc: Document, chunk_size: int, chunk_overlap: int) -> list[Passage]:
    """``doc`` as passages of at most ``chunk_size`` words overlapping by ``chunk_overlap`` (the layout of
    :func:`~tokenloom.nn.chunking.chunk_starts`); a document without words gives none."""
    check_chunking(chunk_size, chunk_overlap)
    spans = [m.span() for m in _WORD.finditer(doc.text)]  # (start, end) character offsets of each word
    if not spans:
        return []
    starts = chunk_starts(len(spans), chunk_size, chunk_overlap)
    passages = []
    for k, first in enumerate(starts):
        last = min(first + chunk_size, len(spans)) - 1
        text = doc.text[spans[first][0]:spans[last][1]]
        passage_id = doc.id if len(starts) == 1 else f"{doc.id}#{k}"
        passages.append(Passage(passage_id, text, doc.id, first, doc.title))
    return passages


def chunk_documents(docs: list[Document], chunk_size: int, chunk_overlap: int) -> list[Passage]:
    """Every document's passages, in document order; passage ids that collide (a document named like another's
    chunk, ``a#0``) are a one-line :class:`DataError`."""
    passages = [p for doc in docs for p in chunk_document(doc, chunk_size, chunk_overlap)]
    seen: set[str] = set()
    for p in passages:
        if p.id in seen:
            raise DataError(f"passage id {p.id!r} is given twice (a document id that looks like another document's "
                            "chunk, '<id>#<k>'): rename one")
        seen.add(p.id)
    if not passages:
        raise DataError("the documents hold no words to index")
    return passages
