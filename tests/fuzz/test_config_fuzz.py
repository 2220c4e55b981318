"""Property fuzzers for the recipe loader (issue 23): any YAML value under any key of a run recipe, given as a dict,
as a ``--set key=value`` override or as YAML text, loads to a validated :class:`RunConfig` or is refused with a
one-line :class:`ConfigError`, never another exception. A config that loads survives the YAML round trip that
checkpoints put it through (``save_yaml`` then ``load_run_config``).

Validation only: no model or data is built from the fuzzed configs (memory budgets for huge model sizes, and what
training does with a seed or thread count that validation accepts, are other tests').
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import shutil
import tempfile
import types
import typing
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tokenloom.config import save_yaml  # noqa: E402
from tokenloom.errors import ConfigError  # noqa: E402
from tokenloom.models.registry import MODELS  # noqa: E402
from tokenloom.nn import ATTENTION_BACKENDS, BLOCKS, MLPS, NORMS, POSITIONS  # noqa: E402
from tokenloom.tasks import TASKS  # noqa: E402
from tokenloom.training import load_run_config  # noqa: E402
from tokenloom.training.config import RunConfig, TrainConfig  # noqa: E402
from tokenloom.training.schedules import SCHEDULES  # noqa: E402

from .strategies import assert_one_line, floats, ints, note, weird_text, yaml_values  # noqa: E402

pytestmark = pytest.mark.fuzz

# the model families each task trains (a recipe may name any family; these are the ones whose fields matter)
TASK_FAMILIES = {"lm": ["gpt", "rnn", "universal"],
                 "translation": ["seq2seq", "rnn_seq2seq", "universal_seq2seq", "semi_ar"],
                 "nat_translation": ["nat"], "image_classification": ["vit", "swin"],
                 "dpo": ["gpt"], "reward": ["gpt_reward"], "sft": ["gpt"], "grpo": ["gpt"]}


def _field_paths(cls: type, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every settable key of dataclass ``cls`` as a path, nested dataclasses (train.scheduled_sampling.k) included."""
    hints = typing.get_type_hints(cls)
    paths = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        paths.append((*prefix, f.name))
        if dataclasses.is_dataclass(hints[f.name]):
            paths += _field_paths(hints[f.name], (*prefix, f.name))
    return paths


def _keys() -> list[tuple[str, str, tuple[str, ...]]]:
    """(task, model family, key path) for every key of every section, enumerated from the dataclasses."""
    assert sorted(TASK_FAMILIES) == TASKS.names(), "a new task: add it and its model families here"
    named = sorted({f for families in TASK_FAMILIES.values() for f in families})  # (several tasks train gpt)
    assert named == MODELS.names(), "a new model family: add it under the task that trains it"
    keys = []
    for task, families in TASK_FAMILIES.items():
        top = [(f.name,) for f in dataclasses.fields(RunConfig) if f.init]
        common = top + _field_paths(TrainConfig, ("train",)) + [("tokenizer", "eos_token"), ("machine", "precision")]
        common += _field_paths(TASKS.get(task).data_config_cls, ("data",))
        for family in families:
            model = [("model", "family")] + _field_paths(MODELS.get(family)[0], ("model",))
            keys += [(task, family, path) for path in common + model]
    return keys


KEYS = _keys()


def _hint(task: str, family: str, path: tuple[str, ...]) -> object:
    """The type hint of the field at ``path`` (Any for the free-form sections)."""
    roots = {"model": MODELS.get(family)[0], "data": TASKS.get(task).data_config_cls, "train": TrainConfig}
    if len(path) < 2 or path[0] not in roots or path[1] == "family":
        return typing.Any
    cls = roots[path[0]]
    for part in path[1:-1]:
        cls = typing.get_type_hints(cls)[part]
    return typing.get_type_hints(cls)[path[-1]]


# names the registries know (parts, schedules, families, tasks): str fields take them
NAMES = sorted({*MODELS.names(), *TASKS.names(), *POSITIONS.names(), *NORMS.names(), *MLPS.names(),
                *ATTENTION_BACKENDS.names(), *BLOCKS.names(), *SCHEDULES.names(),
                "auto", "fp32", "bf16", "char", "bpe"})


