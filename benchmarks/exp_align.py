"""SFT, then DPO or GRPO, on a format constraint a checker verifies (issue 32): constraint satisfaction before SFT,
after SFT, after DPO and after GRPO, with the KL to the SFT model and the answers' correctness.

The task (data/kb/README.md): questions about the knowledge base's seen people ("Where is Batri Wos from?"); a
reply satisfies the constraint when it is exactly ``The answer is VALUE.`` (``^The answer is [A-Za-z0-9 ]+\\.$``).

1. **base**: the character-level GPT pretrained on data/kb/pretrain.txt (``tokenloom train kb-char --out
   runs/kb-lm``), whose question/answer pairs use that style 30% of the time.
2. **SFT** (``task: sft``, default chat template, packed) from the base on ``format_sft.jsonl``: 30% of the
   responses in the style, 70% the bare value -- the model learns the chat format and, by design, the style only
   about 30% of the time.
3. **DPO** (``task: dpo``, beta ``--beta``) from the SFT model, which is also the frozen reference, on
   ``format_dpo.jsonl`` (chosen ``The answer is VALUE.``, rejected ``VALUE``).
4. **GRPO** (``task: grpo``) from the SFT model (the frozen reference of its KL term) on the questions of
   ``format_grpo.jsonl``, the reward the checker (the ``regex`` reward with the pattern above): G completions per
   prompt, group-normalised advantages.

Each model is measured on the questions of ``format_eval.jsonl`` (200 seen people in no training file of steps
2-4): satisfaction with greedy decoding and with sampling at T = 1 (one sample per question, seeded), exact match
of the value (``The answer is Keford.`` and ``Keford`` both give Keford), and for DPO and GRPO the KL to the SFT
model in nats per reply (:func:`tokenloom.tasks.policy.policy_kl`: Monte Carlo over the policy's own samples at
T = 1). Prints a Markdown table and one JSON line; the machine first.

    python benchmarks/exp_align.py                     # 9.3 minutes on 2 shared CPU cores (AMD EPYC)
    python benchmarks/exp_align.py --quick             # a smoke run: a tiny model, a few steps
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from kb_common import (
    FORMAT_PATTERN,
    KB,
    REPO,
    ChatModel,
    RunResult,
    ensure_base,
    exact_match,
    machine_line,
    markdown_table,
    pct,
    read_jsonl,
    satisfies,
    train,
)

STAGES = ("base", "SFT", "DPO", "GRPO")


def finetune_train(init_from: Path, steps: int, lr: float, batch_size: int, seq_len: int, seed: int) -> dict:
    return {"init_from": str(init_from), "max_steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
            "min_lr": lr / 10, "warmup_steps": max(1, steps // 10), "schedule": "cosine", "weight_decay": 0.0,
            "grad_clip": 1.0, "precision": "auto", "eval_every": 0, "eval_batches": 5, "checkpoint_every": 0,
            "seed": seed}


def sft_recipe(base: Path, args: argparse.Namespace) -> dict:
    return {"task": "sft", "model": {"dropout": 0.0},
            "data": {"path": str(KB / "format_sft.jsonl"), "template": "default", "packing": True,
                     "val_fraction": 0.05},
            "train": finetune_train(base, args.sft_steps, args.sft_lr, 16, 256, args.seed)}


def dpo_recipe(sft: Path, args: argparse.Namespace) -> dict:
    return {"task": "dpo", "model": {"dropout": 0.0},
            "data": {"path": str(KB / "format_dpo.jsonl"), "loss": "dpo", "beta": args.beta, "val_fraction": 0.05},
            "train": finetune_train(sft, args.dpo_steps, args.dpo_lr, 16, 128, args.seed)}


def grpo_recipe(sft: Path, args: argparse.Namespace) -> dict:
    return {"task": "grpo", "model": {"dropout": 0.0},
            "data": {"path": str(KB / "format_grpo.jsonl"), "val_fraction": 0.02,
                     "rewards": [{"name": "regex", "options": {"pattern": FORMAT_PATTERN}}],
                     "group_size": args.group_size, "prompts_per_step": args.prompts_per_step, "max_new_tokens": 32,
                     "temperature": 1.0, "beta": args.grpo_beta, "kl_samples": 0},
            "train": {**finetune_train(sft, args.grpo_steps, args.grpo_lr, args.prompts_per_step, 128, args.seed),
                      "eval_batches": 1}}


def reused(out: Path) -> RunResult:
    """A finished run's result, read back (``--reuse-sft``; its time is not known: 0)."""
    metrics = out / "metrics.jsonl"
    return RunResult(out, 0.0, 0.0, read_jsonl(metrics) if metrics.is_file() else [])


