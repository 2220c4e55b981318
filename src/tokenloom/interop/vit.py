"""ViT (``ViTForImageClassification``) <-> tokenloom :class:`~tokenloom.models.vit.ViT`.

Hugging Face's ViT is the tokenloom ViT with a class token (``pool='cls'``), learned positions (the class
token's first), pre-norm LayerNorm (eps 1e-12 by default), a two-layer MLP and a classifier on the final-normed
class token. It keeps q, k and v as three projections (tokenloom fuses them into ``qkv_proj``: ``concat``);
``qkv_bias=False`` drops only their biases. The table uses the checkpoint names (``vit.encoder.layer.{i}...``,
what ``save_pretrained`` writes); transformers 5 names the modules ``vit.layers.{i}.attention.q_proj`` etc.
(``renames``). Images need no processor here: the models take (B, C, H, W) float pixels as given.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..models.vit import ViTConfig
from .hf import HF_CONVERTERS, HFConverter, Rule, per_layer, rule

ACTIVATIONS_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                       "silu": "silu", "swish": "silu"}
ACTIVATIONS_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}

_LAYER = "vit.encoder.layer.{i}"


def num_labels(hf: dict[str, Any]) -> int:
    """The number of classes of an image classification ``config.json`` (``id2label``, else ``num_labels``)."""
    id2label = hf.get("id2label")
    return len(id2label) if id2label else int(hf.get("num_labels", 2))


def labels_to_hf(num_classes: int) -> dict[str, Any]:
    """``id2label`` / ``label2id`` for ``num_classes`` unnamed classes (transformers' LABEL_i)."""
    names = [f"LABEL_{i}" for i in range(num_classes)]
    return dict(id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})


def image_size_to_hf(size: int | tuple[int, int]) -> int | list[int]:
    if isinstance(size, int):
        return size
    return size[0] if size[0] == size[1] else list(size)


def image_size_from_hf(size: Any) -> int | tuple[int, int]:
    return size if isinstance(size, int) else tuple(size)


class ViTConverter(HFConverter):
    family = "vit"
    model_types = ("vit",)
    architecture = "ViTForImageClassification"
    base_prefix = "vit."
    hf_defaults = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                       hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       layer_norm_eps=1e-12, image_size=224, patch_size=16, num_channels=3, qkv_bias=True)
    renames = (("encoder.layer.", "layers."), ("attention.attention.query", "attention.q_proj"),
               ("attention.attention.key", "attention.k_proj"), ("attention.attention.value", "attention.v_proj"),
               ("attention.output.dense", "attention.o_proj"), ("intermediate.dense", "mlp.fc1"),
               ("output.dense", "mlp.fc2"))

    def rules(self, config: ViTConfig) -> list[Rule]:
        C = config.embed_dim
        qkv = [f"{_LAYER}.attention.attention.{n}" for n in ("query", "key", "value")]
        layer = [rule("blocks.{i}.attn.qkv_proj.weight", [f"{n}.weight" for n in qkv], "concat", (C, C, C))]
        if config.qkv_bias:
            layer.append(rule("blocks.{i}.attn.qkv_proj.bias", [f"{n}.bias" for n in qkv], "concat", (C, C, C)))
        for p in ("weight", "bias"):
            layer += [rule(f"blocks.{{i}}.norm1.{p}", f"{_LAYER}.layernorm_before.{p}"),
                      rule(f"blocks.{{i}}.attn.out_proj.{p}", f"{_LAYER}.attention.output.dense.{p}"),
                      rule(f"blocks.{{i}}.norm2.{p}", f"{_LAYER}.layernorm_after.{p}"),
                      rule(f"blocks.{{i}}.mlp.fc_in.{p}", f"{_LAYER}.intermediate.dense.{p}"),
                      rule(f"blocks.{{i}}.mlp.fc_out.{p}", f"{_LAYER}.output.dense.{p}")]
        return [rule("patch_embed.proj.weight", "vit.embeddings.patch_embeddings.projection.weight"),
                rule("patch_embed.proj.bias", "vit.embeddings.patch_embeddings.projection.bias"),
                rule("cls_token", "vit.embeddings.cls_token"),
                rule("pos_embed", "vit.embeddings.position_embeddings"),
                *per_layer(config.num_layers, layer),
                rule("final_norm.weight", "vit.layernorm.weight"), rule("final_norm.bias", "vit.layernorm.bias"),
                rule("head.weight", "classifier.weight"), rule("head.bias", "classifier.bias")]

    def ignored(self, config: ViTConfig) -> list[str]:
        return [r"vit\.pooler\..*"]  # ViTModel's pooler (a checkpoint saved from ViTModel): classification skips it

    def config_from_hf(self, hf: dict[str, Any]) -> ViTConfig:
        problems = []
        act = hf["hidden_act"]
        if act not in ACTIVATIONS_FROM_HF:
            problems.append(f"hidden_act={act!r} (tokenloom has {', '.join(map(repr, ACTIVATIONS_FROM_HF))})")
        if not isinstance(hf["patch_size"], int):
            problems.append(f"patch_size={hf['patch_size']!r} (tokenloom has square patches)")
        if problems:
            raise ConfigError("tokenloom cannot express the ViT setting(s) " + "; ".join(problems))
        C, hidden = hf["hidden_size"], hf["intermediate_size"]
        ratio = hidden / C  # kept as a ratio when it gives the width back exactly (a tokenloom config round-trips)
        width = dict(mlp_ratio=ratio, mlp_hidden_dim=None) if int(ratio * C) == hidden else dict(mlp_hidden_dim=hidden)
        drop, attn_drop = float(hf["hidden_dropout_prob"]), float(hf["attention_probs_dropout_prob"])
        return ViTConfig(image_size=image_size_from_hf(hf["image_size"]), patch_size=hf["patch_size"],
                         in_channels=hf["num_channels"], num_classes=num_labels(hf), embed_dim=C,
                         num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                         **width, mlp=ACTIVATIONS_FROM_HF[act],
                         norm="layernorm", norm_eps=float(hf["layer_norm_eps"]), norm_placement="pre", dropout=drop,
                         attention_dropout=None if attn_drop == drop else attn_drop, pool="cls", position="learned",
                         qkv_bias=bool(hf["qkv_bias"]))

    def config_to_hf(self, config: ViTConfig) -> dict[str, Any]:
        wanted = dict(pool="cls", position="learned", norm="layernorm", norm_placement="pre")
        problems = [f"{k}={getattr(config, k)!r} (ViT has {v!r})" for k, v in wanted.items() if getattr(config, k) != v]
        if config.mlp not in ACTIVATIONS_TO_HF:
            problems.append(f"mlp={config.mlp!r} (ViT has {', '.join(map(repr, ACTIVATIONS_TO_HF))})")
        if problems:
            raise ConfigError("Hugging Face ViT cannot express " + "; ".join(problems))
        attn_drop = config.dropout if config.attention_dropout is None else config.attention_dropout
        return dict(hidden_size=config.embed_dim, num_hidden_layers=config.num_layers,
                    num_attention_heads=config.num_heads, intermediate_size=config.mlp_hidden,
                    hidden_act=ACTIVATIONS_TO_HF[config.mlp], hidden_dropout_prob=config.dropout,
                    attention_probs_dropout_prob=attn_drop, layer_norm_eps=config.norm_eps,
                    image_size=image_size_to_hf(config.image_size), patch_size=config.patch_size,
                    num_channels=config.in_channels, qkv_bias=config.qkv_bias, **labels_to_hf(config.num_classes))


HF_CONVERTERS.register("vit")(ViTConverter())
