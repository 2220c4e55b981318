"""Retrieval-augmented generation on the synthetic knowledge base (issue 32): exact match on questions about
held-out people with retrieval, without it, and with the wrong passages; citations.

The knowledge base (data/kb/README.md): 2,000 invented people with a home town, an occupation and a birth year; a
character-level GPT pretrained on the documents of the 1,600 seen people (``tokenloom train kb-char --out
runs/kb-lm``) has never read anything about the 400 held-out ones, so it can answer a question about them only from
a retrieved passage (chance: 1/60 towns, 1/40 occupations, 1/100 years).

1. ``tokenloom index data/kb/docs.jsonl`` (BM25 over all 2,000 documents, one passage each).
2. The SFT set: every question about a seen person (4,800) as the prompt ``tokenloom generate --rag`` builds
   (:func:`tokenloom.retrieval.build_prompt`: the top-3 BM25 passages ``[e0001] NAME\nTEXT`` in rank order, then
   ``Question: ...\nAnswer:``) followed by `` VALUE`` and a line break; a fifth (``--no-context``) without
   passages (the model answers from what it read in pretraining). Training retrieval keeps seen people's passages
   only, so no held-out document is in any training prompt. ``--extra-questions K`` (default 2): a prompt with
   passages continues with K more turns ``Question: ...\nAnswer: VALUE`` about the people of its other passages
   -- three times the answer tokens for each prompt read, and each turn teaches to pick the passage that the
   question names. The attributes are learned one after the other (a sudden drop of the loss each): with one
   question per prompt 600 steps copied towns (85%) but not occupations or years; with two extra questions towns
   by step 900 (96%), occupations by about step 1,100 (96.5% at 1,800), years not by step 1,800. With
   ``--counterfactual F`` a fraction F of the examples with the gold passage get another value of the attribute
   written into that passage and as the answer (a model that recalls instead of reading is wrong on them;
   default 0). Rendered by a Jinja chat template that writes the prompt as it is (no ``User:`` header), so
   training and ``generate --rag`` see the same text; the loss covers the answers and their line breaks only.
3. ``task: sft`` from the pretrained model (``train.init_from``), ``--steps`` steps.
4. Evaluation on ``--questions`` held-out questions, greedy, the answer cut at the line break
   (:func:`tokenloom.retrieval.rag.answer_text`), as ``generate --rag`` does:

   * **with retrieval**: the top-3 BM25 passages; exact match; retrieval recall@3 (the gold document among them);
     **citations** (:func:`tokenloom.retrieval.rag.finish`: the passages in the prompt that hold the answer's words):
     among the correct answers, the share whose citations include the gold passage, and the share citing it alone.
   * **without retrieval**: the prompt with no passages (chance level expected).
   * **wrong passages**: the top-3 passages retrieved for another held-out person's question about the same
     attribute: exact match against the gold value, and the share of answers equal to the other person's value
     (does the model follow its context?).

Prints a Markdown table and one JSON line; the machine first.

    python benchmarks/exp_rag.py                     # 28 minutes on 2 shared CPU cores (1,800 steps, 2 threads)
    python benchmarks/exp_rag.py --steps 900         # 23 minutes (1 thread): towns only
    python benchmarks/exp_rag.py --quick             # a smoke run: a tiny model, a few steps
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from kb_common import (
    KB,
    REPO,
    continue_batch,
    ensure_base,
    machine_line,
    markdown_table,
    pct,
    read_jsonl,
    train,
    write_jsonl,
)

# the SFT template: the prompt as it is, then " ANSWER\n" (the trained part); generation prompt: nothing
RAG_CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %} {{ m['content'] }}\n"
                     "{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
TOP_K = 3


def build_index(out: Path) -> Path:
    index = out.resolve() / "index"
    cmd = [sys.executable, "-m", "tokenloom", "index", str(KB / "docs.jsonl"), "--out", str(index), "--force"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True)
    return index


def counterfactual(hits: list, q: dict, values: list[str], rng: random.Random) -> tuple[list, str]:
    """``hits`` with the gold passage's value of ``q``'s attribute replaced by another value (and that value)."""
    from dataclasses import replace

    new = rng.choice([v for v in values if v != q["answer"]])
    changed = []
    for h in hits:
        if h.passage.id == q["doc"]:
            h = replace(h, passage=replace(h.passage, text=h.passage.text.replace(q["answer"], new)))
        changed.append(h)
    return changed, new


def sft_rows(retriever, questions: list[dict], no_context: float, counterfactual_share: float,  # noqa: ANN001
             seed: int, extra_questions: int = 0) -> tuple[list[dict], dict]:
    """The SFT conversations (``{"messages": [...]}``) and counts of their kinds. Retrieval for training keeps only
    seen people's passages (the top 3 of them), so no held-out document enters any training prompt. With
    ``extra_questions`` k, an example with passages continues with k more turns (``Question: ...\nAnswer:`` and
    the value) about the people of the other passages in its prompt: more answer tokens per prompt read, and each
    teaches to pick the passage whose name the question gives."""
    from tokenloom.retrieval import RagConfig, build_prompt

    rng = random.Random(seed)
    config = RagConfig(top_k=TOP_K)
    values: dict[str, list[str]] = {}
    by_doc: dict[str, list[dict]] = {}
    for q in read_jsonl(KB / "qa_seen.jsonl"):
        by_doc.setdefault(q["doc"], []).append(q)
    for q in read_jsonl(KB / "qa_seen.jsonl") + read_jsonl(KB / "qa_heldout.jsonl"):
        values.setdefault(q["attribute"], [])
        if q["answer"] not in values[q["attribute"]]:
            values[q["attribute"]].append(q["answer"])
    rows, counts = [], {"context": 0, "no_context": 0, "counterfactual": 0, "gold_retrieved": 0, "extra_turns": 0}
    for q in questions:
        answer = q["answer"]
        turns: list[tuple[str, str]] = []
        if rng.random() < no_context:
            prompt = build_prompt(q["question"], [], config)
            counts["no_context"] += 1
        else:
            hits = [h for h in retriever.search(q["question"], TOP_K + 12) if h.passage.doc_id in by_doc][:TOP_K]
            gold = any(h.passage.id == q["doc"] for h in hits)
            counts["gold_retrieved"] += gold
            if gold and rng.random() < counterfactual_share:
                hits, answer = counterfactual(hits, q, values[q["attribute"]], rng)
                counts["counterfactual"] += 1
            prompt = build_prompt(q["question"], hits, config)
            counts["context"] += 1
            others = [h.passage.doc_id for h in hits if h.passage.doc_id != q["doc"]]
            for doc in (others * extra_questions)[:extra_questions]:
                extra = rng.choice(by_doc[doc])
                turns.append((build_prompt(extra["question"], [], config).lstrip("\n"), extra["answer"]))
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        for user, reply in turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        counts["extra_turns"] += len(turns)
        rows.append({"messages": messages})
    rng.shuffle(rows)
    return rows, counts


def sft_recipe(base: Path, data: Path, args: argparse.Namespace) -> dict:
    steps = args.steps
    return {"task": "sft", "model": {"dropout": 0.0},
            "data": {"path": str(data), "template": RAG_CHAT_TEMPLATE, "packing": True, "val_fraction": 0.02},
            "train": {"init_from": str(base), "max_steps": steps, "batch_size": args.batch_size,
                      "seq_len": args.seq_len, "lr": args.lr, "min_lr": args.lr / 10,
                      "warmup_steps": max(1, steps // 10), "schedule": "cosine", "weight_decay": 0.0,
                      "grad_clip": 1.0, "precision": "auto", "eval_every": 0, "eval_batches": 10,
                      "checkpoint_every": 0, "seed": args.seed}}


def answers(model, tokenizer, prompts: list[list[int]]) -> list[str]:  # noqa: ANN001
    from tokenloom.retrieval.rag import answer_text

    raw = continue_batch(model, tokenizer, prompts, max_new_tokens=16, stops=["\n"], batch_size=32)
    return [answer_text(text, ["\n"]) for text in raw]


def evaluate(checkpoint: Path, retriever, questions: list[dict], seed: int) -> dict:  # noqa: ANN001
    """Exact match with retrieval, without it and with another question's passages; recall@3; citations."""
    from tokenloom.checkpoint import load_model, load_tokenizer
    from tokenloom.retrieval import RagAnswer, RagConfig, fit_prompt
    from tokenloom.retrieval.rag import finish

    model, _ = load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    config = RagConfig(top_k=TOP_K)
    context = int(model.config.max_seq_len)
    hits = [retriever.search(q["question"], TOP_K) for q in questions]
    # another held-out question about the same attribute for each (a derangement within each attribute)
    rng = random.Random(seed)
    other: dict[int, int] = {}
    for attribute in sorted({q["attribute"] for q in questions}):
        idx = [i for i, q in enumerate(questions) if q["attribute"] == attribute]
        shuffled = idx[:]
        rng.shuffle(shuffled)
        for a, b in zip(shuffled, shuffled[1:] + shuffled[:1], strict=True):
            other[a] = b if b != a else a
    fitted = [fit_prompt(tokenizer, q["question"], h, context, 16, config) for q, h in zip(questions, hits,
                                                                                           strict=True)]
    wrong = [fit_prompt(tokenizer, q["question"], hits[other[i]], context, 16, config)
             for i, q in enumerate(questions)]
    bare = [fit_prompt(tokenizer, q["question"], [], context, 16, config) for q in questions]
    start = time.perf_counter()
    with_rag = answers(model, tokenizer, [f[1] for f in fitted])
    without = answers(model, tokenizer, [f[1] for f in bare])
    misled = answers(model, tokenizer, [f[1] for f in wrong])
    seconds = time.perf_counter() - start
    gold = [q["answer"] for q in questions]
    correct = [a == g for a, g in zip(with_rag, gold, strict=True)]
    cited_gold = cited_alone = 0
    for q, f, a, ok in zip(questions, fitted, with_rag, correct, strict=True):
        if not ok:
            continue
        result = finish(RagAnswer(q["question"], a, [], f[2], [h.passage.id for h in f[3]], f[0]), f[2], config)
        cited_gold += q["doc"] in result.citations
        cited_alone += result.citations == [q["doc"]]
    n = len(questions)
    by_attribute = {}
    for attribute in sorted({q["attribute"] for q in questions}):
        idx = [i for i, q in enumerate(questions) if q["attribute"] == attribute]
        by_attribute[attribute] = {"questions": len(idx), "em_rag": sum(correct[i] for i in idx) / len(idx),
                                   "em_no_context": sum(without[i] == gold[i] for i in idx) / len(idx)}
    return {
        "questions": n,
        "recall_at_3": sum(any(h.passage.id == q["doc"] for h in hs) for q, hs in zip(questions, hits, strict=True))
        / n,
        "em_rag": sum(correct) / n,
        "em_no_context": sum(a == g for a, g in zip(without, gold, strict=True)) / n,
        "em_wrong_passages": sum(a == g for a, g in zip(misled, gold, strict=True)) / n,
        "follows_wrong_passages": sum(a == questions[other[i]]["answer"] for i, a in enumerate(misled)) / n,
        "citation_gold": cited_gold / max(1, sum(correct)),
        "citation_gold_only": cited_alone / max(1, sum(correct)),
        "chance": sum({"town": 1 / 60, "occupation": 1 / 40, "year": 1 / 100}[q["attribute"]] for q in questions) / n,
        "by_attribute": by_attribute,
        "generation_seconds": seconds,
        "examples": [{"question": q["question"], "gold": g, "rag": a, "no_context": b, "wrong": c,
                      "wrong_value": questions[other[i]]["answer"]}
                     for i, (q, g, a, b, c) in enumerate(zip(questions, gold, with_rag, without, misled,
                                                             strict=True)) if i < 4],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=None, help="the pretrained checkpoint (default runs/kb-lm/checkpoint)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "exp-rag", help="work directory")
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny base model, a few steps")
    parser.add_argument("--questions", type=int, default=600, help="held-out questions evaluated (of 1,200)")
    parser.add_argument("--train-questions", type=int, default=4800, help="seen questions in the SFT set")
    parser.add_argument("--no-context", type=float, default=0.2, help="share of SFT examples without passages")
    parser.add_argument("--counterfactual", type=float, default=0.0,
                        help="share of SFT examples whose gold passage and answer get another value")
    parser.add_argument("--extra-questions", type=int, default=2,
                        help="SFT: more question turns per prompt, about the other passages' people")
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the training process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # the training processes run in the repository root
    if args.quick:
        args.questions, args.train_questions, args.steps, args.batch_size = 12, 48, 3, 2
    torch.set_num_threads(1)
    print(machine_line(), flush=True)
    start = time.perf_counter()
    base = ensure_base(args.base, args.quick, args.out)
    shutil.rmtree(args.out / "sft", ignore_errors=True)
    from tokenloom.retrieval import Retriever

    index = build_index(args.out)
    retriever = Retriever.open(index)
    seen = read_jsonl(KB / "qa_seen.jsonl")
    random.Random(args.seed).shuffle(seen)
    rows, counts = sft_rows(retriever, seen[:args.train_questions], args.no_context, args.counterfactual, args.seed,
                            args.extra_questions)
    data = write_jsonl(args.out / "sft.jsonl", rows)
    print(f"SFT set: {len(rows)} conversations {counts}", flush=True)
    before = evaluate(base, retriever, read_jsonl(KB / "qa_heldout.jsonl")[:args.questions], args.seed)
    run = train(sft_recipe(base, data, args), args.out / "sft", threads=args.threads)
    after = evaluate(run.checkpoint, retriever, read_jsonl(KB / "qa_heldout.jsonl")[:args.questions], args.seed)
    total = time.perf_counter() - start

    def row(name: str, r: dict) -> list[str]:
        return [name, pct(r["em_rag"]), pct(r["em_no_context"]), pct(r["em_wrong_passages"]),
                pct(r["follows_wrong_passages"]), pct(r["citation_gold"]), pct(r["citation_gold_only"])]

    table = markdown_table(["model", "EM with retrieval", "EM without", "EM, wrong passages",
                            "answer = wrong passage's value", "citations incl. gold passage",
                            "citing only the gold passage"],
                           [row("pretrained (no SFT)", before), row(f"RAG SFT ({args.steps} steps)", after)])
    print()
    print(table)
    attrs = ", ".join(f"{a} {pct(v['em_rag'])} with / {pct(v['em_no_context'])} without"
                      for a, v in after["by_attribute"].items())
    print(f"\n{after['questions']} held-out questions; retrieval recall@3 {pct(after['recall_at_3'])}; chance "
          f"{pct(after['chance'])}; by attribute (after SFT): {attrs}")
    print(f"SFT: {len(rows)} conversations ({counts}), {args.steps} steps of {args.batch_size} packed rows of "
          f"{args.seq_len} tokens, lr {args.lr}: {run.seconds:.0f} s, final val_loss {run.last('val_loss')}; "
          f"total {total / 60:.1f} min")
    for ex in after["examples"][:3]:
        print(f"  {ex}")
    result = {"experiment": "rag", "machine": machine_line(), "quick": args.quick, "seconds": total,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "sft_set": counts, "train_seconds": run.seconds, "val_loss": run.last("val_loss"),
              "before": {k: v for k, v in before.items() if k != "examples"},
              "after": {k: v for k, v in after.items() if k != "examples"}}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
