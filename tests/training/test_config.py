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


def test_every_problem_of_a_recipe_is_reported_at_once(tmp_path):
    """Three bad keys in three sections (issue 26): one error lists all three, headed with the file's name, in the
    order of the recipe's sections; each problem keeps the message it has alone."""
    recipe = tmp_path / "x.yaml"
    recipe.write_text("model: {num_layers: 1, num_heads: 2, embed_dim: 8, max_seq_len: 16, dropuot: 0.1}\n"
                      "data: {path: x.txt, tokenizer: bpe}\n"
                      "train: {max_step: 3, lr: fast}\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(recipe)
    header, *lines = str(err.value).split("\n")
    assert header == f"4 problems in {recipe}:"
    assert lines == ["  - unknown key 'model.dropuot' (did you mean 'dropout'?)",
                     "  - data.vocab_size must be set to at least 257 for a bpe tokenizer, got None",
                     "  - unknown key 'train.max_step' (did you mean 'max_steps'?)",
                     "  - train.lr: expected float, got 'fast' (str)"]
    assert [str(e) for e in err.value.errors][2].startswith("unknown key 'train.max_step' (did you mean 'max_steps'?)"
                                                           "; allowed: max_steps, batch_size")  # alone: the keys


def test_several_range_checks_of_one_section_and_nested_sections():
    with pytest.raises(ConfigError) as err:
        load_run_config(cfg(train={"lr": -1, "batch_size": 0, "scheduled_sampling": {"min_teacher": 2, "k": 0}},
                            model={"embed_dim": 10, "num_heads": 3}, tokenizer={"eos": "x"}))
    assert str(err.value).startswith("6 problems in the recipe:\n")
    for message in ("train.batch_size must be >= 1, got 0", "train.lr must be positive, got -1",
                    "train.scheduled_sampling.min_teacher must be in [0, 1], got 2", "train.scheduled_sampling.k "
                    "must be positive, got 0", "model.embed_dim=10 must be divisible by num_heads=3",
                    "unknown key 'tokenizer.eos' (did you mean 'eos_token'?)"):
        assert f"\n  - {message}" in str(err.value)


def test_a_default_a_bad_value_fell_back_to_is_not_blamed():
    """A value refused leaves its field at the default for the other checks; a check that then fails because of
    that default (here: lr's default is below this min_lr, 224 is no multiple of 5) is not reported."""
    with pytest.raises(ConfigError) as err:
        load_run_config(cfg(train={"lr": "fast", "min_lr": 0.5}))
    assert str(err.value) == "train.lr: expected float, got 'fast' (str)"
    with pytest.raises(ConfigError) as err:
        load_run_config({"task": "image_classification", "model": {"family": "vit", "image_size": 28, "patch_size": 5}})
    assert str(err.value) == "model.image_size=28 must be a multiple of patch_size=5"
    with pytest.raises(ConfigError) as err:  # a typo'd key: the check of the field it meant is not trusted either
        load_run_config(cfg(model={"embed_dim": 12, "num_head": 3}))
    assert str(err.value).startswith("unknown key 'model.num_head' (did you mean 'num_heads'?); allowed: ")
