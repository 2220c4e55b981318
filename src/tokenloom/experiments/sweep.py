"""Sweeps: a grid (and/or list) of recipe overrides, times seeds; each point a normal run directory.

A sweep file (``sweeps/*.yaml``)::

    recipe: configs/shakespeare-char.yaml      # relative to the working directory or to the sweep file, or
                                               # the name of a packaged recipe (shakespeare-char)
    set: {train.max_steps: 300}                # overrides every run shares
    grid:                                      # the cartesian product of these
      model.num_layers: [2, 6]
      model.norm_placement: [pre, post]
    runs:                                      # and/or a list of points (each crossed with the grid)
      - {train.warmup_steps: 0}
      - {train.warmup_steps: 100}
    seeds: [1, 2, 3]                           # every point once per seed (train.seed)
    evaluate: {seq_lens: [128, 256, 512]}      # language models: also val loss/ppl at these window lengths
    report: {metric: val_loss, collapsed_above: 3.0}   # sweep-report: a finished run whose final metric stays
                                               # above 3.0 counts as collapsed (never learned past a baseline)

``run_sweep`` trains the points one after another (or ``parallel`` at a time, each process with its share of
the cores), skips points already finished (``<run>/result.json``), resumes points that stopped midway (their
checkpoint) and records failures (a one-line reason; ``diverged`` for runs stopped by the non-finite guard)
without stopping the sweep. ``<out>/results.csv`` and ``results.md`` collect every run's final and best
metrics.
"""

from __future__ import annotations

import copy
import csv
import itertools
import json
import os
import re
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import load_yaml
from ..errors import ConfigError, TokenloomError, TrainingError
from ..metric_scope import scoped_name
from ..packaged import packaged_recipe, packaged_recipes
from ..registry import did_you_mean

RESULT_FILE = "result.json"
SWEEP_KEYS = ("recipe", "set", "grid", "runs", "seeds", "evaluate", "report", "name", "description")
REPORT_KEYS = ("metric", "collapsed_above")


@dataclass
class Point:
    """One run of a sweep: its directory name and the overrides that make it."""

    name: str
    overrides: dict[str, Any]  # dotted key -> value (without the shared ``set``)
    seed: int | None = None

    def all_overrides(self, shared: dict[str, Any]) -> list[str]:
        values = {**shared, **self.overrides, **({"train.seed": self.seed} if self.seed is not None else {})}
        return [f"{key}={json.dumps(value) if not isinstance(value, str) else value}" for key, value in values.items()]


@dataclass
class Sweep:
    recipe: Path
    shared: dict[str, Any] = field(default_factory=dict)
    points: list[Point] = field(default_factory=list)
    evaluate: dict[str, Any] = field(default_factory=dict)
    name: str = "sweep"
    keys: list[str] = field(default_factory=list)  # the keys that vary (grid, runs, seed)
    report: dict[str, Any] = field(default_factory=dict)  # sweep-report's defaults (metric, collapsed_above)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping of recipe keys to values, got {type(value).__name__}")
    return {str(k): v for k, v in value.items()}


def _short(key: str, keys: list[str]) -> str:
    last = key.rsplit(".", 1)[-1]
    return last if sum(k.rsplit(".", 1)[-1] == last for k in keys) == 1 else key


