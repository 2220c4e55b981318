"""GPT-2 (``GPT2LMHeadModel``) <-> tokenloom :class:`~tokenloom.models.gpt.GPT`.

GPT-2 is the tokenloom GPT with learned positions, pre-norm LayerNorm, a two-layer MLP (HF ``gelu_new``
= tokenloom ``gelu_tanh``; ``gelu``; ``relu``) and biases everywhere. A GPT without biases exports with
zero biases (the same function); it imports back with ``bias: true`` and those zeros. HF's ``Conv1D`` stores its weight
as (in, out), the transpose of ``nn.Linear``'s; both fused q/k/v projections order their outputs
[q heads, k heads, v heads] with each head's features contiguous, so ``c_attn.weight`` is exactly
``qkv_proj.weight`` transposed.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import ConfigError
from ..models.gpt import GPTConfig
from .hf import HF_CONVERTERS, HFConverter, Rule, per_layer, rule, speedrun_problems

# tokenloom mlp name -> HF activation_function (GPT-2's own is gelu_new, the tanh approximation)
_ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_ACTIVATION_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}

_BLOCK = [
    rule("blocks.{i}.norm1.weight", "transformer.h.{i}.ln_1.weight"),
    rule("blocks.{i}.norm1.bias", "transformer.h.{i}.ln_1.bias"),
    rule("blocks.{i}.attn.qkv_proj.weight", "transformer.h.{i}.attn.c_attn.weight", "transpose"),
    rule("blocks.{i}.attn.qkv_proj.bias", "transformer.h.{i}.attn.c_attn.bias"),
    rule("blocks.{i}.attn.out_proj.weight", "transformer.h.{i}.attn.c_proj.weight", "transpose"),
    rule("blocks.{i}.attn.out_proj.bias", "transformer.h.{i}.attn.c_proj.bias"),
    rule("blocks.{i}.norm2.weight", "transformer.h.{i}.ln_2.weight"),
    rule("blocks.{i}.norm2.bias", "transformer.h.{i}.ln_2.bias"),
    rule("blocks.{i}.mlp.fc_in.weight", "transformer.h.{i}.mlp.c_fc.weight", "transpose"),
    rule("blocks.{i}.mlp.fc_in.bias", "transformer.h.{i}.mlp.c_fc.bias"),
    rule("blocks.{i}.mlp.fc_out.weight", "transformer.h.{i}.mlp.c_proj.weight", "transpose"),
    rule("blocks.{i}.mlp.fc_out.bias", "transformer.h.{i}.mlp.c_proj.bias"),
]


class GPT2Converter(HFConverter):
    family = "gpt"
    model_types = ("gpt2",)
    architecture = "GPT2LMHeadModel"
    base_prefix = "transformer."
    hf_defaults = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                       activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                       layer_norm_epsilon=1e-5, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                       add_cross_attention=False, tie_word_embeddings=True)

    def rules(self, config: GPTConfig) -> list[Rule]:
        block = _BLOCK
        if not config.bias:  # exported with zero biases: the same function in GPT-2's layout
            C, qkv, hidden = config.embed_dim, 3 * config.embed_dim, config.mlp_hidden
            sizes = {"norm1": C, "qkv_proj": qkv, "out_proj": C, "norm2": C, "fc_in": hidden, "fc_out": C}
            block = [r if not r.ours.endswith(".bias") else
                     Rule("", r.hf, "zeros", (sizes[r.ours.split(".")[-2]],)) for r in _BLOCK]
        final_bias = rule("final_norm.bias", "transformer.ln_f.bias") if config.bias else \
            Rule("", ("transformer.ln_f.bias",), "zeros", (config.embed_dim,))
        rules = [rule("tok_embed.weight", "transformer.wte.weight"),
                 rule("position.weight.weight", "transformer.wpe.weight"),
                 *per_layer(config.num_layers, block),
                 rule("final_norm.weight", "transformer.ln_f.weight"), final_bias]
        if not config.tie_embeddings:
            rules.append(rule("lm_head.weight", "lm_head.weight"))
        return rules

    def ignored(self, config: GPTConfig) -> list[str]:
        # the causal-mask buffers older checkpoints saved; lm_head when it is a copy of wte
        return [r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias"] + (["lm_head.weight"] if config.tie_embeddings else [])

    def config_to_hf(self, config: GPTConfig) -> dict[str, Any]:
        problems = []
        if config.position != "learned":
            problems.append(f"position={config.position!r} (GPT-2 has 'learned')")
        if config.norm != "layernorm":
            problems.append(f"norm={config.norm!r} (GPT-2 has 'layernorm')")
        if config.norm_placement != "pre":
            problems.append(f"norm_placement={config.norm_placement!r} (GPT-2 has 'pre')")
        if config.mlp not in _ACTIVATION_TO_HF:
            problems.append(f"mlp={config.mlp!r} (GPT-2 has {', '.join(map(repr, _ACTIVATION_TO_HF))})")
        if config.num_kv_heads not in (None, config.num_heads):
            problems.append(f"num_kv_heads={config.num_kv_heads} (GPT-2 has num_kv_heads == num_heads)")
        if config.attention_window is not None:
            problems.append(f"attention_window={config.attention_window} (GPT-2 attends to the whole context)")
        problems += speedrun_problems(config, "GPT-2")
        if problems:
            raise ConfigError("GPT-2 cannot express " + "; ".join(problems))
        hidden = config.mlp_hidden
        attn_drop = config.dropout if config.attention_dropout is None else config.attention_dropout
        return dict(vocab_size=config.vocab_size, n_positions=config.max_seq_len, n_embd=config.embed_dim,
                    n_layer=config.num_layers, n_head=config.num_heads,
                    n_inner=None if hidden == 4 * config.embed_dim else hidden,
                    activation_function=_ACTIVATION_TO_HF[config.mlp], layer_norm_epsilon=config.norm_eps,
                    resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=attn_drop,
                    tie_word_embeddings=config.tie_embeddings, bos_token_id=None, eos_token_id=None)

    def config_from_hf(self, hf: dict[str, Any]) -> GPTConfig:
        problems = []
        if hf["add_cross_attention"]:
            problems.append("add_cross_attention=True")
        if not hf["scale_attn_weights"]:
            problems.append("scale_attn_weights=False")
        if hf["scale_attn_by_inverse_layer_idx"]:
            problems.append("scale_attn_by_inverse_layer_idx=True")
        act = hf["activation_function"]
        if act not in _ACTIVATION_FROM_HF:
            problems.append(f"activation_function={act!r} (tokenloom has {', '.join(map(repr, _ACTIVATION_FROM_HF))})")
        if problems:
            raise ConfigError("tokenloom cannot express the GPT-2 setting(s) " + "; ".join(problems))
        if hf["resid_pdrop"] != hf["embd_pdrop"]:
            warnings.warn(f"tokenloom has one dropout rate for embeddings and residuals; GPT-2 config has "
                          f"resid_pdrop={hf['resid_pdrop']}, embd_pdrop={hf['embd_pdrop']}: using resid_pdrop",
                          stacklevel=3)
        embed_dim = hf["n_embd"]
        hidden = hf["n_inner"] or 4 * embed_dim
        return GPTConfig(vocab_size=hf["vocab_size"], num_layers=hf["n_layer"], num_heads=hf["n_head"],
                         embed_dim=embed_dim, max_seq_len=hf["n_positions"], position="learned", norm="layernorm",
                         norm_placement="pre", norm_eps=hf["layer_norm_epsilon"], mlp=_ACTIVATION_FROM_HF[act],
                         mlp_hidden_dim=None if hidden == 4 * embed_dim else hidden, dropout=float(hf["resid_pdrop"]),
                         attention_dropout=None if hf["attn_pdrop"] == hf["resid_pdrop"] else float(hf["attn_pdrop"]),
                         bias=True, tie_embeddings=bool(hf["tie_word_embeddings"]))


HF_CONVERTERS.register("gpt2")(GPT2Converter())
