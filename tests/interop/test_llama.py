"""Parity with Hugging Face Llama-style models (``LlamaForCausalLM``, ``MistralForCausalLM`` whose window covers
the context; shorter windows: test_mistral_window.py): a saved directory imports with the same logits, a tokenloom
model exports with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.interop.helpers import (
    DELETE,
    assert_one_line,
    assert_same_logits,
    edit_json,
    ids,
    llama_hf,
    randomise,
    save_hf,
)
from tokenloom.errors import ConfigError
from tokenloom.interop import HF_CONVERTERS, from_hf, to_hf
from tokenloom.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, norm_eps=1e-5)

# (heads, kv heads, hidden, intermediate, tied, rope_theta, attn_implementation)
SHAPES = [
    (4, 1, 64, 100, False, 10000.0, "eager"),  # multi-query
    (4, 2, 64, 100, True, 500000.0, "sdpa"),  # grouped, tied
    (4, 4, 64, 176, False, 500000.0, "eager"),  # multi-head; 176 = tokenloom's own swiglu width for 64
    (3, 3, 48, 100, True, 10000.0, "sdpa"),  # odd head count, head_dim 16
    (3, 1, 48, 60, False, 500000.0, "sdpa"),  # odd heads, multi-query, intermediate not a multiple of 8
    (6, 2, 48, 37, False, 10000.0, "eager"),  # head_dim 8, kv ratio 3
]
SHAPE_IDS = [f"h{h}-kv{k}-c{c}-i{i}-{'tied' if t else 'untied'}-theta{int(b)}-{a}" for h, k, c, i, t, b, a in SHAPES]

# rope_parameters as config.json holds them (transformers 5); max_position_embeddings 64, contexts of 48
ROPE = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    # betas that move the ramp at head_dim 16 (the defaults 32 / 1 and these give different logits)
    "yarn-beta": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 4.0,
                  "beta_slow": 0.5},
}


def _llama() -> object:
    return HF_CONVERTERS.get("llama")


def _hf(heads, kv, hidden, inter, tie, theta, attn, seed=1, **kw):
    return llama_hf(seed=seed, num_attention_heads=heads, num_key_value_heads=kv, hidden_size=hidden,
                    intermediate_size=inter, tie_word_embeddings=tie,
                    rope_parameters={"rope_type": "default", "rope_theta": theta}, attn_implementation=attn, **kw)


@pytest.mark.parametrize(("heads", "kv", "hidden", "inter", "tie", "theta", "attn"), SHAPES, ids=SHAPE_IDS)
def test_hf_directory_to_tokenloom_same_logits(tmp_path, heads, kv, hidden, inter, tie, theta, attn) -> None:
    hf = _hf(heads, kv, hidden, inter, tie, theta, attn)
    model = from_hf(save_hf(hf, tmp_path))
    assert isinstance(model, GPT) and not model.training
    c = model.config
    assert (c.num_heads, c.num_kv_heads, c.embed_dim, c.mlp_hidden, c.num_layers) == \
        (heads, None if kv == heads else kv, hidden, inter, 2)
    assert (c.position, c.norm, c.mlp, c.bias, c.norm_eps) == ("rope", "rmsnorm", "swiglu", False, 1e-5)
    assert c.rope_base == theta and c.rope_scaling is None and c.max_seq_len == 64
    assert c.tie_embeddings == tie and (model.lm_head.weight is model.tok_embed.weight) == tie
    assert_same_logits(model, hf, ids(2, 48, seed=heads + kv))


@pytest.mark.parametrize(("heads", "kv", "hidden", "inter", "tie", "theta", "attn"), SHAPES, ids=SHAPE_IDS)
def test_tokenloom_to_hf_same_logits(heads, kv, hidden, inter, tie, theta, attn) -> None:
    config = GPTConfig(**LLAMA, vocab_size=100, num_layers=2, num_heads=heads, num_kv_heads=kv, embed_dim=hidden,
                       mlp_hidden_dim=inter, tie_embeddings=tie, rope_base=theta, max_seq_len=64)
    model = randomise(GPT(config).eval(), 2)
    hf = to_hf(model, attn_implementation=attn)
    assert isinstance(hf, transformers.LlamaForCausalLM) and not hf.training
    assert hf.config._attn_implementation == attn
    hc = hf.config
    assert (hc.num_attention_heads, hc.num_key_value_heads, hc.hidden_size, hc.intermediate_size) == \
        (heads, kv, hidden, inter)
    assert hc.head_dim == hidden // heads and hc.rms_norm_eps == 1e-5 and hc.tie_word_embeddings == tie
    assert hc.rope_parameters["rope_theta"] == theta
    assert_same_logits(model, hf, ids(2, 48, seed=heads * kv))


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_preserves_every_tensor(tie: bool) -> None:
    config = GPTConfig.from_name("llama-tiny", vocab_size=100, num_layers=2, embed_dim=64, num_heads=4,
                                 tie_embeddings=tie, rope_base=500000.0, norm_eps=1e-6)
    model = randomise(GPT(config), 3)
    back = from_hf(to_hf(model))
    assert back.config == model.config
    before, after = model.state_dict(), back.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name


@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_scaling_both_ways(tmp_path, kind: str) -> None:
    params = ROPE[kind]
    hf = llama_hf(seed=4, rope_parameters={**params, "rope_theta": 500000.0}, attn_implementation="sdpa")
    model = from_hf(save_hf(hf, tmp_path))
    scaling = model.config.rope_scaling
    assert scaling is not None and (scaling.get("type") or scaling.get("rope_type")) == params["rope_type"]
    assert scaling["factor"] == params["factor"] and model.config.rope_base == 500000.0
    assert_same_logits(model, hf, ids(2, 48, seed=4))  # positions past the original context of 16
    back = to_hf(model)
    assert back.config.rope_parameters["rope_type"] == params["rope_type"]
    assert_same_logits(model, back, ids(2, 48, seed=5))
    assert from_hf(back).config == model.config


@pytest.mark.parametrize("old_scaling", [
    {"type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    None,
], ids=["linear-type-key", "llama3-rope_type-key", "no-scaling"])
def test_old_style_rope_keys(tmp_path, old_scaling: dict | None) -> None:
    """config.json of transformers < 5: ``rope_theta`` and ``rope_scaling`` keys, no ``rope_parameters``."""
    new = {("rope_type" if k == "type" else k): v for k, v in (old_scaling or {"rope_type": "default"}).items()}
    hf = llama_hf(seed=5, rope_parameters={**new, "rope_theta": 500000.0})
    save_hf(hf, tmp_path)
    data = edit_json(tmp_path / "config.json", rope_parameters=DELETE, rope_theta=500000.0,
                     rope_scaling=old_scaling if old_scaling is not None else DELETE)
    assert "rope_parameters" not in data
    model = from_hf(tmp_path)
    assert model.config.rope_base == 500000.0
    assert (model.config.rope_scaling is None) == (old_scaling is None)
    assert_same_logits(model, hf, ids(2, 48, seed=6))
    # transformers reads the hand-written file the same way
    reread = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert_same_logits(model, reread, ids(2, 48, seed=6))


@pytest.mark.parametrize("window", [None, 64, 4096], ids=["none", "whole-context", "longer-than-context"])
def test_mistral_without_sliding_window_imports(tmp_path, window: int | None) -> None:
    hf = llama_hf(seed=6, cls="MistralForCausalLM", sliding_window=window)
    model = from_hf(save_hf(hf, tmp_path))
    assert model.config.position == "rope" and model.config.num_kv_heads == 2
    assert model.config.attention_window == window  # kept when it covers the context: it acts past it
    assert_same_logits(model, hf, ids(2, 48, seed=7))


@pytest.mark.parametrize(("overrides", "setting"), [
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(head_dim=32), "head_dim"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "dynamic"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
])
def test_unsupported_settings_refused(overrides: dict, setting: str) -> None:
    hf = llama_hf(seed=7, num_hidden_layers=1, vocab_size=16, **overrides)
    with pytest.raises(ConfigError) as err:
        from_hf(hf)
    assert_one_line(err.value, setting)
    conv = _llama()
    with pytest.raises(ConfigError) as err:
        conv.config_from_hf({**conv.hf_defaults, **hf.config.to_dict()})
    assert_one_line(err.value, setting)


def test_unsupported_setting_in_directory_refused(tmp_path) -> None:
    save_hf(llama_hf(seed=7, num_hidden_layers=1, vocab_size=16), tmp_path)
    edit_json(tmp_path / "config.json", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ConfigError) as err:
        from_hf(tmp_path)
    assert_one_line(err.value, "dynamic")


@pytest.mark.parametrize(("overrides", "setting"), [
    (dict(position="learned"), "position"),
    (dict(norm="layernorm"), "norm"),
    (dict(mlp="gelu"), "mlp"),
    (dict(bias=True), "bias"),
    (dict(norm_placement="post"), "norm_placement"),
])
def test_unexpressible_tokenloom_config_refused(overrides: dict, setting: str) -> None:
    config = GPTConfig(**{**LLAMA, "vocab_size": 32, "num_layers": 1, "num_heads": 2, "embed_dim": 16,
                          "max_seq_len": 16, **overrides})
    with pytest.raises(ConfigError) as err:
        _llama().config_to_hf(config)
    assert_one_line(err.value, setting)


def test_config_to_hf_is_a_valid_llama_config() -> None:
    config = GPTConfig.from_name("llama-tiny", vocab_size=300, num_layers=2,
                                 rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    hf = _llama().config_to_hf(config)
    json.dumps(hf)  # config.json material
    hf_config = transformers.LlamaConfig(**hf)
    assert hf_config.rope_parameters["rope_type"] == "llama3" and hf_config.rope_parameters["factor"] == 8.0
    assert (hf_config.num_key_value_heads, hf_config.intermediate_size) == (2, config.mlp_hidden)
    back = _llama().config_from_hf({**_llama().hf_defaults, **hf_config.to_dict()})
    assert back == config


@pytest.mark.parametrize("layout", ["rotary-inv_freq-buffers", "headless-LlamaModel"])
def test_legacy_checkpoint_layouts_import(tmp_path, layout: str) -> None:
    """Older checkpoints saved each layer's ``rotary_emb.inv_freq`` buffer (ignored); checkpoints saved from
    the headless ``LlamaModel`` name tensors without ``model.`` (and, tied, have no lm_head)."""
    hf = llama_hf(seed=8, tie_word_embeddings=layout.startswith("headless"))
    save_hf(hf, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    if layout.startswith("headless"):
        assert "lm_head.weight" not in state
        state = {k.removeprefix("model."): v for k, v in state.items()}
        edit_json(tmp_path / "config.json", architectures=["LlamaModel"])
    else:
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
        state.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone() for i in range(2)})
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_same_logits(from_hf(tmp_path), hf, ids(2, 48, seed=8))
