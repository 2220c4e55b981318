# tokenloom: `make demo` trains a small model on Tiny Shakespeare and samples from it; `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin

.PHONY: install demo test test-all lint bench clean

install: $(VENV)/.installed

# torch==2.13.0 (a CPU build) first, so pip never resolves a newer (CUDA) torch for the package's range.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,parity,viz,serve,serve-test]'
	touch $@

demo: install
	rm -rf runs/demo
	$(BIN)/tokenloom train configs/shakespeare-char.yaml --out runs/demo
	$(BIN)/tokenloom generate runs/demo --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8 --top-k 40 --seed 1

test: install
	$(PY) -m pytest

test-all: install
	$(PY) -m pytest -m ""

lint: install
	$(BIN)/ruff check src tests benchmarks

bench: install
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_generate.py

clean:
	rm -rf runs build dist src/*.egg-info .pytest_cache
