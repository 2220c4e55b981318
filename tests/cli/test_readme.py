"""Every README (and docs/python.md) block marked ``<!-- quick -->`` runs, in order, as a new user would type it on a
fresh clone.

The commands run in a sandbox laid out like the repository (recipes, bundled checkpoints and scripts copied; the
corpora cut to a few hundred lines, so the recipes train in seconds), with ``tokenloom train`` shrunk by ``--set``
(two steps, one evaluation batch; their other settings stay the recipe's). Files and runs a block refers to but no
README command makes (``sentences.de``, ``digit.png``, ``runs/nat``, ``path/to/hf-model``, ...) are made first by
:data:`PREPARE`. Optional parts written ``[--flag value]`` are left out; a block's ``python`` code runs as a
script in the sandbox.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "docs" / "python.md"]  # the pages whose quick blocks run, in this order
MARK = "<!-- quick -->"
BIN = Path(sys.executable).parent

# made before the blocks run: a path a README block uses -> the commands that make it in the sandbox
PREPARE = {
    "runs/nat": "tokenloom train configs/multi30k-de-en-nat.yaml --out runs/nat",
    "runs/ctc": "tokenloom train configs/multi30k-de-en-ctc.yaml --out runs/ctc",
    "runs/vit": "tokenloom train configs/digits-vit.yaml --out runs/vit",
    "runs/a": "tokenloom train configs/shakespeare-char.yaml --out runs/a",
    "runs/b": "tokenloom train configs/shakespeare-char.yaml --out runs/b --set model.position=rope",
    "runs/demo": "tokenloom train configs/shakespeare-char.yaml --out runs/demo",
}
SHRINK = ["train.max_steps={steps}", "train.eval_every=0", "train.eval_batches=1", "train.checkpoint_every=0",
          "train.warmup_steps=0", "train.log_every=1"]
SHRINK_TASK = {"translation": ["data.bleu_sentences=4"], "nat_translation": ["data.bleu_sentences=4"],
               "image_classification": ["data.eval_batch_size=64", "data.val_size=100"]}


def quick_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, commands) of every fenced block right after a ``<!-- quick -->`` line; a command's ``\\``
    continuations joined; shell comments, blank lines and ``[optional]`` parts removed (python: the code)."""
    blocks = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fence = lines[i + 1]
        assert fence.startswith("```"), f"README line {i + 2}: {MARK} must come right before a code block"
        body = []
        for j in range(i + 2, len(lines)):
            if lines[j].startswith("```"):
                break
            body.append(lines[j])
        language = fence[3:].strip() or "bash"
        if language == "python":
            blocks.append((language, ["\n".join(body)]))
            continue
        commands, current = [], ""
        for raw in body:
            current += raw.rstrip()
            if current.endswith("\\"):
                current = current[:-1] + " "
                continue
            command = re.sub(r"\s+#\s.*$", "", current)  # a comment after the command (two spaces, '# ')
            command = re.sub(r"\s\[[^\]]*\]", "", command)  # [--optional parts]
            command = " ".join(command.split())
            if command and not command.startswith("#"):
                commands.append(command)
            current = ""
        blocks.append((language, commands))
    return blocks


def _shrunk(command: str, sandbox: Path) -> str:
    """``tokenloom train`` made quick: two steps (four on a resume), one evaluation batch."""
    if not command.startswith("tokenloom train "):
        return command
    words = command.split()
    resume = "--resume" in words
    recipe = next((w for w in words[2:] if w.endswith((".yaml", ".yml"))), None)
    if recipe is not None:
        task = (yaml.safe_load((sandbox / recipe).read_text()) or {}).get("task", "lm")
    else:
        recorded = sandbox / words[words.index("--out") + 1] / "checkpoint" / "config.yaml"
        task = (yaml.safe_load(recorded.read_text()) if recorded.is_file() else {}).get("task", "lm")
    settings = [s.format(steps=4 if resume else 2) for s in SHRINK] + SHRINK_TASK.get(task, [])
    return command + "".join(f" --set {s}" for s in settings)


