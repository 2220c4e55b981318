"""LoRA runs (train.lora): only the adapters train; checkpoints hold the adapter and name the base (never a copy of
it); loading one gives the base with the adapter merged; a run resumes exactly (fp32 and bf16 with master weights);
QLoRA over an int8 / int4 base trains; the `tokenloom lora` commands; the one-line refusals."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from tokenloom.checkpoint import load_model, load_tokenizer, read_config, read_weights, write_checkpoint
from tokenloom.cli.main import main
from tokenloom.errors import CheckpointError, ConfigError
from tokenloom.nn.lora import LoRALinear, base_state_dict, lora_modules, lora_parameters, lora_state_dict
from tokenloom.nn.quantized import QuantizedLinear
from tokenloom.training import load_run_config, setup_run

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40)
IDS = torch.tensor([[5, 9, 3, 7, 2, 11, 4, 1]])


def recipe(tmp_path, **train):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return {
        "model": {"num_layers": 2, "num_heads": 2, "embed_dim": 32, "max_seq_len": 32, "dropout": 0.0},
        "data": {"path": str(path)},
        "train": {"max_steps": 8, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup_steps": 2,
                  "eval_every": 4, "eval_batches": 2, "checkpoint_every": 4, "log_every": 2,
                  "precision": "fp32", **train},
    }


def run(config_dict, run_dir, resume=False, overrides=()):
    trainer = setup_run(load_run_config(config_dict, list(overrides)), run_dir, resume=resume, show_progress=False)
    return trainer, trainer.fit()


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A small trained GPT (the base the LoRA runs start from)."""
    tmp = tmp_path_factory.mktemp("base")
    run(recipe(tmp, max_steps=4, eval_every=0, checkpoint_every=0), tmp / "base",
        overrides=["model.tie_embeddings=false"])
    return tmp / "base"


def lora_recipe(tmp_path, base, **lora):
    return recipe(tmp_path, init_from=str(base), lora={"rank": 4, "alpha": 8.0, **lora})


def logits(model):
    with torch.no_grad():
        return model.eval()(IDS)


def test_a_lora_run_trains_only_the_adapters_and_checkpoints_the_adapter_alone(tmp_path, base_run):
    trainer, summary = run(lora_recipe(tmp_path, base_run), tmp_path / "lora")
    model = trainer.model
    names = lora_modules(model)
    assert len(names) == 8 and all(isinstance(model.get_submodule(n), LoRALinear) for n in names)
    # only the adapters are trainable, only they are in the optimizer, and only they changed
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in lora_parameters(model)}
    trainable = sum(4 * (model.get_submodule(n).in_features + model.get_submodule(n).out_features) for n in names)
    assert summary["trainable_parameters"] == trainable == trainer.parameter_counts[0]
    assert summary["parameters"] == trainable + sum(t.numel() for t in read_weights(base_run / "checkpoint").values())
    base = read_weights(base_run / "checkpoint")
    for key, value in base_state_dict(model).items():
        assert torch.equal(value, base[key]), key  # the frozen base, bit for bit
    assert all(m.lora_B.weight.abs().sum() > 0 for m in model.modules() if isinstance(m, LoRALinear))
    # the checkpoint: the adapter and a reference to the base, no copy of it
    ckpt = tmp_path / "lora" / "checkpoint"
    files = {f.name for f in ckpt.iterdir()}
    assert {"adapter.safetensors", "adapter.json", "trainer_state.pt", "config.yaml"} <= files
    assert "model.safetensors" not in files
    meta = json.loads((ckpt / "adapter.json").read_text())
    assert meta["rank"] == 4 and meta["modules"] == names and meta["base"]["kind"] == "checkpoint"
    assert meta["base"]["sha256"] == json.loads((base_run / "checkpoint" / "checksums.json").read_text())[
        "model.safetensors"]
    # loading it (generation, evaluation, serving) gives the base with the adapter merged: plain linear layers
    loaded, _ = load_model(tmp_path / "lora")
    assert not lora_modules(loaded) and type(loaded.blocks[0].attn.qkv_proj) is nn.Linear
    torch.testing.assert_close(logits(loaded), logits(model), atol=1e-5, rtol=1e-5)
    assert (logits(loaded) - logits(load_model(base_run)[0])).abs().max() > 1e-3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_lora_run_resumes_exactly(tmp_path, base_run, precision):
    cfg = lora_recipe(tmp_path, base_run, dropout=0.1)
    cfg["train"].update(precision=precision, grad_accum_steps=2)
    full, _ = run(cfg, tmp_path / "full")
    _, first = run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=4"])
    assert first["step"] == 4
    resumed, _ = run(read_config(tmp_path / "split"), tmp_path / "split", resume=True)  # as `train --resume`
    assert resumed.step == 8 and full.last_eval == resumed.last_eval
    a, b = lora_state_dict(full.model), lora_state_dict(resumed.model)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    base = read_weights(base_run / "checkpoint")  # bf16: the frozen base comes back unrounded after training
    for key, value in base_state_dict(resumed.model).items():
        assert torch.equal(value, base[key]), key
    lines = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lines if "loss" in r] == [r["loss"] for r in again if "loss" in r]


