"""Parity with Hugging Face ``MistralForCausalLM`` with a sliding window (``sliding_window`` <-> GPT's
``attention_window``): the uncached forward, cached decoding over a rolling cache, greedy generation (also past
``max_position_embeddings``), export and the settings that cannot cross. Every comparison is also made against a
full-attention model with the same weights, which must differ: a window that was ignored would fail."""

from __future__ import annotations

import json

import pytest
import torch

from tests.interop.helpers import DELETE, assert_one_line, edit_json, ids, llama_hf, logits, randomise, save_hf
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.generation import GenerationConfig, generate
from tokenloom.interop import HF_CONVERTERS, converter_for, export_hf, from_hf, to_hf
from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.nn.kv_cache import RollingKVCache

transformers = pytest.importorskip("transformers")

WINDOW = 8
LENGTH = 40  # five windows
ATOL = 1e-4
MISTRAL = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, norm_eps=1e-5, tie_embeddings=False,
               vocab_size=100, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, mlp_hidden_dim=100)


def _mistral(window: int | None = WINDOW, attn: str = "eager", seed: int = 1, **kw) -> torch.nn.Module:
    """A random eval-mode MistralForCausalLM: 2 layers, hidden 64, 4 heads (2 kv), vocab 100."""
    return llama_hf(seed=seed, cls="MistralForCausalLM", sliding_window=window, attn_implementation=attn, **kw)


def _peaked(hf: torch.nn.Module, scale: float = 4.0) -> torch.nn.Module:
    """Peaked logits: no argmax near-ties that float noise between two implementations could flip."""
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(scale)
    return hf


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Assert ``a`` == ``b`` within the parity tolerance; returns the max abs difference."""
    assert a.abs().max() > 0.5, "logits are near zero: the comparison would prove little"
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
    return float((a - b).abs().max())


def _window_matters(windowed: torch.Tensor, full: torch.Tensor, window: int = WINDOW) -> None:
    """The same weights with full attention: equal where every key is inside the window, different after."""
    torch.testing.assert_close(windowed[:, :window], full[:, :window], atol=ATOL, rtol=1e-4)
    assert (windowed[:, window:] - full[:, window:]).abs().max() > 1e-2


@pytest.mark.parametrize("length", [LENGTH, 100], ids=["dense-mask-40", "banded-100"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_import_same_logits(tmp_path, attn: str, length: int) -> None:
    """40 positions attend with the windowed (T, T) mask; 100 with the block-wise Band (>= 4 blocks of 16)."""
    hf = _mistral(attn=attn, max_position_embeddings=128)
    model = from_hf(save_hf(hf, tmp_path))
    c = model.config
    assert (c.attention_window, c.attention_global, c.max_seq_len, c.num_kv_heads) == (WINDOW, 0, 128, 2)
    x = ids(2, length, seed=3)
    ours, theirs = logits(model, x), logits(hf, x)
    _close(ours, theirs)
    _close(logits(from_hf(hf), x), theirs)  # the model object imports the same way
    _window_matters(theirs, logits(_mistral(None, attn=attn, max_position_embeddings=128), x))


def test_cached_decoding_matches_the_full_forward() -> None:
    """Prefill 10 positions, then one-token steps over a RollingKVCache of the window's slots: the logits at every
    position are transformers' uncached ones."""
    hf = _mistral()
    model = from_hf(hf)
    x = ids(1, LENGTH, seed=4)
    cache = model.create_cache(1, LENGTH)
    assert isinstance(cache, RollingKVCache) and cache.slots == WINDOW
    with torch.no_grad():
        steps = [model(x[:, :10], cache=cache)] + [model(x[:, t:t + 1], cache=cache) for t in range(10, LENGTH)]
    theirs = logits(hf, x)
    _close(torch.cat(steps, dim=1).float(), theirs)
    _window_matters(theirs, logits(_mistral(None), x))


def _hf_generate(hf: torch.nn.Module, prompt: torch.Tensor, n: int) -> torch.Tensor:
    return hf.generate(prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                       pad_token_id=0)[:, prompt.shape[1]:]


