"""Parity with Hugging Face GPT-2: the same weights give the same logits, both ways."""

from __future__ import annotations

import pytest
import torch

from tokenloom.errors import ConfigError
from tokenloom.interop import from_hf_gpt2, gpt2_config_to_hf, hf_config_to_gpt, to_hf_gpt2
from tokenloom.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

SMALL = dict(num_layers=2, num_heads=4, embed_dim=64, vocab_size=100, max_seq_len=32)


def _ids(batch: int = 3, length: int = 32, vocab: int = 100, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere (biases and norm weights too), so every tensor's mapping is tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_weight = name.endswith("weight") and p.ndim == 1  # LayerNorm scale: keep it near 1
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if is_norm_weight else 0.0))


@pytest.mark.parametrize("mlp", ["gelu_tanh", "gelu", "relu"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_tokenloom_to_hf_same_logits(mlp: str, attn_implementation: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, mlp=mlp)).eval()
    _randomise(model, 1)
    hf = to_hf_gpt2(model, attn_implementation=attn_implementation).eval()
    assert hf.config._attn_implementation == attn_implementation
    ids = _ids()
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_hf_to_tokenloom_same_logits() -> None:
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=32,
                                        attn_implementation="eager", bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    _randomise(hf, 2)
    model = from_hf_gpt2(hf)
    assert not model.training
    assert model.config.mlp == "gelu_tanh" and model.config.tie_embeddings
    assert model.lm_head.weight is model.tok_embed.weight
    ids = _ids(seed=1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_untied_and_custom_mlp_width() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, tie_embeddings=False, mlp_ratio=2.5)).eval()
    _randomise(model, 3)
    hf = to_hf_gpt2(model, attn_implementation="eager").eval()
    assert hf.config.n_inner == 160 and not hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    ids = _ids(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=1e-5)


def test_round_trip_preserves_every_tensor() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, mlp="gelu_tanh", norm_eps=1e-6))
    _randomise(model, 4)
    back = from_hf_gpt2(to_hf_gpt2(model))
    assert back.config == model.config
    assert back.training == model.training
    before, after = model.state_dict(), back.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name


def test_config_round_trip() -> None:
    config = GPTConfig(**SMALL, mlp="gelu_tanh", mlp_ratio=1000 / 64, dropout=0.1)
    hf_config = gpt2_config_to_hf(config)
    assert (hf_config.n_layer, hf_config.n_head, hf_config.n_embd, hf_config.n_positions) == (2, 4, 64, 32)
    assert hf_config.activation_function == "gelu_new" and hf_config.n_inner == 1000
    back = hf_config_to_gpt(hf_config)
    assert int(back.mlp_ratio * back.embed_dim) == 1000
    assert back.mlp == "gelu_tanh" and back.dropout == 0.1 and back.norm_eps == 1e-5


@pytest.mark.parametrize("overrides, field", [
    (dict(position="rope"), "position"),
    (dict(position="sinusoidal"), "position"),
    (dict(norm="rmsnorm"), "norm"),
    (dict(mlp="swiglu"), "mlp"),
    (dict(norm_placement="post"), "norm_placement"),
    (dict(num_kv_heads=2), "num_kv_heads"),
    (dict(bias=False), "bias"),
])
def test_unsupported_config_raises(overrides: dict, field: str) -> None:
    config = GPTConfig(**{**SMALL, **overrides})
    with pytest.raises(ConfigError, match=field):
        gpt2_config_to_hf(config)
    with pytest.raises(ConfigError, match=field):
        to_hf_gpt2(GPT(config))


def test_unsupported_hf_config_raises() -> None:
    hf_config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=10, n_positions=4,
                                        activation_function="silu", bos_token_id=None, eos_token_id=None)
    with pytest.raises(ConfigError, match="activation_function"):
        hf_config_to_gpt(hf_config)
    hf_config.activation_function = "gelu_new"
    hf_config.scale_attn_by_inverse_layer_idx = True
    with pytest.raises(ConfigError, match="scale_attn_by_inverse_layer_idx"):
        hf_config_to_gpt(hf_config)
