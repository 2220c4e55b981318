"""Weight conversion between tokenloom's :class:`~tokenloom.models.gpt.GPT` and Hugging Face
``transformers.GPT2LMHeadModel``.

GPT-2 is the tokenloom GPT with learned positions, pre-norm LayerNorm, a two-layer MLP (HF
``gelu_new`` = tokenloom ``gelu_tanh``; ``gelu``; ``relu``) and biases everywhere. Parameter names
(L = layer index)::

    tokenloom                   Hugging Face GPT-2
    tok_embed.weight            transformer.wte.weight
    position.weight.weight      transformer.wpe.weight
    blocks.L.norm1.*            transformer.h.L.ln_1.*
    blocks.L.attn.qkv_proj.*    transformer.h.L.attn.c_attn.*   (Conv1D)
    blocks.L.attn.out_proj.*    transformer.h.L.attn.c_proj.*   (Conv1D)
    blocks.L.norm2.*            transformer.h.L.ln_2.*
    blocks.L.mlp.fc_in.*        transformer.h.L.mlp.c_fc.*      (Conv1D)
    blocks.L.mlp.fc_out.*       transformer.h.L.mlp.c_proj.*    (Conv1D)
    final_norm.*                transformer.ln_f.*
    lm_head.weight              lm_head.weight                  (tied to the token embedding by default)

HF's Conv1D stores its weight as (in, out), the transpose of ``nn.Linear``'s (out, in). Both fused
q/k/v projections order their output features [q heads..., k heads..., v heads...] with each head's
D features contiguous, so ``c_attn.weight`` is exactly ``qkv_proj.weight.T``.

``transformers`` is an optional extra; it is imported inside the functions that need it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..models.gpt import GPT, GPTConfig

if TYPE_CHECKING:  # pragma: no cover
    from transformers import GPT2Config, GPT2LMHeadModel

# tokenloom mlp name -> HF activation_function (GPT-2's own is gelu_new, the tanh approximation)
_ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_ACTIVATION_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                       "gelu": "gelu", "relu": "relu"}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("Hugging Face interop needs `transformers`: "
                          "pip install 'tokenloom[parity]'") from err
    return transformers


def _mlp_hidden(config: GPTConfig) -> int:
    """The MLP hidden width exactly as :class:`GPT` computes it."""
    return int(config.mlp_ratio * config.embed_dim)


def gpt2_config_to_hf(config: GPTConfig, *, attn_implementation: str | None = None,
                      **overrides: Any) -> GPT2Config:
    """The ``transformers.GPT2Config`` of the same architecture as ``config``.

    Raises :class:`ConfigError` naming every field GPT-2 cannot express (rope/alibi/... positions,
    rmsnorm, swiglu, post-norm, grouped-query attention, no biases). ``attn_implementation``
    ("eager", "sdpa"; None = HF's default) and ``overrides`` (any ``GPT2Config`` field) pass through.
    bos/eos ids are None: a tokenloom config knows nothing of special tokens.
    """
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
    if not config.bias:
        problems.append("bias=False (GPT-2 has biases)")
    if problems:
        raise ConfigError("GPT-2 cannot express " + "; ".join(problems))
    hidden = _mlp_hidden(config)
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size, n_positions=config.max_seq_len, n_embd=config.embed_dim,
        n_layer=config.num_layers, n_head=config.num_heads,
        n_inner=None if hidden == 4 * config.embed_dim else hidden,
        activation_function=_ACTIVATION_TO_HF[config.mlp], layer_norm_epsilon=config.norm_eps,
        resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
        tie_word_embeddings=config.tie_embeddings, bos_token_id=None, eos_token_id=None)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    kwargs.update(overrides)
    return _transformers().GPT2Config(**kwargs)


def hf_config_to_gpt(hf_config: Any, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a ``transformers.GPT2Config``; ``overrides`` are GPTConfig fields.

    Raises :class:`ConfigError` for GPT-2 variants tokenloom cannot express (cross-attention,
    attention scaled by layer index or unscaled, an unknown activation).
    """
    problems = []
    if getattr(hf_config, "add_cross_attention", False):
        problems.append("add_cross_attention=True")
    if not getattr(hf_config, "scale_attn_weights", True):
        problems.append("scale_attn_weights=False")
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx=True")
    act = hf_config.activation_function
    if act not in _ACTIVATION_FROM_HF:
        known = ", ".join(map(repr, _ACTIVATION_FROM_HF))
        problems.append(f"activation_function={act!r} (tokenloom has {known})")
    if problems:
        raise ConfigError("tokenloom cannot express the GPT-2 config field(s) " + "; ".join(problems))
    drops = {"resid_pdrop": hf_config.resid_pdrop, "embd_pdrop": hf_config.embd_pdrop,
             "attn_pdrop": hf_config.attn_pdrop}
    if len(set(drops.values())) > 1:
        warnings.warn(f"tokenloom has one dropout rate; GPT-2 config has {drops}, using "
                      f"resid_pdrop={hf_config.resid_pdrop}", stacklevel=2)
    embed_dim = hf_config.n_embd
    hidden = hf_config.n_inner or 4 * embed_dim
    ratio = hidden / embed_dim
    if int(ratio * embed_dim) != hidden:  # float rounding: nudge so GPT rebuilds exactly `hidden`
        ratio = (hidden + 0.5) / embed_dim
    kwargs: dict[str, Any] = dict(
        vocab_size=hf_config.vocab_size, num_layers=hf_config.n_layer, num_heads=hf_config.n_head,
        embed_dim=embed_dim, max_seq_len=hf_config.n_positions, position="learned", norm="layernorm",
        norm_placement="pre", norm_eps=hf_config.layer_norm_epsilon, mlp=_ACTIVATION_FROM_HF[act],
        mlp_ratio=ratio, dropout=float(hf_config.resid_pdrop), bias=True,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)))
    kwargs.update(overrides)
    config = GPTConfig(**kwargs)
    assert _mlp_hidden(config) == hidden, (hidden, config.mlp_ratio)
    return config


