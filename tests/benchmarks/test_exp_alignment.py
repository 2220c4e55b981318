"""The knowledge-base demonstrations of issue 32: the generated data keeps its promises (scripts/make_kb.py,
data/kb/), the drivers' scoring and prompt pieces are right (benchmarks/exp_rag.py, exp_align.py, exp_lora.py),
and (slow) each driver's ``--quick`` run goes end to end on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the drivers import their shared kb_common module


def _load(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


make_kb = _load("make_kb", ROOT / "scripts" / "make_kb.py")
kb_common = _load("kb_common", ROOT / "benchmarks" / "kb_common.py")
exp_rag = _load("exp_rag", ROOT / "benchmarks" / "exp_rag.py")


@pytest.fixture(scope="module")
def kb():
    return make_kb.build(32)


def _lines(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "data" / "kb" / f"{name}.jsonl").read_text().splitlines()]


def test_the_bundled_files_are_what_the_generator_writes(kb):
    assert make_kb.build(32)["pretrain"] == kb["pretrain"]  # deterministic
    assert (ROOT / "data" / "kb" / "pretrain.txt").read_text() == kb["pretrain"]
    for name in ("entities", "docs", "qa_seen", "qa_heldout", "format_sft", "format_dpo", "format_grpo",
                 "format_eval"):
        assert _lines(name) == json.loads(json.dumps(kb[name])), name


def test_held_out_people_appear_in_no_training_text(kb):
    heldout = [e for e in kb["entities"] if e["split"] == "heldout"]
    assert len(heldout) == 400 and len(kb["entities"]) == 2000
    assert len({e["name"] for e in kb["entities"]}) == 2000  # unique names
    training = kb["pretrain"] + "".join(json.dumps(kb[f]) for f in ("format_sft", "format_dpo", "format_grpo"))
    words = set(re.findall(r"[A-Za-z]+", training))
    for e in heldout:  # nothing about them can be learned
        assert e["name"] not in training
    eval_prompts = {q["prompt"] for q in kb["format_eval"]}
    assert not eval_prompts & {r["prompt"] for r in kb["format_sft"]}
    assert {"Question", "Answer", "User", "Assistant"} <= words  # both prompt phrasings are in the language


def test_attributes_cover_their_ranges_and_each_document_states_its_values(kb):
    towns = {e["town"] for e in kb["entities"]}
    jobs = {e["occupation"] for e in kb["entities"]}
    years = {e["year"] for e in kb["entities"]}
    assert len(towns) == 60 and len(jobs) == 40 and min(years) == 1800 and max(years) == 1899
    for e, d in zip(kb["entities"], kb["docs"], strict=True):  # the document states exactly its three values
        assert d["id"] == e["id"] and d["title"] == e["name"] and d["text"].isascii()
        assert e["town"] in d["text"] and e["occupation"] in d["text"] and str(e["year"]) in d["text"]


def test_the_preference_data_has_the_stated_split_of_styles(kb):
    checker = re.compile(make_kb.FORMAT_RE)
    styled = [bool(checker.match(r["response"])) for r in kb["format_sft"]]
    assert abs(sum(styled) / len(styled) - 0.3) < 0.01
    for r in kb["format_dpo"]:
        assert checker.match(r["chosen"]) and not checker.match(r["rejected"]) and r["chosen"] != r["rejected"]
        assert r["chosen"] == f"The answer is {r['rejected']}."
    assert make_kb.FORMAT_RE == kb_common.FORMAT_PATTERN


@pytest.mark.parametrize(("reply", "ok", "value"), [
    ("The answer is Keford.", True, "Keford"), (" The answer is 1855.\n", True, "1855"),
    ("The answer is ship carpenter.", True, "ship carpenter"), ("Keford", False, "Keford"),
    ("The answer is Keford", False, "The answer is Keford"), ("the answer is Keford.", False, "the answer is Keford."),
    ("The answer is Keford. Yes.", False, "Keford. Yes"), ("The answer is .", False, "The answer is ."),
])
def test_the_checker_and_the_value_of_a_reply(reply, ok, value):
    assert kb_common.satisfies(reply) is ok
    assert kb_common.answer_value(reply) == value
    assert kb_common.exact_match(reply, "Keford") is (value == "Keford")


def test_the_rag_template_renders_the_prompt_as_it_is_and_trains_the_answer_only(kb):
    from tokenloom.data.chat import chat_template_for
    from tokenloom.data.tokenizers import create_tokenizer

    tokenizer = create_tokenizer("char", kb["pretrain"])
    template = chat_template_for(tokenizer, None, exp_rag.RAG_CHAT_TEMPLATE)
    prompt = "[e0001] Batri Wos\nBatri Wos comes from Keford.\n\nQuestion: Where is Batri Wos from?\nAnswer:"
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "Keford"}]
    ids, trained = template.encode(tokenizer, messages)
    assert tokenizer.decode(ids) == prompt + " Keford\n"
    assert tokenizer.decode([i for i, t in zip(ids, trained, strict=True) if t]) == " Keford\n"
    assert template.encode_prompt(tokenizer, messages[:1]) == tokenizer.encode(prompt)  # generate --rag's prompt
    assert template.stop_strings == ["\n"]


def test_a_counterfactual_changes_the_gold_passage_and_the_answer_only():
    import random

    from tokenloom.retrieval import Hit, Passage

    hits = [Hit(Passage("e0002", "Ana Bel comes from Keford.", "e0002", 0, "Ana Bel"), 3.0, 1),
            Hit(Passage("e0001", "Batri Wos comes from Keford.", "e0001", 0, "Batri Wos"), 2.0, 2)]
    q = {"question": "Where is Batri Wos from?", "answer": "Keford", "doc": "e0001"}
    changed, value = exp_rag.counterfactual(hits, q, ["Keford", "Seby", "Raby"], random.Random(0))
    assert value in ("Seby", "Raby")
    assert changed[0] == hits[0] and changed[1].passage.text == f"Batri Wos comes from {value}."
    assert [h.passage.id for h in changed] == ["e0002", "e0001"]


def test_the_rag_training_set_holds_no_held_out_passage_and_its_extra_turns_ask_about_the_other_passages(tmp_path):
    pytest.importorskip("bm25s")
    from tokenloom.retrieval import Retriever, build_index

    build_index(ROOT / "data" / "kb" / "docs.jsonl", tmp_path / "index")
    retriever = Retriever.open(tmp_path / "index")
    questions = _lines("qa_seen")[:60]
    rows, counts = exp_rag.sft_rows(retriever, questions, 0.2, 0.0, 0, extra_questions=2)
    assert counts["context"] + counts["no_context"] == 60 and counts["extra_turns"] == 2 * counts["context"]
    heldout = {e["id"] for e in _lines("entities") if e["split"] == "heldout"}
    qa = {(q["question"], q["answer"]): q for q in _lines("qa_seen")}
    for row in rows:
        first = row["messages"][0]["content"]
        passages = re.findall(r"^\[(e\d{4})\] ", first, flags=re.M)
        assert not set(passages) & heldout and len(passages) in (0, 3)
        assert first.endswith("\nAnswer:") and "Question: " in first
        gold = qa[(first.split("Question: ")[-1].removesuffix("\nAnswer:"), row["messages"][1]["content"])]
        assert not passages or gold["doc"] in passages  # BM25 finds the person named in the question
        turns = row["messages"][2:]
        assert len(turns) == (4 if passages else 0)
        for user, reply in zip(turns[::2], turns[1::2], strict=True):
            question = user["content"].removeprefix("Question: ").removesuffix("\nAnswer:")
            asked = qa[(question, reply["content"])]  # a real question about a seen person, with its answer
            assert asked["doc"] in passages and asked["doc"] != gold["doc"]  # about another passage of the prompt


@pytest.mark.slow
def test_each_driver_runs_its_quick_mode(tmp_path):
    """About a minute each on a shared 2-core machine: each trains a tiny base once (kept in --out), then a few
    steps of each stage."""
    exp_align = _load("exp_align", ROOT / "benchmarks" / "exp_align.py")
    exp_lora = _load("exp_lora", ROOT / "benchmarks" / "exp_lora.py")
    align = exp_align.main(["--quick", "--out", str(tmp_path)])
    assert set(align["rows"]) == {"base", "SFT", "DPO", "GRPO"}
    assert all(0 <= r["satisfied_greedy"] <= 1 and 0 <= r["em_sampled"] <= 1 for r in align["rows"].values())
    assert "kl" in align["rows"]["DPO"] and "kl" in align["rows"]["GRPO"]
    rag = exp_rag.main(["--quick", "--out", str(tmp_path)])
    assert rag["after"]["recall_at_3"] == 1.0 and 0 <= rag["after"]["em_rag"] <= 1
    lora = exp_lora.main(["--quick", "--out", str(tmp_path)])
    shares = {name: r["trainable_share"] for name, r in lora["rows"].items()}
    assert shares["full"] == 1.0 and 0 < shares["LoRA r8, attention"] < shares["LoRA r8, attention + MLP"] < 1