def _typed(tp: object) -> st.SearchStrategy:
    """Values of the type ``tp`` names, edge cases of that type leading (nan, inf, 2^64, -0.0, odd unicode)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([_typed(a) for a in args])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (list, tuple):
        return st.lists(_typed(args[0] if args else typing.Any), max_size=4)
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-3, 300) | ints
    if tp is float:
        return st.floats(-2, 2) | floats
    if tp is str:
        return st.sampled_from(NAMES) | weird_text
    return yaml_values


@st.composite
def key_values(draw: st.DrawFn) -> tuple[tuple[str, str, tuple[str, ...]], object]:
    """A key and a value for it: of the key's type two times in three, else any YAML value."""
    key = draw(st.sampled_from(KEYS))
    value = draw(yaml_values if draw(st.integers(0, 2)) == 0 else _typed(_hint(*key)))
    return key, value


def _base(task: str, family: str) -> dict:
    """A valid recipe of ``task`` with the model ``family`` (small, defaults elsewhere)."""
    data = {"task": task, "model": {"family": family}, "train": {"max_steps": 10}}
    if task == "lm":
        data["data"] = {"path": "corpus.txt"}
    if task == "grpo":  # (a GRPO recipe must name its reward)
        data["data"] = {"rewards": [{"name": "regex", "options": {"pattern": "a+"}}]}
    return data


@pytest.mark.parametrize(("task", "families"), TASK_FAMILIES.items())
def test_the_base_recipes_are_valid(task, families):
    for family in families:
        assert isinstance(load_run_config(_base(task, family), []), RunConfig)


def _set(data: dict, path: tuple[str, ...], value: object) -> dict:
    node = data
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value
    return data


_ROUND_TRIP_DIR = Path(tempfile.mkdtemp(prefix="tokenloom-fuzz-config-"))
atexit.register(shutil.rmtree, _ROUND_TRIP_DIR, ignore_errors=True)


def _loads_or_refuses(source: dict | Path, overrides: list[str] | None = None) -> RunConfig | None:
    """load_run_config's result, or None after checking that its error is a one-line ConfigError."""
    try:
        config = load_run_config(copy.deepcopy(source) if isinstance(source, dict) else source, overrides)
    except ConfigError as err:
        assert_one_line(err)
        note("refused")
        return None
    except Exception as err:  # noqa: BLE001 - the property: nothing else escapes
        raise AssertionError(f"{type(err).__name__} escaped load_run_config: {err!r:.300}") from err
    assert isinstance(config, RunConfig)
    note("loaded")
    # what a checkpoint does with it: written as YAML, read back on resume
    path = _ROUND_TRIP_DIR / "config.yaml"
    save_yaml(config.to_dict(), path)
    again = load_run_config(path, [])
    assert repr(again.to_dict()) == repr(config.to_dict())
    return config


@given(key_value=key_values())
@example(key_value=(("lm", "gpt", ("model", "mlp_ratio")), float("inf")))  # OverflowError: int(inf)
@example(key_value=(("lm", "gpt", ("model", "mlp_ratio")), 1e308))
@example(key_value=(("lm", "gpt", ("model", "mlp_ratio")), 1e-300))  # accepted: an MLP of width 0
@example(key_value=(("lm", "gpt", ("model", "family")), ["gpt"]))  # TypeError: unhashable (registry)
@example(key_value=(("lm", "gpt", ("train", "max_steps")), -(16 ** 4000)))  # ValueError: the message's str()
@example(key_value=(("lm", "gpt", ("tokenizer",)), {"eos_token": 16 ** 4000}))
@example(key_value=(("lm", "gpt", ("tokenizer",)), {"\r": None}))  # the message quoted the key raw: two lines
@example(key_value=(("lm", "gpt", ("train",)), {"\n": None}))
@example(key_value=(("lm", "gpt", ("model", "rope_scaling")), {"type": "linear", "factor": float("nan")}))
def test_any_value_for_any_key(key_value):
    """Each key of each section (enumerated from the config dataclasses) set to a value of its type or any YAML
    value."""
    (task, family, path), value = key_value
    _loads_or_refuses(_set(_base(task, family), path, value))