def _ours_generate(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> torch.Tensor:
    return generate(model, prompt, GenerationConfig(max_new_tokens=n, do_sample=False))[:, prompt.shape[1]:]


@pytest.mark.parametrize(("window", "context", "new"), [
    (WINDOW, 64, 30),  # 40 positions, inside the context
    (WINDOW, 24, 40),  # 50 positions, past max_position_embeddings: transformers does not stop there
    (24, 24, 40),  # a window as long as the context is kept (not mapped to full attention): the same past it
], ids=["inside-context", "past-context", "window-equals-context"])
def test_greedy_generation_matches_transformers(window: int, context: int, new: int) -> None:
    hf = _peaked(_mistral(window, attn="sdpa", seed=5, std=0.3, max_position_embeddings=context))
    model = from_hf(hf)
    assert model.config.attention_window == window and model.config.max_positions is None
    prompt = ids(1, 10, seed=6)
    theirs = _hf_generate(hf, prompt, new)
    ours = _ours_generate(model, prompt, new)
    assert ours.tolist() == theirs.tolist()
    assert len(set(ours[0].tolist())) > 4  # not one repeated token
    # no step was decided by float noise: the best logit leads the second by a margin
    full = torch.cat((prompt, theirs), dim=1)
    top2 = logits(hf, full)[:, prompt.shape[1] - 1:-1].topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-3
    # the window decides the text: with full attention (same weights) transformers generates another one
    hf_full = _peaked(_mistral(None, attn="sdpa", seed=5, std=0.3, max_position_embeddings=context))
    assert _hf_generate(hf_full, prompt, new).tolist() != theirs.tolist()
    if prompt.shape[1] + new > context:  # without its window tokenloom would stop at the context
        with pytest.raises(GenerationError, match="exceeds the model's context"):
            _ours_generate(from_hf(hf, attention_window=None), prompt, new)


def _windowed_gpt(seed: int = 2, **overrides) -> GPT:
    return randomise(GPT(GPTConfig(**{**MISTRAL, "max_seq_len": 64, "attention_window": WINDOW, **overrides})), seed)


def test_export_round_trip(tmp_path) -> None:
    model = _windowed_gpt().eval()
    out = export_hf(model, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mistral" and config["architectures"] == ["MistralForCausalLM"]
    assert config["sliding_window"] == WINDOW and "attention_bias" not in config
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert isinstance(hf, transformers.MistralForCausalLM) and hf.config.sliding_window == WINDOW
    x = ids(2, LENGTH, seed=7)
    ours = logits(model, x)
    _close(ours, logits(hf, x))
    in_memory = to_hf(model, attn_implementation="sdpa")
    assert isinstance(in_memory, transformers.MistralForCausalLM)
    _close(ours, logits(in_memory, x))
    back = from_hf(out)
    assert back.config == model.config
    _close(logits(back, x), ours)
    _window_matters(ours, logits(from_hf(out, attention_window=None), x))
    # without a window the same model still exports as Llama
    plain = GPT(GPTConfig(**{**MISTRAL, "max_seq_len": 64}))
    assert converter_for("gpt", plain.config).architecture == "LlamaForCausalLM"


def test_attention_global_is_not_exported(tmp_path) -> None:
    model = _windowed_gpt(attention_global=2)
    for export in (lambda: export_hf(model, tmp_path / "hf"), lambda: to_hf(model),
                   lambda: converter_for("gpt", model.config)):
        with pytest.raises(ConfigError) as err:
            export()
        assert_one_line(err.value, "attention_global=2", "MistralForCausalLM")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConfigError) as err:
        HF_CONVERTERS.get("mistral").config_to_hf(model.config)
    assert_one_line(err.value, "Mistral cannot express attention_global=2")


def test_a_window_is_never_exported_without_it() -> None:
    """Llama and GPT-2 have no window: a windowed model of either layout is refused, not exported as full attention."""
    llama_like = _windowed_gpt().config
    with pytest.raises(ConfigError) as err:
        HF_CONVERTERS.get("llama").config_to_hf(llama_like)
    assert_one_line(err.value, f"attention_window={WINDOW}")
    gpt2_like = GPTConfig(num_layers=1, num_heads=2, embed_dim=16, vocab_size=20, max_seq_len=16,
                          attention_window=WINDOW)
    with pytest.raises(ConfigError) as err:
        converter_for("gpt", gpt2_like)
    assert_one_line(err.value, "GPT-2 cannot express attention_window=8")


def test_sliding_window_left_out_means_transformers_default(tmp_path) -> None:
    """MistralConfig's default window is 4096: a config.json without the key has one (here longer than the context)."""
    save_hf(_mistral(), tmp_path)
    edit_json(tmp_path / "config.json", sliding_window=DELETE)
    assert transformers.MistralForCausalLM.from_pretrained(tmp_path).config.sliding_window == 4096
    assert from_hf(tmp_path).config.attention_window == 4096


@pytest.mark.parametrize(("changes", "needles"), [
    (dict(sliding_window=0), ("sliding_window=0",)),
    (dict(layer_types=["full_attention", "sliding_attention"]), ("layer_types", "full_attention")),
    (dict(sliding_window=None, layer_types=["sliding_attention"] * 2), ("layer_types", "sliding_attention")),
], ids=["zero-window", "alternating-layers", "sliding-layers-without-window"])
def test_inexpressible_mistral_settings_refused(tmp_path, changes: dict, needles: tuple[str, ...]) -> None:
    save_hf(_mistral(), tmp_path)
    edit_json(tmp_path / "config.json", **changes)
    with pytest.raises(ConfigError) as err:
        from_hf(tmp_path)
    assert_one_line(err.value, "mistral", *needles)
