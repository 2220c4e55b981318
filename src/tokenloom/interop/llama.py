"""Llama-style models (``LlamaForCausalLM``, ``MistralForCausalLM``) <-> tokenloom
:class:`~tokenloom.models.gpt.GPT` with ``position: rope``, ``norm: rmsnorm``, ``mlp: swiglu``, ``bias: false``
and grouped-query attention.

HF keeps q, k and v as three projections; tokenloom fuses them into one ``qkv_proj`` whose output
features are [q heads, k heads, v heads], so the rule is a ``concat`` along dim 0. Both apply RoPE in the
half-split layout (``rotate_half``), so no permutation of the q/k rows is needed. RoPE scaling (``linear``,
``llama3``, ``yarn``) maps to ``rope_scaling``; ``dynamic`` and ``longrope`` are refused.

Mistral is Llama with a causal sliding window on every layer: its ``sliding_window`` W (a key is visible iff
``q - k < W``) is tokenloom's ``attention_window`` (the same convention), null is full attention. A window of at
least ``max_position_embeddings`` is kept as it is, not dropped: within the context it attends to every earlier
position either way, and past the context (transformers does not stop there, nor does a windowed tokenloom model
with RoPE) it keeps generation identical to transformers'. Export picks Llama for a model without a window and
Mistral for one with it; ``attention_global`` (global positions) has no Mistral equivalent and is refused.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..models.gpt import GPTConfig
from ..nn.mlp import swiglu_hidden_dim
from .hf import HF_CONVERTERS, HFConverter, Rule, per_layer, rule, speedrun_problems

_ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(base, tokenloom rope_scaling) from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` keys."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    base = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor={partial} is not supported (tokenloom rotates the whole head)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return base, None
    scaling = {"type": rope_type, **{k: v for k, v in params.items() if k not in _ROPE_KEYS and v is not None}}
    if rope_type in ("llama3", "yarn"):  # transformers' defaults for these two
        scaling.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    if rope_type == "yarn" and "factor" not in scaling:
        scaling["factor"] = hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return base, scaling


class LlamaConverter(HFConverter):
    family = "gpt"
    model_types = ("llama",)
    architecture = "LlamaForCausalLM"
    display = "Llama"  # the name in error messages
    windowed = False  # whether the architecture has a sliding window (``attention_window``)
    base_prefix = "model."
    hf_defaults = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                       max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       attention_bias=False, attention_dropout=0.0, mlp_bias=False, head_dim=None)

    def rules(self, config: GPTConfig) -> list[Rule]:
        q = config.num_heads * config.head_dim
        kv = (config.num_kv_heads or config.num_heads) * config.head_dim
        layer = "model.layers.{i}."
        rules = [rule("tok_embed.weight", "model.embed_tokens.weight"),
                 *per_layer(config.num_layers, [
                     rule("blocks.{i}.norm1.weight", layer + "input_layernorm.weight"),
                     rule("blocks.{i}.attn.qkv_proj.weight",
                          [layer + f"self_attn.{p}_proj.weight" for p in "qkv"], "concat", (q, kv, kv)),
                     rule("blocks.{i}.attn.out_proj.weight", layer + "self_attn.o_proj.weight"),
                     rule("blocks.{i}.norm2.weight", layer + "post_attention_layernorm.weight"),
                     rule("blocks.{i}.mlp.fc_gate.weight", layer + "mlp.gate_proj.weight"),
                     rule("blocks.{i}.mlp.fc_up.weight", layer + "mlp.up_proj.weight"),
                     rule("blocks.{i}.mlp.fc_out.weight", layer + "mlp.down_proj.weight")]),
                 rule("final_norm.weight", "model.norm.weight")]
        if not config.tie_embeddings:
            rules.append(rule("lm_head.weight", "lm_head.weight"))
        return rules

    def ignored(self, config: GPTConfig) -> list[str]:
        # the rotary inverse frequencies older checkpoints saved; lm_head when it is a copy of embed_tokens
        return [r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq"] + \
            (["lm_head.weight"] if config.tie_embeddings else [])

    def export_problems(self, config: GPTConfig) -> list[str]:
        """The settings of ``config`` this architecture cannot express."""
        wanted = dict(position="rope", norm="rmsnorm", norm_placement="pre", mlp="swiglu", bias=False)
        problems = [f"{k}={getattr(config, k)!r} ({self.display} has {v!r})" for k, v in wanted.items()
                    if getattr(config, k) != v]
        if config.attention_window is not None and not self.windowed:
            problems.append(f"attention_window={config.attention_window} ({self.display} attends to the whole "
                            "context)")
        if config.attention_global:
            problems.append(f"attention_global={config.attention_global} ({self.display} has no global positions)")
        return problems + speedrun_problems(config, self.display)

    def config_to_hf(self, config: GPTConfig) -> dict[str, Any]:
        problems = self.export_problems(config)
        if problems:
            raise ConfigError(f"{self.display} cannot express " + "; ".join(problems))
        out = dict(vocab_size=config.vocab_size, hidden_size=config.embed_dim, intermediate_size=config.mlp_hidden,
                   num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                   num_key_value_heads=config.num_kv_heads or config.num_heads, head_dim=config.head_dim,
                   hidden_act="silu", max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
                   tie_word_embeddings=config.tie_embeddings, rope_theta=config.rope_base,
                   attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None,
                   attention_dropout=config.dropout if config.attention_dropout is None else config.attention_dropout)
        if config.rope_scaling is not None:
            params = dict(config.rope_scaling)
            out["rope_scaling"] = {"rope_type": params.pop("type", params.pop("rope_type", None)), **params}
        return out

    def window_from_hf(self, hf: dict[str, Any], problems: list[str]) -> int | None:
        """The ``attention_window`` of a config.json mapping; what tokenloom cannot express goes to ``problems``.
        transformers' Llama has biases as options and no window (a ``sliding_window`` key is ignored, as there)."""
        if hf["attention_bias"]:
            problems.append("attention_bias=True")
        if hf["mlp_bias"]:
            problems.append("mlp_bias=True")
        return None

    def config_from_hf(self, hf: dict[str, Any]) -> GPTConfig:
        problems = []
        if hf["hidden_act"] != "silu":
            problems.append(f"hidden_act={hf['hidden_act']!r} (tokenloom's swiglu uses 'silu')")
        window = self.window_from_hf(hf, problems)
        heads, embed_dim = hf["num_attention_heads"], hf["hidden_size"]
        if hf["head_dim"] not in (None, embed_dim // heads):
            problems.append(f"head_dim={hf['head_dim']} (tokenloom has hidden_size / num_attention_heads = "
                            f"{embed_dim // heads})")
        try:
            base, scaling = _rope_from_hf(hf)
        except ConfigError as err:
            problems.append(str(err))
            base, scaling = 10000.0, None
        if problems:
            model_type = hf.get("model_type", self.model_types[0])
            raise ConfigError(f"tokenloom cannot express the {model_type} setting(s) " + "; ".join(problems))
        kv = hf["num_key_value_heads"] or heads
        hidden = hf["intermediate_size"]
        attn_drop = float(hf["attention_dropout"] or 0.0)
        return GPTConfig(vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
                         num_kv_heads=None if kv == heads else kv, embed_dim=embed_dim,
                         max_seq_len=hf["max_position_embeddings"], position="rope", norm="rmsnorm",
                         norm_placement="pre", norm_eps=hf["rms_norm_eps"], mlp="swiglu",
                         mlp_hidden_dim=None if hidden == swiglu_hidden_dim(4 * embed_dim) else hidden, dropout=0.0,
                         attention_dropout=attn_drop or None, attention_window=window, bias=False,
                         tie_embeddings=bool(hf["tie_word_embeddings"]), rope_base=base, rope_scaling=scaling)


class MistralConverter(LlamaConverter):
    """``MistralForCausalLM``: Llama's layout without bias options, with ``sliding_window`` on every layer.

    transformers' Mistral reads no ``use_sliding_window`` / ``max_window_layers`` (Qwen2's keys): such keys are
    ignored here as there. It ignores ``layer_types`` too, with a warning (alternating layers are Ministral's);
    ``layer_types`` naming another kind than the one every layer has are refused (the checkpoint means something
    else than what Mistral computes)."""

    model_types = ("mistral",)
    architecture = "MistralForCausalLM"
    display = "Mistral"
    windowed = True
    hf_defaults = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                       max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       attention_dropout=0.0, head_dim=None, sliding_window=4096)

    def config_to_hf(self, config: GPTConfig) -> dict[str, Any]:
        out = super().config_to_hf(config)
        del out["attention_bias"], out["mlp_bias"]  # not Mistral settings: it has no biases
        out["sliding_window"] = config.attention_window  # always written: transformers' default is 4096
        return out

    def window_from_hf(self, hf: dict[str, Any], problems: list[str]) -> int | None:
        window = hf["sliding_window"]
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            problems.append(f"sliding_window={window!r} (a window is a positive number of positions, or null)")
            window = None
        layer_types = hf.get("layer_types")
        kind = "full_attention" if window is None else "sliding_attention"
        if layer_types is not None and any(t != kind for t in layer_types):
            problems.append(f"layer_types={sorted(set(layer_types))} (every Mistral layer has {kind!r}; "
                            "alternating layers are Ministral's)")
        return window


HF_CONVERTERS.register("llama")(LlamaConverter())
HF_CONVERTERS.register("mistral")(MistralConverter())