def measure(checkpoint: Path, questions: list[dict], args: argparse.Namespace,
            reference: ChatModel | None = None) -> dict:
    """Satisfaction (greedy, sampled at T = 1), exact match and (with a reference) the KL to it."""
    model = ChatModel(checkpoint)
    prompts = [q["prompt"] for q in questions]
    start = time.perf_counter()
    greedy = model.answer(prompts)
    sampled = model.answer(prompts, sample=True, temperature=1.0, seed=args.seed)
    row = {"satisfied_greedy": sum(map(satisfies, greedy)) / len(greedy),
           "satisfied_sampled": sum(map(satisfies, sampled)) / len(sampled),
           "em_greedy": sum(exact_match(r, q["answer"]) for r, q in zip(greedy, questions, strict=True)) / len(greedy),
           "em_sampled": sum(exact_match(r, q["answer"]) for r, q in zip(sampled, questions, strict=True))
           / len(sampled),
           "examples": [{"question": q["prompt"], "greedy": g, "sampled": s}
                        for q, g, s in list(zip(questions, greedy, sampled, strict=True))[:3]]}
    if reference is not None:
        from tokenloom.tasks.policy import policy_kl

        details: dict = {}
        kl_prompts = prompts[:args.kl_prompts]
        # (k1, the summed log-ratio: the estimator of the figures in docs/alignment.md; the k3 sum, GRPO's val_kl,
        # is recorded beside it)
        row["kl"] = policy_kl(model.model, reference.model, model.tokenizer, kl_prompts, model.template,
                              samples_per_prompt=args.kl_samples, max_new_tokens=32, seed=args.seed, estimator="k1",
                              details=details)
        row["kl_std_error"] = details["kl_std"] / max(1, details["samples"]) ** 0.5
        row["kl_k3"] = details["kl_k3"]
    row["eval_seconds"] = time.perf_counter() - start
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=None, help="the pretrained checkpoint (default runs/kb-lm/checkpoint)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "exp-align", help="work directory")
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny base model, a few steps of each")
    parser.add_argument("--questions", type=int, default=600, help="evaluation questions (of format_eval.jsonl)")
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--sft-lr", type=float, default=5e-4)
    parser.add_argument("--dpo-steps", type=int, default=60)
    parser.add_argument("--dpo-lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta")
    parser.add_argument("--grpo-steps", type=int, default=40)
    parser.add_argument("--grpo-lr", type=float, default=1e-4)
    parser.add_argument("--grpo-beta", type=float, default=0.04, help="GRPO's KL coefficient")
    parser.add_argument("--group-size", type=int, default=8, help="GRPO: completions per prompt")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="GRPO: prompts per step")
    parser.add_argument("--kl-prompts", type=int, default=200, help="prompts of the KL estimate")
    parser.add_argument("--kl-samples", type=int, default=2, help="samples per prompt of the KL estimate")
    parser.add_argument("--reuse-sft", action="store_true", help="keep the SFT run already in --out (tune DPO / GRPO)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # the training processes run in the repository root
    if args.quick:
        args.questions, args.kl_prompts = min(args.questions, 16), min(args.kl_prompts, 8)
        args.sft_steps, args.dpo_steps, args.grpo_steps = 4, 2, 2
        args.group_size, args.prompts_per_step = 2, 2
    torch.set_num_threads(1)
    print(machine_line(), flush=True)
    start = time.perf_counter()
    base = ensure_base(args.base, args.quick, args.out)
    reuse = args.reuse_sft and (args.out / "sft" / "checkpoint" / "config.yaml").is_file()
    for name in ("dpo", "grpo") if reuse else ("sft", "dpo", "grpo"):  # fresh runs (never resumed here)
        shutil.rmtree(args.out / name, ignore_errors=True)
    questions = read_jsonl(KB / "format_eval.jsonl")[:args.questions]
    rows: dict[str, dict] = {"base": measure(base, questions, args)}
    print(f"base: {json.dumps({k: v for k, v in rows['base'].items() if k != 'examples'})}", flush=True)
    runs = {"SFT": reused(args.out / "sft") if reuse else train(sft_recipe(base, args), args.out / "sft")}
    rows["SFT"] = measure(runs["SFT"].checkpoint, questions, args)
    print(f"SFT: {json.dumps({k: v for k, v in rows['SFT'].items() if k != 'examples'})}", flush=True)
    reference = ChatModel(runs["SFT"].checkpoint)
    runs["DPO"] = train(dpo_recipe(runs["SFT"].checkpoint, args), args.out / "dpo")
    rows["DPO"] = measure(runs["DPO"].checkpoint, questions, args, reference)
    print(f"DPO: {json.dumps({k: v for k, v in rows['DPO'].items() if k != 'examples'})}", flush=True)
    runs["GRPO"] = train(grpo_recipe(runs["SFT"].checkpoint, args), args.out / "grpo")
    rows["GRPO"] = measure(runs["GRPO"].checkpoint, questions, args, reference)
    print(f"GRPO: {json.dumps({k: v for k, v in rows['GRPO'].items() if k != 'examples'})}", flush=True)
    for stage, run in runs.items():
        rows[stage].update(train_seconds=run.seconds, steps=run.metrics[-1]["step"] if run.metrics else None)
    total = time.perf_counter() - start

    table = markdown_table(
        ["model", "satisfied (greedy)", "satisfied (T=1)", "EM (greedy)", "EM (T=1)", "KL to SFT (nats/reply)",
         "training"],
        [[stage, pct(r["satisfied_greedy"]), pct(r["satisfied_sampled"]), pct(r["em_greedy"]), pct(r["em_sampled"]),
          f"{r['kl']:.2f} +- {r['kl_std_error']:.2f}" if "kl" in r else "-",
          f"{r['steps']} steps, {r['train_seconds']:.0f} s" if "train_seconds" in r else "-"]
         for stage, r in rows.items()])
    print()
    print(table)
    print(f"\n{len(questions)} questions (format_eval.jsonl); SFT {args.sft_steps} steps, DPO {args.dpo_steps} steps "
          f"(beta {args.beta}), GRPO {args.grpo_steps} steps ({args.prompts_per_step} prompts x {args.group_size} "
          f"completions, KL coefficient {args.grpo_beta}); KL over {min(args.kl_prompts, len(questions))} prompts x "
          f"{args.kl_samples} samples; total {total / 60:.1f} min")
    for stage, r in rows.items():
        for ex in r["examples"][:2]:
            print(f"  {stage}: {ex['question']!r} -> greedy {ex['greedy']!r}, sampled {ex['sampled']!r}")
    result = {"experiment": "align", "machine": machine_line(), "quick": args.quick, "seconds": total,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "rows": {stage: {k: v for k, v in r.items() if k != "examples"} for stage, r in rows.items()}}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
