"""Thin wrapper: ``python benchmarks/bench_generate.py ARGS`` = ``tokenloom bench generate ARGS``; the benchmark
itself is :mod:`tokenloom.benchmarks.generate` (its docstring describes the method)."""

from __future__ import annotations

from tokenloom.benchmarks.generate import main

if __name__ == "__main__":
    main()
