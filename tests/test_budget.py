"""Resource budgets (tokenloom.budget, tokenloom.models.sizes): the estimates match the models as built, the limit
comes from the machine or TOKENLOOM_MEMORY_LIMIT, and what cannot fit is refused before anything is allocated."""

import time

import pytest
import torch

from tokenloom.budget import check_memory, format_bytes, memory_limit, parse_size
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.models.factory import create_model, model_config_from_dict
from tokenloom.models.sizes import model_parts, parameter_count


@pytest.mark.parametrize("section", [
    {"family": "gpt"},
    {"family": "gpt", "position": "rope", "mlp": "swiglu", "num_kv_heads": 2, "tie_embeddings": False},
    {"family": "gpt", "position": "sinusoidal", "vocab_size": 5000, "num_layers": 2, "attention": "performer"},
    {"family": "gpt", "position": "rope", "mlp": "relu2", "qk_norm": True, "logit_softcap": 15.0},
    {"family": "seq2seq", "encoder_layers": 2, "decoder_layers": 2},
    {"family": "seq2seq", "share_embeddings": False, "tie_embeddings": False, "position": "learned",
     "encoder_layers": 1, "decoder_layers": 1},
    {"family": "nat", "kind": "cmlm", "mask_id": 5, "encoder_layers": 1, "decoder_layers": 1, "attention": "linformer"},
    {"family": "vit", "num_layers": 2},
    {"family": "vit", "image_size": 28, "patch_size": 4, "in_channels": 1, "num_classes": 10, "embed_dim": 128,
     "num_layers": 6, "num_heads": 4, "mlp_ratio": 2.0, "position": "sincos2d"},
    {"family": "swin"},
], ids=lambda section: "-".join(str(v) for v in section.values()))
def test_the_estimate_is_a_close_lower_bound_of_the_model_as_built(section):
    """Within 2% below the parameters (and exact for the tables) of the model create_model builds."""
    family, config = model_config_from_dict(section)
    model = create_model(family, config, init=False)
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers() if b.numel() > 1)
    estimate = parameter_count(config)
    assert 0.98 * params <= estimate <= params
    assert sum(p.values for p in model_parts(config) if not p.parameter) <= buffers


@pytest.mark.parametrize("text, expected", [
    ("64GiB", 64 << 30), ("64 GiB", 64 << 30), ("64G", 64 << 30), ("64GB", 64 * 10 ** 9), ("512mb", 512 * 10 ** 6),
    ("2e9", 2 * 10 ** 9), ("1.5TiB", int(1.5 * (1 << 40))), ("50%", 500), ("none", None), ("off", None),
])
def test_memory_sizes_are_parsed(text, expected):
    assert parse_size(text, total=1000) == expected


@pytest.mark.parametrize("text", ["lots", "-1GB", "0", "12 parsecs", "150%", "0%"])
def test_a_bad_memory_limit_names_the_variable(text):
    with pytest.raises(ConfigError, match="TOKENLOOM_MEMORY_LIMIT"):
        parse_size(text, total=1000)


def test_the_limit_is_this_machines_or_the_variables(monkeypatch):
    monkeypatch.delenv("TOKENLOOM_MEMORY_LIMIT", raising=False)
    limit, source = memory_limit()
    assert limit is not None and limit > 1 << 20 and "TOKENLOOM_MEMORY_LIMIT" in source
    monkeypatch.setenv("TOKENLOOM_MEMORY_LIMIT", "3GiB")
    assert memory_limit() == (3 << 30, "TOKENLOOM_MEMORY_LIMIT=3GiB")
    monkeypatch.setenv("TOKENLOOM_MEMORY_LIMIT", "none")
    assert memory_limit()[0] is None
    check_memory("anything", [("a petabyte", 1 << 50)])  # no limit: nothing is refused


def test_check_memory_names_the_estimate_the_largest_parts_and_the_limit(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_MEMORY_LIMIT", "1GiB")
    check_memory("small", [("a", 1 << 20)])
    with pytest.raises(GenerationError) as err:
        check_memory("--thing 5", [("small part", 1 << 20), ("big part", 3 << 30)], error=GenerationError)
    assert str(err.value) == ("--thing 5 needs about 3 GiB of memory (big part: 3 GiB, small part: 1 MiB); this "
                              "machine has 1 GiB (TOKENLOOM_MEMORY_LIMIT=1GiB)")
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 bytes"


@pytest.mark.parametrize("section, setting", [
    ({"family": "gpt", "num_layers": 1_000_000_000}, "model.num_layers=1000000000"),
    ({"family": "gpt", "max_seq_len": 100_000_000_000}, "model.max_seq_len=100000000000"),
    ({"family": "gpt", "vocab_size": 10 ** 12}, "model.vocab_size=1000000000000"),
    ({"family": "seq2seq", "max_source_len": 10 ** 11}, "model.max_source_len=100000000000"),
    ({"family": "vit", "image_size": 1_600_000, "patch_size": 16}, "model.image_size=1600000"),
    ({"family": "swin", "window_size": 10_000}, "model.window_size=10000"),
])
def test_create_model_refuses_a_model_that_cannot_fit_at_once(monkeypatch, section, setting):
    monkeypatch.setenv("TOKENLOOM_MEMORY_LIMIT", "64GiB")
    family, config = model_config_from_dict(section)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"^{setting}: the model needs about .* this machine has 64 GiB"):
        create_model(family, config)
    assert time.perf_counter() - start < 0.5


def test_the_engine_refuses_a_cache_that_cannot_fit(monkeypatch):
    from tokenloom import GPT, GPTConfig
    from tokenloom.serving.engine import Engine

    monkeypatch.setenv("TOKENLOOM_MEMORY_LIMIT", "1GiB")
    model = GPT(GPTConfig(vocab_size=16, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=4096)).eval()
    with pytest.raises(ConfigError, match=r"^max_batch=100000 needs about 195 GiB of memory \(key/value cache of "
                                          r"100000 rows x 2 layers x 2 x 4096 positions x 32 x 4 bytes"):
        Engine(model, None, max_batch=100_000)
    Engine(model, None, max_batch=4)  # 8 MiB: fine


def test_beam_search_refuses_a_cache_that_cannot_fit(monkeypatch):
    from tokenloom import GPT, GPTConfig
    from tokenloom.generation import GenerationConfig, beam_search

    monkeypatch.setenv("TOKENLOOM_MEMORY_LIMIT", "1GiB")
    model = GPT(GPTConfig(vocab_size=16, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=512)).eval()
    config = GenerationConfig(max_new_tokens=500, do_sample=False, num_beams=200_000)
    with pytest.raises(GenerationError, match=r"^beam search with num_beams=200000 over 1 prompt\(s\) of 3 tokens "
                                              r"needs about"):
        beam_search(model, torch.tensor([[1, 2, 3]]), config)