def test_a_lora_run_without_a_base_checkpoint_writes_its_base_once(tmp_path):
    cfg = recipe(tmp_path, keep_checkpoints=2, keep_best="val_loss", lora={"rank": 2})
    trainer, _ = run(cfg, tmp_path / "r")
    assert (tmp_path / "r" / "best" / "adapter.json").is_file() and load_model(tmp_path / "r" / "best")
    assert (tmp_path / "r" / "base" / "model.safetensors").is_file()
    history = sorted((tmp_path / "r" / "history").glob("step-*"))
    assert history and not any((d / "model.safetensors").exists() for d in [tmp_path / "r" / "checkpoint", *history])
    torch.testing.assert_close(logits(load_model(tmp_path / "r")[0]), logits(trainer.model), atol=1e-5, rtol=1e-5)
    earlier, _ = load_model(history[-1])  # a history entry finds <run>/base too
    assert (logits(earlier) - logits(trainer.model)).abs().max() > 0


def test_a_changed_or_missing_base_is_a_one_line_error(tmp_path, base_run):
    base = tmp_path / "base"
    shutil.copytree(base_run / "checkpoint", base)
    run(lora_recipe(tmp_path, base), tmp_path / "lora", overrides=["train.max_steps=2", "train.eval_every=0"])
    model, config = load_model(base)
    with torch.no_grad():
        model.blocks[0].mlp.fc_in.weight.add_(1e-3)
    write_checkpoint(base, model, config, load_tokenizer(base))
    with pytest.raises(CheckpointError, match="has other weights than the adapter was trained on") as err:
        load_model(tmp_path / "lora")
    assert "\n" not in str(err.value) and "adapter.json" in str(err.value)
    base.rename(tmp_path / "moved")
    with pytest.raises(CheckpointError, match="its base checkpoint is not found"):
        load_model(tmp_path / "lora")


def test_activation_checkpointing_trains_the_same_adapters(tmp_path, base_run):
    cfg = lora_recipe(tmp_path, base_run)
    cfg["train"].update(max_steps=3, eval_every=0, checkpoint_every=0)
    plain, _ = run(cfg, tmp_path / "plain")
    saved, _ = run(cfg, tmp_path / "ckpt", overrides=["train.activation_checkpointing=true"])
    assert saved.model.config.gradient_checkpointing
    a, b = lora_state_dict(plain.model), lora_state_dict(saved.model)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_qlora_run_trains_over_a_quantised_base_and_its_loss_decreases(tmp_path, base_run, quantize):
    # (a tiny GPT's small random output layer caps its logits: the adapters on lm_head let the loss fall quickly)
    cfg = lora_recipe(tmp_path, base_run, quantize_base=quantize, targets=["*.attn.*_proj", "*.mlp.fc_*", "lm_head"])
    cfg["train"].update(max_steps=30, eval_every=0, checkpoint_every=0, log_every=1, lr=1e-2)
    trainer, summary = run(cfg, tmp_path / "q")
    adapted = lora_modules(trainer.model)
    assert len(adapted) == 9 and all(isinstance(trainer.model.get_submodule(n).base, QuantizedLinear) for n in adapted)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "q" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    meta = json.loads((tmp_path / "q" / "checkpoint" / "adapter.json").read_text())
    assert meta["quantized_base"]["bits"] == (8 if quantize == "int8" else 4) and meta["quantized_base"][
        "layers"] == adapted
    loaded, _ = load_model(tmp_path / "q")  # merged into the dequantised base: float layers
    assert not any(isinstance(m, QuantizedLinear) for m in loaded.modules())
    torch.testing.assert_close(logits(loaded), logits(trainer.model), atol=1e-4, rtol=1e-4)


def test_the_lora_commands_describe_and_merge_an_adapter(tmp_path, base_run, capsys):
    trainer, _ = run(lora_recipe(tmp_path, base_run), tmp_path / "lora", overrides=["train.max_steps=2"])
    capsys.readouterr()
    assert main(["lora", "info", str(tmp_path / "lora")]) == 0
    out = capsys.readouterr().out
    assert "rank: 4" in out and "*.attn.*_proj" in out and f"{trainer.parameter_counts[0]:,} parameters" in out
    assert "SHA-256 checked" in out
    assert main(["lora", "merge", str(tmp_path / "lora"), "--out", str(tmp_path / "merged")]) == 0
    assert not (tmp_path / "merged" / "adapter.json").exists()
    merged, config = load_model(tmp_path / "merged")
    assert config["train"]["lora"]["rank"] == 0 and config["merged_adapter"]["rank"] == 4
    torch.testing.assert_close(logits(merged), logits(load_model(tmp_path / "lora")[0]), atol=0, rtol=0)
    assert main(["lora", "merge", str(tmp_path / "lora"), "--out", str(tmp_path / "merged")]) == 2  # not empty
    assert main(["lora", "info", str(tmp_path / "merged")]) == 2
    assert "holds no LoRA adapter" in capsys.readouterr().err