def _slug(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text).strip("_") or "x"


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> Sweep:
    """Read and expand a sweep file; every point is validated against the recipe before anything runs.
    ``overrides`` (``key=value``, the CLI's ``--set``) are added to the file's shared ``set``, e.g. fewer steps
    for a quick version of a sweep."""
    from ..config import apply_overrides
    from ..training import load_run_config

    path = Path(path)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a sweep file is a mapping with recipe, grid / runs, seeds")
    unknown = [k for k in data if k not in SWEEP_KEYS]
    if unknown:
        raise ConfigError(f"{path}: unknown sweep key {unknown[0]!r}{did_you_mean(unknown[0], SWEEP_KEYS)}; "
                          f"known: {', '.join(SWEEP_KEYS)}")
    if "recipe" not in data:
        raise ConfigError(f"{path}: no recipe (the YAML recipe every run starts from)")
    recipe = Path(data["recipe"])
    for candidate in (recipe, path.parent / recipe, path.parent.parent / recipe, packaged_recipe(str(recipe))):
        if candidate is not None and candidate.is_file():
            recipe = candidate
            break
    else:
        known = packaged_recipes()
        raise ConfigError(f"{path}: recipe {data['recipe']} not found (relative to the working directory or the "
                          f"sweep file), nor a packaged recipe{did_you_mean(recipe.stem, known)}; packaged recipes: "
                          f"{', '.join(known) or 'none'}")
    grid = _mapping(data.get("grid"), "grid")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"grid.{key} must be a non-empty list of values, got {values!r}")
    runs = data.get("runs")
    if runs is not None and (not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs)):
        raise ConfigError("runs must be a list of mappings (recipe key -> value)")
    runs = [_mapping(r, "runs[]") for r in runs or []]
    if not grid and not runs:
        raise ConfigError(f"{path}: the sweep is empty: give a grid (key: [values]) or a list of runs")
    seeds = data.get("seeds") or []
    if not isinstance(seeds, list) or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"seeds must be a list of integers, got {seeds!r}")
    shared = _mapping(data.get("set"), "set")
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r} must look like key.sub=value")
        if key in grid or any(key in r for r in runs) or (key == "train.seed" and seeds):
            raise ConfigError(f"--set {key}: the sweep varies this key (grid, runs or seeds); edit the sweep file")
        shared[key] = apply_overrides({}, [f"value={raw}"])["value"]  # the YAML parsing of train --set
    grid_points = [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())] or [{}]
    combos = [{**g, **r} for g in grid_points for r in (runs or [{}])]
    keys = list(dict.fromkeys(k for c in combos for k in c))
    points = []
    for combo in combos:
        base = ",".join(f"{_short(k, keys)}={_slug(v)}" for k, v in combo.items()) or "run"
        for seed in seeds or [None]:
            points.append(Point(base + (f",seed={seed}" if seed is not None else ""), combo, seed))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: two points share the name {next(n for n in names if names.count(n) > 1)!r}")
    recipe_data = load_yaml(recipe)
    for point in points:  # every key must exist in the recipe schema: fail before the first run
        try:
            load_run_config(copy.deepcopy(recipe_data), point.all_overrides(shared))
        except ConfigError as err:
            raise ConfigError(f"{path}: point {point.name}: {err}") from None
    evaluate = _mapping(data.get("evaluate"), "evaluate")
    for key in evaluate:
        if key != "seq_lens":
            raise ConfigError(f"evaluate.{key}: unknown{did_you_mean(key, ['seq_lens'])}; known: seq_lens")
    report = _mapping(data.get("report"), "report")
    for key, value in report.items():
        if key not in REPORT_KEYS:
            raise ConfigError(f"report.{key}: unknown{did_you_mean(key, REPORT_KEYS)}; known: {', '.join(REPORT_KEYS)}")
        if key == "collapsed_above" and not isinstance(value, int | float):
            raise ConfigError(f"report.collapsed_above must be a number, got {value!r}")
        if key == "metric" and not isinstance(value, str):
            raise ConfigError(f"report.metric must be a metric name such as val_loss, got {value!r}")
    return Sweep(recipe=recipe, shared=shared, points=points, evaluate=evaluate, name=data.get("name", path.stem),
                 keys=keys + (["train.seed"] if seeds else []), report=report)


