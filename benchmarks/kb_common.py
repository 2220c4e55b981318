"""Shared parts of the knowledge-base experiments (``exp_rag.py``, ``exp_align.py``, ``exp_lora.py``; issue 32).

* :func:`train` runs ``tokenloom train`` on a recipe (a dict written as YAML) in its own process, so each run's
  peak memory (``ru_maxrss``, from ``os.wait4``) and wall time are its own, and returns its metrics.
* :class:`ChatModel` loads a checkpoint with its chat template and answers batches of user messages (greedy or
  sampled), cutting each reply at the template's end mark.
* :func:`ensure_base` finds the pretrained model (``runs/kb-lm``, ``tokenloom train kb-char --out runs/kb-lm``) or,
  for ``--quick``, trains a tiny one in a few seconds.
* Scoring: :func:`exact_match` (the stripped reply equals the value, or ``The answer is VALUE.`` holds it) and
  :func:`satisfies` (the format constraint of data/kb/README.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
KB = REPO / "data" / "kb"
BASE_RECIPE = REPO / "src" / "tokenloom" / "recipes" / "kb-char.yaml"
FORMAT_RE = re.compile(r"^The answer is [A-Za-z0-9 ]+\.$")  # the checker of data/kb/README.md
FORMAT_PATTERN = FORMAT_RE.pattern
_STYLED = re.compile(r"^The answer is (.+)\.$")
QUICK_BASE = {"num_layers": 2, "num_heads": 2, "embed_dim": 64}  # --quick: a tiny model, a few steps


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: str | Path, rows: Sequence[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` prints it (``/proc/cpuinfo``'s where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from tokenloom.hardware import machine

    return machine().cpu


def machine_line() -> str:
    from tokenloom.hardware import machine

    return f"machine: {machine().describe()}; lscpu model name: {cpu_model()}; {os.cpu_count()} CPUs"


def satisfies(reply: str) -> bool:
    """The format constraint: the whole stripped reply is ``The answer is VALUE.``."""
    return FORMAT_RE.match(reply.strip()) is not None


def answer_value(reply: str) -> str:
    """The value a reply gives: ``VALUE`` of ``The answer is VALUE.``, else the stripped reply."""
    reply = reply.strip()
    styled = _STYLED.match(reply)
    return styled.group(1).strip() if styled else reply


def exact_match(reply: str, answer: str) -> bool:
    return answer_value(reply) == answer.strip()


# ---- training runs ------------------------------------------------------------------------------------------

@dataclass
class RunResult:
    """One ``tokenloom train`` process: where it wrote, how long it took, its peak memory and metrics."""

    out: Path  # the run directory (its checkpoint in out / "checkpoint")
    seconds: float  # wall time of the process
    max_rss_mb: float  # the process's peak resident memory (ru_maxrss), MiB
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl

    @property
    def checkpoint(self) -> Path:
        return self.out / "checkpoint"

    def last(self, key: str) -> float | None:
        """The last logged value of ``key`` (e.g. ``val_loss``), or None."""
        values = [m[key] for m in self.metrics if key in m]
        return values[-1] if values else None

    def step_seconds(self) -> float | None:
        """Mean seconds per optimizer step from the logged ``elapsed_s`` (the first logged step excluded: warm-up)."""
        logged = [(m["step"], m["elapsed_s"]) for m in self.metrics if "elapsed_s" in m and "loss" in m]
        if len(logged) < 2:
            return None
        (s0, t0), (s1, t1) = logged[0], logged[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None


def train(recipe: dict, out: Path, *, threads: int = 1, log: Path | None = None) -> RunResult:
    """Run ``tokenloom train RECIPE --out OUT`` in a child process (``OMP_NUM_THREADS=threads``); the recipe is
    written next to the run as ``OUT.yaml``. A failed run raises RuntimeError with the tail of its log."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    recipe_path = out.with_suffix(".yaml")
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    log = log or out.with_suffix(".log")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "tokenloom", "train", str(recipe_path), "--out", str(out)]
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}")
    metrics_path = out / "metrics.jsonl"
    metrics = read_jsonl(metrics_path) if metrics_path.is_file() else []
    return RunResult(out, seconds, usage.ru_maxrss / 1024, metrics)


