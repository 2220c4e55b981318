import pytest
import torch

from tokenloom import GPT, GPTConfig
from tokenloom.checkpoint import load_model, load_tokenizer, read_config, resolve_checkpoint, write_checkpoint
from tokenloom.data import create_tokenizer
from tokenloom.errors import CheckpointError
from tokenloom.models.factory import model_config_to_dict


def make(tmp_path, **kw):
    model = GPT(GPTConfig(vocab_size=30, num_layers=2, num_heads=2, embed_dim=16, max_seq_len=16, **kw)).eval()
    tok = create_tokenizer("char", "abcdefghijklmnopqrstuvwxyz .,\n")
    config = {"task": "lm", "model": model_config_to_dict("gpt", model.config)}
    return model, tok, config


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": False, "position": "rope", "norm": "rmsnorm"}])
def test_round_trip_same_logits(tmp_path, kw):
    model, tok, config = make(tmp_path, **kw)
    write_checkpoint(tmp_path / "ckpt", model, config, tok)
    loaded, cfg = load_model(tmp_path / "ckpt")
    x = torch.randint(0, 30, (2, 9))
    assert torch.equal(model(x), loaded(x))
    assert cfg["model"]["num_layers"] == 2
    assert load_tokenizer(tmp_path / "ckpt").encode("hello") == tok.encode("hello")


def test_bf16_storage_loads_as_fp32(tmp_path):
    model, tok, config = make(tmp_path)
    write_checkpoint(tmp_path / "ckpt", model, config, tok, dtype=torch.bfloat16)
    size = (tmp_path / "ckpt" / "model.safetensors").stat().st_size
    write_checkpoint(tmp_path / "ckpt32", model, config, tok)
    assert size < 0.6 * (tmp_path / "ckpt32" / "model.safetensors").stat().st_size
    loaded, _ = load_model(tmp_path / "ckpt")
    assert loaded.tok_embed.weight.dtype == torch.float32
    assert torch.equal(loaded.tok_embed.weight, model.tok_embed.weight.bfloat16().float())


def test_run_dir_resolves_to_its_checkpoint_and_old_copy(tmp_path):
    model, tok, config = make(tmp_path)
    write_checkpoint(tmp_path / "run" / "checkpoint", model, config, tok)
    assert resolve_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoint"
    (tmp_path / "run" / "checkpoint").rename(tmp_path / "run" / "checkpoint.old")  # a crash mid-swap
    assert resolve_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoint.old"


def test_bad_checkpoints(tmp_path):
    model, tok, config = make(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint directory"):
        load_model(tmp_path / "empty")
    write_checkpoint(tmp_path / "ckpt", model, config, tok)
    (tmp_path / "ckpt" / "checksums.json").unlink()  # edited by hand below: the loaders' own checks of the files
    (tmp_path / "ckpt" / "config.yaml").write_text("model: {num_layers: 3, family: gpt, vocab_size: 30, "
                                                   "num_heads: 2, embed_dim: 16, max_seq_len: 16}\n")
    with pytest.raises(CheckpointError, match="missing|does not match|shape"):
        load_model(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(CheckpointError, match="corrupt checkpoint config"):
        read_config(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    (tmp_path / "ckpt" / "config.yaml").write_text("model: {family: gpt, vocab_size: 30, num_layers: 2, "
                                                   "num_heads: 2, embed_dim: 16, max_seq_len: 16}\n")
    with pytest.raises(CheckpointError, match="missing its weights"):
        load_model(tmp_path / "ckpt")