@given(first=key_values(), more=st.lists(key_values(), max_size=3))
def test_several_values_at_once(first, more):
    """Combinations: interactions between fields (num_heads with embed_dim, min_lr with lr, ...); the first key
    picks the task."""
    (task, family, path), value = first
    data = _set(_base(task, family), path, value)
    for (_, _, other), v in more:
        data = _set(data, other, v)
    _loads_or_refuses(data)


override_values = st.one_of(weird_text, st.text(), yaml_values.map(lambda v: _flow_yaml(v)))


class _Dumper(yaml.SafeDumper):
    """YAML's own dumper, writing an int too long for str() in hex (as a hand-written recipe could)."""


def _represent_int(dumper: yaml.SafeDumper, value: int) -> yaml.ScalarNode:
    try:
        text = str(value)
    except ValueError:
        text = ("-" if value < 0 else "") + hex(abs(value))
    return dumper.represent_scalar("tag:yaml.org,2002:int", text)


_Dumper.add_representer(int, _represent_int)


def _flow_yaml(value: object) -> str:
    """``value`` as one line of YAML flow text."""
    text = yaml.dump(value, Dumper=_Dumper, default_flow_style=True, width=10 ** 9)
    return text.strip().removesuffix("...").strip()


@given(key=st.sampled_from(KEYS), raw=override_values | key_values().map(lambda kv: _flow_yaml(kv[1])))
@example(key=("lm", "gpt", ("train", "max_steps")), raw="0x" + "f" * 4000)
@example(key=("lm", "gpt", ("train", "max_steps")), raw="[" * 5000)  # RecursionError parsing the value
def test_any_override(key, raw):
    """``--set key=value`` for any key with any text after the ``=`` (parsed as YAML)."""
    task, family, path = key
    _loads_or_refuses(_base(task, family), [".".join(path) + "=" + raw])


@given(override=st.text(max_size=30) | st.builds(lambda a, b: f"{a}={b}", st.text(max_size=12), st.text(max_size=12)))
@example(override="=")
@example(override="..=1")
@example(override="train.=1")
@example(override="train.max_steps.x=1")
def test_any_override_text(override):
    """An override string of any shape (no ``=``, empty key parts, a section set to a scalar, ...)."""
    _loads_or_refuses(_base("lm", "gpt"), [override])


YAML_CHARS = "{}[]:,-?&*!|>'\"#%@`\n\t abcx0129.e+_~"


@given(text=st.text(max_size=200) | st.text(YAML_CHARS, max_size=80)
       | yaml_values.map(lambda v: _flow_yaml({"train": v})))
@example(text="train: {max_steps: 5}\x00")  # the reader's error was two lines (no .problem: str(err) was used)
@example(text="[" * 10000)  # RecursionError from the YAML composer
@example(text="a: &x [*x]")
@example(text="train: {max_steps: 0x" + "f" * 4000 + "}")  # an int of 4817 digits: ValueError quoting it
@example(text="train: {max_steps: !!python/object/apply:os.system [touch /tmp/tokenloom-fuzz-pwned]}")
@example(text="model: !!binary aGVsbG8=")
@example(text="? [a]\n: 1")
def test_any_yaml_text(text):
    """A recipe file holding any text."""
    path = _ROUND_TRIP_DIR / "recipe.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _loads_or_refuses(path)
    assert not Path("/tmp/tokenloom-fuzz-pwned").exists()


@given(data=st.binary(max_size=200))
@example(data=b"train: {max_steps: 5}\n\xff\xfe")  # UnicodeDecodeError from read_text
@example(data=b"\xef\xbb\xbftrain: {max_steps: 5}\n")  # a UTF-8 byte-order mark
def test_any_bytes(data):
    """A recipe file holding any bytes (not UTF-8, a byte-order mark, NUL bytes)."""
    path = _ROUND_TRIP_DIR / "recipe.yaml"
    path.write_bytes(data)
    _loads_or_refuses(path)
