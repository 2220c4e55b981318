"""Write the local lm-evaluation-harness tasks over the bundled Tiny Shakespeare validation split (deterministic):

* ``evals/shakespeare_mc/shakespeare_mc.jsonl``: 200 multiple-choice items. Each has a ``context`` (200 characters
  ending at a random position: mid-word, or after a space or a newline), four ``choices`` of 30 to 50 characters
  (random lengths: the true next characters and three runs from other random positions of the split, at least
  1,000 characters away; the lengths differ so that ``acc_norm``, the sum per character, is not ``acc``) and the
  ``label`` (index of the true one). About a fifth of the contexts end with whitespace, which lm-eval moves to the
  start of each continuation before tokenizing (``TemplateLM._encode_pair``).
* ``evals/shakespeare_gen/shakespeare_gen.jsonl``: 20 generation prompts: a ``context`` of the 200 characters
  before a line start (it ends with a newline) and the ``target`` (the true text that follows, up to the next
  blank line, at most 40 characters).

The validation split is the recipe's (configs/shakespeare-char.yaml: ``data.val_fraction`` 0.1 of the characters,
the last ones, as tokenloom.data.text splits a char-tokenized corpus).

    python scripts/make_shakespeare_mc.py [--seed 1234] [--items 200] [--gen-items 20]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "data" / "tinyshakespeare" / "input.txt"
VAL_FRACTION = 0.1  # configs/shakespeare-char.yaml: data.val_fraction
CONTEXT_CHARS, GEN_CHARS, CHOICES, MIN_DISTANCE = 200, 40, 4, 1000
MIN_CHOICE, MAX_CHOICE = 30, 50  # multiple choice: each choice's length


def validation_text() -> str:
    text = CORPUS.read_text(encoding="utf-8")
    return text[int(len(text) * (1.0 - VAL_FRACTION)):]  # char tokenizer: one token per character


def line_starts(val: str) -> list[int]:
    """Positions just after a newline with a full context before them and a full choice after them."""
    return [i + 1 for i, ch in enumerate(val) if ch == "\n"
            and CONTEXT_CHARS <= i + 1 <= len(val) - GEN_CHARS]


def make_mc(val: str, rng: random.Random, count: int) -> list[dict]:
    items, used = [], set()
    starts = range(CONTEXT_CHARS, len(val) - MAX_CHOICE + 1)
    while len(items) < count:
        p = rng.choice(starts)
        if p in used:
            continue
        true = val[p:p + rng.randint(MIN_CHOICE, MAX_CHOICE)]
        others: list[str] = []
        while len(others) < CHOICES - 1:
            q = rng.choice(starts)
            cand = val[q:q + rng.randint(MIN_CHOICE, MAX_CHOICE)]
            if abs(q - p) >= MIN_DISTANCE and cand != true and cand not in others:
                others.append(cand)
        label = rng.randrange(CHOICES)
        choices = others[:label] + [true] + others[label:]
        used.add(p)
        items.append({"id": len(items), "offset": p, "context": val[p - CONTEXT_CHARS:p], "choices": choices,
                      "label": label})
    return items


def make_gen(val: str, starts: list[int], rng: random.Random, count: int) -> list[dict]:
    items, used = [], set()
    while len(items) < count:
        p = rng.choice(starts)
        target = val[p:p + GEN_CHARS].split("\n\n")[0]
        if p in used or not target.strip():
            continue
        used.add(p)
        items.append({"id": len(items), "offset": p, "context": val[p - CONTEXT_CHARS:p], "target": target})
    return items


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--gen-items", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "evals")
    args = parser.parse_args()
    val = validation_text()
    starts = line_starts(val)
    write_jsonl(args.out / "shakespeare_mc" / "shakespeare_mc.jsonl",
                make_mc(val, random.Random(args.seed), args.items))
    write_jsonl(args.out / "shakespeare_gen" / "shakespeare_gen.jsonl",
                make_gen(val, starts, random.Random(args.seed + 1), args.gen_items))
    print(f"wrote {args.items} multiple-choice items and {args.gen_items} generation prompts under {args.out}")


if __name__ == "__main__":
    main()
