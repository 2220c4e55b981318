"""Hub names (``gpt2``, ``org/name``) resolved through the local Hugging Face cache, never the network: ``tokenloom
import hf org/name`` and ``from_hf("org/name")`` read the cached snapshot; an absent name is a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.interop.helpers import gpt2_hf, ids, save_hf
from tokenloom.checkpoint import load_model, read_config
from tokenloom.cli.main import main
from tokenloom.errors import CheckpointError
from tokenloom.interop import from_hf, hub_cache_dir, read_hf_config, resolve_hf_model

pytest.importorskip("transformers")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root: Path, repo_id: str, model: torch.nn.Module) -> Path:
    """The hub cache layout: ``models--org--name/refs/main`` holding a commit hash, the files in
    ``snapshots/<hash>/`` (here written by ``save_pretrained``). Returns the snapshot folder."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return save_hf(model, repo / "snapshots" / COMMIT)


@pytest.fixture(scope="module")
def hf_model():
    return gpt2_hf(seed=3)


def test_import_hf_reads_a_hub_name_from_the_local_cache(tmp_path, monkeypatch, no_network, capsys, hf_model):
    snapshot = fake_cache(tmp_path / "hub", "org/name", hf_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache_dir() == tmp_path / "hub"
    assert resolve_hf_model("org/name") == snapshot
    assert main(["import", "hf", "org/name", "--out", str(tmp_path / "tl")]) == 0
    assert "imported org/name" in capsys.readouterr().out
    source = read_config(tmp_path / "tl")["source"]
    assert source["name"] == "org/name" and Path(source["path"]) == snapshot.resolve()
    model, _ = load_model(tmp_path / "tl")
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(x).logits, atol=1e-5, rtol=1e-5)


def test_hf_home_and_a_name_without_org(tmp_path, monkeypatch, no_network, hf_model):
    """HF_HOME/hub when HF_HUB_CACHE is unset; a bare name (``gpt2``) is ``models--gpt2``."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    fake_cache(tmp_path / "home" / "hub", "tinygpt", hf_model)
    assert read_hf_config("tinygpt")["model_type"] == "gpt2"
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(from_hf("tinygpt")(x), hf_model(x).logits, atol=1e-5, rtol=1e-5)


def test_a_name_not_in_the_cache_is_one_line(tmp_path, monkeypatch, no_network, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub").mkdir()
    with pytest.raises(CheckpointError) as err:
        resolve_hf_model("org/missing")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("'org/missing' is neither a directory nor in the local Hugging Face cache "
                              f"(HF_HUB_CACHE={tmp_path / 'hub'}); nothing is downloaded")
    assert "hf download org/missing" in message and "or pass a directory" in message
    assert main(["import", "hf", "gpt2", "--out", str(tmp_path / "x")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: 'gpt2' is neither a directory") and "\n" not in line
    assert not (tmp_path / "x").exists()
    # a path that cannot be a hub name stays a missing directory
    with pytest.raises(CheckpointError, match="Hugging Face model directory not found"):
        resolve_hf_model(tmp_path / "nowhere" / "deeper")


def test_a_hugging_face_directory_where_a_checkpoint_goes_says_to_import_it(tmp_path, hf_model):
    """``train.init_from`` / ``generate`` take tokenloom checkpoints: a Hugging Face directory there says how."""
    from tokenloom.checkpoint import resolve_checkpoint

    save_hf(hf_model, tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"is a Hugging Face model directory, not a tokenloom checkpoint .*: "
                                              r"convert it first with `tokenloom import hf .*hf --out DIR`"):
        resolve_checkpoint(tmp_path / "hf")
