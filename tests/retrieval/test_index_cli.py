"""``tokenloom index`` and ``tokenloom generate --rag`` end to end on a tiny checkpoint, and their one-line refusals
(an index built with another tokenizer among them)."""

from __future__ import annotations

import json

import pytest

from tests.retrieval.conftest import QUESTION
from tokenloom.cli.main import main
from tokenloom.retrieval import Retriever, build_prompt, load_index


@pytest.fixture(scope="module")
def built(corpus, checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "index"
    assert main(["index", str(corpus), "--out", str(out), "--encoder", str(checkpoint), "--chunk-size", "12",
                 "--chunk-overlap", "4"]) == 0
    return out


def one_line_error(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_index_writes_the_documented_directory(built, checkpoint):
    assert sorted(p.name for p in built.iterdir()) == ["bm25", "embeddings.safetensors", "index.json",
                                                       "passages.jsonl"]
    meta = json.loads((built / "index.json").read_text())
    assert (meta["chunk_size"], meta["chunk_overlap"], meta["documents"]) == (12, 4, 4)
    assert meta["encoder"]["checkpoint"] == str(checkpoint.resolve())
    from tokenloom.checkpoint import load_tokenizer

    assert meta["encoder"]["tokenizer_fingerprint"] == load_tokenizer(checkpoint).fingerprint
    assert meta["passages"] == len(load_index(built).passages) == 8


@pytest.mark.parametrize("retriever", ["bm25", "hybrid"])
def test_generate_rag_json_end_to_end(built, checkpoint, capsys, retriever):
    capsys.readouterr()
    assert main(["generate", str(checkpoint), "--rag", str(built), "--prompt", QUESTION, "--rag-top-k", "3",
                 "--retriever", retriever, "--greedy", "--max-new-tokens", "6", "--fact-check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # one JSON object
    expected = Retriever.open(built, retriever).search(QUESTION, 3, retriever)
    assert [p["id"] for p in out["passages"]] == [h.passage.id for h in expected]
    assert [p["score"] for p in out["passages"]] == pytest.approx([h.score for h in expected])
    assert set(out["citations"]) <= {p["id"] for p in out["passages"]}
    assert out["fact_check"]["method"] == "lexical" and isinstance(out["answer"], str)
    assert out["question"] == QUESTION and "\n" not in out["answer"]
    assert build_prompt(QUESTION, expected).startswith(f"[{expected[0].passage.id}] ")


def test_generate_rag_prints_answer_citations_and_flags(built, checkpoint, capsys):
    capsys.readouterr()
    assert main(["generate", str(checkpoint), "--rag", str(built), "--prompt", QUESTION, "--greedy",
                 "--max-new-tokens", "4", "--fact-check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("citations: ") and lines[2].startswith("passages: people/curie.txt#0 (")
    assert lines[3].startswith("fact check (lexical): ")


def test_generate_rag_bad_input_is_one_line(built, checkpoint, other_checkpoint, tmp_path, capsys):
    rag = ["generate", str(checkpoint), "--prompt", QUESTION]
    one_line_error(capsys, [*rag, "--rag", str(built), "--retriever", "dense", "--rag-encoder",
                            str(other_checkpoint)], "built with another tokenizer")
    one_line_error(capsys, [*rag, "--rag", str(tmp_path / "none")], "index not found")
    one_line_error(capsys, [*rag, "--json"], "--json applies to retrieval-augmented generation: give --rag INDEX")
    one_line_error(capsys, [*rag, "--rag", str(built), "--beam", "2"], "--rag generates one answer")
    one_line_error(capsys, ["generate", str(checkpoint), "--rag", str(built)], "give it with --prompt")
    one_line_error(capsys, [*rag, "--rag", str(built), "--rag-template", "{question} only"],
                   "must hold {passages} exactly once")
    one_line_error(capsys, ["index", str(tmp_path / "nothing"), "--out", str(tmp_path / "i")], "documents not found")
    one_line_error(capsys, ["index", str(built), "--out", str(built)], "exists and is not empty")
    one_line_error(capsys, ["index", str(built), "--out", str(tmp_path / "j"), "--chunk-overlap", "200"],
                   "--chunk-overlap must be an integer in [0, --chunk-size=100)")
