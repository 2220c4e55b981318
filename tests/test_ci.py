"""CI runs lint, the default suite, and the float-sensitive tests again under other CPU kernel settings: the check
that the suite passes on CPUs other than CI's own cannot silently disappear."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands(path: Path) -> list[str]:
    """The lines of a shell script that run something (comments and blank lines left out)."""
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line]


def make_variable(name: str) -> list[str]:
    """A Makefile variable's words (shell-quoted words kept whole), following backslash continuations."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(rf"^{name}\s*:=(.*)$", text, re.MULTILINE)
    assert match, f"the Makefile defines no {name}"
    return shlex.split(match.group(1))


def test_ci_lints_then_tests_then_tests_under_other_kernels_then_fuzzes():
    run = commands(ROOT / ".ci" / "run")
    assert "set -euo pipefail" in run  # a failing step fails CI
    steps = [line for line in run if line.startswith("make ")]
    core = ["make lint", "make test", "make test-kernels", "make test-fuzz"]
    assert [step for step in steps if step in core] == core  # in this order; other checks may sit between them
    assert "make wheel-test" in steps  # the wheel in a fresh venv, run from outside the repository


def test_the_wheel_test_runs_the_slow_packaging_test():
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("\nwheel-test:", 1)[1].split("\n\n", 1)[0]
    assert "-m slow" in recipe and "tests/test_packaging.py" in recipe


def test_the_long_fuzz_run_selects_the_fuzz_tests_with_the_fuzz_profile():
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("\ntest-fuzz:", 1)[1].split("\n\n", 1)[0]
    assert "HYPOTHESIS_PROFILE=fuzz" in recipe and "-m fuzz" in recipe
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert 'register_profile("fuzz"' in conftest and 'load_profile(os.environ.get("HYPOTHESIS_PROFILE"' in conftest


def test_the_kernel_settings_cover_avx2_and_scalar_kernels_and_one_thread():
    settings = [dict(word.split("=", 1) for word in setting.split()) for setting in make_variable("KERNEL_SETTINGS")]
    assert {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"} in settings
    assert {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"} in settings
    tests = make_variable("KERNEL_TESTS")
    assert {"tests/models", "tests/training", "tests/generation", "tests/nn"} <= set(tests)
    assert all((ROOT / t).is_dir() for t in tests)


def test_each_setting_runs_the_tests_with_its_own_inductor_cache_and_stops_on_failure():
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("\ntest-kernels:", 1)[1].split("\n\n", 1)[0]
    assert "set -e;" in recipe and "for setting in $(KERNEL_SETTINGS)" in recipe
    # Inductor's on-disk cache does not key on ATEN_CPU_CAPABILITY: a kernel compiled for AVX-512 and loaded under
    # avx2 indexed out of bounds (test_compiled.py), so every setting compiles afresh
    assert "TORCHINDUCTOR_CACHE_DIR=$$cache" in recipe and "env $$setting" in recipe
    assert "-m pytest $(KERNEL_TESTS)" in recipe
