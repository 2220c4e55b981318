"""Parity with Hugging Face GPT-2 (``GPT2LMHeadModel``): the same weights give the same logits, both ways."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.interop.helpers import assert_one_line, assert_same_logits, gpt2_hf, ids, randomise
from tokenloom.errors import CheckpointError, ConfigError
from tokenloom.interop import HF_CONVERTERS, from_hf, to_hf
from tokenloom.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

SMALL = dict(num_layers=2, num_heads=4, embed_dim=64, vocab_size=100, max_seq_len=32)

# (num_heads, embed_dim, mlp_hidden_dim, mlp, tie_embeddings, attn_implementation)
CASES = [
    (4, 64, None, "gelu_tanh", True, "eager"),
    (4, 64, None, "gelu_tanh", True, "sdpa"),
    (3, 48, None, "gelu", False, "eager"),
    (3, 48, 100, "relu", True, "sdpa"),
    (5, 80, None, "relu", False, "eager"),
    (5, 80, 100, "gelu_tanh", False, "sdpa"),
    (5, 80, 36, "gelu", True, "sdpa"),
]
CASE_IDS = [f"h{h}-c{c}-inner{n}-{m}-{'tied' if t else 'untied'}-{a}" for h, c, n, m, t, a in CASES]
HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


def _gpt2() -> object:
    return HF_CONVERTERS.get("gpt2")


def _config(num_heads: int, embed_dim: int, mlp_hidden_dim: int | None, mlp: str, tie: bool) -> GPTConfig:
    return GPTConfig(**{**SMALL, "num_heads": num_heads, "embed_dim": embed_dim}, mlp_hidden_dim=mlp_hidden_dim,
                     mlp=mlp, tie_embeddings=tie)


@pytest.mark.parametrize(("heads", "embed", "inner", "mlp", "tie", "attn"), CASES, ids=CASE_IDS)
def test_tokenloom_to_hf_same_logits(heads, embed, inner, mlp, tie, attn) -> None:
    model = randomise(GPT(_config(heads, embed, inner, mlp, tie)).eval(), 1)
    hf = to_hf(model, attn_implementation=attn)
    assert isinstance(hf, transformers.GPT2LMHeadModel) and not hf.training
    assert hf.config._attn_implementation == attn
    assert (hf.config.n_head, hf.config.n_embd, hf.config.n_layer, hf.config.n_positions) == (heads, embed, 2, 32)
    assert hf.config.activation_function == HF_ACTIVATION[mlp]
    assert hf.config.n_inner == inner  # None means 4 * n_embd, on both sides
    assert hf.config.tie_word_embeddings == tie
    assert (hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()) == tie
    assert_same_logits(model, hf, ids(3, 32, seed=heads))


@pytest.mark.parametrize(("heads", "embed", "inner", "mlp", "tie", "attn"), CASES, ids=CASE_IDS)
def test_hf_to_tokenloom_same_logits(heads, embed, inner, mlp, tie, attn) -> None:
    hf = gpt2_hf(seed=2, n_head=heads, n_embd=embed, n_inner=inner, activation_function=HF_ACTIVATION[mlp],
                 tie_word_embeddings=tie, attn_implementation=attn)
    model = from_hf(hf)
    assert isinstance(model, GPT) and not model.training
    c = model.config
    assert (c.num_heads, c.embed_dim, c.num_layers, c.max_seq_len, c.vocab_size) == (heads, embed, 2, 32, 100)
    assert c.mlp == mlp and c.tie_embeddings == tie and c.mlp_hidden == (inner or 4 * embed)
    assert c.position == "learned" and c.norm == "layernorm" and c.bias
    assert (model.lm_head.weight is model.tok_embed.weight) == tie
    assert_same_logits(model, hf, ids(3, 32, seed=heads + 1))


def test_gelu_pytorch_tanh_reads_as_gelu_tanh() -> None:
    hf = gpt2_hf(seed=3, activation_function="gelu_pytorch_tanh")
    model = from_hf(hf)
    assert model.config.mlp == "gelu_tanh"
    assert_same_logits(model, hf, ids(2, 32))


def test_from_hf_keeps_training_mode() -> None:
    hf = gpt2_hf(seed=3).train()
    assert from_hf(hf).training
    model = randomise(GPT(GPTConfig(**SMALL)), 1).train()
    assert to_hf(model).training


@pytest.mark.parametrize("overrides", [
    dict(mlp="gelu_tanh", norm_eps=1e-6),
    dict(mlp="relu", tie_embeddings=False, mlp_hidden_dim=100),
    dict(mlp="gelu", num_heads=3, embed_dim=48, dropout=0.1, attention_dropout=0.0),
], ids=["tied", "untied-inner", "odd-heads-dropout"])
def test_round_trip_preserves_every_tensor(overrides: dict) -> None:
    model = randomise(GPT(GPTConfig(**{**SMALL, **overrides})), 4)
    back = from_hf(to_hf(model))
    assert back.config == model.config
    assert back.training == model.training
    before, after = model.state_dict(), back.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name


def test_config_round_trip() -> None:
    conv = _gpt2()
    config = GPTConfig(**SMALL, mlp="gelu_tanh", mlp_hidden_dim=1000, dropout=0.1)
    hf = conv.config_to_hf(config)
    assert (hf["n_layer"], hf["n_head"], hf["n_embd"], hf["n_positions"], hf["vocab_size"]) == (2, 4, 64, 32, 100)
    assert hf["activation_function"] == "gelu_new" and hf["n_inner"] == 1000
    assert hf["layer_norm_epsilon"] == 1e-5 and hf["resid_pdrop"] == hf["embd_pdrop"] == hf["attn_pdrop"] == 0.1
    back = conv.config_from_hf({**conv.hf_defaults, **hf})
    assert back == config
    assert back.mlp_hidden == 1000 and back.mlp == "gelu_tanh" and back.dropout == 0.1 and back.norm_eps == 1e-5
    # transformers itself accepts the mapping
    hf_config = transformers.GPT2Config(**hf)
    assert hf_config.n_inner == 1000 and hf_config.activation_function == "gelu_new"


def test_config_from_hf_defaults() -> None:
    """A config.json that leaves keys out means transformers' defaults (GPT-2 small)."""
    conv = _gpt2()
    config = conv.config_from_hf({**conv.hf_defaults, "model_type": "gpt2"})
    assert config == GPTConfig.from_name("gpt2", dropout=0.1)


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(position="rope"), "position"),
    (dict(position="sinusoidal"), "position"),
    (dict(norm="rmsnorm"), "norm"),
    (dict(mlp="swiglu"), "mlp"),
    (dict(norm_placement="post"), "norm_placement"),
    (dict(num_kv_heads=2), "num_kv_heads"),
])
def test_unsupported_config_raises(overrides: dict, field: str) -> None:
    config = GPTConfig(**{**SMALL, **overrides})
    with pytest.raises(ConfigError, match=field) as err:
        _gpt2().config_to_hf(config)
    assert_one_line(err.value, field)
    with pytest.raises(ConfigError, match=field) as err:
        to_hf(GPT(config))
    assert_one_line(err.value, field, "GPT2LMHeadModel")


