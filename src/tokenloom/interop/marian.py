"""Marian (``MarianMTModel``) <-> tokenloom :class:`~tokenloom.models.seq2seq.EncoderDecoder`.

Marian is the encoder-decoder with post-norm blocks, sinusoidal positions with all sines before all
cosines (``sinusoidal_halves``), embeddings scaled by sqrt(d_model) when ``scale_embedding``, one shared
embedding matrix tied to the output projection, and a bias on the logits (``final_logits_bias``, a (1, V)
buffer -> ``lm_head.bias``). HF keeps q, k and v as three projections; tokenloom fuses self-attention's
into ``qkv_proj`` and cross-attention's k and v into ``kv_proj`` (``concat`` rules). Decoding starts from
``decoder_start_token_id`` (Marian uses the pad id), which becomes the config's ``bos_id``.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..models.seq2seq import Seq2SeqConfig
from .hf import HF_CONVERTERS, HFConverter, Rule, per_layer, rule

_ACTIVATION_FROM_HF = {"swish": "silu", "silu": "silu", "gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh",
                       "gelu_pytorch_tanh": "gelu_tanh"}
_ACTIVATION_TO_HF = {"silu": "swish", "gelu": "gelu", "relu": "relu", "gelu_tanh": "gelu_new"}


def _proj(prefix: str, names: str) -> list[str]:
    return [f"{prefix}.{n}_proj" for n in names]


class MarianConverter(HFConverter):
    family = "seq2seq"
    model_types = ("marian",)
    architecture = "MarianMTModel"
    base_prefix = "model."
    hf_defaults = dict(vocab_size=58101, decoder_vocab_size=None, max_position_embeddings=1024, encoder_layers=12,
                       encoder_ffn_dim=4096, encoder_attention_heads=16, decoder_layers=12, decoder_ffn_dim=4096,
                       decoder_attention_heads=16, activation_function="gelu", d_model=1024, dropout=0.1,
                       attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=58100,
                       scale_embedding=False, pad_token_id=58100, eos_token_id=0,
                       share_encoder_decoder_embeddings=True, tie_word_embeddings=True)

    def rules(self, config: Seq2SeqConfig) -> list[Rule]:
        C = config.embed_dim
        enc, dec = "model.encoder.layers.{i}", "model.decoder.layers.{i}"
        rules = [rule("tgt_embed.weight", "model.shared.weight")]
        for side, prefix, n in (("encoder", enc, config.encoder_layers), ("decoder", dec, config.decoder_layers)):
            ours = side + ".{i}"
            layer = []
            for p in ("weight", "bias"):
                layer += [rule(f"{ours}.attn.qkv_proj.{p}", [f"{x}.{p}" for x in _proj(prefix + ".self_attn", "qkv")],
                               "concat", (C, C, C)),
                          rule(f"{ours}.attn.out_proj.{p}", f"{prefix}.self_attn.out_proj.{p}"),
                          rule(f"{ours}.norm1.{p}", f"{prefix}.self_attn_layer_norm.{p}"),
                          rule(f"{ours}.mlp.fc_in.{p}", f"{prefix}.fc1.{p}"),
                          rule(f"{ours}.mlp.fc_out.{p}", f"{prefix}.fc2.{p}"),
                          rule(f"{ours}.norm2.{p}", f"{prefix}.final_layer_norm.{p}")]
                if side == "decoder":
                    cross = prefix + ".encoder_attn"
                    layer += [rule(f"{ours}.cross_attn.q_proj.{p}", f"{cross}.q_proj.{p}"),
                              rule(f"{ours}.cross_attn.kv_proj.{p}", [f"{x}.{p}" for x in _proj(cross, "kv")],
                                   "concat", (C, C)),
                              rule(f"{ours}.cross_attn.out_proj.{p}", f"{cross}.out_proj.{p}"),
                              rule(f"{ours}.norm_cross.{p}", f"{prefix}.encoder_attn_layer_norm.{p}")]
            rules += per_layer(n, layer)
        rules.append(rule("lm_head.bias", "final_logits_bias", "row"))
        return rules

    def ignored(self, config: Seq2SeqConfig) -> list[str]:
        # tied copies of the shared embedding, the sinusoid tables, lm_head (tied)
        return [r"model\.(encoder|decoder)\.embed_tokens\.weight", r"model\.(encoder|decoder)\.embed_positions\.weight",
                "lm_head.weight"]

    def config_from_hf(self, hf: dict[str, Any]) -> Seq2SeqConfig:
        problems = []
        if hf["encoder_attention_heads"] != hf["decoder_attention_heads"]:
            problems.append(f"encoder_attention_heads={hf['encoder_attention_heads']} != "
                            f"decoder_attention_heads={hf['decoder_attention_heads']}")
        if hf["encoder_ffn_dim"] != hf["decoder_ffn_dim"]:
            problems.append(f"encoder_ffn_dim={hf['encoder_ffn_dim']} != decoder_ffn_dim={hf['decoder_ffn_dim']}")
        if not hf["share_encoder_decoder_embeddings"] or hf.get("decoder_vocab_size") not in (None, hf["vocab_size"]):
            problems.append("share_encoder_decoder_embeddings=False (separate vocabularies)")
        if not hf["tie_word_embeddings"]:
            problems.append("tie_word_embeddings=False")
        act = hf["activation_function"]
        if act not in _ACTIVATION_FROM_HF:
            problems.append(f"activation_function={act!r} (tokenloom has {', '.join(map(repr, _ACTIVATION_FROM_HF))})")
        if hf.get("activation_dropout"):
            problems.append(f"activation_dropout={hf['activation_dropout']} (tokenloom has no dropout inside the MLP)")
        if problems:
            raise ConfigError("tokenloom cannot express the Marian setting(s) " + "; ".join(problems))
        eos = hf["eos_token_id"][0] if isinstance(hf["eos_token_id"], list) else hf["eos_token_id"]
        attn_drop = float(hf["attention_dropout"] or 0.0)
        return Seq2SeqConfig(
            vocab_size=hf["vocab_size"], encoder_layers=hf["encoder_layers"], decoder_layers=hf["decoder_layers"],
            num_heads=hf["encoder_attention_heads"], embed_dim=hf["d_model"],
            max_source_len=hf["max_position_embeddings"], max_target_len=hf["max_position_embeddings"],
            position="sinusoidal_halves", norm="layernorm", norm_placement="post", norm_eps=1e-5,
            mlp=_ACTIVATION_FROM_HF[act], mlp_hidden_dim=hf["encoder_ffn_dim"], dropout=float(hf["dropout"]),
            attention_dropout=None if attn_drop == float(hf["dropout"]) else attn_drop, bias=True,
            share_embeddings=True, tie_embeddings=True, scale_embeddings=bool(hf["scale_embedding"]),
            output_bias=True, pad_id=hf["pad_token_id"], bos_id=hf["decoder_start_token_id"], eos_id=eos)

    def config_to_hf(self, config: Seq2SeqConfig) -> dict[str, Any]:
        wanted = dict(position="sinusoidal_halves", norm="layernorm", norm_placement="post", bias=True,
                      share_embeddings=True, tie_embeddings=True, output_bias=True)
        problems = [f"{k}={getattr(config, k)!r} (Marian has {v!r})" for k, v in wanted.items()
                    if getattr(config, k) != v]
        if config.num_kv_heads not in (None, config.num_heads):
            problems.append(f"num_kv_heads={config.num_kv_heads} (Marian has num_kv_heads == num_heads)")
        if config.mlp not in _ACTIVATION_TO_HF:
            problems.append(f"mlp={config.mlp!r} (Marian has {', '.join(map(repr, _ACTIVATION_TO_HF))})")
        if config.norm_eps != 1e-5:
            problems.append(f"norm_eps={config.norm_eps} (Marian's LayerNorm has 1e-5)")
        if config.encoder_attention_window is not None:
            problems.append(f"encoder_attention_window={config.encoder_attention_window} (Marian's encoder attends "
                            f"to the whole source)")
        if problems:
            raise ConfigError("Marian cannot express " + "; ".join(problems))
        return dict(vocab_size=config.vocab_size, d_model=config.embed_dim, encoder_layers=config.encoder_layers,
                    decoder_layers=config.decoder_layers, encoder_attention_heads=config.num_heads,
                    decoder_attention_heads=config.num_heads, encoder_ffn_dim=config.mlp_hidden,
                    decoder_ffn_dim=config.mlp_hidden, activation_function=_ACTIVATION_TO_HF[config.mlp],
                    max_position_embeddings=max(config.max_source_len, config.max_target_len),
                    dropout=config.dropout,
                    attention_dropout=config.dropout if config.attention_dropout is None else config.attention_dropout,
                    activation_dropout=0.0, scale_embedding=config.scale_embeddings,
                    pad_token_id=config.pad_id, eos_token_id=config.eos_id, forced_eos_token_id=config.eos_id,
                    decoder_start_token_id=config.bos_id, share_encoder_decoder_embeddings=True,
                    tie_word_embeddings=True)


HF_CONVERTERS.register("marian")(MarianConverter())
