"""Speculative decoding against plain decoding on the bundled models, side by side in one run (issue 30).

Every row decodes the same prompts at batch 1 with plain decoding and with a drafter, the two taking turns
(``--repeats`` rounds, the best time of each kept, so a burst of load from another process hits both alike), and
checks that greedy outputs are identical token for token. Reported: ms per generated token, the speedup (plain /
speculative), the drafter's acceptance (kept / proposed drafts) and the tokens per pass of the model.

* **draft model** on ``checkpoints/shakespeare-char`` (6 x 384): the small drafter given by ``--draft`` (default
  ``checkpoints/shakespeare-char-draft``, 2 x 128, the same character tokenizer), greedy, k = ``--k`` values.
* **prompt lookup, open-ended**: the same prompts, greedy and sampled (temperature 0.8, seeded; the sampled tokens
  differ from plain sampling's, both draw from the same distribution, so only speed is compared).
* **prompt lookup, self-echo**: a prompt followed by the model's own greedy continuation and the prompt again, so
  the continuation recurs (an echo task: the text to produce is already in the context).
* **prompt lookup, translator**: ``checkpoints/multi30k-de-en`` translating ``--sentences`` test2016 sentences
  greedily one at a time, n-grams looked up in the source and the output.

    python benchmarks/bench_speculative.py
    python benchmarks/bench_speculative.py --new-tokens 100 --repeats 2 --k 4 --out speculative.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from tokenloom.checkpoint import load_model, load_tokenizer
from tokenloom.generation import DraftTally, GenerationConfig, PromptLookup, generate
from tokenloom.hardware import machine

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further, hear me speak.\n", "KING HENRY VI:\n"]


def _best(fns: list, repeats: int) -> list[tuple[float, object]]:
    """Best wall time and last output of each function, the functions taking turns ``repeats`` times."""
    best = [(float("inf"), None)] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            out = fn()
            best[i] = min(best[i], (time.perf_counter() - start, out), key=lambda pair: pair[0])
    return best


def compare(name: str, model, prompts: list[torch.Tensor], config: GenerationConfig, draft_of, repeats: int,
            exact: bool = True) -> dict:
    """One row: plain vs speculative decoding of ``prompts`` (each (1, T)) under ``config``; ``draft_of()`` makes
    a fresh drafter (a model or a :class:`PromptLookup`) per prompt."""
    tally = DraftTally()

    def plain():
        return [generate(model, ids, config) for ids in prompts]

    def speculative():
        return [generate(model, ids, config, draft=draft_of(), draft_tally=tally) for ids in prompts]

    plain(), speculative()  # warm-up: every shape once
    tally.__init__()
    (t_plain, out_plain), (t_spec, out_spec) = _best([plain, speculative], repeats)
    new = sum(o.shape[1] - p.shape[1] for o, p in zip(out_plain, prompts, strict=True))
    same = all(torch.equal(a, b) for a, b in zip(out_plain, out_spec, strict=True))
    row = {"name": name, "k": config.num_draft_tokens, "new_tokens": new,
           "plain_ms_per_token": 1000 * t_plain / new, "speculative_ms_per_token": 1000 * t_spec / new,
           "speedup": t_plain / t_spec, "acceptance": tally.acceptance_rate, "tokens_per_pass": tally.tokens_per_pass,
           "identical": same if exact else None}
    print(f"  {name}, k={row['k']}: plain {row['plain_ms_per_token']:.2f} ms/token, speculative "
          f"{row['speculative_ms_per_token']:.2f} ({row['speedup']:.2f}x), acceptance {row['acceptance']:.2f}, "
          f"{row['tokens_per_pass']:.2f} tokens/pass" + (f", identical {same}" if exact else ""), flush=True)
    return row


def translator_row(args: argparse.Namespace, k: int) -> dict:
    """Greedy translation one sentence at a time, plain vs prompt lookup over the source (the same outputs)."""
    from tokenloom.generation import DraftTally as Tally
    from tokenloom.tasks.translation import Speculation, translate

    model, _ = load_model(ROOT / "checkpoints/multi30k-de-en")
    tokenizer = load_tokenizer(ROOT / "checkpoints/multi30k-de-en")
    lines = (ROOT / "data/multi30k/test2016.de").read_text().splitlines()[:args.sentences]
    tally = Tally()

    def plain():
        return translate(model, tokenizer, lines, beam=1, max_tokens=1)

    def speculative():
        return translate(model, tokenizer, lines, beam=1, max_tokens=1,
                         speculation=Speculation(None, args.lookup, k, tally))

    with torch.inference_mode():
        plain(), speculative()
        tally.__init__()
        (t_plain, a), (t_spec, b) = _best([plain, speculative], args.repeats)
    tokens = tally.emitted / max(1, args.repeats)
    row = {"name": f"prompt lookup, translator ({args.sentences} sentences)", "k": k, "new_tokens": tokens,
           "plain_ms_per_token": 1000 * t_plain / tokens, "speculative_ms_per_token": 1000 * t_spec / tokens,
           "speedup": t_plain / t_spec, "acceptance": tally.acceptance_rate, "tokens_per_pass": tally.tokens_per_pass,
           "identical": a == b}
    print(f"  {row['name']}, k={k}: {row['speedup']:.2f}x, acceptance {row['acceptance']:.2f}, identical {a == b}",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=str(ROOT / "checkpoints/shakespeare-char-draft"),
                        help="the draft model for the Shakespeare model")
    parser.add_argument("--k", default="3,4,6", help="comma-separated numbers of draft tokens")
    parser.add_argument("--lookup", type=int, default=3, help="prompt lookup's largest n-gram")
    parser.add_argument("--new-tokens", type=int, default=150)
    parser.add_argument("--sentences", type=int, default=40, help="test2016 sentences for the translator row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--only", default=None, help="comma-separated: draft, lookup, echo, translator")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    only = set(args.only.split(",")) if args.only else {"draft", "lookup", "echo", "translator"}
    ks = [int(k) for k in args.k.split(",")]
    print(machine().describe() + f"; load average {os.getloadavg()[0]:.1f}")
    model, _ = load_model(ROOT / "checkpoints/shakespeare-char")
    tokenizer = load_tokenizer(ROOT / "checkpoints/shakespeare-char")
    prompts = [torch.tensor([tokenizer.encode(p)]) for p in PROMPTS]
    rows = []
    with torch.inference_mode():
        if "draft" in only:
            draft, _ = load_model(args.draft)
            for k in ks:
                rows.append(compare("draft model, greedy", model, prompts,
                                    GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False,
                                                     num_draft_tokens=k), lambda: draft.eval(), args.repeats))
        if "lookup" in only:
            for k in ks:
                config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, num_draft_tokens=k)
                rows.append(compare("prompt lookup, open-ended greedy", model, prompts, config,
                                    lambda: PromptLookup(args.lookup), args.repeats))
                sampled = GenerationConfig(max_new_tokens=args.new_tokens, temperature=0.8, seed=0,
                                           num_draft_tokens=k)
                rows.append(compare("prompt lookup, open-ended sampling (T 0.8)", model, prompts, sampled,
                                    lambda: PromptLookup(args.lookup), args.repeats, exact=False))
        if "echo" in only:
            echoes, echo_len = [], min(args.new_tokens, 60)  # prompt + continuation + prompt + its echo fit 256
            for ids in prompts:
                continued = generate(model, ids, GenerationConfig(max_new_tokens=echo_len, do_sample=False))
                echoes.append(torch.cat([continued, tokenizer_ids(tokenizer, "\n\n"), ids], dim=1))
            for k in ks:
                config = GenerationConfig(max_new_tokens=echo_len, do_sample=False, num_draft_tokens=k)
                rows.append(compare("prompt lookup, self-echo greedy", model, echoes, config,
                                    lambda: PromptLookup(args.lookup), args.repeats))
    if "translator" in only:
        rows.append(translator_row(args, ks[len(ks) // 2]))
    print("\n| drafter, decoding | k | plain ms/token | speculative ms/token | speedup | acceptance | tokens/pass "
          "| identical |\n|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        print(f"| {r['name']} | {r['k']} | {r['plain_ms_per_token']:.2f} | {r['speculative_ms_per_token']:.2f} | "
              f"{r['speedup']:.2f}x | {r['acceptance']:.2f} | {r['tokens_per_pass']:.2f} | {same} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine().as_dict(), "rows": rows}, indent=1))


def tokenizer_ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(text)])


if __name__ == "__main__":
    main()
