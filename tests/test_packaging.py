"""The wheel: `python -m build` of a copy of the source, installed into a fresh venv (torch==2.13.0 first), runs
from a folder outside the repository: --help, generate from the bundled checkpoint given by its path, a packaged
recipe trained by name, and the one-line error that says where the repository's data/ is.

Slow (a fresh venv and its packages: 65-125 s on 2 shared cores): `make wheel-test` runs it, and CI."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "tinyshakespeare" / "input.txt"
CHECKPOINT = ROOT / "checkpoints" / "shakespeare-char"
TINY = ["model.num_layers=1", "model.num_heads=2", "model.embed_dim=32", "model.max_seq_len=32", "train.seq_len=32",
        "train.batch_size=4", "train.max_steps=2", "train.warmup_steps=0", "train.eval_every=0",
        "train.eval_batches=1", "train.checkpoint_every=0", "train.precision=fp32", "train.max_minutes=null",
        "train.seq_len_warmup=0"]


def _env() -> dict[str, str]:
    """This process's environment without what would point the fresh venv back at the source tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "TOKENLOOM_DEVICE": "cpu"}


def _run(command: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"{' '.join(result.args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> tuple[Path, Path]:
    """(the fresh venv's bin folder, a working folder outside the repository) with the wheel installed."""
    pytest.importorskip("build", reason="the dev extra's `build` (pip install -e '.[dev]')")
    work = tmp_path_factory.mktemp("wheel")
    tree = work / "tree"  # what the build reads, copied: build/ and *.egg-info stay out of the shared checkout
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(ROOT / "configs", tree / "configs")
    shutil.copytree(ROOT / "src" / "tokenloom", tree / "src" / "tokenloom", symlinks=True,  # recipes: the link
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = work / "dist"
    built = _ok(_run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(tree)], cwd=work))
    said = (built.stdout + built.stderr).lower()
    assert "deprecat" not in said, "the build warns (pyproject.toml):\n" + "\n".join(
        line for line in (built.stdout + built.stderr).splitlines() if "deprecat" in line.lower())
    wheel, = dist.glob("tokenloom-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "tokenloom/recipes/shakespeare-char.yaml" in names and "tokenloom/cli/main.py" in names
    assert not [n for n in names if n.startswith(("data/", "checkpoints/", "configs/", "tests/"))], names
    _ok(_run([sys.executable, "-m", "venv", str(work / "venv")], cwd=work))
    python = work / "venv" / "bin" / "python"
    _ok(_run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0"], cwd=work))
    _ok(_run([str(python), "-m", "pip", "install", "-q", str(wheel)], cwd=work))
    outside = work / "elsewhere"
    outside.mkdir()
    return python.parent, outside


def test_the_wheel_is_what_runs(venv):
    bin_dir, outside = venv
    where = _ok(_run([str(bin_dir / "python"), "-c", "import tokenloom.packaged as p; print(p.__file__); "
                      "print(p.repository())"], cwd=outside)).stdout.split()
    assert "site-packages" in where[0] and where[1] == "None"


def test_help(venv):
    bin_dir, outside = venv
    out = _ok(_run([str(bin_dir / "tokenloom"), "--help"], cwd=outside)).stdout
    assert "train" in out and "generate" in out and "recipes" in out


def test_generate_from_the_bundled_checkpoint_by_its_path(venv):
    bin_dir, outside = venv
    out = _ok(_run([str(bin_dir / "tokenloom"), "generate", str(CHECKPOINT), "--prompt", "ROMEO:",
                    "--max-new-tokens", "20", "--seed", "1", "--precision", "fp32"], cwd=outside)).stdout
    assert out.startswith("ROMEO:") and len(out) >= len("ROMEO:") + 20


def test_a_packaged_recipe_by_name(venv):
    bin_dir, outside = venv
    listed = _ok(_run([str(bin_dir / "tokenloom"), "recipes"], cwd=outside)).stdout
    assert "shakespeare-char " in listed and "mnist-vit " in listed
    sets = [arg for key in [*TINY, f"data.path={DATA}"] for arg in ("--set", key)]
    _ok(_run([str(bin_dir / "tokenloom"), "train", "shakespeare-char", "--out", "run", *sets], cwd=outside))
    assert (outside / "run" / "checkpoint" / "model.safetensors").is_file()


def test_a_packaged_recipe_without_its_data_says_where_it_is(venv):
    bin_dir, outside = venv
    sets = [arg for key in TINY for arg in ("--set", key)]
    result = _run([str(bin_dir / "tokenloom"), "train", "shakespeare-char", "--out", "run2", *sets], cwd=outside)
    assert result.returncode == 2 and result.stdout == ""
    err = result.stderr
    assert err.count("\n") == 1, err
    assert err.startswith("error: data.path: data/tinyshakespeare/input.txt not found")
    assert "tokenloom repository's data/ folder" in err
    assert "--set data.path=<repository>/data/tinyshakespeare/input.txt" in err
    assert not (outside / "run2").exists()
    unknown = _run([str(bin_dir / "tokenloom"), "train", "shakespeare-chr", "--out", "run3"], cwd=outside)
    assert unknown.returncode == 2 and "(did you mean 'shakespeare-char'?)" in unknown.stderr
