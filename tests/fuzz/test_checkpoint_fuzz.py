"""Property fuzzers for the checkpoint loaders (issue 23): random byte flips, overwrites, truncations, insertions
and deletions in every file of a real checkpoint (config.yaml, model.safetensors, tokenizer.json, trainer_state.pt,
checksums.json), with the checksums left as written or regenerated (as an attacker, or a careless copy, would).

What is acceptable, per loader:

* ``read_config``, ``load_model``, ``load_tokenizer``, ``Trainer.load_state`` (the resume path's state loader),
  ``newest_intact_checkpoint`` and the whole resume (``load_run_config(read_config(run))`` then ``setup_run(...,
  resume=True)``, what ``tokenloom train --resume`` does): a result or a one-line :class:`TokenloomError`
  (CheckpointError mostly), never another exception.
* A load may succeed from damaged bytes when the checksums were regenerated: a flipped byte inside a float weight is
  just another weight (with the checksums as written, every loader refuses a file that does not match
  ``checksums.json``: tests/checkpoint/test_checksums.py), a flipped letter in a
  vocabulary entry is another token, an edited config value that still describes the same shapes is a valid
  config. A model that loads has the architecture its config names and runs (its logits may be anything).
* With the checksums as written, any change to a checksummed file makes ``newest_intact_checkpoint`` refuse it
  (one-line error; no older checkpoint here).
* Never code execution: crafted pickles in ``trainer_state.pt`` (reducing to ``os.system``, ``exec``, ``eval``,
  ``open``, ``subprocess.call``, ``Path.touch``, ``__import__``; placed anywhere in a real state; saved by
  ``torch.save`` in both formats or as a bare pickle of every protocol; checksums regenerated) are refused, and so
  are Python tags in ``config.yaml``; a sentinel file and environment variable prove that none of them ran. Every
  mutated-file example checks the sentinels too.

A config edited into a huge model (a digit inserted into ``max_seq_len``) is not built here: memory budgets for
model sizes are another test's; such examples stop after ``read_config``.
"""

from __future__ import annotations

import builtins
import functools
import os
import pickle
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tokenloom.checkpoint import (  # noqa: E402
    CHECKSUM_FILE,
    CONFIG_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    checkpoint_damage,
    load_model,
    load_tokenizer,
    read_config,
    write_checksums,
)
from tokenloom.errors import TokenloomError  # noqa: E402
from tokenloom.training import load_run_config, setup_run  # noqa: E402
from tokenloom.training.setup import newest_intact_checkpoint  # noqa: E402

from .strategies import assert_one_line, note  # noqa: E402

pytestmark = pytest.mark.fuzz

FILES = [CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, STATE_FILE, CHECKSUM_FILE]
SENTINEL_FILE = Path(tempfile.gettempdir()) / f"tokenloom-fuzz-pwned-{os.getpid()}"
SENTINEL_ENV = "TOKENLOOM_FUZZ_PWNED"
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 8


class Fixture:
    """A trained tiny run: its checkpoint's pristine bytes, a trainer to load states into, a scratch run dir."""

    def __init__(self, root: Path) -> None:
        (root / "corpus.txt").write_text(TEXT)
        recipe = {"model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "max_seq_len": 16},
                  "data": {"path": str(root / "corpus.txt")},
                  "train": {"max_steps": 2, "batch_size": 2, "seq_len": 8, "warmup_steps": 1, "eval_every": 0,
                            "eval_batches": 1, "checkpoint_every": 0, "log_every": 1, "precision": "fp32"}}
        self.trainer = setup_run(load_run_config(recipe, []), root / "run", show_progress=False)
        self.trainer.fit()
        checkpoint = root / "run" / "checkpoint"
        self.pristine = {name: (checkpoint / name).read_bytes() for name in FILES}
        self.run_dir = root / "scratch"
        self.checkpoint = self.run_dir / "checkpoint"
        self.config = read_config(checkpoint)

    def reset(self) -> Path:
        """The scratch run dir holding exactly the pristine checkpoint."""
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.checkpoint.mkdir(parents=True)
        for name, data in self.pristine.items():
            (self.checkpoint / name).write_bytes(data)
        return self.checkpoint


