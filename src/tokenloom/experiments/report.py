"""``tokenloom sweep-report`` and ``tokenloom fit-scaling``: what a finished (or partial) sweep directory says."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .sweep import RESULT_FILE, read_result, write_tables


def load_results(out: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every run's result in a sweep directory (sweep order when ``sweep.json`` is there) and the swept keys."""
    out = Path(out)
    if not out.is_dir():
        raise ConfigError(f"no sweep directory at {out}")
    plan = out / "sweep.json"
    if plan.is_file():
        info = json.loads(plan.read_text())
        names, keys = [p["name"] for p in info["points"]], list(info.get("keys", []))
    else:
        names, keys = sorted(p.parent.name for p in out.glob(f"*/{RESULT_FILE}")), []
    results = [r for r in (read_result(out / name) for name in names) if r is not None]
    if not results:
        raise ConfigError(f"{out} holds no finished runs (no */{RESULT_FILE}); run `tokenloom sweep` first")
    return results, keys


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _collapsed(result: dict[str, Any], metric: str, threshold: float | None) -> bool:
    """A finished run whose final ``metric`` stayed above ``threshold`` (it never learned past a baseline such as
    the unigram loss), or came out non-finite."""
    if result.get("status") != "done" or threshold is None:
        return False
    value = result.get("final", {}).get(metric)
    return isinstance(value, int | float) and (not math.isfinite(value) or value > threshold)


def _stats(values: list[float]) -> str:
    if not values:
        return "- | - | -"
    return (f"{statistics.mean(values):.4f} | {statistics.stdev(values) if len(values) > 1 else 0:.4f} | "
            f"{min(values):.4f}")


def group_table(results: list[dict[str, Any]], keys: list[str], metric: str,
                collapsed_above: float | None = None) -> list[str]:
    """Markdown: per swept key and value, ``metric`` over the runs (mean, std, min), the runs that diverged or
    failed and (with ``collapsed_above``) those that collapsed; then one row per combination of the swept keys
    with the seeds pooled."""
    from .sweep import swept_value

    varied = [k for k in keys if k != "train.seed"]
    collapse = f" | collapsed (> {collapsed_above:g})" if collapsed_above is not None else ""

    def row(group: list[dict[str, Any]]) -> str:
        values = [v for r in group if (v := _number(r.get("final", {}).get(metric))) is not None
                  and not _collapsed(r, metric, collapsed_above)]
        bad = sum(r.get("status") != "done" for r in group)
        down = f" | {sum(_collapsed(r, metric, collapsed_above) for r in group)}" if collapse else ""
        return f"{len(group)} | {bad}{down} | {_stats(values)} |"

    lines = []
    note = " (mean / std / min over the runs that did not collapse)" if collapse else ""
    for key in varied:
        lines += [f"### {metric} by {key}{note}", "",
                  f"| {key} | runs | diverged / failed{collapse} | mean | std | min |",
                  "|---|---|---|" + "---|" * bool(collapse) + "---|---|---|"]
        for value in dict.fromkeys(swept_value(key, r) for r in results):
            lines.append(f"| {value} | " + row([r for r in results if swept_value(key, r) == value]))
        lines.append("")
    if len(varied) > 1 or (varied and "train.seed" in keys):
        lines += [f"### {metric} by run, seeds pooled{note}", "",
                  "| " + " | ".join(varied) + f" | runs | diverged / failed{collapse} | mean | std | min | per seed |",
                  "|" + "---|" * (len(varied) + 6 + bool(collapse))]
        cells: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for r in results:
            cells.setdefault(tuple(swept_value(k, r) for k in varied), []).append(r)
        for cell, group in cells.items():
            seeds = " / ".join(f"{v:.4f}" if (v := _number(r.get("final", {}).get(metric))) is not None
                               else r.get("status", "?") for r in group)
            lines.append("| " + " | ".join(cell) + " | " + row(group) + f" {seeds} |")
        lines.append("")
    return lines


