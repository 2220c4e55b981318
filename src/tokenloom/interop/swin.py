"""Swin (``SwinForImageClassification``) <-> tokenloom :class:`~tokenloom.models.swin.Swin`.

The same network, tensor for tensor: the patch embedding and its LayerNorm (``embeddings.norm``), per block
``layernorm_before`` / ``layernorm_after``, q, k and v as three projections (fused into ``qkv_proj``:
``concat``), the relative position bias table, the MLP, per stage but the last the patch merging's
``reduction`` (no bias) and ``norm``, the final ``layernorm`` and the classifier after average pooling. The
relative position index is a buffer both sides compute (older checkpoints saved it: ignored). The table uses
the checkpoint names (``attention.self.query``, ...); transformers 5's modules are ``attention.q_proj`` etc.
(``renames``). Absolute position embeddings (``use_absolute_embeddings``) are not supported.
"""

from __future__ import annotations

from typing import Any

from ..data.images import image_size_hw
from ..errors import ConfigError
from ..models.swin import SwinConfig
from .hf import HF_CONVERTERS, HFConverter, Rule, per_layer, rule
from .vit import ACTIVATIONS_FROM_HF, ACTIVATIONS_TO_HF, image_size_from_hf, image_size_to_hf, labels_to_hf, num_labels