@pytest.fixture(scope="module")
def trained():
    root = Path(tempfile.mkdtemp(prefix="tokenloom-fuzz-ckpt-"))
    torch.manual_seed(0)
    try:
        yield Fixture(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_sentinels():
    SENTINEL_FILE.unlink(missing_ok=True)
    os.environ.pop(SENTINEL_ENV, None)
    yield
    _assert_nothing_ran()


def _assert_nothing_ran() -> None:
    assert not SENTINEL_FILE.exists(), "code from the checkpoint ran (sentinel file written)"
    assert SENTINEL_ENV not in os.environ, "code from the checkpoint ran (sentinel variable set)"


def _check(fn, *args):
    """``fn(*args)``'s result, or None after checking that its error is a one-line TokenloomError."""
    try:
        return fn(*args)
    except TokenloomError as err:
        assert_one_line(err)
        return None
    except Exception as err:  # noqa: BLE001 - the property: nothing else escapes
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn))
        raise AssertionError(f"{type(err).__name__} escaped {name}: {err!r:.300}") from err


# --- mutations ---------------------------------------------------------------------------------------------

@st.composite
def mutations(draw: st.DrawFn, sizes: dict[str, int]) -> list[tuple]:
    """One to three edits of one checkpoint file: (file, op, offset, bytes/length). Offsets lean to the start of a
    file, where its structure lives (safetensors' header, the zip directory's entries, YAML keys)."""
    name = draw(st.sampled_from(FILES), label="file")
    size = sizes[name]
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "overwrite", "truncate", "insert", "delete"]))
        offset = draw(st.integers(0, min(size, 256)) | st.integers(0, size) | st.integers(max(0, size - 64), size))
        if op == "flip":
            edits.append((name, op, offset, draw(st.integers(1, 255))))
        elif op in ("overwrite", "insert"):
            edits.append((name, op, offset, draw(st.binary(min_size=1, max_size=8)
                                                  | st.sampled_from([b"\x00", b"\xff" * 8, b"9999", b"-1", b"\n",
                                                                     b": [", b"\x80\x02c", b"PK\x03\x04"]))))
        elif op == "truncate":
            edits.append((name, op, offset, None))
        else:
            edits.append((name, op, offset, draw(st.integers(1, 64))))
    return edits


def _apply(path: Path, edits: list[tuple]) -> None:
    for name, op, offset, arg in edits:
        data = bytearray((path / name).read_bytes())
        offset = min(offset, len(data))
        if op == "flip" and offset < len(data):
            data[offset] ^= arg
        elif op == "overwrite":
            data[offset:offset + len(arg)] = arg
        elif op == "truncate":
            del data[offset:]
        elif op == "insert":
            data[offset:offset] = arg
        elif op == "delete":
            del data[offset:offset + arg]
        (path / name).write_bytes(bytes(data))


def _huge(section: object) -> bool:
    """A model section asking for sizes a tiny test must not allocate (left to the memory-budget checks)."""
    return isinstance(section, dict) and any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > 4096
                                             for v in section.values())


def _sizes(trained: Fixture) -> dict[str, int]:
    return {name: len(data) for name, data in trained.pristine.items()}


@pytest.fixture(scope="module")
def sizes(trained):
    return _sizes(trained)


def _load_everything(trained: Fixture, path: Path) -> None:
    """Every loader over the checkpoint at ``path``: results or one-line errors."""
    assert isinstance(_check(checkpoint_damage, path), (str, type(None)))
    config = _check(read_config, path)
    if config is not None and not _huge(config.get("model")):
        loaded = _check(load_model, path)
        if loaded is not None:
            model, _ = loaded
            assert model.config.num_layers == len(model.blocks)
            T = min(4, model.config.max_seq_len)
            with torch.no_grad():
                assert model(torch.zeros(1, T, dtype=torch.long)).shape == (1, T, model.config.vocab_size)
        note("model: loaded" if loaded is not None else "model: refused")
    else:
        note("config: refused" if config is None else "config: a huge model section, not built")
    note("tokenizer: loaded" if _check(load_tokenizer, path) is not None else "tokenizer: refused")
    trainer = trained.trainer
    trainer.step = -1
    _check(trainer.load_state, path)
    note("trainer state: loaded" if trainer.step != -1 else "trainer state: refused")
    _assert_nothing_ran()


@given(data=st.data(), regenerate=st.booleans())
def test_damaged_checkpoints_load_or_fail_in_one_line(trained, sizes, data, regenerate):
    """Edit one file; with the checksums as written or regenerated, every loader gives a result or a one-line
    error; with the checksums as written, a changed file is never resumed from."""
    edits = data.draw(mutations(sizes), label="edits")
    note(f"edited {edits[0][0]}")
    path = trained.reset()
    _apply(path, edits)
    # checksums.json itself may change harmlessly (whitespace): only a changed checksummed file must be refused
    changed = any((path / name).read_bytes() != trained.pristine[name] for name in FILES if name != CHECKSUM_FILE)
    if regenerate:
        write_checksums(path)
    _load_everything(trained, path)
    resumed = _check(newest_intact_checkpoint, trained.run_dir)
    if changed and not regenerate:
        assert resumed is None, f"resumed from a damaged checkpoint: {edits}"


