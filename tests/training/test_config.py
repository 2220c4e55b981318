import pytest

from tokenloom.errors import ConfigError
from tokenloom.training import load_run_config

BASE = {"model": {"num_layers": 1, "num_heads": 2, "embed_dim": 8, "max_seq_len": 16},
        "data": {"path": "x.txt"}, "train": {"max_steps": 3}}


def cfg(**sections):
    data = {k: dict(v) for k, v in BASE.items()}
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return data


def test_exponent_floats_are_numbers():
    # YAML 1.1 reads 1e-4 (no dot) as a string; float fields accept it as the number it means
    c = load_run_config(cfg(train={"lr": "3e-4"}), ["train.min_lr=1e-5", "train.weight_decay=1E-1"])
    assert c.train.lr == 3e-4 and c.train.min_lr == 1e-5 and c.train.weight_decay == 0.1


def test_valid_recipe_and_overrides():
    c = load_run_config(cfg(), ["train.max_steps=7", "train.lr=0.01", "model.dropout=0.1"])
    assert c.train.max_steps == 7 and c.train.lr == 0.01 and c.model["dropout"] == 0.1
    assert c.train.min_lr == pytest.approx(0.001)


@pytest.mark.parametrize("sections, message", [
    ({"train": {"max_stpes": 3}}, "unknown key 'train.max_stpes' (did you mean 'max_steps'?)"),
    ({"model": {"num_layer": 3}}, "unknown key 'model.num_layer' (did you mean 'num_layers'?)"),
    ({"train": {"lr": "fast"}}, "train.lr: expected float, got 'fast'"),
    ({"train": {"precision": "fp8"}}, "train.precision: 'fp8' is not allowed"),
    ({"train": {"device": "gpu"}}, "train.device must be auto, cpu, cuda, cuda:N or mps, got 'gpu'"),
    ({"model": {"position": "rotary"}}, "position: unknown position 'rotary'"),
    ({"model": {"embed_dim": 10, "num_heads": 3}}, "embed_dim=10 must be divisible by num_heads=3"),
    ({"train": {"schedule": "cosin"}}, "did you mean 'cosine'"),
    ({"data": {"tokenizer": "bpe"}}, "data.vocab_size must be set"),
    ({"train": {"max_steps": 0}}, "train.max_steps must be >= 1, got 0"),
])
def test_bad_recipes_name_the_key(sections, message):
    with pytest.raises(ConfigError) as err:
        load_run_config(cfg(**sections))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_top_level_section():
    with pytest.raises(ConfigError, match="unknown key 'trian' \\(did you mean 'train'\\?\\)"):
        load_run_config({**cfg(), "trian": {}})


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_run_config(cfg(), ["train.max_steps"])


def test_missing_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_run_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML at line"):
        load_run_config(bad)