class SwinConverter(HFConverter):
    family = "swin"
    model_types = ("swin",)
    architecture = "SwinForImageClassification"
    base_prefix = "swin."
    hf_defaults = dict(image_size=224, patch_size=4, num_channels=3, embed_dim=96, depths=[2, 2, 6, 2],
                       num_heads=[3, 6, 12, 24], window_size=7, mlp_ratio=4.0, qkv_bias=True, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, drop_path_rate=0.1, hidden_act="gelu",
                       use_absolute_embeddings=False, layer_norm_eps=1e-5)
    renames = (("attention.self.query", "attention.q_proj"), ("attention.self.key", "attention.k_proj"),
               ("attention.self.value", "attention.v_proj"),
               ("attention.self.relative_position_bias_table",
                "attention.relative_position_bias.relative_position_bias_table"),
               ("attention.output.dense", "attention.o_proj"), ("intermediate.dense", "mlp.fc1"),
               ("output.dense", "mlp.fc2"))

    def rules(self, config: SwinConfig) -> list[Rule]:
        rules = [rule("patch_embed.proj.weight", "swin.embeddings.patch_embeddings.projection.weight"),
                 rule("patch_embed.proj.bias", "swin.embeddings.patch_embeddings.projection.bias"),
                 rule("embed_norm.weight", "swin.embeddings.norm.weight"),
                 rule("embed_norm.bias", "swin.embeddings.norm.bias")]
        for s, (C, depth) in enumerate(zip(config.stage_dims, config.depths, strict=True)):
            ours, theirs = f"stages.{s}.blocks.{{i}}", f"swin.encoder.layers.{s}.blocks.{{i}}"
            qkv = [f"{theirs}.attention.self.{n}" for n in ("query", "key", "value")]
            block = [rule(f"{ours}.attn.qkv_proj.weight", [f"{n}.weight" for n in qkv], "concat", (C, C, C)),
                     rule(f"{ours}.attn.relative_position_bias_table",
                          f"{theirs}.attention.self.relative_position_bias_table")]
            if config.qkv_bias:
                block.append(rule(f"{ours}.attn.qkv_proj.bias", [f"{n}.bias" for n in qkv], "concat", (C, C, C)))
            for p in ("weight", "bias"):
                block += [rule(f"{ours}.norm1.{p}", f"{theirs}.layernorm_before.{p}"),
                          rule(f"{ours}.attn.out_proj.{p}", f"{theirs}.attention.output.dense.{p}"),
                          rule(f"{ours}.norm2.{p}", f"{theirs}.layernorm_after.{p}"),
                          rule(f"{ours}.mlp.fc_in.{p}", f"{theirs}.intermediate.dense.{p}"),
                          rule(f"{ours}.mlp.fc_out.{p}", f"{theirs}.output.dense.{p}")]
            rules += per_layer(depth, block)
            if s < len(config.depths) - 1:
                down = f"swin.encoder.layers.{s}.downsample"
                rules += [rule(f"stages.{s}.downsample.reduction.weight", f"{down}.reduction.weight"),
                          rule(f"stages.{s}.downsample.norm.weight", f"{down}.norm.weight"),
                          rule(f"stages.{s}.downsample.norm.bias", f"{down}.norm.bias")]
        return rules + [rule("final_norm.weight", "swin.layernorm.weight"),
                        rule("final_norm.bias", "swin.layernorm.bias"),
                        rule("head.weight", "classifier.weight"), rule("head.bias", "classifier.bias")]

    def ignored(self, config: SwinConfig) -> list[str]:
        return [r".*\.relative_position_index"]  # a buffer computed from the window size (older checkpoints saved it)

    def config_from_hf(self, hf: dict[str, Any]) -> SwinConfig:
        problems = []
        act = hf["hidden_act"]
        if act not in ACTIVATIONS_FROM_HF:
            problems.append(f"hidden_act={act!r} (tokenloom has {', '.join(map(repr, ACTIVATIONS_FROM_HF))})")
        if hf["use_absolute_embeddings"]:
            problems.append("use_absolute_embeddings=True")
        if not isinstance(hf["patch_size"], int):
            problems.append(f"patch_size={hf['patch_size']!r} (tokenloom has square patches)")
        if problems:
            raise ConfigError("tokenloom cannot express the Swin setting(s) " + "; ".join(problems))
        drop, attn_drop = float(hf["hidden_dropout_prob"]), float(hf["attention_probs_dropout_prob"])
        return SwinConfig(image_size=image_size_from_hf(hf["image_size"]), patch_size=hf["patch_size"],
                          in_channels=hf["num_channels"], num_classes=num_labels(hf), embed_dim=hf["embed_dim"],
                          depths=list(hf["depths"]), num_heads=list(hf["num_heads"]), window_size=hf["window_size"],
                          mlp_ratio=float(hf["mlp_ratio"]), mlp=ACTIVATIONS_FROM_HF[act], qkv_bias=bool(hf["qkv_bias"]),
                          dropout=drop, attention_dropout=None if attn_drop == drop else attn_drop,
                          drop_path=float(hf["drop_path_rate"]), norm_eps=float(hf["layer_norm_eps"]))

    def config_to_hf(self, config: SwinConfig) -> dict[str, Any]:
        if config.mlp not in ACTIVATIONS_TO_HF:
            raise ConfigError(f"Hugging Face Swin cannot express mlp={config.mlp!r} "
                              f"(Swin has {', '.join(map(repr, ACTIVATIONS_TO_HF))})")
        grid = tuple(-(-side // config.patch_size) for side in image_size_hw(config.image_size))
        for stage in range(len(config.depths)):
            if min(grid) < config.window_size:
                raise ConfigError(
                    f"Hugging Face Swin cannot run stage {stage + 1}'s {grid[0]}x{grid[1]} map with "
                    f"window_size={config.window_size}: its relative position bias is built for "
                    f"{config.window_size}x{config.window_size} windows only (tokenloom uses the table's central "
                    f"rows); export a model whose every stage map is at least the window")
            grid = tuple(-(-side // 2) for side in grid)  # patch merging pads odd sides
        attn_drop = config.dropout if config.attention_dropout is None else config.attention_dropout
        return dict(image_size=image_size_to_hf(config.image_size), patch_size=config.patch_size,
                    num_channels=config.in_channels, embed_dim=config.embed_dim, depths=list(config.depths),
                    num_heads=list(config.num_heads), window_size=config.window_size, mlp_ratio=config.mlp_ratio,
                    qkv_bias=config.qkv_bias, hidden_dropout_prob=config.dropout,
                    attention_probs_dropout_prob=attn_drop, drop_path_rate=config.drop_path,
                    hidden_act=ACTIVATIONS_TO_HF[config.mlp], use_absolute_embeddings=False,
                    layer_norm_eps=config.norm_eps, **labels_to_hf(config.num_classes))


HF_CONVERTERS.register("swin")(SwinConverter())
