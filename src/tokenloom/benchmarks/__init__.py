"""Benchmarks that run tokenloom and its reference (Hugging Face transformers, needs the ``parity`` extra) side by
side in one run: ``tokenloom bench train`` (:mod:`.train`) and ``tokenloom bench generate`` (:mod:`.generate`),
also runnable as ``python benchmarks/bench_train.py`` / ``bench_generate.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path


def report_load_and_save(results: dict, load_before: float, threads: int, out: Path | None) -> None:
    """Record and print the 1-minute load average before and after a benchmark (a hint that other processes
    competed for the CPU), then write ``results`` as JSON to ``out`` if given."""
    load = results["load_average"] = (load_before, os.getloadavg()[0])
    print(f"1-min load average before/after: {load[0]:.2f} / {load[1]:.2f}"
          + (" (other processes competed for the CPU)" if min(load) > threads + 0.5 else ""))
    if out:
        Path(out).write_text(json.dumps(results, indent=2))
