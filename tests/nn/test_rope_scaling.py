"""RoPE frequency scaling: parity with Hugging Face transformers' rope_type functions, and config errors."""

import math

import pytest
import torch

from tokenloom.errors import ConfigError
from tokenloom.nn import POSITIONS, ROPE_SCALINGS, check_rope_scaling, rope_frequencies
from tokenloom.nn.positions import RotaryPosition

# (head_dim, base, scaling): the scaling dict as tokenloom takes it (HF gets the same keys plus rope_type/theta)
CASES = [
    (64, 10000.0, {"type": "linear", "factor": 2.0}),
    (32, 500000.0, {"type": "linear", "factor": 4}),
    (64, 10000.0, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}),
    (32, 500000.0, {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256}),
    (128, 500000.0, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}),  # Llama 3.1 8B
    (64, 10000.0, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    (32, 500000.0, {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                    "beta_fast": 16, "beta_slow": 2}),
    (64, 500000.0, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                    "mscale": 1.0, "mscale_all_dim": 0.5}),
    (32, 10000.0, {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024,
                   "attention_factor": 1.25, "truncate": False}),
    (64, 10000.0, {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                   "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),  # DeepSeek-V3 style
]
IDS = [f"{s.get('type') or s.get('rope_type')}-d{d}-b{int(b)}-{i}" for i, (d, b, s) in enumerate(CASES)]


def hf_config(head_dim, base, scaling, num_heads=4):
    transformers = pytest.importorskip("transformers")
    params = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    kind = scaling.get("type") or scaling.get("rope_type")
    # a context longer than the original one, so HF's consistency checks have nothing to warn about
    original = params.get("original_max_position_embeddings", 1024)
    max_positions = int(original * params.get("factor", 1))
    return transformers.LlamaConfig(
        hidden_size=head_dim * num_heads, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_positions, rope_parameters={"rope_type": kind, "rope_theta": base, **params},
    )


@pytest.mark.parametrize(("head_dim", "base", "scaling"), CASES, ids=IDS)
def test_frequencies_match_transformers(head_dim, base, scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config(head_dim, base, scaling)
    kind = scaling.get("type") or scaling.get("rope_type")
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    inv, factor = rope_frequencies(head_dim, base, scaling, max_seq_len=config.max_position_embeddings)
    assert inv.dtype == torch.float32 and inv.shape == (head_dim // 2,)
    torch.testing.assert_close(inv, hf_inv, atol=0, rtol=1e-6)
    assert isinstance(factor, float)
    assert factor == pytest.approx(hf_factor, rel=1e-12, abs=0)
    unscaled, _ = rope_frequencies(head_dim, base)
    assert not torch.equal(inv, unscaled)  # every case really scales something


@pytest.mark.parametrize(("head_dim", "base", "scaling"), CASES, ids=IDS)
def test_cos_sin_match_llama_rotary_embedding(head_dim, base, scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = hf_config(head_dim, base, scaling)
    positions = torch.tensor([[0, 1, 2, 7, 100, 1000, 2047]])
    x = torch.zeros(1, positions.shape[1], head_dim)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(x, positions)  # (B, T, D)
    rope = POSITIONS.get("rope")(embed_dim=head_dim * 4, num_heads=4, head_dim=head_dim, max_seq_len=2048,
                                 base=base, scaling=scaling)
    cos, sin = rope.rotary(positions)  # (B, 1, T, D)
    torch.testing.assert_close(cos[:, 0], hf_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("head_dim", "base"), [(64, 10000.0), (32, 500000.0)])
def test_default_matches_transformers(head_dim, base):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = hf_config(head_dim, base, {"type": "default"})
    hf_inv, hf_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    for scaling in (None, {"type": "default"}):
        inv, factor = rope_frequencies(head_dim, base, scaling)
        torch.testing.assert_close(inv, hf_inv, atol=0, rtol=0)
        assert factor == hf_factor == 1.0


@pytest.mark.parametrize("scaling", [None, {"type": "default"}])
def test_unscaled_rope_is_unchanged(scaling):
    head_dim, max_seq_len, base = 16, 64, 10000.0
    rope = RotaryPosition(embed_dim=32, num_heads=2, head_dim=head_dim, max_seq_len=max_seq_len, base=base,
                          scaling=scaling)
    # the formula RotaryPosition used before scaling existed
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv
    angles = torch.cat((angles, angles), dim=-1)
    assert torch.equal(rope.cos, angles.cos()) and torch.equal(rope.sin, angles.sin())


def test_linear_scaling_is_position_interpolation():
    rope = RotaryPosition(embed_dim=32, num_heads=2, head_dim=16, max_seq_len=64)
    scaled = RotaryPosition(embed_dim=32, num_heads=2, head_dim=16, max_seq_len=64,
                            scaling={"type": "linear", "factor": 2.0})
    torch.testing.assert_close(scaled.cos[2 * torch.arange(32)], rope.cos[:32], atol=1e-6, rtol=0)


def test_yarn_attention_factor_scales_cos_and_sin():
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    rope = RotaryPosition(embed_dim=32, num_heads=2, head_dim=16, max_seq_len=64, scaling=scaling)
    _, factor = rope_frequencies(16, scaling=scaling)
    assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    torch.testing.assert_close(rope.cos**2 + rope.sin**2, torch.full((64, 16), factor**2))


def test_registry_names():
    assert ROPE_SCALINGS.names() == ["default", "linear", "llama3", "yarn"]


def test_valid_scalings_pass_and_are_not_modified():
    for _, _, scaling in CASES:
        before = dict(scaling)
        check_rope_scaling(scaling)
        rope_frequencies(32, scaling=scaling)
        assert scaling == before
    check_rope_scaling(None)
    check_rope_scaling({"type": "linear", "rope_type": "linear", "factor": 2})


@pytest.mark.parametrize(("scaling", "message"), [
    ({"type": "lineer", "factor": 2.0},
     "unknown rope_scaling type 'lineer' (did you mean 'linear'?); known: default, linear, llama3, yarn"),
    ({"type": "dynamic", "factor": 2.0}, "unknown rope_scaling type 'dynamic'"),
    ({"factor": 2.0}, "rope_scaling needs a 'type', one of: default, linear, llama3, yarn"),
    ({"type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     "rope_scaling: 'llama3' needs 'low_freq_factor'"),
    ({"type": "yarn"}, "rope_scaling: 'yarn' needs 'factor', 'original_max_position_embeddings'"),
    ({"type": "linear"}, "rope_scaling: 'linear' needs 'factor'"),
    ({"type": "linear", "factr": 2.0},
     "rope_scaling: 'linear' has no parameter 'factr' (did you mean 'factor'?); its parameters: factor"),
    ({"type": "linear", "factor": 2.0, "rope_theta": 10000.0}, "'linear' has no parameter 'rope_theta'"),
    ({"type": "linear", "factor": "2"}, "rope_scaling: 'linear' factor must be a number, got '2'"),
    ({"type": "linear", "factor": 0}, "rope_scaling: 'linear' factor must be positive, got 0"),
    ({"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "truncate": "no"},
     "rope_scaling: 'yarn' truncate must be true or false, got 'no'"),
    ({"type": "linear", "rope_type": "yarn", "factor": 2.0}, "rope_scaling: 'type' 'linear' and 'rope_type' 'yarn'"),
    ("linear", "rope_scaling must be a mapping"),
])
def test_errors(scaling, message):
    for call in (lambda: check_rope_scaling(scaling), lambda: rope_frequencies(16, scaling=scaling),
                 lambda: RotaryPosition(embed_dim=32, num_heads=2, head_dim=16, max_seq_len=8, scaling=scaling)):
        with pytest.raises(ConfigError) as err:
            call()
        assert message in str(err.value)
        assert "\n" not in str(err.value)
