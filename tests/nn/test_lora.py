"""LoRA adapters: the formula, zero-initialised B equal to the base, merging to the same logits, unmerged decoding
through the fast paths equal to the merged model's, target patterns and their one-line errors, the adapter-only
files, QLoRA over int8 / int4 bases, and parity with peft."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tokenloom import GPT, GenerationConfig, GPTConfig, generate
from tokenloom.checkpoint import merged_adapter_state
from tokenloom.errors import CheckpointError, ConfigError
from tokenloom.nn.block import runs_plain
from tokenloom.nn.lora import (
    AdapterSpec,
    LoRALinear,
    apply_lora,
    base_state_dict,
    full_trained,
    load_lora,
    lora_modules,
    lora_parameters,
    lora_state_dict,
    match_targets,
    merge_lora,
    parameter_counts,
    read_adapter,
    save_adapter,
)
from tokenloom.nn.quantized import QuantizationConfig, QuantizedLinear, quantize_model

LAYERS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc_in", "mlp.fc_out")


class Settings:
    def __init__(self, rank=4, alpha=8.0, dropout=0.0, targets=("*.attn.*_proj", "*.mlp.fc_*")):
        self.rank, self.alpha, self.dropout, self.targets = rank, alpha, dropout, list(targets)


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    config = dict(vocab_size=40, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=48)
    return GPT(GPTConfig(**{**config, **overrides})).eval()


def randomize(model: nn.Module, seed: int = 1) -> None:
    """Non-zero B everywhere (a trained adapter)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4], [6, 2, 8, 8, 1, 30, 12, 5]])


def test_lora_linear_is_the_formula_and_starts_equal_to_its_base():
    base = nn.Linear(12, 7)
    layer = LoRALinear(copy.deepcopy(base), rank=3, alpha=6.0)
    x = torch.randn(4, 5, 12)
    assert torch.equal(layer.lora_B.weight, torch.zeros(7, 3)) and layer.lora_A.weight.abs().sum() > 0
    torch.testing.assert_close(layer(x), base(x), atol=0, rtol=0)  # B = 0: exactly the base
    nn.init.normal_(layer.lora_B.weight)
    a, b = layer.lora_A.weight, layer.lora_B.weight
    expected = x @ base.weight.T + base.bias + (6.0 / 3) * (x @ a.T @ b.T)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert not any(p.requires_grad for p in layer.base.parameters())


def test_zero_initialised_b_gives_the_base_models_logits_on_every_path():
    base = tiny_gpt()
    model = copy.deepcopy(base)
    apply_lora(model, Settings())
    with torch.no_grad():
        assert torch.equal(model(IDS), base(IDS))  # eval forward (fused residual forms)
        model.train(), base.train()
        assert torch.equal(model(IDS), base(IDS))  # the modules
    model.eval(), base.eval()
    config = GenerationConfig(max_new_tokens=10, do_sample=False)
    assert torch.equal(generate(model, IDS, config), generate(base, IDS, config))


@pytest.mark.parametrize("overrides", [{}, {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
                                            "tie_embeddings": False, "num_kv_heads": 1}])
def test_merge_gives_the_same_logits_and_plain_linear_layers(overrides):
    model = tiny_gpt(**overrides)
    names = apply_lora(model, Settings())
    randomize(model)
    with torch.no_grad():
        before = model(IDS)
        merged = merge_lora(copy.deepcopy(model))
        after = merged(IDS)
    assert not (before - tiny_gpt(**overrides)(IDS)).abs().max() < 1e-3  # the adapters do change the model
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert not lora_modules(merged) and all(type(merged.get_submodule(n)) is nn.Linear for n in names)


