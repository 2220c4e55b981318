"""CLI rough edges (issue 26): progress on stderr for the commands that work through many inputs, shell completion,
one beam default for Python and the CLI, every warning as one line, and a distill that never overwrites data."""

from __future__ import annotations

import argparse
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tokenloom.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
MT = ROOT / "checkpoints" / "multi30k-de-en"
LM = ROOT / "checkpoints" / "shakespeare-char"
SENTENCES = ["Zwei Hunde spielen im Schnee.", "Ein Mann fährt Fahrrad."]
SUMMARY = r"^{verb} {count} {unit}s? in \d+\.\d s( \([\d,]+(\.\d+)?/s\))?$"


def summary_lines(err: str, verb: str, count: int | str, unit: str) -> list[str]:
    pattern = re.compile(SUMMARY.format(verb=verb, count=count, unit=unit))
    return [line for line in err.splitlines() if pattern.match(line)]


# ---- progress ---------------------------------------------------------------------------------------------------

def test_summary_line_format():
    from tokenloom.cli.progress import summary

    assert summary("translated", 1014, "sentence", 12.34) == "translated 1,014 sentences in 12.3 s (82/s)"
    assert summary("classified", 1, "image", 0.0) == "classified 1 image in 0.0 s"
    assert summary("translated", 20, "sentence", 13.4) == "translated 20 sentences in 13.4 s (1.5/s)"
    assert summary("translated", 3, "sentence", 12.0) == "translated 3 sentences in 12.0 s (0.25/s)"


def test_translate_on_a_pipe_prints_one_summary_line_and_leaves_stdout_alone(tmp_path, capsys):
    from tokenloom import translate
    from tokenloom.checkpoint import load_model, load_tokenizer

    source = tmp_path / "in.de"
    source.write_text(f"{SENTENCES[0]}\n\n{SENTENCES[1]}\n", encoding="utf-8")
    assert main(["translate", str(MT), "--input", str(source), "--beam", "1", "--precision", "fp32"]) == 0
    captured = capsys.readouterr()
    model, _ = load_model(MT)
    expected = translate(model.float(), load_tokenizer(MT), SENTENCES, beam=1)
    assert captured.out == f"{expected[0]}\n\n{expected[1]}\n"  # the translations only, as before
    assert len(summary_lines(captured.err, "translated", 2, "sentence")) == 1, captured.err
    assert "\r" not in captured.err and "%|" not in captured.err  # no bar off a terminal