@given(data=st.data(), regenerate=st.booleans())
def test_resuming_a_damaged_run(trained, sizes, data, regenerate):
    """What ``tokenloom train --resume RUN`` does (the recipe read back from the checkpoint, then setup_run with
    resume=True: newest intact checkpoint, tokenizer, data, weights, trainer state) gives a ready trainer at the
    saved step or a one-line error."""
    edits = data.draw(mutations(sizes), label="edits")
    path = trained.reset()
    _apply(path, edits)
    if regenerate:
        write_checksums(path)
    recipe = _check(read_config, trained.run_dir)
    config = None if recipe is None else _check(load_run_config, recipe, [])
    if config is None or _huge(config.model):
        note("recipe: refused" if config is None else "recipe: a huge model section, not built")
        return
    trainer = _check(functools.partial(setup_run, resume=True, show_progress=False), config, trained.run_dir)
    note("resume: refused" if trainer is None else "resume: ready")
    if trainer is not None:
        assert trainer.step == 2
    _assert_nothing_ran()


@pytest.mark.parametrize("record", ["fp", 3, ["fp32"]])
def test_resuming_with_a_damaged_machine_record(trained, record):
    """Found by the fuzzer (config.yaml truncated inside its ``machine`` section, checksums regenerated): the
    record of the precision chosen became a string and the Trainer raised AttributeError ('str' object has no
    attribute 'get'). A record that is not a mapping now counts as no record."""
    import yaml

    path = trained.reset()
    config = yaml.safe_load(trained.pristine[CONFIG_FILE])
    config["machine"]["precision"] = record
    (path / CONFIG_FILE).write_text(yaml.safe_dump(config))
    write_checksums(path)
    trainer = setup_run(load_run_config(read_config(trained.run_dir), []), trained.run_dir, resume=True,
                        show_progress=False)
    assert trainer.step == 2


@pytest.mark.parametrize("edit", [("truncate", 19), ("model", "f"), ("model", [1, 2]), ("model", None),
                                  ("tokenizer", ["<eos>"]), ("tokenizer", "x")])
def test_found_config_damage_is_one_line(trained, edit):
    """Found by the fuzzer: config.yaml cut after ``model:\n  f`` made the model section a string, and load_model
    raised ValueError from dict('f'). A section that is not a mapping is now a one-line error (or, for the
    informational tokenizer section, ignored by load_tokenizer)."""
    import yaml

    path = trained.reset()
    if edit[0] == "truncate":
        _apply(path, [(CONFIG_FILE, "truncate", edit[1], None)])
    else:
        config = yaml.safe_load(trained.pristine[CONFIG_FILE])
        config[edit[0]] = edit[1]
        (path / CONFIG_FILE).write_text(yaml.safe_dump(config))
    write_checksums(path)
    _load_everything(trained, path)


def test_resuming_with_a_vocabulary_that_no_longer_covers_the_corpus(trained):
    """Found by the fuzzer: a byte deleted inside tokenizer.json's vocabulary (checksums regenerated) merged two
    one-character tokens, the tokenizer loaded as a word-level one without [UNK], and preparing the corpus on
    --resume raised the tokenizers library's bare Exception ('WordLevel error: Missing [UNK] token'). The library's
    errors are now a one-line TokenizerError."""
    import json

    path = trained.reset()
    spec = json.loads(trained.pristine[TOKENIZER_FILE])
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[:2]
    vocab[first + second] = vocab.pop(first)  # what deleting the quote between two entries does
    (path / TOKENIZER_FILE).write_text(json.dumps(spec))
    write_checksums(path)
    config = load_run_config(read_config(trained.run_dir), [])
    assert _check(functools.partial(setup_run, resume=True, show_progress=False), config, trained.run_dir) is None


def test_the_pristine_checkpoint_loads(trained):
    path = trained.reset()
    assert checkpoint_damage(path) is None
    model, _ = load_model(path)
    assert load_tokenizer(path).encode("Speak") and newest_intact_checkpoint(trained.run_dir) == path
    trained.trainer.load_state(path)
    assert trained.trainer.step == 2