# -- running ----------------------------------------------------------------------------------------------
def read_result(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def best_metrics(run_dir: Path) -> dict[str, float]:
    """The best value of every validation metric the run logged (lowest loss/ppl, highest of the others)."""
    best: dict[str, float] = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return best
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        for key, value in row.items():
            if not key.startswith("val_") or not isinstance(value, int | float):
                continue
            lower = key.endswith(("_loss", "_ppl", "_ece"))
            if key not in best or (value < best[key] if lower else value > best[key]):
                best[key] = value
    return best


def _extra_evaluations(trainer: Any, seq_lens: list[int]) -> dict[str, float]:
    """Validation loss and perplexity with windows of each length (language models; length extrapolation)."""
    import torch

    from ..nn.modes import eval_mode

    task = trainer.task
    if not hasattr(task, "seq_len"):
        raise ConfigError("evaluate.seq_lens applies to language models")
    out: dict[str, float] = {}
    trained, batch = task.seq_len, task.batch_size
    limit = getattr(getattr(trainer.model, "config", None), "max_seq_len", None)
    try:
        for length in seq_lens:
            if limit is not None and length > limit:
                out[f"val_ppl@{length}"] = float("nan")  # the model cannot take windows this long
                continue
            task.seq_len, task.batch_size = length, max(1, batch * trained // length)
            with eval_mode(trainer.model), torch.no_grad():
                metrics = task.evaluate(trainer.model)
            out[f"val_loss@{length}"] = metrics["val_loss"]
            out[f"val_ppl@{length}"] = metrics["val_ppl"]
    finally:
        task.seq_len, task.batch_size = trained, batch
    return out


def run_point(recipe: str, overrides: list[str], run_dir: str, evaluate: dict[str, Any],
              threads: int | None = None) -> dict[str, Any]:
    """Train one point in ``run_dir`` (resuming a checkpoint left by an interrupted sweep); returns its result
    (also written to ``<run>/result.json``). Never raises for a failed run: the failure is the result."""
    from ..training import load_run_config, setup_run

    run = Path(run_dir)
    start = time.perf_counter()
    result: dict[str, Any] = {"name": run.name, "overrides": overrides}
    try:
        if threads:
            import torch

            torch.set_num_threads(threads)
        resume = (run / "checkpoint" / "config.yaml").is_file()
        if not resume and (run / "metrics.jsonl").exists():
            (run / "metrics.jsonl").unlink()  # a start that never reached a checkpoint: begin again
        config = load_run_config(recipe, overrides)
        trainer = setup_run(config, run, resume=resume, show_progress=False)
        result["params"] = sum(p.numel() for p in trainer.model.parameters())
        summary = trainer.fit()
        result["final"] = {k: v for k, v in summary.items() if isinstance(v, int | float | str)}
        if evaluate.get("seq_lens"):
            result["final"].update(_extra_evaluations(trainer, list(evaluate["seq_lens"])))
        result["status"] = "done"
    except TrainingError as err:  # the non-finite guard stopped it
        result.update(status="diverged", error=str(err))
    except TokenloomError as err:
        result.update(status="failed", error=str(err))
    except Exception as err:  # noqa: BLE001 - a sweep records any failure and goes on
        result.update(status="failed", error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                      traceback=traceback.format_exc(limit=4))
    result["best"] = best_metrics(run)
    result["seconds"] = round(time.perf_counter() - start, 1)
    run.mkdir(parents=True, exist_ok=True)
    _write_json(run / RESULT_FILE, result)
    return result


def _warn_like(formatwarning: Any) -> None:
    """A spawned worker formats warnings as its parent does (the CLI's: one ``warning: ...`` line)."""
    warnings.formatwarning = formatwarning


def run_sweep(sweep: Sweep, out: str | Path, *, parallel: int = 1, log: Any = print) -> list[dict[str, Any]]:
    """Run every point not finished yet; returns all results (finished earlier or now) in sweep order."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "sweep.json", {"name": sweep.name, "recipe": str(sweep.recipe), "set": sweep.shared,
                                     "keys": sweep.keys, "evaluate": sweep.evaluate, "report": sweep.report,
                                     "points": [{"name": p.name, "overrides": p.overrides, "seed": p.seed}
                                                for p in sweep.points]})
    todo = []
    for point in sweep.points:
        done = read_result(out / point.name)
        if done is not None and done.get("status") in ("done", "diverged"):
            log(f"{point.name}: already {done['status']}, skipped")
        else:
            todo.append(point)
    jobs = [(str(sweep.recipe), p.all_overrides(sweep.shared), str(out / p.name), sweep.evaluate) for p in todo]
    if parallel > 1 and len(jobs) > 1:
        threads = max(1, (os.cpu_count() or 1) // parallel)
        import multiprocessing

        with ProcessPoolExecutor(max_workers=parallel, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_warn_like, initargs=(warnings.formatwarning,)) as pool:
            futures = {pool.submit(run_point, *job, threads): job for job in jobs}
            for future in futures:
                _report(future.result(), log)
    else:
        for job in jobs:
            _report(run_point(*job), log)
    results = [read_result(out / p.name) or {"name": p.name, "status": "missing"} for p in sweep.points]
    write_tables(out, results, sweep.keys)
    return results


def _report(result: dict[str, Any], log: Any) -> None:
    final = result.get("final", {})
    shown = "  ".join(f"{scoped_name(k, final)} {v:.4f}" for k, v in final.items()  # val_loss[20 of 28 batches]
                      if k.startswith("val_") and isinstance(v, float) and "@" not in k and not k.endswith("_ppl"))
    log(f"{result['name']}: {result['status']} ({result['seconds']:.0f}s) "
        + (shown if result["status"] == "done" else result.get("error", "")))


# -- tables -----------------------------------------------------------------------------------------------
def _columns(results: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    kept = ("train_loss", "step", "tokens", "nonfinite_steps")
    final = list(dict.fromkeys(k for r in results for k, v in r.get("final", {}).items()
                               if isinstance(v, int | float) and (k.startswith("val_") or k in kept)))
    best = list(dict.fromkeys(k for r in results for k in r.get("best", {})))
    return final, best


def swept_value(key: str, result: dict[str, Any]) -> Any:
    """A swept key's value in a run (from its overrides list)."""
    for item in result.get("overrides", []):
        k, _, v = item.partition("=")
        if k == key:
            return v
    return ""


def write_tables(out: Path, results: list[dict[str, Any]], keys: list[str]) -> tuple[Path, Path]:
    """``results.csv`` (every run, every final and best metric) and ``results.md`` (the same as a table)."""
    final, best = _columns(results)
    header = ["run", *keys, "status", *final, *(f"best_{k}" for k in best), "seconds", "params"]
    rows = []
    for r in results:
        rows.append([r["name"], *(swept_value(k, r) for k in keys), r.get("status", ""),
                     *(r.get("final", {}).get(k, "") for k in final), *(r.get("best", {}).get(k, "") for k in best),
                     round(r["seconds"]) if isinstance(r.get("seconds"), float) else "", r.get("params", "")])
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)

    def cell(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    failed = [r for r in results if r.get("status") not in ("done",)]
    if failed:
        lines += ["", *(f"- {r['name']}: {r.get('status')} — {r.get('error', '')}" for r in failed)]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    return out / "results.csv", out / "results.md"