def sweep_report(out: str | Path, metric: str | None = None, collapsed_above: float | None = None) -> list[Path]:
    """results.csv / results.md (with the grouped tables) and curves.png in the sweep directory. ``metric`` and
    ``collapsed_above`` default to the sweep file's ``report`` section (then val_loss, no collapse count)."""
    out = Path(out)
    results, keys = load_results(out)
    defaults = _report_defaults(out)
    metric = metric or defaults.get("metric") or "val_loss"
    if collapsed_above is None:
        collapsed_above = defaults.get("collapsed_above")
    csv_path, md_path = write_tables(out, results, keys)
    md_path.write_text(md_path.read_text() + "\n" + "\n".join(group_table(results, keys, metric, collapsed_above)))
    written = [csv_path, md_path]
    runs = {}
    for r in results:
        path = out / r["name"] / "metrics.jsonl"
        if path.is_file():
            runs[r["name"]] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if runs:
        from ..viz.plots import plot_curves

        written.append(plot_curves(runs, out / "curves.png"))
    return written


def _report_defaults(out: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((out / "sweep.json").read_text()).get("report") or {})
    except (OSError, ValueError):
        return {}


# -- scaling ------------------------------------------------------------------------------------------------
def scaling_points(results: list[dict[str, Any]], out: Path, metric: str) -> list[dict[str, float]]:
    """Per finished run: parameters (all and without embeddings), tokens trained, compute C = 6 N D, ``metric``."""
    from safetensors import safe_open

    points = []
    for r in results:
        value = _number(r.get("final", {}).get(metric))
        weights = out / r["name"] / "checkpoint" / "model.safetensors"
        if r.get("status") != "done" or value is None or not weights.is_file():
            continue
        total = embedding = 0
        with safe_open(str(weights), "pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                n = math.prod(fh.get_slice(name).get_shape())
                total += n
                if "embed" in name or name.startswith(("position", "lm_head")):
                    embedding += n
        config = _read_yaml(out / r["name"] / "checkpoint" / "config.yaml")
        t = config.get("train", {})
        tokens = _number(r["final"].get("tokens"))  # counted by the trainer (target tokens for translation)
        if not tokens:  # a run from before the count: steps x batch x window (language models)
            seq = t.get("seq_len") or config.get("model", {}).get("max_seq_len", 0)
            step = int(r["final"].get("step", t.get("max_steps", 0)))
            tokens = step * t.get("batch_size", 0) * t.get("grad_accum_steps", 1) * seq
        n = total - embedding
        points.append({"name": r["name"], "params": float(total), "non_embedding_params": float(n),
                       "tokens": float(tokens), "compute": 6.0 * n * tokens, metric: value})
    return points


def _read_yaml(path: Path) -> dict[str, Any]:
    from ..config import load_yaml

    return load_yaml(path)


def fit_scaling(out: str | Path, metric: str = "val_loss", n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Fit L(N) (non-embedding parameters) and L(C) (C = 6 N D) over a sweep's runs; writes scaling.json,
    scaling.md and scaling.png. Runs of one size are averaged first (seeds)."""
    import numpy as np

    from .scaling import fit_power_law, plot_fit

    out = Path(out)
    results, _ = load_results(out)
    points = scaling_points(results, out, metric)
    fits: dict[str, Any] = {}
    plotted = []
    for x_name, key in (("N", "non_embedding_params"), ("C", "compute")):
        by_x: dict[float, list[float]] = {}
        for p in points:
            by_x.setdefault(p[key], []).append(p[metric])
        xs = np.array(sorted(by_x))
        ys = np.array([statistics.mean(by_x[x]) for x in xs])
        fit = fit_power_law(xs, ys, n_boot=n_boot, seed=seed, x_name=x_name)
        fits[x_name] = {**fit.to_dict(), "summary": fit.describe()}
        plotted.append((f"L({x_name})", xs, ys, fit))
    report = {"metric": metric, "points": points, "fits": fits}
    (out / "scaling.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Scaling fits over {out}", "", f"metric: {metric}; {len(points)} runs", ""]
    lines += [f"- {plotted[i][3].describe()}" for i in range(len(plotted))]
    lines += ["", "| run | non-embedding params | tokens | compute (6ND) | " + metric + " |", "|---|---|---|---|---|"]
    lines += [f"| {p['name']} | {p['non_embedding_params']:.3g} | {p['tokens']:.3g} | {p['compute']:.3g} | "
              f"{p[metric]:.4f} |" for p in points]
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    plot_fit(plotted[:1], out / "scaling-params.png", xlabel="non-embedding parameters N", ylabel=metric)
    plot_fit(plotted[1:], out / "scaling-compute.png", xlabel="compute C = 6ND (FLOPs)", ylabel=metric)
    return report
