"""Time to a target validation loss: train a recipe (and variants of it) and report the training minutes at which
the whole-split validation loss first reached each target, and the value at the end of the budget.

    python benchmarks/bench_time_to_target.py configs/shakespeare-char.yaml --minutes 3 --targets 1.7 1.6 1.55
    python benchmarks/bench_time_to_target.py configs/shakespeare-char-full.yaml --minutes 20 \\
        --variant muon "train.optimizer=muon" --variant wsd "train.schedule=wsd" --seeds 1337 1338 1339

Each variant is a name and ``--set`` overrides (``key=value``, space-separated in one string) applied to the recipe;
``base`` (no overrides) always runs first. The runs are sequential (one at a time: never time two trainings on the
same cores). Every run trains until ``--minutes`` of training time (``train.max_minutes``) or its ``max_steps``,
evaluates the whole validation split every ``--eval-every`` steps (``train.eval_batches`` is raised past the
split), and logs ``train_s``: the run's training seconds, evaluations and checkpoints left out, compilation and the
first steps included. A target's time is the ``train_s`` of the first evaluation at or below it (so the resolution
is ``--eval-every`` steps). The machine (CPU, bf16 features, threads, torch) is printed first and stored with
``--out``.

A schedule laid out over ``max_steps`` (cosine, WSD) must end with the budget: ``--clock`` runs it over the training
time instead (``train.schedule_clock=minutes``: exact budgets whatever a variant's step costs, a growing window
included); ``--fit-steps`` times 60 steps first and sets ``max_steps`` to fill the budget (it undershoots where
early steps are cheaper).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenloom.hardware import machine

WHOLE_SPLIT = 100_000  # train.eval_batches: more than any bundled validation split has


def read_curve(metrics: Path) -> list[tuple[int, float, float]]:
    """(step, train_s, val_loss) of every evaluation in a run's metrics.jsonl; train_s from the training record of
    the same step (written just before the evaluation)."""
    train_s: dict[int, float] = {}
    curve = []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "train_s" in record:
            train_s[record["step"]] = record["train_s"]
        elif "val_loss" in record and record["step"] in train_s:
            curve.append((record["step"], train_s[record["step"]], record["val_loss"]))
    return curve


def time_to(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """Training seconds at the first evaluation with val_loss <= target (None: never)."""
    return next((s for _, s, loss in curve if loss <= target), None)


def train(recipe: str, sets: list[str], out: Path) -> None:
    """``tokenloom train recipe --out out --set ...`` in a subprocess; its stderr's tail on failure."""
    command = [sys.executable, "-m", "tokenloom", "train", recipe, "--out", str(out)]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")


def run_variant(recipe: str, overrides: list[str], out: Path, minutes: float, eval_every: int,
                threads: int | None) -> list[tuple[int, float, float]]:
    sets = [f"train.max_minutes={minutes}", f"train.eval_every={eval_every}", f"train.eval_batches={WHOLE_SPLIT}",
            "train.checkpoint_every=0", "train.log_every=" + str(_log_every(eval_every)), *overrides]
    if threads:
        sets.append(f"train.threads={threads}")
    train(recipe, sets, out)
    return read_curve(out / "metrics.jsonl")


def fitted_steps(recipe: str, overrides: list[str], out: Path, minutes: float, threads: int | None) -> int:
    """``train.max_steps`` that fills ``minutes`` of training: 60 steps timed (the last 50 of them) and the budget
    divided by their mean step time, so that a schedule tied to max_steps (cosine, WSD) ends with the budget. Timed
    at the full sequence length (a ``train.seq_len_warmup`` run's shorter first steps then leave it a little
    under)."""
    sets = [*overrides, "train.max_steps=60", "train.warmup_steps=0", "train.schedule=constant",
            "train.seq_len_warmup=0", "train.eval_every=0",
            "train.eval_batches=1", "train.checkpoint_every=0", "train.log_every=10"] + \
        ([f"train.threads={threads}"] if threads else [])
    train(recipe, sets, out)
    seconds = {r["step"]: r["train_s"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if "train_s" in r}
    per_step = (seconds[60] - seconds[10]) / 50
    return max(int(minutes * 60 / per_step), 1)


CLOCK_CAP = 100_000  # --clock: max_steps, a cap the budget ends first (the schedule's position is time-scaled to it)


def _log_every(eval_every: int) -> int:
    return next(n for n in (25, 10, 5, 1) if eval_every % n == 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--minutes", type=float, default=3.0, help="training minutes per run (train.max_minutes)")
    parser.add_argument("--targets", type=float, nargs="+", default=[1.70, 1.60, 1.55])
    parser.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "OVERRIDES"),
                        help="a named variant: space-separated key=value overrides (repeatable)")
    parser.add_argument("--only", nargs="+", default=None, help="run only these variants (base included if named)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="repeat every variant with these seeds")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--clock", action="store_true",
                        help="run each schedule over the budget's training time (train.schedule_clock=minutes, "
                             "max_steps a cap): exact budgets, no timing run")
    parser.add_argument("--fit-steps", action="store_true",
                        help="set each variant's train.max_steps to fill --minutes (its step time measured first)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument("--out", type=Path, default=None, help="write the rows and the machine as JSON")
    args = parser.parse_args(argv)
    print(machine().describe())
    variants = [("base", "")] + [tuple(v) for v in args.variant]
    if args.only:
        variants = [v for v in variants if v[0] in args.only]
    rows = []
    root = args.keep or Path(tempfile.mkdtemp(prefix="ttt-"))
    header = f"{'variant':<28} {'seed':>5} {'steps':>6} " + " ".join(f"{'<=' + str(t):>8}" for t in args.targets) \
        + f" {'final':>7} {'best':>7} {'min':>6}"
    print(header)
    for name, overrides in variants:
        for seed in args.seeds or [None]:
            sets = shlex.split(overrides) + ([f"train.seed={seed}"] if seed is not None else [])
            out = root / (name + (f"-s{seed}" if seed is not None else ""))
            if args.clock:
                sets += ["train.schedule_clock=minutes", f"train.max_steps={CLOCK_CAP}"]
            elif args.fit_steps:
                steps = fitted_steps(args.recipe, sets, root / (out.name + "-timing"), args.minutes, args.threads)
                sets.append(f"train.max_steps={steps}")
            curve = run_variant(args.recipe, sets, out, args.minutes * (1.5 if args.fit_steps else 1), args.eval_every,
                                args.threads)
            times = [time_to(curve, t) for t in args.targets]
            step, seconds, final = curve[-1]
            row = {"variant": name, "overrides": sets, "seed": seed, "steps": step, "train_minutes": seconds / 60,
                   "final_val_loss": final, "best_val_loss": min(c[2] for c in curve),
                   "minutes_to": {str(t): (None if s is None else s / 60)
                                  for t, s in zip(args.targets, times, strict=True)},
                   "curve": curve}
            rows.append(row)
            shown = " ".join(f"{'-' if s is None else f'{s / 60:.2f}':>8}" for s in times)
            print(f"{name:<28} {seed if seed is not None else '':>5} {step:>6} {shown} {final:>7.4f} "
                  f"{row['best_val_loss']:>7.4f} {seconds / 60:>6.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"machine": machine().as_dict(), "recipe": args.recipe, "minutes": args.minutes,
                                        "targets": args.targets, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