def base_recipe() -> dict:
    return yaml.safe_load(BASE_RECIPE.read_text(encoding="utf-8"))


def ensure_base(base: str | None, quick: bool, work: Path) -> Path:
    """The pretrained checkpoint: ``base`` if given; for ``--quick`` a tiny model trained for 30 steps into
    ``work/base`` (kept for later quick runs); else ``runs/kb-lm/checkpoint``, which must exist."""
    if base:
        return Path(base).resolve()
    if not quick:
        path = REPO / "runs" / "kb-lm" / "checkpoint"
        if not (path / "config.yaml").is_file():
            sys.exit(f"no pretrained model at {path}: run `tokenloom train kb-char --out runs/kb-lm` first "
                     "(about 13 minutes on 2 CPU cores), or pass --base")
        return path
    path = work / "base" / "checkpoint"
    if not (path / "config.yaml").is_file():
        recipe = base_recipe()
        recipe["model"].update(QUICK_BASE)
        recipe["train"].update({"max_steps": 30, "batch_size": 8, "seq_len": 128, "warmup_steps": 5,
                                "eval_every": 0, "checkpoint_every": 0, "max_minutes": None})
        train(recipe, work / "base")
    return path


# ---- answering ----------------------------------------------------------------------------------------------

@torch.no_grad()
def continue_batch(model: torch.nn.Module, tokenizer, rows: Sequence[Sequence[int]], *,  # noqa: ANN001
                   max_new_tokens: int, stops: Sequence[str] = (), eos_id: int | None = None, sample: bool = False,
                   temperature: float = 1.0, seed: int = 0, batch_size: int = 32) -> list[str]:
    """The decoded continuation of each prompt (token id rows), greedy or sampled, in batches of prompts of about
    the same length (left-padded); a row stops at a stop string or ``eos_id``. The text is returned whole (a stop
    string and anything after it included: the caller cuts)."""
    from tokenloom.generation import GenerationConfig, generate

    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    texts: dict[int, str] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(rows[i]) for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, i in enumerate(chunk):  # left padding: every prompt ends where generation starts
            ids[b, width - len(rows[i]):] = torch.as_tensor(list(rows[i]), dtype=torch.long)
            mask[b, width - len(rows[i]):] = 1
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature,
                                  seed=seed + start, stop_strings=list(stops), eos_token_id=eos_id, pad_token_id=-1)
        out = generate(model, ids, config, attention_mask=mask, tokenizer=tokenizer)
        for b, i in enumerate(chunk):
            new = [t for t in out[b, width:].tolist() if t >= 0 and t != eos_id]
            texts[i] = tokenizer.decode(new)
    return [texts[i] for i in range(len(rows))]


class ChatModel:
    """A checkpoint with its tokenizer and chat template, answering user messages in batches."""

    def __init__(self, checkpoint: str | Path) -> None:
        from tokenloom.checkpoint import load_model, load_tokenizer
        from tokenloom.data.chat import template_from_section

        self.checkpoint = Path(checkpoint)
        self.model, self.config = load_model(checkpoint)
        self.tokenizer = load_tokenizer(checkpoint)
        self.template = template_from_section(self.tokenizer, self.config.get("tokenizer"), "auto")

    def prompt_ids(self, message: str) -> list[int]:
        return self.template.encode_prompt(self.tokenizer, [{"role": "user", "content": message}])

    def answer(self, messages: Sequence[str], *, sample: bool = False, temperature: float = 1.0, seed: int = 0,
               max_new_tokens: int = 32, batch_size: int = 64) -> list[str]:
        """One reply per user message: the generated text cut at the template's end mark."""
        raw = continue_batch(self.model, self.tokenizer, [self.prompt_ids(m) for m in messages],
                             max_new_tokens=max_new_tokens, stops=self.template.stop_strings,
                             eos_id=self.template.stop_token_id, sample=sample, temperature=temperature, seed=seed,
                             batch_size=batch_size)
        return [self.template.reply(text) for text in raw]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"
