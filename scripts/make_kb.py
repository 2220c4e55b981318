"""Write the synthetic knowledge base of the RAG and alignment demonstrations (deterministic, seeded) into ``data/kb/``.

2,000 invented people, each with three attributes whose values cannot be guessed from the name (drawn
independently of it): a home town (one of 60 invented towns), an occupation (one of 40) and a birth year
(1800-1899). One short document per person (2-4 sentences, ASCII, a few surface variants). 1,600 people are
"seen" (their documents are the pretraining text), 400 "held out" (their attribute values appear in no training
text: only retrieval can answer questions about them).

Files (described in ``data/kb/README.md``):

* ``entities.jsonl``: ``{"id", "name", "town", "occupation", "year", "split"}`` (split: seen | heldout).
* ``docs.jsonl``: ``{"id", "title", "text"}``, one document per entity (the retrieval corpus).
* ``pretrain.txt``: the seen entities' documents plus question/answer pairs (in the default chat template's
  phrasing and in that of tokenloom.retrieval's prompt) and catalogue lines about seen entities; every character
  of the documents, the questions and both templates occurs in it.
* ``qa_seen.jsonl`` / ``qa_heldout.jsonl``: ``{"id", "entity", "attribute", "question", "answer", "doc"}``.
* ``format_sft.jsonl``: ``{"prompt", "response"}`` for the preference demo; about 30% of the responses are in the
  required style ``The answer is VALUE.``, the rest the bare value.
* ``format_dpo.jsonl``: ``{"prompt", "chosen", "rejected"}``: chosen ``The answer is VALUE.``, rejected ``VALUE``.
* ``format_grpo.jsonl``: ``{"prompt", "answer"}`` (the checker is the reward).
* ``format_eval.jsonl``: ``{"prompt", "answer"}``: questions about seen entities kept out of the three files above.

    python scripts/make_kb.py [--seed 32] [--out data/kb]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTITIES, HELDOUT = 2000, 400
FIRST_YEAR, LAST_YEAR = 1800, 1899
QA_PRETRAIN_LINES = 400  # question/answer pairs (about seen entities) added to pretrain.txt, half in each phrasing
RECORD_LINES = 150  # catalogue lines (about seen entities) added to pretrain.txt
FORMAT_FRACTION = 0.3  # share of format_sft.jsonl responses in the required style
FORMAT_EVAL_ENTITIES = 200  # seen entities whose questions form format_eval.jsonl (in no format_* training file)
FORMAT_TRAIN_QUESTIONS = 2400  # questions in format_sft / format_dpo / format_grpo (each)
FORMAT_RE = r"^The answer is [A-Za-z0-9 ]+\.$"  # the checker of the preference demo (documented in README.md)

ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th",
          "v", "w", "z", "sh", "tr"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
CODAS = ["", "", "", "n", "l", "r", "s", "th", "m", "k"]
TOWN_SUFFIXES = ["marrow", "ford", "wick", "holt", "mere", "by", "stead", "ton", "well", "moor", "field", "bridge",
                 "haven", "dale", "combe", "ley"]
OCCUPATIONS = ["baker", "glassblower", "carpenter", "weaver", "potter", "blacksmith", "tailor", "shoemaker",
               "fisherman", "farmer", "miller", "brewer", "butcher", "mason", "cooper", "tanner", "chandler",
               "bookbinder", "clockmaker", "locksmith", "saddler", "wheelwright", "thatcher", "shepherd", "gardener",
               "innkeeper", "schoolteacher", "physician", "midwife", "apothecary", "lawyer", "surveyor", "printer",
               "sailor", "ferryman", "miner", "stonecutter", "jeweller", "painter", "musician"]
FILLERS = ["{n} is known for a quiet manner.", "{n} keeps a small garden behind the house.",
           "{n} writes letters every week.", "{n} rarely travels far.", "{n} has many friends in the area.",
           "{n} enjoys long walks in the evening.", "{n} is fond of old songs.",
           "Everyone on the street knows {n}.", "Old friends often visit {n}.", "Young people ask {n} for advice.",
           "{n} takes the express coach twice a year."]
DOC_TEMPLATES = [
    ["{n} was born in {y} in {t}.", "{n} works as {a} {o}."],
    ["{n} comes from {t}.", "Born in {y}, {n} works as {a} {o}."],
    ["{n} is {a} {o} from {t}.", "{n} was born in {y}."],
    ["Born in {t} in the year {y}, {n} earns a living as {a} {o}."],
]
QUESTIONS = {
    "town": ["Where is {n} from?", "Which town does {n} come from?"],
    "occupation": ["What does {n} do for a living?", "What is the occupation of {n}?"],
    "year": ["In what year was {n} born?", "When was {n} born?"],
}


def syllable(rng: random.Random, coda: bool = True) -> str:
    return rng.choice(ONSETS) + rng.choice(VOWELS) + (rng.choice(CODAS) if coda else "")


def make_towns(rng: random.Random, count: int = 60) -> list[str]:
    towns: set[str] = set()
    while len(towns) < count:
        towns.add((syllable(rng, coda=False) + rng.choice(TOWN_SUFFIXES)).capitalize())
    return sorted(towns)


def make_names(rng: random.Random, count: int, avoid: set[str]) -> list[str]:
    """``count`` unique two-part names, none sharing a word with ``avoid`` (the towns)."""
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < count:
        first = "".join(syllable(rng, coda=i == 1) for i in range(rng.choice([2, 2, 3]))).capitalize()
        last = "".join(syllable(rng) for _ in range(rng.choice([1, 2]))).capitalize()
        name = f"{first} {last}"
        if name in seen or first in avoid or last in avoid or len(first) < 4 or len(last) < 3:
            continue
        seen.add(name)
        names.append(name)
    return names


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def make_doc(rng: random.Random, e: dict) -> str:
    sentences = [s.format(n=e["name"], t=e["town"], y=e["year"], o=e["occupation"], a=article(e["occupation"]))
                 for s in rng.choice(DOC_TEMPLATES)]
    for filler in rng.sample(FILLERS, rng.choice([1, 1, 2]) if len(sentences) < 2 else rng.choice([0, 1, 1])):
        sentences.insert(rng.randrange(1, len(sentences) + 1), filler.format(n=e["name"]))
    return " ".join(sentences)


def qa_rows(e: dict, rng: random.Random) -> list[dict]:
    """One question per attribute (a random template of two)."""
    return [{"id": f"{e['id']}-{attr}", "entity": e["name"], "attribute": attr,
             "question": rng.choice(templates).format(n=e["name"]), "answer": str(e[attr]), "doc": e["id"]}
            for attr, templates in QUESTIONS.items()]


def qa_line(q: dict, rag_style: bool) -> str:
    """A question/answer pair in the default chat template's phrasing (tokenloom.data.chat: ``User: ...``,
    ``Assistant: ...`` and a blank line) or in that of a retrieval prompt (tokenloom.retrieval.rag:
    ``Question: ...``, ``Answer: ...``)."""
    if rag_style:
        return f"Question: {q['question']}\nAnswer: {q['answer']}\n\n"
    return f"User: {q['question']}\nAssistant: {q['answer']}\n\n"


def record_line(e: dict) -> str:
    """A catalogue line (brackets, parentheses, dashes, semicolons: characters a retrieval prompt may use)."""
    return (f"Record [{e['id']}] ({e['name']}): town - {e['town']}; occupation - {e['occupation']}; "
            f"born - {e['year']}.\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="ascii") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


def build(seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    towns = make_towns(rng)
    names = make_names(rng, ENTITIES, set(towns))
    entities = [{"id": f"e{i + 1:04d}", "name": name, "town": rng.choice(towns), "occupation": rng.choice(OCCUPATIONS),
                 "year": rng.randint(FIRST_YEAR, LAST_YEAR), "split": "seen"} for i, name in enumerate(names)]
    for e in rng.sample(entities, HELDOUT):
        e["split"] = "heldout"
    docs = [{"id": e["id"], "title": e["name"], "text": make_doc(rng, e)} for e in entities]
    qa = {e["id"]: qa_rows(e, rng) for e in entities}
    seen = [e for e in entities if e["split"] == "seen"]
    qa_seen = [q for e in seen for q in qa[e["id"]]]
    qa_heldout = [q for e in entities if e["split"] == "heldout" for q in qa[e["id"]]]

    # pretrain.txt: the seen documents and some question/answer lines about seen entities, shuffled together
    by_id = {d["id"]: d for d in docs}
    pieces = [by_id[e["id"]]["text"] + "\n" for e in seen]
    for q in rng.sample(qa_seen, QA_PRETRAIN_LINES):
        value = q["answer"]
        styled = f"The answer is {value}." if rng.random() < FORMAT_FRACTION else value
        pieces.append(qa_line({**q, "answer": styled}, rag_style=rng.random() < 0.5))
    pieces += [record_line(e) for e in rng.sample(seen, RECORD_LINES)]
    rng.shuffle(pieces)
    pretrain = "".join(pieces)

    # the preference demo: questions about seen entities; the evaluation entities are in no training file
    eval_ids = {e["id"] for e in rng.sample(seen, FORMAT_EVAL_ENTITIES)}
    train_qs = [q for q in qa_seen if q["doc"] not in eval_ids]
    rng.shuffle(train_qs)
    train_qs = train_qs[:FORMAT_TRAIN_QUESTIONS]
    styled = set(rng.sample(range(len(train_qs)), round(FORMAT_FRACTION * len(train_qs))))
    fmt_sft = [{"prompt": q["question"], "response": f"The answer is {q['answer']}." if i in styled else q["answer"]}
               for i, q in enumerate(train_qs)]
    fmt_dpo = [{"prompt": q["question"], "chosen": f"The answer is {q['answer']}.", "rejected": q["answer"]}
               for q in train_qs]
    fmt_grpo = [{"prompt": q["question"], "answer": q["answer"]} for q in train_qs]
    fmt_eval = [{"prompt": q["question"], "answer": q["answer"]} for q in qa_seen if q["doc"] in eval_ids]
    return {"entities": entities, "docs": docs, "pretrain": pretrain, "qa_seen": qa_seen, "qa_heldout": qa_heldout,
            "format_sft": fmt_sft, "format_dpo": fmt_dpo, "format_grpo": fmt_grpo, "format_eval": fmt_eval,
            "towns": towns}


def check(kb: dict) -> None:
    """The promises of README.md: ASCII, no held-out value in the training text, the checker's split."""
    pretrain = kb["pretrain"]
    assert pretrain.isascii() and not set("<|{}#") & set(pretrain)
    known = set(pretrain)
    needed = set("".join(d["text"] + d["title"] + d["id"] for d in kb["docs"]))
    needed |= set("".join(q["question"] for q in kb["qa_seen"] + kb["qa_heldout"]))
    needed |= set("System: User: Assistant: Question: Answer: The answer is [e0123456789]\n")  # the templates
    assert needed <= known, f"characters missing from pretrain.txt: {sorted(needed - known)}"
    heldout_names = [e["name"] for e in kb["entities"] if e["split"] == "heldout"]
    assert not any(name in pretrain for name in heldout_names), "a held-out entity appears in pretrain.txt"
    styled = sum(bool(re.match(FORMAT_RE, r["response"])) for r in kb["format_sft"])
    assert abs(styled / len(kb["format_sft"]) - FORMAT_FRACTION) < 0.01
    assert all(re.match(FORMAT_RE, r["chosen"]) and not re.match(FORMAT_RE, r["rejected"]) for r in kb["format_dpo"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPO / "data" / "kb")
    args = parser.parse_args()
    kb = build(args.seed)
    check(kb)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("entities", "docs", "qa_seen", "qa_heldout", "format_sft", "format_dpo", "format_grpo",
                 "format_eval"):
        write_jsonl(args.out / f"{name}.jsonl", kb[name])
    (args.out / "pretrain.txt").write_text(kb["pretrain"], encoding="ascii")
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir())}
    print(json.dumps({"seed": args.seed, "bytes": sum(sizes.values()), "files": sizes}))


if __name__ == "__main__":
    main()
