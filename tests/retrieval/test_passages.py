"""Documents to passages: every word of a document lies in some passage, passages follow the long-sequence chunk
layout (nn.chunking.chunk_starts) in words, their ids are stable, and bad sources are one-line errors naming the
line."""

from __future__ import annotations

import json

import pytest

from tokenloom.errors import ConfigError, DataError
from tokenloom.nn.chunking import chunk_starts
from tokenloom.retrieval import Document, chunk_document, chunk_documents, read_documents


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n)).replace("w7 ", "w7\n\n")  # a paragraph break inside


@pytest.mark.parametrize("n, size, overlap", [(1, 5, 0), (5, 5, 2), (6, 5, 2), (23, 5, 2), (40, 8, 0), (41, 8, 7)])
def test_every_word_is_in_a_passage_at_the_chunk_layout(n, size, overlap):
    doc = Document("d", words(n))
    passages = chunk_document(doc, size, overlap)
    assert [p.start for p in passages] == chunk_starts(n, size, overlap)
    covered = set()
    for p in passages:
        own = p.text.split()
        assert own == doc.text.split()[p.start:p.start + len(own)]  # the text is the document's, words in order
        assert len(own) == min(size, n)
        covered.update(range(p.start, p.start + len(own)))
    assert covered == set(range(n))
    assert [p.id for p in passages] == (["d"] if len(passages) == 1 else [f"d#{k}" for k in range(len(passages))])


def test_passage_text_keeps_the_documents_own_layout():
    doc = Document("d", "  alpha beta\n\ngamma   delta epsilon ")
    first, second = chunk_document(doc, 3, 1)
    assert first.text == "alpha beta\n\ngamma" and second.text == "gamma   delta epsilon"


def test_ids_are_stable_and_titles_travel(tmp_path):
    docs = [Document("a", words(30), "Title A"), Document("b", "short one")]
    once, again = chunk_documents(docs, 10, 3), chunk_documents(list(docs), 10, 3)
    assert [p.id for p in once] == [p.id for p in again] == ["a#0", "a#1", "a#2", "a#3", "b"]
    assert once[0].content.startswith("Title A\nw0 ")
    assert once[-1].content == "short one"


def test_read_a_directory_a_file_and_jsonl(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "b.md").write_text("bee")
    (tmp_path / "docs" / "sub" / "a.txt").write_text("ay")
    (tmp_path / "docs" / "skip.csv").write_text("x")
    assert [(d.id, d.text) for d in read_documents(tmp_path / "docs")] == [("b.md", "bee"), ("sub/a.txt", "ay")]
    assert [d.id for d in read_documents(tmp_path / "docs" / "b.md")] == ["b.md"]
    rows = [{"id": "x", "text": "one"}, {"id": "y", "text": "two", "title": "T"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert [(d.id, d.text, d.title) for d in read_documents(tmp_path / "d.jsonl")] == [("x", "one", None),
                                                                                       ("y", "two", "T")]


@pytest.mark.parametrize("lines, message", [
    (['{"id": "x", "text": "a"}', '{"text": "b"}'], ':2: "id" must be a non-empty string'),
    (['{"id": "x", "text": 5}'], ':1: "text" must be a string'),
    (['{"id": "x", "text": "a"}', "", '{"id": "x", "text": "b"}'], ":3: id 'x' repeats line 1"),
    (["[1, 2]"], ":1: each line must be a JSON object"),
    (["{oops"], ":1: not valid JSON"),
])
def test_bad_jsonl_names_the_line(tmp_path, lines, message):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        read_documents(path)
    assert message in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_empty_and_colliding_sources(tmp_path):
    with pytest.raises(DataError, match="documents not found"):
        read_documents(tmp_path / "nope")
    with pytest.raises(DataError, match="holds no .txt or .md files"):
        read_documents(tmp_path)
    with pytest.raises(DataError, match="passage id 'a#0' is given twice"):
        chunk_documents([Document("a", words(12)), Document("a#0", "x")], 5, 0)
    with pytest.raises(DataError, match="no words"):
        chunk_documents([Document("a", "   ")], 5, 0)
    with pytest.raises(ConfigError, match="overlap must be an integer in"):
        chunk_document(Document("a", "x"), 5, 5)
