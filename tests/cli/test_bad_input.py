"""Bad input to the command line (issue 23, defect 6): every case is one line ``error: ...`` on stderr and exit
status 2 -- never a traceback -- and nothing already written is lost. The resource budgets (``tokenloom.budget``)
refuse sizes that cannot fit before anything is allocated, naming the estimate and the limit."""

import io
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml

from tokenloom.checkpoint import STATE_FILE, write_checksums
from tokenloom.cli.main import main

BUNDLE = Path(__file__).resolve().parents[2] / "checkpoints"
LM, MT = BUNDLE / "shakespeare-char", BUNDLE / "multi30k-de-en"
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\nAy me.\n" * 100
NOT_UTF8 = "Ein Hund läuft im Schnee.\nZwei Männer.\n".encode("latin-1")  # ä as the single byte 0xe4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A corpus, a tiny recipe, a run of it (4 steps, a checkpoint every 2), files of German, of references, and
    of German in Latin-1 (not UTF-8)."""
    root = tmp_path_factory.mktemp("bad-input")
    (root / "corpus.txt").write_text(TEXT)
    recipe = {
        "model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "max_seq_len": 32},
        "data": {"path": str(root / "corpus.txt")},
        "train": {"max_steps": 4, "batch_size": 4, "seq_len": 16, "warmup_steps": 1, "eval_every": 0,
                  "eval_batches": 1, "checkpoint_every": 2, "log_every": 1, "precision": "fp32"},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (root / "de.txt").write_text("Ein Hund läuft im Schnee.\nZwei Männer.\n", encoding="utf-8")
    (root / "en.txt").write_text("A dog runs in the snow.\nTwo men.\n", encoding="utf-8")
    (root / "latin1.txt").write_bytes(NOT_UTF8)
    assert main(["train", str(root / "recipe.yaml"), "--out", str(root / "run")]) == 0
    return root


def one_line_error(capsys, code: int) -> str:
    """Exit status 2 and exactly one ``error:`` line (no traceback); returns that line."""
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, captured.err
    return errors[0]


def fill(args: list[str], root: Path, tmp_path: Path) -> list[str]:
    return [a.format(lm=LM, mt=MT, root=root, run=root / "run", out=tmp_path / "out") for a in args]


TRAIN = ["train", "{root}/recipe.yaml", "--out", "{out}", "--set"]


@pytest.mark.parametrize("args, message", [
    # text that is not UTF-8
    (["translate", "{mt}", "--input", "{root}/latin1.txt"], "latin1.txt is not UTF-8 text (line 1"),
    (["evaluate", "{mt}", "--source", "{root}/latin1.txt", "--reference", "{root}/en.txt"], "is not UTF-8 text"),
    (["evaluate", "{mt}", "--source", "{root}/de.txt", "--reference", "{root}/latin1.txt"], "is not UTF-8 text"),
    (["evaluate", "{lm}", "--data", "{root}/latin1.txt"], "is not UTF-8 text"),
    # an output that cannot be written: one line, before anything is translated
    (["translate", "{mt}", "--input", "{root}/de.txt", "--output", "{root}"], "is a directory"),
    (["translate", "{mt}", "--input", "{root}/de.txt", "--output", "{root}/recipe.yaml/out.txt"], "cannot write"),
    # settings out of range
    ([*TRAIN, "train.seed=18446744073709551616"], "train.seed must be an integer in [0, 2^64)"),
    ([*TRAIN, "train.seed=-1"], "train.seed must be an integer in [0, 2^64), got -1"),
    ([*TRAIN, "train.threads=-1"], "train.threads must be a positive integer or null, got -1"),
    ([*TRAIN, "train.threads=0"], "train.threads must be a positive integer or null, got 0"),
    (["evaluate", "{lm}", "--data", "{root}/corpus.txt", "--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
    (["evaluate", "{lm}", "--data", "{root}/corpus.txt", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["evaluate", "{lm}", "--data", "{root}/corpus.txt", "--batches", "0"], "--batches must be >= 1, got 0"),
    ([*TRAIN, "tokenizer.eos_token=[a, b]"], "tokenizer.eos_token must be a token (a string) or null, got ['a', 'b']"),
    ([*TRAIN, "tokenizer.eos_token={{a: 1}}"], "tokenizer.eos_token must be a token (a string) or null"),
    ([*TRAIN, "tokenizer.eos=x"], "unknown key 'tokenizer.eos'"),
    # numbers no setting can be (the fuzzers' leftovers): NaN, infinities, a norm epsilon of 0, a negative RoPE base
    ([*TRAIN, "train.lr=.inf"], "train.lr: expected a finite number, got inf"),
    ([*TRAIN, "train.max_minutes=.nan"], "train.max_minutes: expected a finite number, got nan"),
    ([*TRAIN, "model.norm_eps=0"], "norm_eps must be in (0, 1), got 0"),
    ([*TRAIN, "model.rope_base=-1"], "rope_base must be > 1 (the RoPE frequency base), got -1"),
    # server flags: checked before the model loads (no server starts)
    (["serve", "{lm}", "--request-timeout", "nan"], "--request-timeout must be a number of seconds in (0, 604800]"),
    (["serve", "{lm}", "--request-timeout", "-1"], "--request-timeout must be a number of seconds in (0, 604800]"),
    (["serve", "{lm}", "--max-batch", "0"], "--max-batch must be an integer >= 1, got 0"),
    (["serve", "{lm}", "--max-queue", "-5"], "--max-queue must be an integer >= 1, got -5"),
    (["serve", "{lm}", "--grammar-seconds", "0"], "--grammar-seconds must be a number of seconds in (0, 3600], got 0"),
    (["serve", "{lm}", "--grammar-memory-mb", "1"], "--grammar-memory-mb must be an integer number of MB in [16,"),
])
def test_bad_input_is_one_line(root, tmp_path, capsys, args, message):
    capsys.readouterr()
    line = one_line_error(capsys, main(fill(args, root, tmp_path)))
    assert message in line
    assert not (tmp_path / "out").exists()  # a refused run leaves no run directory behind


def test_non_utf8_stdin_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(NOT_UTF8), encoding="utf-8"))
    capsys.readouterr()
    line = one_line_error(capsys, main(["translate", str(MT)]))
    assert "standard input is not UTF-8 text (line 1" in line


def test_translate_and_evaluate_output_create_missing_folders(root, tmp_path, capsys):
    """Like every other --out / --output of the CLI (train, distill, bench, report, viz), a missing parent folder
    is created; the file appears whole (written to a temporary name, then renamed)."""
    out = tmp_path / "new" / "folder" / "en.txt"
    assert main(["translate", str(MT), "--input", str(root / "de.txt"), "--output", str(out), "--beam", "1"]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2
    hyp = tmp_path / "other" / "hyp.txt"
    assert main(["evaluate", str(MT), "--source", str(root / "de.txt"), "--reference", str(root / "en.txt"),
                 "--beam", "1", "--output", str(hyp)]) == 0
    assert hyp.read_text(encoding="utf-8") == out.read_text(encoding="utf-8")
    assert sorted(p.name for p in out.parent.iterdir()) == ["en.txt"]  # no temporary file left


def test_a_checkpoint_naming_a_list_as_eos_token_is_one_line(tmp_path, capsys):
    shutil.copytree(LM, tmp_path / "ckpt")
    config = yaml.safe_load((tmp_path / "ckpt" / "config.yaml").read_text())
    config["tokenizer"] = {"eos_token": ["\n"]}
    (tmp_path / "ckpt" / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "ckpt" / "checksums.json").unlink()  # edited by hand: no checksums to hold it to
    capsys.readouterr()
    line = one_line_error(capsys, main(["generate", str(tmp_path / "ckpt"), "--max-new-tokens", "2"]))
    assert "tokenizer.eos_token must be a token (a string) or null" in line and "config.yaml" in line


# ---- an unreadable trainer_state.pt ---------------------------------------------------------------------------

def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00garbage, not a trainer state" * 10)


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:3000])


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "data.pkl").write_bytes(b"x")


@pytest.mark.parametrize("damage", [_garbage, _truncated, _directory], ids=["garbage", "truncated", "directory"])
def test_an_unreadable_trainer_state_is_one_line(root, tmp_path, capsys, damage):
    """Damaged with its checksum regenerated (so the checkpoint looks intact): --resume fails in one line that
    names the file, and the run directory is left as it was."""
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    damage(run / "checkpoint" / STATE_FILE)
    write_checksums(run / "checkpoint")
    capsys.readouterr()
    line = one_line_error(capsys, main(["train", "--out", str(run), "--resume", "--set", "train.max_steps=6"]))
    assert STATE_FILE in line
    assert (run / "metrics.jsonl").read_text() == (root / "run" / "metrics.jsonl").read_text()


def test_a_trainer_state_that_cannot_be_opened_is_one_line(root, tmp_path, capsys, monkeypatch):
    """Permission denied (simulated: tests may run as root, where chmod 000 does not stop reads)."""
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    real_open = open

    def guarded_open(file, *args, **kwargs):
        if Path(str(file)).name == STATE_FILE and Path(str(file)).parent.name == "checkpoint":
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded_open)
    capsys.readouterr()
    line = one_line_error(capsys, main(["train", "--out", str(run), "--resume", "--set", "train.max_steps=6"]))
    assert STATE_FILE in line and "Permission denied" in line


# ---- a run directory that becomes unwritable mid-run ---------------------------------------------------------

def _fail_second_checkpoint(monkeypatch):
    """Let the first checkpoint through and fail writing the weights of the next ones, as a read-only or full
    disk would."""
    import tokenloom.checkpoint as checkpoint

    real, calls = checkpoint.save_file, {"n": 0}

    def save_file(tensors, filename, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:
            raise PermissionError(13, "Permission denied", str(filename))
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", save_file)


def _fail_metrics_after_step_2(monkeypatch):
    real_open = open

    def guarded_open(file, mode="r", *args, **kwargs):
        name = Path(str(file)).name
        if "metrics" in name and any(m in mode for m in "wa") and (Path(str(file)).parent / "checkpoint").exists():
            raise OSError(28, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded_open)


@pytest.mark.parametrize("failure", [_fail_second_checkpoint, _fail_metrics_after_step_2],
                         ids=["checkpoint", "metrics"])
def test_a_run_directory_that_becomes_unwritable_is_one_line(root, tmp_path, capsys, monkeypatch, failure):
    """The write fails mid-run: one line naming the path; the last good checkpoint (step 2) stays intact and
    resumes once the directory is writable again."""
    from tokenloom.checkpoint import checkpoint_damage

    out = tmp_path / "run"
    failure(monkeypatch)
    capsys.readouterr()
    line = one_line_error(capsys, main(["train", str(root / "recipe.yaml"), "--out", str(out)]))
    assert str(out) in line and ("Permission denied" in line or "No space left" in line)
    assert checkpoint_damage(out / "checkpoint") is None
    assert torch.load(out / "checkpoint" / STATE_FILE, weights_only=True)["step"] == 2
    monkeypatch.undo()
    assert main(["train", "--out", str(out), "--resume"]) == 0


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root writes into read-only directories; the simulated failures above cover it")
def test_a_run_directory_made_read_only_mid_run(root, tmp_path, capsys, monkeypatch):
    import os
    import stat

    from tokenloom.training.trainer import Trainer

    out = tmp_path / "run"
    real = Trainer.save

    def save(self):
        path = real(self)
        for folder in (out, out / "checkpoint"):
            folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
        return path

    monkeypatch.setattr(Trainer, "save", save)
    capsys.readouterr()
    try:
        line = one_line_error(capsys, main(["train", str(root / "recipe.yaml"), "--out", str(out)]))
    finally:
        for folder in (out, out / "checkpoint"):
            os.chmod(folder, stat.S_IRWXU)
    assert str(out) in line


# ---- resource budgets: refused before anything is allocated ----------------------------------------------------

def _huge_checkpoint(tmp_path: Path) -> str:
    shutil.copytree(LM, tmp_path / "ckpt")
    config = yaml.safe_load((tmp_path / "ckpt" / "config.yaml").read_text())
    config["model"]["num_layers"] = 1_000_000_000
    (tmp_path / "ckpt" / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "ckpt" / "checksums.json").unlink()  # edited by hand: no checksums to hold it to
    return str(tmp_path / "ckpt")


@pytest.mark.parametrize("args, message", [
    ([*TRAIN, "model.num_layers=1000000000"], "model.num_layers=1000000000"),
    ([*TRAIN, "model.max_seq_len=100000000000"], "model.max_seq_len=100000000000"),
    (["serve", "{lm}", "--max-batch", "100000"], "--max-batch 100000"),
    (["generate", "{lm}", "--beam", "100000"], "num_beams=100000"),
    (["translate", "{mt}", "--input", "{root}/de.txt", "--beam", "1000000"], "num_beams=1000000"),
    (["generate", "HUGE", "--max-new-tokens", "2"], "num_layers=1000000000"),
])
def test_sizes_beyond_the_memory_budget_fail_fast(root, tmp_path, capsys, monkeypatch, args, message):
    import uvicorn

    def never(*args, **kwargs):
        raise AssertionError("the server must not start")

    monkeypatch.setattr(uvicorn, "run", never)
    monkeypatch.setattr(uvicorn.Server, "run", never)
    monkeypatch.setenv("TOKENLOOM_MEMORY_LIMIT", "64GiB")  # the same answer on any machine
    args = [_huge_checkpoint(tmp_path) if a == "HUGE" else a for a in fill(args, root, tmp_path)]
    capsys.readouterr()
    start = time.perf_counter()
    code = main(args)
    seconds = time.perf_counter() - start
    line = one_line_error(capsys, code)
    assert message in line and "needs about" in line and "64 GiB" in line and "TOKENLOOM_MEMORY_LIMIT" in line
    assert seconds < 3.0, f"took {seconds:.1f} s"
    assert not (tmp_path / "out").exists()


def test_the_budget_uses_this_machines_memory_by_default(root, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TOKENLOOM_MEMORY_LIMIT", raising=False)
    capsys.readouterr()
    line = one_line_error(capsys, main(fill([*TRAIN, "model.num_layers=1000000000"], root, tmp_path)))
    assert "needs about" in line and "this machine has" in line


@pytest.mark.parametrize("argv, usage", [
    (["generate", "checkpoints/shakespeare-char", "--tempreature", "1"], "usage: tokenloom generate"),
    (["viz", "check", "checkpoints/shakespeare-char", "--foo"], "usage: tokenloom viz check"),
])
def test_a_typo_in_a_commands_flag_shows_that_commands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(usage) and "error: unrecognized arguments: --" in err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "(default: 200)" in out and "0 = greedy (default: 1.0)" in out


def test_a_recipe_with_several_problems_prints_them_all(tmp_path, capsys):
    """Three bad keys in three sections (issue 26): one ``error:`` header naming the recipe and one indented line
    per problem, exit status 2, no traceback, no run directory."""
    recipe = tmp_path / "x.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "num_layer": 2},
                                      "data": {"path": "corpus.txt", "tokenizr": "char"},
                                      "train": {"max_step": 3}}, sort_keys=False))
    capsys.readouterr()
    code = main(["train", str(recipe), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == [f"error: 3 problems in {recipe}:",
                                "  - unknown key 'model.num_layer' (did you mean 'num_layers'?)",
                                "  - unknown key 'data.tokenizr' (did you mean 'tokenizer'?)",
                                "  - unknown key 'train.max_step' (did you mean 'max_steps'?)"]
    assert not (tmp_path / "out").exists()


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    """A "billion laughs" YAML mapping: ``width`` aliases of ``width`` aliases ... ``levels`` deep (width**levels
    values once expanded, a few dozen nodes as written)."""
    lines = ["  a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("where", ["unknown key", "known key"])
def test_an_alias_bomb_recipe_fails_fast_in_one_line(tmp_path, capsys, where):
    """9 levels of 9 aliases (9**9 values once expanded) under an unknown or a known key: refused while parsing, in
    one line, before any message renders the value (it took over 60 s and 2 GB when an error message repr()'d it)."""
    recipe = tmp_path / "laughs.yaml"
    section = "bogus" if where == "unknown key" else "data"
    recipe.write_text(f"model: {{num_layers: 1}}\n{section}:\n" + _alias_bomb(), encoding="utf-8")
    start = time.perf_counter()
    code = main(["train", str(recipe), "--out", str(tmp_path / "out")])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "expands to more than" in err and str(recipe) in err
    assert seconds < 10  # (generous for a loaded CI machine: the parse itself takes milliseconds)
    assert not (tmp_path / "out").exists()


def test_yaml_bounds_leave_ordinary_aliases_alone(tmp_path):
    """A recipe that shares a few values through anchors loads as before; the node bound counts expanded values."""
    from tokenloom.config import MAX_YAML_NODES, load_yaml, safe_load

    path = tmp_path / "ok.yaml"
    path.write_text("base: &b {lr: 0.001, steps: [1, 2, 3]}\nrun: *b\n", encoding="utf-8")
    data = load_yaml(path)
    assert data["run"] == data["base"] == {"lr": 0.001, "steps": [1, 2, 3]}
    width = 317  # 317**2 = 100,489 values (> MAX_YAML_NODES): just past the bound
    assert width ** 2 > MAX_YAML_NODES > (width - 2) ** 2 + 2 * width
    with pytest.raises(ValueError, match="expands to more than"):
        safe_load(_alias_bomb(levels=1, width=width))
    safe_load(_alias_bomb(levels=1, width=width - 2))  # just under: loads
    for recursive in ("a: &x [*x]", "a: &x {b: [1, *x]}"):  # an alias inside its own anchor expands without end
        with pytest.raises(ValueError, match="its own anchor"):
            safe_load(recursive)


def test_a_huge_yaml_file_is_refused_before_reading(tmp_path, monkeypatch):
    from tokenloom import config
    from tokenloom.errors import ConfigError

    monkeypatch.setattr(config, "MAX_YAML_BYTES", 1000)
    path = tmp_path / "big.yaml"
    path.write_text("a: " + "x" * 2000 + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"2004 bytes, over the limit of 1000"):
        config.load_yaml(path)


def test_error_messages_quote_values_shortly():
    """A wrong value is quoted cut short, whatever its size: a long list, a long string, a huge integer."""
    from tokenloom.config import shown
    from tokenloom.errors import ConfigError
    from tokenloom.training.config import TrainConfig

    assert shown(list(range(10_000))) == "[0, 1, 2, 3, 4, 5, ...]"
    assert len(shown("x" * 100_000)) <= 90
    assert shown(1 << 20_000) == "<an integer of 20001 bits>"
    with pytest.raises(ConfigError) as err:
        from tokenloom.config import from_dict
        from_dict(TrainConfig, {"max_steps": list(range(100_000))})
    assert len(str(err.value)) < 300 and "..." in str(err.value)
