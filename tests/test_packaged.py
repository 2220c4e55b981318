"""The packaged recipes (a bare name finds tokenloom/recipes/NAME.yaml; an existing file wins; an unknown name lists
the known ones) and the one-line "where is the bundled data" errors of a recipe run outside the repository."""

from pathlib import Path

import pytest
import yaml

from tokenloom.checkpoint import resolve_checkpoint
from tokenloom.cli.main import main
from tokenloom.errors import CheckpointError, ConfigError, DataError
from tokenloom.experiments.sweep import load_sweep
from tokenloom.packaged import packaged_recipe, packaged_recipes, recipe_folder, repository, resolve_recipe
from tokenloom.training import load_run_config
from tokenloom.training.config import check_bundled_paths

ROOT = Path(__file__).resolve().parent.parent


def test_the_packaged_recipes_are_the_repositorys_configs_and_all_load():
    known = packaged_recipes()
    assert list(known) == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert "shakespeare-char" in known and known["shakespeare-char"].parent == recipe_folder()
    for name, path in known.items():
        assert path.read_text() == (ROOT / "configs" / f"{name}.yaml").read_text()
        load_run_config(name)  # every packaged recipe is valid as shipped


def test_a_bare_name_finds_the_packaged_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the repository
    path = resolve_recipe("shakespeare-char")
    assert path == packaged_recipes()["shakespeare-char"]
    assert resolve_recipe("shakespeare-char.yaml") == path == packaged_recipe("shakespeare-char")
    config = load_run_config("shakespeare-char", ["train.max_steps=700"])
    assert config.train.max_steps == 700 and config.data["path"] == "data/tinyshakespeare/input.txt"


def test_an_existing_file_wins_over_the_packaged_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load(packaged_recipes()["shakespeare-char"].read_text())
    recipe["train"]["max_steps"] = 1100
    Path("shakespeare-char").write_text(yaml.safe_dump(recipe))
    assert resolve_recipe("shakespeare-char") == Path("shakespeare-char")
    assert load_run_config("shakespeare-char").train.max_steps == 1100
    Path("shakespeare-char.yaml").write_text(yaml.safe_dump(recipe))
    assert resolve_recipe("shakespeare-char.yaml") == Path("shakespeare-char.yaml")


def test_an_unknown_name_lists_the_packaged_recipes_with_the_closest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        resolve_recipe("shakespeare-chr")
    text = str(err.value)
    assert "\n" not in text and "unknown recipe 'shakespeare-chr'" in text
    assert "(did you mean 'shakespeare-char'?)" in text
    assert all(name in text for name in packaged_recipes())
    with pytest.raises(ConfigError, match=r"config file not found: nope/x.yaml; packaged recipes: digits-vit"):
        resolve_recipe("nope/x.yaml")  # a path (with a folder) is never looked up by name
    with pytest.raises(ConfigError, match=r"config file not found: configs/shakespeare-char.yaml \(the packaged "
                                          r"recipe 'shakespeare-char' is used by its name alone\)"):
        resolve_recipe("configs/shakespeare-char.yaml")  # the README's path, from outside the repository


def test_a_packaged_recipe_outside_the_repository_says_where_the_data_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as err:
        check_bundled_paths(load_run_config("shakespeare-char"))
    text = str(err.value)
    assert "\n" not in text and text.startswith("data.path: data/tinyshakespeare/input.txt not found")
    assert "tokenloom repository's data/ folder" in text
    assert repository() == ROOT  # an editable install: the hint names the checkout's own copy
    assert f"--set data.path={ROOT / 'data/tinyshakespeare/input.txt'}" in text
    check_bundled_paths(load_run_config("shakespeare-char", [f"data.path={ROOT / 'data/tinyshakespeare/input.txt'}"]))
    with pytest.raises(DataError, match=r"^data.dir: data/multi30k not found .*--set data.dir="):
        check_bundled_paths(load_run_config("multi30k-de-en"))
    with pytest.raises(CheckpointError, match=r"^train.init_from: checkpoints/x not found .*checkpoints/ folder"):
        check_bundled_paths(load_run_config("shakespeare-char", [f"data.path={ROOT / 'data/tinyshakespeare/input.txt'}",
                                                                 "train.init_from=checkpoints/x"]))
    with pytest.raises(CheckpointError, match=r"checkpoint not found: checkpoints/shakespeare-char \(.*use "):
        resolve_checkpoint("checkpoints/shakespeare-char")


def test_in_the_repository_the_bundled_paths_are_found(monkeypatch):
    monkeypatch.chdir(ROOT)
    check_bundled_paths(load_run_config("shakespeare-char"))
    check_bundled_paths(load_run_config("configs/mnist-vit.yaml"))


def test_the_cli_trains_nothing_and_prints_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "shakespeare-chr", "--out", "run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'shakespeare-char'" in err
    assert main(["train", "shakespeare-char", "--out", "run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: data.path: data/tinyshakespeare/input.txt not found")
    assert not Path("run").exists()  # nothing written


def test_recipes_lists_and_prints_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(packaged_recipes())
    assert main(["recipes", "shakespeare-char"]) == 0
    assert capsys.readouterr().out == (ROOT / "configs" / "shakespeare-char.yaml").read_text()
    assert main(["recipes", "mnist-vt"]) == 2
    assert "did you mean 'mnist-vit'" in capsys.readouterr().err


def test_a_sweep_may_name_a_packaged_recipe(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("sweep.yaml").write_text(yaml.safe_dump({"recipe": "shakespeare-char", "grid": {"train.lr": [1e-3, 2e-3]}}))
    assert load_sweep("sweep.yaml").recipe == packaged_recipes()["shakespeare-char"]
    assert main(["sweep", "sweep.yaml", "--out", "runs"]) == 2  # its data/ is not here: one line, no run started
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: data.path: data/tinyshakespeare/input.txt")
    assert not Path("runs").exists()
    Path("sweep.yaml").write_text(yaml.safe_dump({"recipe": "shakespeare-chr", "grid": {"train.lr": [1e-3]}}))
    with pytest.raises(ConfigError, match=r"recipe shakespeare-chr not found .*nor a packaged recipe \(did you mean "
                                          r"'shakespeare-char'\?\); packaged recipes: "):
        load_sweep("sweep.yaml")