def _cut(source: Path, target: Path, lines: int) -> None:
    with source.open(encoding="utf-8") as f:
        target.write_text("".join(next(f) for _ in range(lines)), encoding="utf-8")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A fresh clone's layout, small: recipes, sweeps, scripts and bundled checkpoints copied, corpora cut."""
    box = tmp_path_factory.mktemp("readme")
    for folder in ("configs", "sweeps", "scripts", "checkpoints"):
        shutil.copytree(ROOT / folder, box / folder, symlinks=False)
    data = box / "data"
    for corpus in ("multi30k", "multi30k-distilled"):
        (data / corpus).mkdir(parents=True)
        for split, n in (("train", 300), ("val", 16), ("test2016", 16)):
            for lang in ("de", "en"):
                _cut(ROOT / "data" / corpus / f"{split}.{lang}", data / corpus / f"{split}.{lang}", n)
    (data / "tinyshakespeare").mkdir()
    text = (ROOT / "data/tinyshakespeare/input.txt").read_text(encoding="utf-8")
    (data / "tinyshakespeare/input.txt").write_text(text[:60_000], encoding="utf-8")
    shutil.copytree(ROOT / "data/digits", data / "digits")
    shutil.copytree(ROOT / "data/sft", data / "sft")
    (data / "kb").mkdir()
    _cut(ROOT / "data/kb/docs.jsonl", data / "kb" / "docs.jsonl", 200)
    _small_mnist(ROOT / "data/mnist", data / "mnist")
    (box / "sentences.de").write_text("Zwei Hunde spielen im Schnee.\nEin Mann fährt Fahrrad.\n", encoding="utf-8")
    (box / "my.de").write_text("Ein Hund rennt.\nZwei Kinder spielen.\n", encoding="utf-8")
    (box / "my.en").write_text("A dog runs.\nTwo children play.\n", encoding="utf-8")
    _digit_png(box / "digit.png")
    (box / "more").mkdir()
    _digit_png(box / "more" / "seven.png")
    return box


def _small_mnist(source: Path, target: Path, train: int = 600, test: int = 200) -> None:
    """The IDX files with their first images only (the header's count rewritten)."""
    target.mkdir(parents=True)
    for name, n in (("train", train), ("t10k", test)):
        for kind, item, header in (("images", 28 * 28, 16), ("labels", 1, 8)):
            raw = gzip.decompress((source / f"{name}-{kind}-idx{3 if kind == 'images' else 1}-ubyte.gz").read_bytes())
            head = bytearray(raw[:header])
            head[4:8] = n.to_bytes(4, "big")
            body = raw[header:header + n * item]
            (target / f"{name}-{kind}-idx{3 if kind == 'images' else 1}-ubyte.gz").write_bytes(
                gzip.compress(bytes(head) + body))


def _digit_png(path: Path) -> None:
    from PIL import Image, ImageDraw

    image = Image.new("L", (28, 28), 0)
    ImageDraw.Draw(image).line([(8, 6), (20, 6), (12, 22)], fill=255, width=3)
    image.save(path)


def _hf_model(path: Path) -> None:
    """A tiny random GPT-2 in Hugging Face's layout, with a byte-level BPE tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    from tokenloom.data.tokenizers import Tokenizer

    path.mkdir(parents=True)
    tok = Tokenizer.train_bpe((ROOT / "data/tinyshakespeare/input.txt").read_text(encoding="utf-8")[:20_000], 300)
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=tok.vocab_size, n_positions=256,
                                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tok.save(path / "tokenizer.json")


def _run(command: str, cwd: Path, language: str = "bash") -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(cwd),
           "TOKENLOOM_DEVICE": "cpu", "MPLBACKEND": "Agg"}
    args = [sys.executable, "-c", command] if language == "python" else ["bash", "-c", command]
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_readme_marks_its_quick_blocks():
    blocks = quick_blocks(README.read_text(encoding="utf-8"))
    commands = [c for _, block in blocks for c in block]
    assert len(blocks) >= 5 and any(c.startswith("tokenloom train") for c in commands)
    assert not [c for c in commands if " [--" in c], "optional [--parts] left in a command"


def test_quick_blocks_parse_commands_continuations_and_optional_parts():
    text = ("<!-- quick -->\n```bash\ntokenloom generate x --top-k 40 \\\n    [--top-p 0.95] --seed 1   # note\n"
            "# a comment line\n\nmake demo\n```\n```bash\nnot marked\n```\n")
    assert quick_blocks(text) == [("bash", ["tokenloom generate x --top-k 40 --seed 1", "make demo"])]


def test_every_quick_readme_command_runs_on_a_fresh_clone(sandbox):
    blocks = [block for page in PAGES for block in quick_blocks(page.read_text(encoding="utf-8"))]
    text = " ".join(c for _, block in blocks for c in block)
    if "path/to/hf-model" in text:
        _hf_model(sandbox / "path/to/hf-model")
    for path, command in PREPARE.items():
        if path in text and not (sandbox / path).exists():
            result = _run(_shrunk(command, sandbox), sandbox)
            assert result.returncode == 0, f"preparing {path}: {command}\n{result.stderr[-2000:]}"
    failures = []
    for language, commands in blocks:
        for command in commands:
            if command.startswith(("make ", "curl ", "open ", "source ")):
                continue  # the quick start's make targets (CI runs them), a browser, the venv (on PATH here)
            result = _run(_shrunk(command, sandbox) if language == "bash" else command, sandbox, language)
            if result.returncode != 0:
                failures.append(f"{command}\n    exit {result.returncode}: {result.stderr.strip()[-1500:]}")
    assert not failures, "README commands that failed:\n" + "\n".join(failures)
