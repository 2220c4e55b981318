"""A/B speed comparison of two commits of this repository, measured interleaved in one run.

    .venv/bin/python benchmarks/ab_commits.py BEFORE AFTER [--repeats 3] [--only NAME,...] [--out ab.json]
    .venv/bin/python benchmarks/ab_commits.py HEAD~1 HEAD --repeats 1 --only generate-tiny-b1-fp32,translate-beam5

BEFORE and AFTER are any git refs. Each is checked out as a temporary detached worktree (removed at the end, also
on an error or Ctrl-C), and every benchmark runs as a subprocess with cwd = that worktree and
PYTHONPATH=<worktree>/src under this interpreter (checked first: the worktree's ``tokenloom`` must be the one
imported, not this checkout's editable install), so the bundled checkpoints, data and benchmark scripts are the
commit's own. Benchmarks (``--only`` takes these names):

    generate-{tiny-b1,tiny-b8,gpt2-b1}-{fp32,bf16}  tokenloom bench generate, tokenloom's ms/token (fp32; bf16 weights)
    train-gpt-6l-384-bf16   tokenloom bench train --preset gpt-6l-384 --dtype bf16, "tokenloom bf16" tokens/s
    translate-beam5         tokenloom bench translate checkpoints/multi30k-de-en, AR beam 5 sentences/s (test2016)
    serve-16                benchmarks/bench_serve.py, 16 clients, concurrent-phase tokens/s

The fp32 and bf16 figures of one generate shape come from one run (``--bf16`` adds the bf16 variants after the
fp32 one); the Hugging Face reference inside generate / train cannot be switched off and is ignored here.
For each repeat, each benchmark runs BEFORE then AFTER (AFTER first on odd repeats), so drifts in the machine's
load hit both sides. Each side keeps its best figure (highest throughput, lowest time). The table's ``speed``
column is after/before for throughputs and before/after for times, so > 1 always means AFTER is faster; below
0.95 the verdict is SLOWER. A run past ``--timeout`` seconds is killed (with its process group, e.g. the server
of serve-16) and counted as failed. The exit status is 0 whatever the figures; ``--out`` writes every raw figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
CLI = [PY, "-c", "import sys; from tokenloom.cli.main import main; sys.argv[0] = \"tokenloom\"; sys.exit(main())"]
GENERATE = {  # shape, batch -> extra options: tiny runs are short, so more tokens and more timed runs per process
    ("tiny", 1): ["--new-tokens", "256", "--repeats", "5"],
    ("tiny", 8): ["--new-tokens", "256", "--repeats", "5"],
    ("gpt2", 1): ["--new-tokens", "128", "--repeats", "1"],
}


@dataclass
class Job:
    """One command per side and repeat, giving one or more figures: name -> (unit, higher is better)."""

    name: str
    figures: dict[str, tuple[str, bool]]
    command: callable  # (out path, selected figure names) -> argv
    parse: callable  # (out path) -> {figure: value}
    results: list[dict] = field(default_factory=list)


def generate_job(shape: str, batch: int) -> Job:
    base = f"generate-{shape}-b{batch}"

    def command(out: Path, selected: set[str]) -> list[str]:
        bf16 = ["--bf16"] if f"{base}-bf16" in selected else []
        return [*CLI, "bench", "generate", "--shapes", shape, "--batch", str(batch), *GENERATE[shape, batch], *bf16,
                "--out", str(out)]

    def parse(out: Path) -> dict[str, float]:
        data = json.loads(out.read_text())
        figures = {f"{base}-fp32": data["generate"][0]["tokenloom_ms_per_token"]}
        for row in data.get("bf16") or []:
            if row["variant"] == "bf16 weights":
                figures[f"{base}-bf16"] = row["ms_per_token"]
        return figures

    return Job(base, {f"{base}-fp32": ("ms/token", False), f"{base}-bf16": ("ms/token", False)}, command, parse)


def train_parse(out: Path) -> dict[str, float]:
    rows = json.loads(out.read_text())["train"]
    return {"train-gpt-6l-384-bf16": next(r["tokens_per_s"] for r in rows if r["variant"] == "tokenloom bf16")}


def translate_parse(out: Path) -> dict[str, float]:
    with open(out / "translate-bench.csv", newline="", encoding="utf-8") as fh:
        row = next(r for r in csv.DictReader(fh) if r["model"] == "AR beam 5")
    return {"translate-beam5": float(row["throughput"])}


def serve_parse(out: Path) -> dict[str, float]:
    data = json.loads(out.read_text())
    return {"serve-16": next(p["tokens_per_s"] for p in data["phases"] if p["phase"] == "concurrent")}


JOBS = [
    *(generate_job(shape, batch) for shape, batch in GENERATE),
    Job("train-gpt-6l-384-bf16", {"train-gpt-6l-384-bf16": ("tokens/s", True)},
        lambda out, _: [*CLI, "bench", "train", "--preset", "gpt-6l-384", "--dtype", "bf16", "--timed-steps", "20",
                        "--out", str(out)], train_parse),
    Job("translate-beam5", {"translate-beam5": ("sent/s", True)},
        lambda out, _: [*CLI, "bench", "translate", "checkpoints/multi30k-de-en", "--latency-sentences", "20",
                        "--out", str(out)], translate_parse),
    Job("serve-16", {"serve-16": ("tokens/s", True)},
        lambda out, _: [PY, "benchmarks/bench_serve.py", "--clients", "16", "--repeats", "1", "--out", str(out)],
        serve_parse),
]
FIGURES = {name: spec for job in JOBS for name, spec in job.figures.items()}


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def run_in(tree: Path, argv: list[str], timeout: float) -> tuple[int | None, str, float]:
    """Run ``argv`` in ``tree`` with its src/ first on the path: (exit status or None on timeout, output, seconds).
    The child gets its own process group, killed whole on a timeout or Ctrl-C (bench_serve starts a server)."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output, time.perf_counter() - start
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output, time.perf_counter() - start
    finally:
        if proc.poll() is None:  # interrupted
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_tree(tree: Path) -> str:
    """Check that ``tree``'s own tokenloom is imported there; return its machine line."""
    code = ("import tokenloom; from tokenloom.hardware import machine; "
            "print(tokenloom.__file__); print(machine().describe())")
    rc, output, _ = run_in(tree, [PY, "-c", code], 120)
    lines = output.strip().splitlines()
    if rc != 0 or len(lines) < 2 or not Path(lines[-2]).resolve().is_relative_to((tree / "src").resolve()):
        sys.exit(f"{tree}: PYTHONPATH does not make its own tokenloom importable:\n{output[-2000:]}")
    return lines[-1]