def _name_pairs(num_layers: int) -> Iterator[tuple[str, str, bool]]:
    """(tokenloom name, HF name, transposed) for every tensor but ``lm_head.weight``."""
    yield "tok_embed.weight", "transformer.wte.weight", False
    yield "position.weight.weight", "transformer.wpe.weight", False
    for i in range(num_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b, conv in (("norm1", "ln_1", False), ("attn.qkv_proj", "attn.c_attn", True),
                           ("attn.out_proj", "attn.c_proj", True), ("norm2", "ln_2", False),
                           ("mlp.fc_in", "mlp.c_fc", True), ("mlp.fc_out", "mlp.c_proj", True)):
            yield ours + a + ".weight", theirs + b + ".weight", conv
            yield ours + a + ".bias", theirs + b + ".bias", False
    yield "final_norm.weight", "transformer.ln_f.weight", False
    yield "final_norm.bias", "transformer.ln_f.bias", False


def to_hf_gpt2(model: GPT, *, attn_implementation: str | None = None) -> GPT2LMHeadModel:
    """A ``GPT2LMHeadModel`` with exactly ``model``'s weights, dtype, device and train/eval mode."""
    transformers = _transformers()
    config = model.config
    hf = transformers.GPT2LMHeadModel(gpt2_config_to_hf(config, attn_implementation=attn_implementation))
    ref = model.tok_embed.weight
    hf.to(device=ref.device, dtype=ref.dtype)
    source = model.state_dict()
    target = {theirs: source[ours].t() if conv else source[ours]
              for ours, theirs, conv in _name_pairs(config.num_layers)}
    target["lm_head.weight"] = source["lm_head.weight"]  # the same tensor as tok_embed when tied
    hf.load_state_dict(target, strict=True)
    hf.train(model.training)
    return hf


def from_hf_gpt2(hf_model: GPT2LMHeadModel, **overrides: Any) -> GPT:
    """A tokenloom :class:`GPT` with exactly ``hf_model``'s weights, dtype, device and train/eval mode;
    ``overrides`` are GPTConfig fields that do not change the weights (e.g. ``attention="math"``)."""
    config = hf_config_to_gpt(hf_model.config, **overrides)
    source = hf_model.state_dict()
    ref = source["transformer.wte.weight"]
    model = GPT(config).to(device=ref.device, dtype=ref.dtype)
    target = {ours: source[theirs].t() if conv else source[theirs]
              for ours, theirs, conv in _name_pairs(config.num_layers)}
    target["lm_head.weight"] = source.get("lm_head.weight", ref)
    model.load_state_dict(target, strict=True)
    model.train(hf_model.training)
    return model