def test_unmerged_generation_with_a_kv_cache_equals_the_merged_model_and_a_plain_one():
    """The eval fast paths bind each linear layer into a plain function by its type: an unmerged adapter is bound as
    base + update (never the base alone), so greedy decoding equals the merged model's and a plain GPT's holding the
    merged weights."""
    model = tiny_gpt()
    apply_lora(model, Settings())
    randomize(model, seed=3)
    merged = merge_lora(copy.deepcopy(model))
    plain = tiny_gpt()
    plain.load_state_dict(merged.state_dict())
    config = GenerationConfig(max_new_tokens=16, do_sample=False)
    out = generate(model, IDS, config)
    assert torch.equal(out, generate(merged, IDS, config)) and torch.equal(out, generate(plain, IDS, config))
    assert not torch.equal(out, generate(tiny_gpt(), IDS, config))  # (the adapters change what is generated)
    cache = model.create_cache(2, 32)
    with torch.no_grad():
        model(IDS, cache=cache)
        step = model(torch.tensor([[3], [4]]), cache=cache)  # one token through the bound step functions
        full = plain(torch.cat([IDS, torch.tensor([[3], [4]])], dim=1))[:, -1:]
    assert runs_plain(cache) is True
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_target_patterns_globs_suffixes_and_regexes():
    model = tiny_gpt()
    everything = [f"blocks.{i}.{layer}" for i in range(2) for layer in LAYERS]
    assert match_targets(model, ["*.attn.*_proj", "*.mlp.fc_*"]) == everything
    assert match_targets(model, ["out_proj"]) == ["blocks.0.attn.out_proj", "blocks.1.attn.out_proj"]
    assert match_targets(model, [r"re:blocks\.1\.mlp\..*"]) == ["blocks.1.mlp.fc_in", "blocks.1.mlp.fc_out"]
    assert match_targets(model, ["blocks.0.attn.qkv_proj"]) == ["blocks.0.attn.qkv_proj"]


def test_targets_matching_no_module_are_a_one_line_error_naming_the_setting_and_real_layers():
    model = tiny_gpt()
    with pytest.raises(ConfigError) as err:
        apply_lora(model, Settings(targets=["*.attn.*_proj", "q_prj"]))
    message = str(err.value)
    assert "\n" not in message and "train.lora.targets" in message and "'q_prj'" in message
    assert "blocks.0.attn.qkv_proj" in message  # a few real linear layer names
    assert not lora_modules(model)  # nothing was changed
    for bad in ([], ["re:("], [""]):
        with pytest.raises(ConfigError, match="train.lora.targets"):
            match_targets(model, bad)


def test_a_head_tied_to_the_embedding_is_refused_and_an_adapted_model_is_not_adapted_twice():
    model = tiny_gpt()
    with pytest.raises(ConfigError, match="lm_head shares its weight with tok_embed.weight"):
        apply_lora(model, Settings(targets=["lm_head"]))
    apply_lora(model, Settings())
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        apply_lora(model, Settings())


def test_only_the_adapters_train_and_their_count_is_rank_times_in_plus_out():
    model = tiny_gpt()
    total_before = sum(p.numel() for p in model.parameters())
    names = apply_lora(model, Settings(rank=4))
    expected = sum(4 * (model.get_submodule(n).in_features + model.get_submodule(n).out_features) for n in names)
    assert expected == 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))
    assert parameter_counts(model) == (expected, total_before + expected)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in lora_parameters(model)}
    assert full_trained(model) == []
    model.train()
    randomize(model)
    loss = model(IDS).logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_parameters(model))
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_dropout_acts_on_the_adapter_input_in_training_only():
    model = tiny_gpt()
    apply_lora(model, Settings(dropout=0.5))
    randomize(model)
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(IDS), model(IDS))
        model.train()
        assert not torch.equal(model(IDS), model(IDS))
        assert all(not m.base.training for m in model.modules() if isinstance(m, LoRALinear))


