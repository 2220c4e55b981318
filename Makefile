# tokenloom: `make demo` trains a small model on Tiny Shakespeare and samples from it; `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin

.PHONY: docs install demo test test-kernels test-fuzz test-lm-eval test-all wheel-test lint bench tour-figures clean

install: $(VENV)/.installed

# torch==2.13.0 (a CPU build) first, so pip never resolves a newer (CUDA) torch for the package's range.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,parity,viz,serve,serve-test,docs,rag,hf,tensorboard]'
	touch $@

demo: install
	rm -rf runs/demo
	$(BIN)/tokenloom train configs/shakespeare-char.yaml --out runs/demo
	$(BIN)/tokenloom generate runs/demo --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8 --top-k 40 --seed 1

test: install
	$(PY) -m pytest

# The tests that train or compare floats, again under other CPU kernels than this CPU's own (the vectorised ATen
# kernels, oneDNN's and MKL's instruction sets, one thread), each with its own Inductor cache: the suite must pass on
# any x86-64 CPU, not only on the one it was written on. .ci/run runs this after `make test`.
KERNEL_TESTS := tests/models tests/training tests/generation tests/nn tests/tasks tests/interop tests/registry
# (not the multi-process tests: they compare processes that run the same kernels, and cost minutes a pass)
KERNEL_SKIP := --ignore=tests/training/test_distributed.py
KERNEL_SETTINGS := \
	"ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2" \
	"ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1"

# A CPU whose best instruction set is AVX2 (torch's own pick, and no AVX512, AVX-VNNI or AMX flag) already ran
# `make test` on exactly the AVX2 setting's kernels: that pass would repeat it and is skipped, saying so.
OWN_KERNELS_ARE_AVX2 = $(PY) -c "import torch, pathlib, sys; \
	flags = set(pathlib.Path('/proc/cpuinfo').read_text().split()) if pathlib.Path('/proc/cpuinfo').exists() else {'?'}; \
	sys.exit(0 if torch.backends.cpu.get_cpu_capability() == 'AVX2' and '?' not in flags \
	and not any(f.startswith(('avx512', 'avx_vnni', 'amx')) for f in flags) else 1)"

test-kernels: install
	@set -e; for setting in $(KERNEL_SETTINGS); do \
		case "$$setting" in ATEN_CPU_CAPABILITY=avx2*) if $(OWN_KERNELS_ARE_AVX2); then \
			echo "== $$setting: skipped, this CPU's own kernels are these (make test ran them)"; continue; fi;; esac; \
		echo "== $$setting: $(KERNEL_TESTS)"; \
		cache=$$(mktemp -d); \
		env $$setting TORCHINDUCTOR_CACHE_DIR=$$cache $(PY) -m pytest $(KERNEL_TESTS) $(KERNEL_SKIP); \
		rm -rf $$cache; \
	done

# The fuzzers again, long and with fresh random examples (make test runs them short and derandomised).
test-fuzz: install
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -m fuzz -p no:cacheprovider

# lm-evaluation-harness as a real client of `tokenloom serve` (tests/serving/test_lm_eval.py): lm-eval pins its own
# stack (datasets, pandas, ...), so it lives in its own environment, with this torch; the test finds it through
# TOKENLOOM_LM_EVAL.
LMEVAL_VENV ?= .venv-lmeval
$(LMEVAL_VENV)/.installed:
	python3 -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install -q --upgrade pip
	$(LMEVAL_VENV)/bin/pip install -q torch==2.13.0 'lm-eval[api]==0.4.13' 'transformers>=4.40'
	touch $@

test-lm-eval: install $(LMEVAL_VENV)/.installed
	TOKENLOOM_LM_EVAL=$(LMEVAL_VENV)/bin/lm_eval $(PY) -m pytest -m slow -p no:cacheprovider tests/serving/test_lm_eval.py

test-all: install
	$(PY) -m pytest -m ""

# The wheel: `python -m build` of a copy of the source, installed into a fresh venv (torch==2.13.0 first) and run from
# outside the repository: --help, generate, a packaged recipe by name, the "where is data/" error
# (tests/test_packaging.py, 1-2 minutes on 2 cores).
wheel-test: install
	$(PY) -m pytest -m slow -p no:cacheprovider tests/test_packaging.py

# The documentation site (mkdocs.yml) into build/site. --strict: a broken link or anchor, a page missing from the nav or
# a README section on no page of the site fails the build (scripts/docs_hooks.py generates the reference pages).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: install
	$(BIN)/ruff check src tests benchmarks scripts

bench: install
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_generate.py

# The guided tour's figures and numbers (docs/tour.md): docs/images/tour/*.png and tour-figures.json, from the bundled
# checkpoints and small runs in runs/tour (15-20 minutes on 2 cores; --only NAME[,NAME] for some sections).
tour-figures: install
	$(PY) scripts/tour_figures.py

clean:
	rm -rf runs build dist src/*.egg-info .pytest_cache