def test_a_terminal_gets_the_tqdm_bar_and_warnings_above_it(tmp_path, capsys, monkeypatch):
    source = tmp_path / "in.de"
    source.write_text("\n".join([*SENTENCES, " ".join([SENTENCES[0]] * 30)]) + "\n", encoding="utf-8")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["translate", str(MT), "--input", str(source), "--beam", "1", "--max-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert "translate:" in captured.err and "sentence/s" in captured.err and "/3 [" in captured.err, captured.err
    assert len(summary_lines(captured.err.split("\r")[-1], "translated", 3, "sentence")) == 1
    pieces = re.split(r"[\r\n]", captured.err)
    assert any(re.fullmatch(r"warning: 1 source sentence\(s\) longer than .* truncated", p) for p in pieces), pieces
    assert "translate:" not in captured.out and len(captured.out.splitlines()) == 3


def test_evaluate_summaries_for_a_language_model_and_a_translation_source(tmp_path, capsys):
    assert main(["evaluate", str(LM), "--data", str(ROOT / "data/tinyshakespeare/input.txt"), "--batches", "1",
                 "--batch-size", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("{") and len(captured.out.splitlines()) == 1  # JSON alone on stdout
    assert len(summary_lines(captured.err, "evaluated", "512", "token")) == 1, captured.err  # 2 x 256 tokens
    (tmp_path / "s.de").write_text(SENTENCES[0] + "\n", encoding="utf-8")
    (tmp_path / "s.en").write_text("Two dogs play in the snow.\n", encoding="utf-8")
    assert main(["evaluate", str(MT), "--source", str(tmp_path / "s.de"), "--reference", str(tmp_path / "s.en"),
                 "--beam", "1"]) == 0
    assert len(summary_lines(capsys.readouterr().err, "translated", 1, "sentence")) == 1


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("rough-vit")
    recipe = {"task": "image_classification",
              "model": {"family": "vit", "image_size": 8, "patch_size": 4, "in_channels": 1, "num_classes": 10,
                        "embed_dim": 16, "num_layers": 1, "num_heads": 2, "mlp_ratio": 2.0},
              "data": {"dataset": "digits", "dir": str(ROOT / "data" / "digits"), "eval_batch_size": 100},
              "train": {"max_steps": 1, "batch_size": 8, "warmup_steps": 0, "eval_every": 0, "eval_batches": 1,
                        "checkpoint_every": 0, "precision": "fp32"}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(root / "recipe.yaml"), "--out", str(root / "run")]) == 0
    images = []
    for i in range(3):
        images.append(root / f"{i}.png")
        Image.new("L", (8, 8), 40 * i).save(images[-1])
    return root / "run", images


def test_image_evaluate_and_classify_summaries(image_run, capsys):
    run, images = image_run
    capsys.readouterr()
    assert main(["evaluate", str(run), "--split", "test", "--batches", "2", "--no-plot", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("{") and len(summary_lines(captured.err, "evaluated", 200, "image")) == 1
    assert main(["classify", str(run), *map(str, images), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("{") and len(summary_lines(captured.err, "classified", 3, "image")) == 1


# ---- shell completion -------------------------------------------------------------------------------------------

def test_completion_scripts_know_the_commands_and_flags(capsys):
    assert main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    for word in ("translate", "distill", "evaluate", "viz", "completion", "--beam", "--max-new-tokens"):
        assert word in script, word
    assert "_shtab_compgen_dirs" in script  # checkpoint arguments complete directories
    for shell, flag in (("zsh", "--beam"), ("tcsh", " beam ")):  # tcsh lists the flags' names after a '--'
        assert main(["completion", shell]) == 0
        script = capsys.readouterr().out
        assert "translate" in script and flag in script, shell
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error
        main(["completion", "fish"])
    assert exit_.value.code == 2 and "invalid choice: 'fish'" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_bash_script_completes_in_bash(tmp_path, capsys):
    assert main(["completion", "bash"]) == 0
    (tmp_path / "tokenloom.bash").write_text(capsys.readouterr().out)
    probe = ('source "$1"; t() { COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMP_LINE="$*"; '
             'COMP_POINT=${#COMP_LINE}; COMPREPLY=(); _shtab_tokenloom; echo "${COMPREPLY[*]}"; }; '
             't tokenloom tr; t tokenloom translate --be; t tokenloom translate --too-long ""')
    result = subprocess.run(["bash", "-c", probe, "bash", str(tmp_path / "tokenloom.bash")], capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.splitlines() == ["train translate", "--beam", "truncate error"], result


# ---- one beam default -------------------------------------------------------------------------------------------

def test_python_and_cli_share_one_beam_default(monkeypatch):
    import tokenloom.generation
    from tokenloom import translate
    from tokenloom.checkpoint import load_model, load_tokenizer
    from tokenloom.cli.commands import decoding_options
    from tokenloom.tasks.translation import DEFAULT_BEAM

    assert DEFAULT_BEAM == 5  # the beam of the README's BLEU figures
    model, _ = load_model(MT)
    tokenizer = load_tokenizer(MT)
    parser = build_parser()
    for argv in (["translate", str(MT)], ["evaluate", str(MT)], ["distill", str(MT), "--out", "x"]):
        args = parser.parse_args(argv)
        assert decoding_options(args, model, tokenizer)["beam"] is DEFAULT_BEAM, argv
    assert parser.parse_args(["distill", str(MT), "--out", "x"]).beam is DEFAULT_BEAM
    assert inspect.signature(translate).parameters["beam"].default is None  # None: DEFAULT_BEAM, or no beam (NAT)
    beams = []
    real = tokenloom.generation.generate

    def recording(decoder, ids, config):
        beams.append(config.num_beams)
        return real(decoder, ids, config)

    monkeypatch.setattr(tokenloom.generation, "generate", recording)
    assert translate(model, tokenizer, SENTENCES[:1])
    assert beams == [DEFAULT_BEAM]
    assert decoding_options(argparse.Namespace(beam=2), model, tokenizer)["beam"] == 2


# ---- warnings: one line each ------------------------------------------------------------------------------------

WARNING_PROBE = """
import logging, sys, warnings

class WarnAtTorchImport:  # stands for a library that warns as it is imported (a NumPy ABI note, a deprecation)
    warned = False

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not self.warned:
            self.warned = True
            warnings.warn("torch warns as it is imported\\n  over two lines")
        return None

sys.meta_path.insert(0, WarnAtTorchImport())
from tokenloom.cli.main import main
assert "torch" not in sys.modules, "importing the CLI imported torch"
code = main(sys.argv[1:])
logging.getLogger("matplotlib.font_manager").warning("findfont: Font family 'Nope' not found.")
sys.exit(code)
"""


def test_every_warning_of_a_viz_command_is_one_line(tmp_path):
    """A warning raised while torch is imported, one from inside ``viz check`` (a source longer than the model's
    limit, truncated) and a library's log record: each one ``warning: ...`` line, no file, line or source."""
    import os

    long_source = " ".join(["Ein Hund rennt durch den Schnee."] * 40)
    result = subprocess.run([sys.executable, "-c", WARNING_PROBE, "viz", "check", str(MT), "--source", long_source],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "TOKENLOOM_DEVICE": "cpu", "MPLBACKEND": "Agg"})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "warning: torch warns as it is imported over two lines", lines
    assert any(re.fullmatch(r"warning: 1 source sentence\(s\) longer than the model's limit of \d+ tokens were "
                            r"truncated", line) for line in lines), lines
    assert lines[-1] == "warning: findfont: Font family 'Nope' not found."
    assert all(line.startswith("warning: ") for line in lines), lines
    assert "Warning:" not in result.stderr and ".py:" not in result.stderr and "<string>" not in result.stderr


def test_warnings_inside_a_command_are_one_line(monkeypatch, capsys, tmp_path):
    """In process too: a multi-line UserWarning from inside viz goes through the CLI's format."""
    import warnings

    from tokenloom.cli import viz
    from tokenloom.cli.main import _one_line_warning

    def warn_then_curves(args):
        warnings.warn("tight layout not applied:\n  the labels are too long", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(viz, "curves", warn_then_curves)
    with warnings.catch_warnings():  # pytest records warnings: print them the way Python would
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, lineno, file=None,
                            line=None: sys.stderr.write(warnings.formatwarning(message, category, filename, lineno)))
        assert main(["viz", "curves", str(tmp_path)]) == 0
    assert capsys.readouterr().err == "warning: tight layout not applied: the labels are too long\n"
    assert _one_line_warning("a\nb", UserWarning, "x.py", 3, "source") == "warning: a b\n"


# ---- distill never overwrites -----------------------------------------------------------------------------------

def _distill(out: Path, *extra: str) -> int:
    return main(["distill", str(MT), "--split", "val", "--limit", "3", "--beam", "1", "--out", str(out), *extra])


def test_distill_refuses_an_out_that_holds_files_and_force_keeps_the_others(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the bundled checkpoint names its data relative to the repository
    out = tmp_path / "distilled"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert _distill(out) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "\n" not in err and "already holds files" in err and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert _distill(out, "--force") == 0
    err = capsys.readouterr().err
    assert len(summary_lines(err, "translated", 3, "sentence")) == 1, err
    assert (out / "notes.txt").read_text() == "mine"
    assert len((out / "val.en").read_text(encoding="utf-8").splitlines()) == 3
    assert (out / "test2016.de").read_bytes() == (ROOT / "data/multi30k/test2016.de").read_bytes()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_distill_never_writes_into_the_teachers_data(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    before = {p.name: p.stat().st_mtime_ns for p in (ROOT / "data/multi30k").iterdir()}
    for out in ("data/multi30k", str(ROOT / "data/multi30k") + "/"):
        assert _distill(Path(out), "--force") == 2
        err = capsys.readouterr().err.strip()
        assert "is the teacher's own data folder" in err and "\n" not in err
    assert {p.name: p.stat().st_mtime_ns for p in (ROOT / "data/multi30k").iterdir()} == before
    assert main(["distill", str(MT), "--out", str(ROOT / "README.md" / "x")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_the_documented_distill_commands_write_outside_the_bundled_data():
    """The README's and the recipes' distill commands run on a fresh clone: their --out is not a folder the
    repository ships (data/multi30k-distilled is bundled, so writing there is refused)."""
    texts = [(ROOT / "README.md").read_text(encoding="utf-8")]
    texts += [p.read_text(encoding="utf-8") for p in sorted((ROOT / "configs").glob("*.yaml"))]
    outs = [m.group(1) for text in texts for m in re.finditer(r"tokenloom distill \S+.*?--out (\S+)", text)]
    assert outs, "no documented distill command found"
    for out in outs:
        assert out.startswith("runs/"), out  # runs/ is ignored by git: never bundled