def interrupt(*_) -> None:
    raise KeyboardInterrupt


def fmt(value: float | None) -> str:
    return f"{value:>10.2f}" if value is not None else f"{'-':>10}"


def best(values: list[float], higher: bool) -> float | None:
    return (max if higher else min)(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each side keeps its best (3)")
    parser.add_argument("--only", default=None, help=f"comma-separated, from: {', '.join(FIGURES)}")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one run counts as failed (600)")
    parser.add_argument("--out", type=Path, default=None, help="write every raw figure as JSON here")
    args = parser.parse_args()
    selected = set(args.only.split(",")) if args.only else set(FIGURES)
    if unknown := selected - set(FIGURES):
        parser.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}; known: {', '.join(FIGURES)}")
    jobs = [job for job in JOBS if selected & set(job.figures)]
    sides = {}
    for side, ref in (("before", args.before), ("after", args.after)):
        try:
            sha = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        except subprocess.CalledProcessError:
            parser.error(f"{ref!r} is not a commit of {REPO}")
        sides[side] = dict(ref=ref, commit=sha, short=git("log", "-1", "--format=%h", sha),
                           subject=git("log", "-1", "--format=%s", sha))
        print(f"{side:<6} {ref}: {sides[side]['short']} {sides[side]['subject'][:100]}")
    for signum in (signal.SIGINT, signal.SIGTERM):  # a kill cleans up like Ctrl-C (also where SIGINT was ignored)
        signal.signal(signum, interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="ab-commits-"))
    trees: dict[str, Path] = {}
    machines: dict[str, str] = {}
    started = time.perf_counter()
    try:
        for side in sides:
            trees[side] = tmp / side
            git("worktree", "add", "--detach", str(trees[side]), sides[side]["commit"])
        machines.update((side, check_tree(tree)) for side, tree in trees.items())
        print(f"machine: {machines['after']}\n")
        for r in range(args.repeats):
            for job in jobs:
                for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    out = tmp / f"{job.name}-{side}-{r}{'' if job.name == 'translate-beam5' else '.json'}"
                    argv = job.command(out, selected)
                    load = os.getloadavg()[0]
                    rc, output, seconds = run_in(trees[side], argv, args.timeout)
                    entry = dict(job=job.name, side=side, repeat=r, cwd=str(trees[side]), command=shlex.join(argv),
                                 rc=rc, seconds=round(seconds, 1), load_before=load, load_after=os.getloadavg()[0])
                    try:
                        entry["figures"] = job.parse(out)  # bench_serve exits 1 on a changed output: kept, flagged
                        if rc != 0:
                            entry["error"] = f"exit status {rc}"
                    except Exception as err:  # noqa: BLE001 - a failed or timed-out run, reported below
                        entry["error"] = "timed out" if rc is None else f"exit status {rc}, no figures ({err!r})"
                        entry["output_tail"] = output[-3000:]
                    job.results.append(entry)
                    shown = ", ".join(f"{k} {v:.2f}" for k, v in entry.get("figures", {}).items() if k in selected)
                    print(f"[{r + 1}/{args.repeats}] {job.name:<22} {side:<6} {seconds:6.1f} s  {shown}"
                          + (f"  ({entry['error']})" if "error" in entry else ""), flush=True)
                    if "output_tail" in entry:
                        print("    " + "\n    ".join(entry["output_tail"].strip().splitlines()[-8:]), flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: the table covers the runs that finished", file=sys.stderr)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)
        subprocess.run(["rm", "-rf", str(tmp)])
    elapsed = time.perf_counter() - started
    rows = []
    for job in jobs:
        for name, (unit, higher) in job.figures.items():
            if name not in selected:
                continue
            got = {side: [e["figures"][name] for e in job.results if e["side"] == side and name in e.get("figures", {})]
                   for side in sides}
            b, a = best(got["before"], higher), best(got["after"], higher)
            speed = None if a is None or b is None else (a / b if higher else b / a)
            load = max((max(e["load_before"], e["load_after"]) for e in job.results), default=0.0)
            verdict = ("failed" if job.results else "not run") if speed is None else "ok" if speed >= 0.95 else "SLOWER"
            rows.append(dict(benchmark=name, unit=unit, higher_is_better=higher, before=b, after=a, speed=speed,
                             verdict=verdict,
                             max_load=round(load, 2), runs=got))
    print(f"\nmachine: {machines.get('after', '-')}")
    print(f"before {sides['before']['short']}, after {sides['after']['short']}; best of {args.repeats} per side "
          f"(highest throughput / lowest time); speed = after/before for throughputs, before/after for times "
          f"(> 1: after faster); {elapsed / 60:.1f} min")
    print(f"{'benchmark':<24} {'unit':<9} {'before':>10} {'after':>10} {'speed':>7}  {'verdict':<7} {'load':>5}")
    for row in rows:
        speed = f"{row['speed']:>6.3f}x" if row["speed"] is not None else f"{'-':>7}"
        print(f"{row['benchmark']:<24} {row['unit']:<9} {fmt(row['before'])} {fmt(row['after'])} {speed}  "
              f"{row['verdict']:<7} {row['max_load']:>5.1f}")
    cores = len(os.sched_getaffinity(0))
    print(f"(load = the highest 1-min load average seen around the benchmark's runs; above {cores + 0.5:.1f} other "
          "processes competed for this machine's cores and the figures are noisy)"
          if any(row["max_load"] > cores + 0.5 for row in rows) else
          "(load = the highest 1-min load average seen around the benchmark's runs)")
    if args.out:
        args.out.write_text(json.dumps(dict(sides=sides, machine=machines, repeats=args.repeats,
                                            timeout_s=args.timeout, minutes=round(elapsed / 60, 2), table=rows,
                                            runs=[e for job in jobs for e in job.results]), indent=2))
        print(f"raw figures: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
