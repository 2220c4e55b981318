"""Exact-match accuracy of a checkpoint trained on the sft example (configs/sft-char.yaml) on fresh instructions of the
same kinds (scripts/make_sft_example.py's generator with another seed), per kind: greedy replies through the
checkpoint's chat template.

    python scripts/check_sft_example.py runs/sft [--items 200] [--seed 12345]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_sft_example import instruction  # noqa: E402

from tokenloom.checkpoint import load_model, load_tokenizer  # noqa: E402
from tokenloom.data.chat import template_for_tokenizer  # noqa: E402
from tokenloom.generation import GenerationConfig  # noqa: E402
from tokenloom.generation.chat import generate_reply  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args()
    model, _ = load_model(args.checkpoint)
    tokenizer = load_tokenizer(args.checkpoint)
    chat = template_for_tokenizer(tokenizer)
    rng = random.Random(args.seed)
    right: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    config = GenerationConfig(max_new_tokens=40, do_sample=False)
    for _ in range(args.items):
        question, answer = instruction(rng)
        kind = question.split()[0].rstrip(":").lower()
        reply = generate_reply(model.eval(), tokenizer, chat, [{"role": "user", "content": question}], config)
        total[kind] += 1
        right[kind] += reply == answer
    for kind in sorted(total):
        print(f"{kind:>10}: {right[kind]}/{total[kind]}")
    print(f"{'all':>10}: {sum(right.values())}/{sum(total.values())} "
          f"({100 * sum(right.values()) / sum(total.values()):.1f}% exact match)")


if __name__ == "__main__":
    main()
