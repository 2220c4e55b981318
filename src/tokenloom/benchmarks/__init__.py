"""Benchmarks that run tokenloom and its reference (Hugging Face transformers, needs the ``parity`` extra) side by
side in one run: ``tokenloom bench train`` (:mod:`.train`) and ``tokenloom bench generate`` (:mod:`.generate`),
also runnable as ``python benchmarks/bench_train.py`` / ``bench_generate.py``."""
