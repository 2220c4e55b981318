"""Thin wrapper: ``python benchmarks/bench_train.py ARGS`` = ``tokenloom bench train ARGS``; the benchmark itself is
:mod:`tokenloom.benchmarks.train` (its docstring describes the method)."""

from __future__ import annotations

from tokenloom.benchmarks.train import main

if __name__ == "__main__":
    main()