def test_a_new_lora_run_may_start_from_a_lora_checkpoint(tmp_path, base_run):
    first, _ = run(lora_recipe(tmp_path, base_run), tmp_path / "a", overrides=["train.max_steps=2"])
    second, _ = run(lora_recipe(tmp_path, tmp_path / "a"), tmp_path / "b", overrides=["train.max_steps=2",
                                                                                      "train.lr=1e-12"])
    assert (tmp_path / "b" / "base" / "model.safetensors").is_file()  # the merged first adapter is its base
    torch.testing.assert_close(logits(load_model(tmp_path / "b")[0]), logits(load_model(tmp_path / "a")[0]),
                               atol=1e-5, rtol=1e-5)


def test_bad_lora_settings_are_one_line_errors(tmp_path, base_run):
    with pytest.raises(ConfigError, match="train.average_last"):
        load_run_config(lora_recipe(tmp_path, base_run), ["train.average_last=2"])
    with pytest.raises(ConfigError, match="train.lora.quantize_base=int8 needs train.lora.rank > 0"):
        load_run_config(recipe(tmp_path), ["train.lora.quantize_base=int8"])
    with pytest.raises(ConfigError) as err:
        setup_run(load_run_config(lora_recipe(tmp_path, base_run, targets=["*.attn.q_proj"])), tmp_path / "x",
                  show_progress=False)
    assert "\n" not in str(err.value) and "train.lora.targets" in str(err.value) and "blocks.0.attn.qkv_proj" in str(
        err.value)
    cfg = lora_recipe(tmp_path, base_run)
    run(cfg, tmp_path / "r", overrides=["train.stop_after_steps=4"])
    with pytest.raises(CheckpointError, match="holds a LoRA adapter"):
        run(read_config(tmp_path / "r"), tmp_path / "r", resume=True, overrides=["train.lora.rank=0"])
    whole = copy.deepcopy(cfg)
    whole["train"].pop("lora")
    run(whole, tmp_path / "w", overrides=["train.stop_after_steps=4"])
    with pytest.raises(CheckpointError, match="holds no adapter"):
        run(read_config(tmp_path / "w"), tmp_path / "w", resume=True, overrides=["train.lora.rank=4"])


def test_tokenloom_train_says_what_trains(tmp_path, base_run, capsys):
    path = tmp_path / "lora.yaml"
    cfg = lora_recipe(tmp_path, base_run)
    cfg["train"].update(max_steps=2, eval_every=0, checkpoint_every=0)
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    trainable = sum(4 * (i + o) for i, o in ((32, 96), (32, 32), (32, 128), (128, 32))) * 2
    assert f"{trainable:,} trainable" in err and (tmp_path / "run" / "checkpoint" / "adapter.json").is_file()


@pytest.mark.slow
def test_the_packaged_lora_recipe_fine_tunes_the_bundled_checkpoint(tmp_path, capsys):
    root = Path(__file__).resolve().parents[2]
    assert main(["train", "finetune-lora", "--out", str(tmp_path / "run"),
                 "--set", f"train.init_from={root / 'checkpoints/shakespeare-char'}",
                 "--set", f"data.path={root / 'data/tinyshakespeare/input.txt'}", "--set", "train.max_steps=5",
                 "--set", "train.eval_batches=2", "--set", "train.precision=fp32"]) == 0
    assert "294,912 trainable (2.67%)" in capsys.readouterr().err
    assert main(["lora", "info", str(tmp_path / "run")]) == 0
    assert "SHA-256 checked" in capsys.readouterr().out


def test_qlora_quantises_the_adapted_layers_only_and_trains_with_others_float(tmp_path, base_run):
    cfg = lora_recipe(tmp_path, base_run, quantize_base="int8", targets=["qkv_proj"])
    cfg["train"].update(max_steps=2, eval_every=0, checkpoint_every=0)
    trainer, _ = run(cfg, tmp_path / "q")
    quantized = [name for name, m in trainer.model.named_modules() if isinstance(m, QuantizedLinear)]
    assert quantized == ["blocks.0.attn.qkv_proj.base", "blocks.1.attn.qkv_proj.base"]
    torch.testing.assert_close(logits(load_model(tmp_path / "q")[0]), logits(trainer.model), atol=1e-4, rtol=1e-4)