def test_adapter_files_round_trip_and_refuse_another_shape(tmp_path):
    model = tiny_gpt()
    names = apply_lora(model, Settings())
    randomize(model)
    spec = AdapterSpec(rank=4, alpha=8.0, modules=names, base={"kind": "checkpoint", "path": "x", "sha256": "0"})
    save_adapter(tmp_path, lora_state_dict(model), spec)
    read_spec, tensors = read_adapter(tmp_path)
    assert read_spec == spec and set(tensors) == {f"{n}.lora_{p}.weight" for n in names for p in "AB"}
    fresh = tiny_gpt()
    apply_lora(fresh, Settings())
    load_lora(fresh, tensors, "adapter.safetensors")
    with torch.no_grad():
        assert torch.equal(fresh(IDS), model(IDS))
    other = tiny_gpt()
    apply_lora(other, Settings(rank=2))
    with pytest.raises(CheckpointError, match="another rank"):
        load_lora(other, tensors, "adapter.safetensors")
    (tmp_path / "adapter.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="adapter.json is not an adapter description"):
        read_adapter(tmp_path)


def test_the_checkpoint_level_merge_equals_merging_the_modules():
    model = tiny_gpt(tie_embeddings=False)
    plain_state = {k: v.clone() for k, v in model.state_dict().items()}
    names = apply_lora(model, Settings(targets=["*.attn.*_proj", "*.mlp.fc_*", "lm_head"]))
    randomize(model)
    assert base_state_dict(model).keys() == plain_state.keys()
    spec = AdapterSpec(rank=4, alpha=8.0, modules=names)
    state = merged_adapter_state(spec, base_state_dict(model), lora_state_dict(model))
    merged = merge_lora(copy.deepcopy(model)).state_dict()
    assert state.keys() == merged.keys()
    for key in state:
        torch.testing.assert_close(state[key], merged[key], atol=0, rtol=0)


@pytest.mark.parametrize("bits", [8, 4])
def test_qlora_over_a_quantised_base(bits):
    """Adapters over int8 / int4 frozen layers: zero B gives the quantised model; gradients reach every adapter
    through the quantised layers; merging dequantises (float layers holding dequant(W) + update)."""
    quantized = quantize_model(tiny_gpt(), QuantizationConfig(bits=bits, group_size=32))
    model = copy.deepcopy(quantized)
    apply_lora(model, Settings())
    assert all(isinstance(m.base, QuantizedLinear) for m in model.modules() if isinstance(m, LoRALinear))
    with torch.no_grad():
        assert torch.equal(model(IDS), quantized(IDS))
    model.train()  # the quantised bases stay in eval mode (they refuse training)
    randomize(model)
    model(IDS).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_parameters(model))
    model.eval()
    with torch.no_grad():
        before = model(IDS)
        merged = merge_lora(copy.deepcopy(model))
        torch.testing.assert_close(merged(IDS), before, atol=1e-5, rtol=1e-5)
    layer = model.blocks[0].mlp.fc_in
    torch.testing.assert_close(merged.blocks[0].mlp.fc_in.weight, layer.base.dequantized() + layer.delta_weight())
    assert not any(isinstance(m, QuantizedLinear) for m in merged.modules())


def test_same_logits_as_peft_with_the_same_adapter_weights():
    """peft's LoRA injected into a copy of the GPT (its plain nn.Modules) and tokenloom's holding the same A and B
    give the same logits: the same update, the same scale alpha / r. (peft's layers are run in training mode: the
    eval fast paths dispatch linear layers by type and do not know peft's, see tokenloom.nn.lora.)"""
    peft = pytest.importorskip("peft")
    base = tiny_gpt(tie_embeddings=False)
    theirs = copy.deepcopy(base)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["qkv_proj", "out_proj", "fc_in",
                                                                                  "fc_out"])
    theirs = peft.inject_adapter_in_model(config, theirs)
    ours = copy.deepcopy(base)
    names = apply_lora(ours, Settings(rank=4, alpha=8.0, targets=["qkv_proj", "out_proj", "fc_in", "fc_out"]))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name in names:
            for part in ("lora_A", "lora_B"):
                value = torch.randn(ours.get_submodule(f"{name}.{part}").weight.shape, generator=gen) * 0.3
                theirs.get_submodule(f"{name}.{part}.default").weight.copy_(value)
                ours.get_submodule(f"{name}.{part}").weight.copy_(value)
        theirs.train(), ours.train()  # dropout 0: deterministic
        expected, got = theirs(IDS), ours(IDS)
    assert (expected - base.train()(IDS)).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # why native: the fast paths dispatch linear layers by type; peft's are unknown to them, tokenloom's declared
    config = GenerationConfig(max_new_tokens=4, do_sample=False)
    with pytest.raises(TypeError, match="not a linear layer the fast paths know"):
        generate(theirs, IDS, config)
    assert generate(ours, IDS, config).shape == (2, 12)
