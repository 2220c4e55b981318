"""No damaged checkpoint loads silently: every loader checks the files it reads against the checkpoint's
``checksums.json``. One flipped byte in ``model.safetensors`` (inside the tensor data, where safetensors itself
parses the file fine and the load would otherwise succeed), ``tokenizer.json``, ``config.yaml`` or an adapter's files
is a one-line :class:`ChecksumError` naming the file, from the Python loaders and from every command that reads a
checkpoint (exit status 2). A checkpoint without ``checksums.json`` (older runs, Hugging Face conversions) loads as
before; every bundled checkpoint carries checksums that hold; one load hashes each file once, and a file found intact
by ``checkpoint_damage`` (``--resume``) is not hashed again by the loads that follow."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from tests.tasks.preference_helpers import PAIRS, make_lm_checkpoint, write_jsonl

from tokenloom import checksums
from tokenloom.checkpoint import (
    CHECKSUM_FILE,
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    adapter_state,
    checkpoint_damage,
    load_model,
    load_tokenizer,
    load_weights,
    merge_adapter_checkpoint,
    quantize_checkpoint,
    read_checked_adapter,
    read_config,
    read_weights,
    write_checkpoint,
    write_checksums,
)
from tokenloom.cli.main import main
from tokenloom.errors import CheckpointError, ChecksumError
from tokenloom.models.factory import create_model, model_config_from_dict
from tokenloom.nn.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tokenloom.nn.quantized import QuantizationConfig
from tokenloom.training import load_run_config, setup_run

REPO = Path(__file__).resolve().parents[2]
BUNDLED = sorted(p for p in (REPO / "checkpoints").iterdir() if p.is_dir())
TEXT = "Speak, speak. say cat ok. say dog bad.\n" * 40
TRAIN = {"max_steps": 1, "batch_size": 2, "seq_len": 8, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0,
         "precision": "fp32", "device": "cpu"}
BASE, ADAPTER = Path("base"), Path("checkpoint")  # inside the LoRA run: its own base, and its adapter checkpoint


def flip(path: Path) -> None:
    """One byte of ``path`` flipped: in the middle of a safetensors file's tensor data (past its header, so the
    file still parses and only a weight changes), else in the middle of the file."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little") if path.suffix == ".safetensors" else 0
    data[(start + len(data)) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """Intact checkpoints to copy and damage: a tiny GPT (``lm``), a LoRA run over its own base (``lora``), a tiny
    ViT (``image``) and the bundled translation model (``mt``); with the text and files the commands read."""
    root = tmp_path_factory.mktemp("checksums")
    (root / "text.txt").write_text(TEXT)
    make_lm_checkpoint(root / "lm")
    lora = {"model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "max_seq_len": 16},
            "data": {"path": str(root / "text.txt")}, "train": {**TRAIN, "lora": {"rank": 2, "alpha": 4.0}}}
    setup_run(load_run_config(lora, []), root / "lora", show_progress=False).fit()
    section = {"family": "vit", "image_size": 8, "patch_size": 4, "in_channels": 1, "num_classes": 10,
               "embed_dim": 16, "num_layers": 1, "num_heads": 2}
    family, config = model_config_from_dict(section)
    data = {"dataset": "digits", "dir": str(REPO / "data" / "digits")}
    write_checkpoint(root / "image", create_model(family, config),
                     {"task": "image_classification", "model": section, "data": data})
    from PIL import Image

    Image.new("L", (8, 8)).save(root / "digit.png")
    (root / "in.de").write_text("Zwei Hunde spielen im Schnee.\n")
    write_jsonl(root / "pairs.jsonl", PAIRS)
    return {"root": root, "lm": root / "lm", "lora": root / "lora", "image": root / "image",
            "mt": REPO / "checkpoints" / "multi30k-de-en"}


def damaged(pristine: dict[str, Path], kind: str, name: str | Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a fresh copy of the ``kind`` checkpoint, its file ``name`` with one byte flipped)."""
    copy = tmp_path / kind
    shutil.copytree(pristine[kind], copy)
    flip(copy / name)
    return copy, copy / name


def _recipe(tmp_path: Path, recipe: dict) -> str:
    recipe = {**recipe, "train": {**TRAIN, **recipe.get("train", {})}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return str(tmp_path / "recipe.yaml")


# (command, checkpoint kind, damaged file, argv from (the damaged checkpoint, the pristine files, tmp_path))
COMMANDS = [
    ("generate", "lm", WEIGHTS_FILE, lambda c, p, t: ["generate", c, "--max-new-tokens", "2"]),
    ("generate", "lm", TOKENIZER_FILE, lambda c, p, t: ["generate", c, "--max-new-tokens", "2"]),
    ("generate", "lm", CONFIG_FILE, lambda c, p, t: ["generate", c, "--max-new-tokens", "2"]),
    ("evaluate", "lm", WEIGHTS_FILE, lambda c, p, t: ["evaluate", c, "--data", str(p["root"] / "text.txt"),
                                                      "--batches", "1"]),
    ("serve", "lm", WEIGHTS_FILE, lambda c, p, t: ["serve", c, "--port", "8765"]),
    ("quantize", "lm", WEIGHTS_FILE, lambda c, p, t: ["quantize", c, "--bits", "8", "--out", str(t / "q")]),
    ("export", "lm", WEIGHTS_FILE, lambda c, p, t: ["export", c, "--out", str(t / "hf")]),
    ("export", "lm", TOKENIZER_FILE, lambda c, p, t: ["export", c, "--out", str(t / "hf")]),
    ("train.init_from", "lm", WEIGHTS_FILE, lambda c, p, t: ["train", _recipe(t, {
        "data": {"path": str(p["root"] / "text.txt")}, "train": {"init_from": c}}), "--out", str(t / "run")]),
    ("train.init_from", "lm", TOKENIZER_FILE, lambda c, p, t: ["train", _recipe(t, {
        "data": {"path": str(p["root"] / "text.txt")}, "train": {"init_from": c}}), "--out", str(t / "run")]),
    ("data.reference", "lm", WEIGHTS_FILE, lambda c, p, t: ["train", _recipe(t, {
        "task": "dpo", "data": {"path": str(p["root"] / "pairs.jsonl"), "reference": c},
        "train": {"init_from": str(p["lm"])}}), "--out", str(t / "run")]),
    ("translate", "mt", WEIGHTS_FILE, lambda c, p, t: ["translate", c, "--input", str(p["root"] / "in.de"),
                                                       "--beam", "1"]),
    ("translate", "mt", TOKENIZER_FILE, lambda c, p, t: ["translate", c, "--input", str(p["root"] / "in.de"),
                                                         "--beam", "1"]),
    ("distill", "mt", WEIGHTS_FILE, lambda c, p, t: ["distill", c, "--split", "val", "--limit", "2", "--beam", "1",
                                                     "--out", str(t / "distilled")]),
    ("classify", "image", WEIGHTS_FILE, lambda c, p, t: ["classify", c, str(p["root"] / "digit.png")]),
    ("generate", "lora", ADAPTER / ADAPTER_WEIGHTS, lambda c, p, t: ["generate", c, "--max-new-tokens", "2"]),
    ("generate", "lora", ADAPTER / ADAPTER_CONFIG, lambda c, p, t: ["generate", c, "--max-new-tokens", "2"]),
    ("generate", "lora", BASE / WEIGHTS_FILE, lambda c, p, t: ["generate", c, "--max-new-tokens", "2"]),
    ("lora info", "lora", ADAPTER / ADAPTER_WEIGHTS, lambda c, p, t: ["lora", "info", c]),
    ("lora merge", "lora", ADAPTER / ADAPTER_WEIGHTS, lambda c, p, t: ["lora", "merge", c, "--out", str(t / "m")]),
    ("lora merge", "lora", BASE / WEIGHTS_FILE, lambda c, p, t: ["lora", "merge", c, "--out", str(t / "m")]),
]


@pytest.mark.parametrize("command, kind, name, argv", COMMANDS,
                         ids=[f"{c[0]}-{c[1]}-{Path(c[2]).as_posix()}" for c in COMMANDS])
def test_every_command_refuses_a_damaged_file_in_one_line(pristine, tmp_path, capsys, command, kind, name, argv):
    ckpt, file = damaged(pristine, kind, name, tmp_path)
    capsys.readouterr()
    assert main(argv(str(ckpt), pristine, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n"), err
    *before, line = err.splitlines()  # (training says what it starts first: the DPO reference loads at its start)
    assert line == f"error: {file} does not match its checksum in {CHECKSUM_FILE} (truncated or corrupt)", err
    assert not before or command == "data.reference", err


def _load_weights(c: Path, t: Path):
    model, _ = load_model(REPO / "checkpoints" / "shakespeare-char-draft")  # another model: the mismatch explains
    return load_weights(model, c)


def _export(c: Path, t: Path):
    from tokenloom.interop.hf import export_hf

    return export_hf(c, t / "hf")


def _init_from(c: Path, t: Path):
    (t / "text.txt").write_text(TEXT)
    recipe = {"data": {"path": str(t / "text.txt")}, "train": {**TRAIN, "init_from": str(c)}}
    return setup_run(load_run_config(recipe, []), t / "run", show_progress=False)


# (loader, checkpoint kind, the files it reads (each flipped in turn), call with (checkpoint, tmp_path))
LOADERS = [
    ("read_config", "lm", [CONFIG_FILE], lambda c, t: read_config(c)),
    ("load_tokenizer", "lm", [CONFIG_FILE, TOKENIZER_FILE], lambda c, t: load_tokenizer(c)),
    ("load_model", "lm", [CONFIG_FILE, WEIGHTS_FILE], lambda c, t: load_model(c)),
    ("read_weights", "lm", [WEIGHTS_FILE], lambda c, t: read_weights(c)),
    ("load_weights", "lm", [WEIGHTS_FILE], _load_weights),
    ("quantize_checkpoint", "lm", [CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE],
     lambda c, t: quantize_checkpoint(c, t / "q", QuantizationConfig(bits=8))),
    ("export_hf", "lm", [CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE], _export),
    ("setup_run.init_from", "lm", [CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE], _init_from),
    ("load_model", "lora", [ADAPTER / CONFIG_FILE, ADAPTER / ADAPTER_CONFIG, ADAPTER / ADAPTER_WEIGHTS,
                            BASE / WEIGHTS_FILE], lambda c, t: load_model(c)),
    ("adapter_state", "lora", [ADAPTER / ADAPTER_CONFIG, ADAPTER / ADAPTER_WEIGHTS, BASE / WEIGHTS_FILE],
     lambda c, t: adapter_state(c)),
    ("read_checked_adapter", "lora", [ADAPTER / ADAPTER_CONFIG, ADAPTER / ADAPTER_WEIGHTS],
     lambda c, t: read_checked_adapter(c)),
    ("merge_adapter_checkpoint", "lora", [ADAPTER / ADAPTER_CONFIG, ADAPTER / ADAPTER_WEIGHTS, BASE / WEIGHTS_FILE],
     lambda c, t: merge_adapter_checkpoint(c, t / "m")),
    ("load_model", "image", [WEIGHTS_FILE], lambda c, t: load_model(c)),
    ("load_model", "mt", [WEIGHTS_FILE], lambda c, t: load_model(c)),
    ("load_tokenizer", "mt", [TOKENIZER_FILE], lambda c, t: load_tokenizer(c)),
]
CASES = [(name, kind, file, call) for name, kind, files, call in LOADERS for file in files]


@pytest.mark.parametrize("loader, kind, name, call", CASES,
                         ids=[f"{n}-{k}-{Path(f).as_posix()}" for n, k, f, _ in CASES])
def test_every_loader_refuses_a_damaged_file(pristine, tmp_path, loader, kind, name, call):
    ckpt, file = damaged(pristine, kind, name, tmp_path)
    with pytest.raises(ChecksumError) as err:
        call(ckpt, tmp_path)
    assert str(err.value) == f"{file} does not match its checksum in {CHECKSUM_FILE} (truncated or corrupt)"


def test_the_flip_inside_the_tensor_data_loads_silently_without_checksums(pristine, tmp_path):
    """What the checksums are for: the damaged weights parse, and a checkpoint without checksums.json (an older run,
    a Hugging Face conversion) still loads, the flipped weight and all."""
    intact, _ = load_model(pristine["lm"])
    ckpt, _ = damaged(pristine, "lm", WEIGHTS_FILE, tmp_path)
    (ckpt / CHECKSUM_FILE).unlink()
    model, _ = load_model(ckpt)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, intact.state_dict()[k])]
    assert len(changed) >= 1


@pytest.mark.parametrize("bundle", BUNDLED, ids=[p.name for p in BUNDLED])
def test_every_bundled_checkpoint_carries_checksums_that_hold(bundle):
    sums = checksums.read_checksums(bundle)
    assert sums is not None, f"{bundle} has no {CHECKSUM_FILE} (python -c 'from tokenloom.checkpoint import " \
                             f"write_checksums; write_checksums(...)')"
    assert set(sums) == {f.name for f in bundle.iterdir() if f.is_file() and f.name != CHECKSUM_FILE}
    assert {CONFIG_FILE, WEIGHTS_FILE} <= set(sums)
    assert checkpoint_damage(bundle) is None


def test_a_file_changed_after_a_load_is_caught_at_the_next(pristine, tmp_path):
    """In place (same inode and size), right after an intact load: not taken for the file hashed before."""
    ckpt = tmp_path / "lm"
    shutil.copytree(pristine["lm"], ckpt)
    load_model(ckpt)
    with (ckpt / WEIGHTS_FILE).open("r+b") as f:
        data = bytearray(f.read())
        data[(8 + int.from_bytes(data[:8], "little") + len(data)) // 2] ^= 0x01
        f.seek(0)
        f.write(data)
    with pytest.raises(ChecksumError, match="model.safetensors does not match"):
        load_model(ckpt)


def _count_hashes(monkeypatch) -> list[str]:
    hashed: list[str] = []
    real = checksums._sha256

    def counting(file, stop=None):
        hashed.append(file.name)
        return real(file, stop)

    monkeypatch.setattr(checksums, "_sha256", counting)
    monkeypatch.setattr(checksums, "_VERIFIED", {})
    monkeypatch.setattr(checksums, "_loaded", True)  # (not the entries earlier tests left in the cache directory)
    return hashed


def test_one_load_hashes_each_file_once(pristine, tmp_path, monkeypatch):
    hashed = _count_hashes(monkeypatch)
    load_model(pristine["lm"])
    assert hashed.count(WEIGHTS_FILE) == 1 and hashed.count(CONFIG_FILE) >= 1
    hashed.clear()
    load_model(pristine["lora"])  # the adapter's files and its base's weights, each once
    assert hashed.count(ADAPTER_WEIGHTS) == 1 and hashed.count(WEIGHTS_FILE) == 1


def test_files_found_intact_are_not_hashed_again(pristine, tmp_path, monkeypatch):
    """A resume's ``checkpoint_damage`` hashes every file; the loads that follow (tokenizer, weights) do not hash
    them again while they are unchanged (files older than RACY_SECONDS; here every file counts as old)."""
    monkeypatch.setattr(checksums, "RACY_SECONDS", -1.0)
    hashed = _count_hashes(monkeypatch)
    ckpt = tmp_path / "lm"
    shutil.copytree(pristine["lm"], ckpt)
    assert checkpoint_damage(ckpt) is None
    assert sorted(hashed) == sorted([CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE])
    hashed.clear()
    load_model(ckpt)
    load_tokenizer(ckpt)
    assert hashed == []
    (tmp_path / "copy.json").write_bytes((ckpt / TOKENIZER_FILE).read_bytes())
    (tmp_path / "copy.json").replace(ckpt / TOKENIZER_FILE)  # the same bytes in another file
    load_tokenizer(ckpt)
    assert hashed == [TOKENIZER_FILE]


def test_a_later_process_trusts_an_unchanged_file_and_hashes_an_edited_one(pristine, tmp_path, monkeypatch):
    """What one process found intact, the next takes from the cache directory's verified.json while the file's
    device, inode, size, mtime and ctime are unchanged (a repeated load costs no hash); an edit in place changes the
    ctime, so the next process hashes the file and refuses it."""
    monkeypatch.setattr(checksums, "RACY_SECONDS", -1.0)
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    hashed = _count_hashes(monkeypatch)
    ckpt = tmp_path / "lm"
    shutil.copytree(pristine["lm"], ckpt)
    load_model(ckpt)
    assert WEIGHTS_FILE in hashed and (tmp_path / "cache" / "verified.json").is_file()

    def new_process() -> None:
        hashed.clear()
        checksums._VERIFIED.clear()
        monkeypatch.setattr(checksums, "_loaded", False)

    new_process()
    load_model(ckpt)
    assert hashed == []
    with (ckpt / WEIGHTS_FILE).open("r+b") as f:  # one byte flipped in place: same inode, size and (here) mtime
        mtime = os.fstat(f.fileno()).st_mtime_ns
        data = bytearray(f.read())
        data[(8 + int.from_bytes(data[:8], "little") + len(data)) // 2] ^= 0x01
        f.seek(0)
        f.write(data)
    os.utime(ckpt / WEIGHTS_FILE, ns=(mtime, mtime))
    new_process()
    with pytest.raises(ChecksumError, match="model.safetensors does not match"):
        load_model(ckpt)
    assert WEIGHTS_FILE in hashed
    (tmp_path / "cache" / "verified.json").write_text("[1, 2]")  # a malformed cache is an empty one
    new_process()
    load_model(pristine["lm"])


def test_a_malformed_checksums_file_is_one_line(pristine, tmp_path):
    ckpt = tmp_path / "lm"
    shutil.copytree(pristine["lm"], ckpt)
    for text in ("{not json", "[1, 2]", '{"model.safetensors": 3}'):
        (ckpt / CHECKSUM_FILE).write_text(text)
        with pytest.raises(CheckpointError, match=f"{CHECKSUM_FILE} is unreadable"):
            load_model(ckpt)
        assert "is unreadable" in checkpoint_damage(ckpt)
    write_checksums(ckpt)
    load_model(ckpt)


def test_resume_past_a_damaged_config_takes_the_newest_intact_checkpoint(pristine, tmp_path, capsys):
    """``train --resume`` reads the run's recipe from its checkpoint: with that config.yaml damaged, from the newest
    intact checkpoint in history, the one it resumes from (not a refusal)."""
    recipe = _recipe(tmp_path, {"model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "max_seq_len": 16},
                                "data": {"path": str(pristine["root"] / "text.txt")},
                                "train": {"max_steps": 4, "checkpoint_every": 2, "keep_checkpoints": 2}})
    run = tmp_path / "run"
    assert main(["train", recipe, "--out", str(run)]) == 0
    flip(run / "checkpoint" / CONFIG_FILE)
    with pytest.warns(UserWarning) as caught:
        assert main(["train", "--resume", "--out", str(run)]) == 0
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "step-00000002" in said[0] and f"{CONFIG_FILE} does not match its checksum" in said[0]
    assert checkpoint_damage(run / "checkpoint") is None  # the run went on from step 2 to its end
