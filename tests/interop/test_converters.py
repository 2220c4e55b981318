"""The converter design itself: registry, tables, defaults, ops (the family tests check parity)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenloom.errors import ConfigError
from tokenloom.interop import HF_CONVERTERS, OPS, Rule, converter_for, find_converter, hf_to_ours, ours_to_hf
from tokenloom.interop.hf import _meta_state, export_hf
from tokenloom.models.gpt import GPT, GPTConfig

CONFIGS = {
    "gpt2": GPTConfig(num_layers=2, num_heads=3, embed_dim=48, vocab_size=50, max_seq_len=16, mlp="gelu_tanh"),
    "llama": GPTConfig.from_name("llama-tiny", vocab_size=50, num_layers=2, mlp_hidden_dim=100),
}


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral"])
def test_hf_defaults_are_transformers_defaults(name: str) -> None:
    """config.json leaves out values equal to the class defaults; ours must be the same values."""
    transformers = pytest.importorskip("transformers")
    conv = HF_CONVERTERS.get(name)
    cls = transformers.AutoConfig.for_model(conv.model_types[0]).__class__
    defaults = cls().to_dict()
    for key, value in conv.hf_defaults.items():
        if key in defaults:
            expected = defaults[key]
            if key == "num_key_value_heads" and value is None:  # None means num_attention_heads
                expected = None if expected == defaults["num_attention_heads"] else expected
            if key == "head_dim" and value is None:
                expected = None if expected == defaults["hidden_size"] // defaults["num_attention_heads"] else expected
            assert value == expected, (name, key, value, expected)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_table_round_trip_is_identity(name: str) -> None:
    config = CONFIGS[name]
    conv = HF_CONVERTERS.get(name)
    torch.manual_seed(0)
    model = GPT(config)
    state = model.state_dict()
    back = hf_to_ours(conv, config, ours_to_hf(conv, config, state))
    _, needed = _meta_state("gpt", config)
    assert sorted(back) == sorted(needed)
    for key in needed:
        assert torch.equal(back[key], state[key]), key


def test_a_table_that_misses_a_tensor_is_caught() -> None:
    config = CONFIGS["gpt2"]
    conv = HF_CONVERTERS.get("gpt2")

    class Broken(type(conv)):
        def rules(self, config):
            return [r for r in super().rules(config) if "ln_f" not in r.hf[0]]

    state = ours_to_hf(conv, config, GPT(config).state_dict())
    with pytest.raises(RuntimeError, match="not covered.*final_norm"):
        hf_to_ours(Broken(), config, state)


def test_ops_are_inverse() -> None:
    t = torch.randn(10, 4)
    for op, rule in [("copy", Rule("a", ("x",))), ("transpose", Rule("a", ("x",), "transpose")),
                     ("concat", Rule("a", ("x", "y", "z"), "concat", (6, 2, 2)))]:
        parts = OPS.get(op).to_hf(t, rule)
        assert len(parts) == len(rule.hf)
        assert torch.equal(OPS.get(op).to_ours(parts, rule), t)


def test_find_converter_by_type_or_architecture() -> None:
    assert find_converter({"model_type": "gpt2"}) is HF_CONVERTERS.get("gpt2")
    assert find_converter({"model_type": "mistral"}) is HF_CONVERTERS.get("mistral")
    assert find_converter({"architectures": ["LlamaForCausalLM"]}) is HF_CONVERTERS.get("llama")
    with pytest.raises(ConfigError) as err:
        find_converter({"model_type": "bert", "architectures": ["BertForMaskedLM"]})
    message = str(err.value)
    assert "BertForMaskedLM" in message and "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message


def test_export_layout_follows_the_options() -> None:
    assert converter_for("gpt", CONFIGS["gpt2"]).architecture == "GPT2LMHeadModel"
    assert converter_for("gpt", CONFIGS["llama"]).architecture == "LlamaForCausalLM"
    assert converter_for("gpt", GPTConfig(bias=False)).architecture == "GPT2LMHeadModel"  # zero biases
    with pytest.raises(ConfigError) as err:
        converter_for("gpt", GPTConfig(position="alibi"))
    assert "GPT2LMHeadModel" in str(err.value) and "LlamaForCausalLM" in str(err.value)
    assert "position='alibi'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("base, options, named", [
    ("gpt2", dict(qk_norm=True), "qk_norm=True"), ("gpt2", dict(logit_softcap=30.0), "logit_softcap=30.0"),
    ("llama", dict(qk_norm=True), "qk_norm=True")], ids=["qk_norm", "softcap", "llama-qk_norm"])
def test_speedrun_options_are_refused_in_one_line_by_every_exporter(base, options, named, tmp_path) -> None:
    # the weights alone would convert (softcap) or lose the q/k norms: a silently wrong file either way
    config = dataclasses.replace(CONFIGS[base], **options)
    with pytest.raises(ConfigError) as err:
        converter_for("gpt", config)
    assert named in str(err.value) and "GPT2LMHeadModel" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=named.split("=")[0]):
        export_hf(GPT(config), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bias_free_gpt_exports_zero_biases_and_refuses_non_zero_ones() -> None:
    from tokenloom.errors import CheckpointError

    config = GPTConfig(num_layers=1, num_heads=2, embed_dim=16, vocab_size=20, max_seq_len=8, bias=False)
    conv = converter_for("gpt", config)
    hf = ours_to_hf(conv, config, GPT(config).state_dict())
    biases = [k for k in hf if k.endswith(".bias")]
    assert biases and all(not hf[k].any() for k in biases)
    assert hf["transformer.h.0.mlp.c_fc.bias"].shape == (64,)
    hf["transformer.h.0.mlp.c_fc.bias"][3] = 1.0
    with pytest.raises(CheckpointError, match="c_fc.bias holds non-zero values"):
        hf_to_ours(conv, config, hf)