# --- crafted pickles ---------------------------------------------------------------------------------------

class _Reduce:
    """Unpickling this calls ``fn(*args)``: what a crafted trainer_state.pt would do."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads() -> list[_Reduce]:
    """Each creates the sentinel file or sets the sentinel variable when unpickled."""
    touch = f"touch {SENTINEL_FILE}"
    code = f"import os; os.environ[{SENTINEL_ENV!r}] = '1'; open({str(SENTINEL_FILE)!r}, 'w').close()"
    return [_Reduce(os.system, touch), _Reduce(builtins.exec, code), _Reduce(builtins.eval, f"exec({code!r})"),
            _Reduce(open, str(SENTINEL_FILE), "w"), _Reduce(subprocess.call, ["touch", str(SENTINEL_FILE)]),
            _Reduce(Path.touch, Path(SENTINEL_FILE)), _Reduce(builtins.__import__, "this")]


PAYLOAD_NAMES = ["os.system", "exec", "eval", "open", "subprocess.call", "Path.touch", "__import__"]


def _place(state: object, where: list[int], payload: object) -> object:
    """``state`` with one value, found by following ``where`` (indices into the keys / items), replaced."""
    if not where or not isinstance(state, (dict, list, tuple)) or not state:
        return payload
    if isinstance(state, dict):
        key = list(state)[where[0] % len(state)]
        return {**state, key: _place(state[key], where[1:], payload)}
    i = where[0] % len(state)
    items = list(state)
    items[i] = _place(items[i], where[1:], payload)
    return type(state)(items) if isinstance(state, list) else tuple(items)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch.load's note on protocols 3-5
@given(payload=st.sampled_from(range(len(PAYLOAD_NAMES))), where=st.lists(st.integers(0, 50), max_size=4),
       how=st.sampled_from(["torch.save", "torch.save-legacy", *[f"pickle-{p}" for p in range(pickle.HIGHEST_PROTOCOL
                                                                                             + 1)]]))
@example(payload=0, where=[], how="torch.save")
@example(payload=1, where=[0], how="pickle-2")
def test_crafted_pickles_never_run(trained, payload, where, how):
    """A crafted object anywhere in a real trainer state, saved by torch.save (zip or legacy format) or as a bare
    pickle of any protocol, checksums regenerated: resuming refuses it in one line and runs nothing."""
    path = trained.reset()
    state = torch.load(path / STATE_FILE, weights_only=True)
    crafted = _place(state, where, _payloads()[payload])
    target = path / STATE_FILE
    if how == "torch.save":
        torch.save(crafted, target)
    elif how == "torch.save-legacy":
        torch.save(crafted, target, _use_new_zipfile_serialization=False)
    else:
        target.write_bytes(pickle.dumps(crafted, protocol=int(how.split("-")[1])))
    _assert_nothing_ran()  # writing ran nothing
    write_checksums(path)
    trained.trainer.step = -1
    _check(trained.trainer.load_state, path)
    assert trained.trainer.step == -1, "a crafted state was accepted"
    _load_everything(trained, path)
    _assert_nothing_ran()


@pytest.mark.parametrize("payload", range(len(PAYLOAD_NAMES) - 1), ids=PAYLOAD_NAMES[:-1])
def test_the_sentinels_see_a_payload_run(payload):
    """The control: unpickled by plain ``pickle`` (what ``torch.load(weights_only=False)`` would do), each payload
    but the harmless ``__import__`` leaves the sentinel file or variable, so their absence above means something."""
    pickle.loads(pickle.dumps(_payloads()[payload]))  # noqa: S301 - the point of the control
    assert SENTINEL_FILE.exists() or SENTINEL_ENV in os.environ
    SENTINEL_FILE.unlink(missing_ok=True)
    os.environ.pop(SENTINEL_ENV, None)


@pytest.mark.parametrize("tag", ["!!python/object/apply:os.system", "!!python/object/new:os.system",
                                 "!!python/name:os.system", "!!python/module:os"])
def test_crafted_yaml_never_runs(trained, tag):
    """config.yaml with Python tags (checksums regenerated): read with yaml.safe_load, refused in one line."""
    path = trained.reset()
    text = trained.pristine[CONFIG_FILE].decode() + f"\nextra: {tag} [\"touch {SENTINEL_FILE}\"]\n"
    (path / CONFIG_FILE).write_text(text)
    write_checksums(path)
    assert _check(read_config, path) is None
    _load_everything(trained, path)
