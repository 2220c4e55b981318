"""Write the bundled instruction-tuning example, ``data/sft/example.jsonl`` (deterministic): short instructions whose
answer a program checks (reverse a word, add two numbers, uppercase a word, count letters, repeat a word), as
``{"prompt", "response"}`` lines and as ``{"messages": [...]}`` lines (some with a system turn, some with two
exchanges), so both formats of ``tokenloom.data.chat.read_conversations`` appear.

    python scripts/make_sft_example.py [--seed 7] [--lines 200] [--out data/sft/example.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "data" / "sft" / "example.jsonl"
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "house", "green", "music", "paper", "night", "horse",
         "bread", "light", "water", "chair", "plant", "sugar", "smile", "train", "king", "moon", "bird", "fish", "rain",
         "tree", "sand", "wolf", "gold", "snow", "star", "ship", "lamp", "door", "milk", "rose", "bell", "frog")
SYSTEM = "You answer with the result only."


def instruction(rng: random.Random) -> tuple[str, str]:
    """(instruction, answer) of a random kind."""
    kind = rng.randrange(5)
    word = rng.choice(WORDS)
    if kind == 0:
        return f"Reverse the word: {word}", word[::-1]
    if kind == 1:
        a, b = rng.randrange(1, 50), rng.randrange(1, 50)
        return f"Add {a} and {b}", str(a + b)
    if kind == 2:
        return f"Uppercase: {word}", word.upper()
    if kind == 3:
        return f"How many letters in {word}?", str(len(word))
    n = rng.randrange(2, 4)
    return f"Repeat {word} {n} times", " ".join([word] * n)


def line(rng: random.Random) -> dict:
    layout = rng.random()
    if layout < 0.5:
        prompt, response = instruction(rng)
        return {"prompt": prompt, "response": response}
    messages = [{"role": "system", "content": SYSTEM}] if layout < 0.75 else []
    for _ in range(1 if layout < 0.9 else 2):
        prompt, response = instruction(rng)
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return {"messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as fh:
        for _ in range(args.lines):
            fh.write(json.dumps(line(rng)) + "\n")
    print(f"wrote {args.lines} conversations to {args.out}")


if __name__ == "__main__":
    main()