def test_bias_free_model_exports_with_zero_biases() -> None:
    """GPT-2 has biases everywhere; a bias-free GPT is the same function with zero biases. It imports back
    with ``bias: true`` and those zeros, or exactly as it was with the override ``bias=False``."""
    model = randomise(GPT(GPTConfig(**SMALL, bias=False, mlp="gelu_tanh")).eval(), 6)
    hf = to_hf(model)
    biases = {k: v for k, v in hf.state_dict().items() if k.endswith(".bias") and ".attn.bias" not in k}
    assert len(biases) == 2 * 6 + 1 and all(not v.any() for v in biases.values())
    assert_same_logits(model, hf, ids(2, 32, seed=6))
    back = from_hf(hf)
    assert back.config.bias and back.config == GPTConfig(**SMALL, bias=True, mlp="gelu_tanh")
    assert_same_logits(back, model, ids(2, 32, seed=7))
    exact = from_hf(hf, bias=False)
    assert exact.config == model.config
    assert exact.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, exact.state_dict()[k]) for k, v in model.state_dict().items())


def test_bias_free_override_refuses_non_zero_biases() -> None:
    hf = gpt2_hf(seed=8)
    with pytest.raises(CheckpointError) as err:
        from_hf(hf, bias=False)
    assert_one_line(err.value, "transformer.h.0.", "non-zero")


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(activation_function="silu"), "activation_function"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(scale_attn_weights=False), "scale_attn_weights"),
    (dict(add_cross_attention=True), "add_cross_attention"),
])
def test_unsupported_hf_config_raises(overrides: dict, field: str) -> None:
    conv = _gpt2()
    hf_config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=10, n_positions=4,
                                        bos_token_id=None, eos_token_id=None, **overrides)
    with pytest.raises(ConfigError, match=field) as err:
        conv.config_from_hf({**conv.hf_defaults, **hf_config.to_dict()})
    assert_one_line(err.value, field)
    with pytest.raises(ConfigError, match=field) as err:
        from_hf(transformers.GPT2LMHeadModel(hf_config))
    assert_one_line(err.value, field)


@pytest.mark.parametrize("layout", ["headless-safetensors", "prefixed-bin"])
def test_legacy_checkpoint_layouts_import(tmp_path, layout: str) -> None:
    """Checkpoints saved from ``GPT2Model`` (no ``transformer.`` prefix, no lm_head) and older ones with the
    causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` import; the buffers are ignored."""
    hf = gpt2_hf(seed=5)
    state = {k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    if layout.startswith("headless"):
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
    prefix = "" if layout.startswith("headless") else "transformer."
    n = hf.config.n_positions
    for i in range(hf.config.n_layer):
        state[f"{prefix}h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.uint8)).view(1, 1, n, n)
        state[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    if layout.endswith("safetensors"):
        save_file(state, str(tmp_path / "model.safetensors"))
    else:
        torch.save(state, tmp_path / "pytorch_model.bin")
    assert any(k.startswith("transformer.") for k in state) == (prefix == "transformer.")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2Model"], "n_layer": 2, "n_head": 4, "n_embd": 64,
        "vocab_size": 100, "n_positions": 32}))
    model = from_hf(tmp_path)
    assert model.config.tie_embeddings and model.lm_head.weight is model.tok_embed.weight
    assert model.config.mlp == "gelu_tanh"  # the default activation_function, gelu_new
    assert_same_logits(model, hf, ids(2, 32, seed=5))
