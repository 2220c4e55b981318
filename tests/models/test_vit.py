"""ViT and the patch parts: patch embedding, 2-D positions, pooling, presets, config errors, a tiny model that
learns. (Parity with Hugging Face: tests/interop/test_vision.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.config import from_dict, to_dict
from tokenloom.errors import ConfigError, DataError
from tokenloom.models import MODELS, SWIN_PRESETS, VIT_PRESETS, Swin, SwinConfig, ViT, ViTConfig
from tokenloom.models.factory import create_model, model_config_from_dict, model_config_to_dict
from tokenloom.nn import PatchEmbed, patchify, resample_grid, sincos_2d, unpatchify


def tiny(**overrides) -> ViT:
    kw = dict(image_size=16, patch_size=4, in_channels=1, num_classes=5, embed_dim=32, num_layers=2, num_heads=4)
    return ViT(ViTConfig(**{**kw, **overrides})).eval()


def images(batch: int = 2, channels: int = 1, size: int | tuple[int, int] = 16, seed: int = 0) -> torch.Tensor:
    h, w = (size, size) if isinstance(size, int) else size
    return torch.randn(batch, channels, h, w, generator=torch.Generator().manual_seed(seed))


# ---- patch embedding ----------------------------------------------------------------------------------------

def test_patch_embed_shapes_and_padding():
    embed = PatchEmbed(1, 16, 4)
    tokens, grid = embed(images(size=28))
    assert tokens.shape == (2, 49, 16) and grid == (7, 7)
    tokens, grid = embed(images(size=(12, 20)))
    assert tokens.shape == (2, 15, 16) and grid == (3, 5)
    with pytest.raises(DataError, match=r"image size 30x30 is not a multiple of patch_size=4"):
        embed(images(size=30))
    padded = PatchEmbed(1, 16, 4, pad=True)
    padded.load_state_dict(embed.state_dict())
    x = images(size=30)
    tokens, grid = padded(x)
    assert tokens.shape == (2, 64, 16) and grid == (8, 8)
    # zero padding on the right and bottom: the same as embedding the padded image
    ref, _ = embed(torch.nn.functional.pad(x, (0, 2, 0, 2)))
    torch.testing.assert_close(tokens, ref)


def test_wrong_channels_is_a_one_line_data_error():
    with pytest.raises(DataError) as err:
        tiny()(images(channels=3))
    message = str(err.value)
    assert "\n" not in message and "3 channel(s)" in message and "in_channels=1" in message
    with pytest.raises(DataError, match="batch, channels, height, width"):
        tiny()(torch.randn(1, 16, 16))


def test_patchify_round_trip_and_conv_equals_linear_over_patches():
    x = images(batch=3, channels=2, size=(8, 12))
    patches = patchify(x, 4)
    assert patches.shape == (3, 6, 4 * 4 * 2)
    assert torch.equal(unpatchify(patches, 4, (2, 3)), x)
    assert torch.equal(patches[0, 1].view(4, 4, 2), x[0, :, 0:4, 4:8].permute(1, 2, 0))  # patch (0, 1), (row, col, ch)
    embed = PatchEmbed(2, 8, 4)
    weight = embed.proj.weight.permute(0, 2, 3, 1).reshape(8, -1)  # (D, C, P, P) -> (D, P*P*C)
    tokens, _ = embed(x)
    torch.testing.assert_close(tokens, patches @ weight.t() + embed.proj.bias, atol=1e-5, rtol=1e-5)


# ---- positions ----------------------------------------------------------------------------------------------

def test_sincos_2d_matches_the_mae_construction():
    gh, gw, dim = 3, 4, 16
    table = sincos_2d((gh, gw), dim)
    assert table.shape == (gh * gw, dim)
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    for r in range(gh):
        for c in range(gw):
            expect = torch.cat([torch.sin(c * omega), torch.cos(c * omega), torch.sin(r * omega), torch.cos(r * omega)])
            torch.testing.assert_close(table[r * gw + c], expect.float())


def test_resample_grid_is_identity_on_the_same_grid_and_resizes_otherwise():
    pos = torch.randn(1, 12, 8)
    assert resample_grid(pos, (3, 4), (3, 4)) is pos
    bigger = resample_grid(pos, (3, 4), (6, 8))
    assert bigger.shape == (1, 48, 8)
    # a constant field stays constant under bicubic resizing
    const = torch.full((1, 12, 8), 0.5)
    torch.testing.assert_close(resample_grid(const, (3, 4), (5, 7)), torch.full((1, 35, 8), 0.5))


@pytest.mark.parametrize("position", ["learned", "sincos2d"])
@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_other_image_sizes_work(position, pool):
    model = tiny(position=position, pool=pool)
    assert model(images(size=16)).shape == (2, 5)
    assert model(images(size=(24, 20))).shape == (2, 5)  # a 6x5 grid: positions resized / recomputed
    same = model.positions((4, 4), torch.float32, torch.device("cpu"))
    assert same is (model.pos_embed if position == "learned" else model.pos_table)


# ---- the model ----------------------------------------------------------------------------------------------

def test_shapes_pooling_and_features():
    model = tiny()
    x = images()
    features = model.forward_features(x)
    assert features.shape == (2, 1 + 16, 32)
    torch.testing.assert_close(model.forward_head(features), model(x))
    torch.testing.assert_close(model(x), model.head(features[:, 0]))
    mean = tiny(pool="mean")
    assert mean.cls_token is None and mean.pos_embed.shape == (1, 16, 32)
    features = mean.forward_features(x)
    assert features.shape == (2, 16, 32)
    torch.testing.assert_close(mean(x), mean.head(features.mean(1)))


def test_images_are_independent_and_sdpa_equals_math():
    model = tiny(norm_placement="post")
    x = images(batch=3)
    batched = model(x)
    torch.testing.assert_close(torch.cat([model(x[i:i + 1]) for i in range(3)]), batched, atol=1e-5, rtol=1e-5)
    slow = tiny(norm_placement="post", attention="math")
    slow.load_state_dict(model.state_dict())
    torch.testing.assert_close(slow(x), batched, atol=1e-5, rtol=1e-5)


def test_qkv_bias_false_drops_only_the_projection_bias():
    model = tiny(qkv_bias=False)
    names = set(model.state_dict())
    assert "blocks.0.attn.qkv_proj.bias" not in names and "blocks.0.attn.out_proj.bias" in names
    assert model(images()).shape == (2, 5)


@pytest.mark.parametrize("family", ["vit", "swin"])
def test_tiny_vision_model_overfits_a_batch(family):
    from test_swin import tiny as tiny_swin  # tests/models is on sys.path (pytest's prepend import mode)

    torch.manual_seed(0)
    model = (tiny if family == "vit" else tiny_swin)(num_classes=8).train()
    x, y = images(batch=8), torch.arange(8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(300):  # under 5% of the first loss at step ~45-50 here; the cap leaves a wide margin
        loss = torch.nn.functional.cross_entropy(model(x), y)
        first = first if first is not None else loss.item()
        if loss.item() < 0.05 * first:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 1.5 and loss.item() < 0.05 * first, f"loss {first:.3f} -> {loss.item():.4f} in 300 steps"


PRESETS = [("vit", name) for name in VIT_PRESETS if name != "vit-base"] + \
          [("swin", name) for name in SWIN_PRESETS if name != "swin-small"]


@pytest.mark.parametrize("family, name", PRESETS)
def test_every_vision_preset_runs_forward_and_backward(family, name):
    """Each registered preset (the two largest aside) at a small image size: logits (B, num_classes), gradients
    reach every parameter."""
    config_cls, model_cls = MODELS.get(family)
    small = {"vit-mnist-tiny": 28, "swin-mnist-tiny": 28}.get(name, 32)
    config = config_cls.from_name(name, image_size=small)
    model = model_cls(config).train()
    x = torch.randn(2, config.in_channels, small, small)
    logits = model(x)
    assert logits.shape == (2, config.num_classes)
    logits.logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_presets_and_registry():
    assert MODELS.get("vit") == (ViTConfig, ViT) and MODELS.get("swin") == (SwinConfig, Swin)
    config = ViTConfig.from_name("vit-mnist-tiny", dropout=0.1)
    assert (config.image_size, config.in_channels, config.num_classes, config.dropout) == (28, 1, 10, 0.1)
    assert config.grid_size == (7, 7) and config.mlp_hidden == 256
    with pytest.raises(ConfigError, match="unknown ViT preset 'vit-tiyn'.*vit-tiny"):
        ViTConfig.from_name("vit-tiyn")


def test_config_round_trips_through_a_plain_mapping():
    config = ViTConfig(image_size=(24, 16), patch_size=8, in_channels=1, num_classes=3, embed_dim=32, num_layers=1,
                       num_heads=2, pool="mean", position="sincos2d")
    family, back = model_config_from_dict(model_config_to_dict("vit", config))
    assert family == "vit" and back == config and back.grid_size == (3, 2)
    assert from_dict(ViTConfig, {**to_dict(config), "image_size": [24, 16]}) == config
    model = create_model("vit", config, init=False)
    with torch.device("meta"):
        meta = create_model("vit", config, init=False)
    assert set(meta.state_dict()) == set(model.state_dict())


@pytest.mark.parametrize("overrides, needle", [
    (dict(patch_size=0), "patch_size must be a positive integer, got 0"),
    (dict(image_size=30), "image_size=30 must be a multiple of patch_size=4"),
    (dict(image_size=(16, 16, 3)), "image_size must be a positive integer or a (height, width) pair"),
    (dict(in_channels=0), "in_channels must be a positive integer"),
    (dict(num_classes=0), "num_classes must be a positive integer"),
    (dict(pool="max"), "pool must be one of cls, mean, got 'max'"),
    (dict(position="rope"), "position must be one of learned, sincos2d"),
    (dict(position="sincos2d", embed_dim=30, num_heads=2), "position 'sincos2d' needs embed_dim divisible by 4"),
    (dict(embed_dim=30), "embed_dim=30 must be divisible by num_heads=4"),
    (dict(norm="batchnorm"), "norm: unknown norm 'batchnorm'"),
    (dict(dropout=1.0), "dropout must be in [0, 1)"),
])
def test_config_errors_name_the_field(overrides, needle):
    with pytest.raises(ConfigError) as err:
        tiny(**overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_features_use_every_patch():
    """Changing one patch changes the class token's output (attention mixes every position)."""
    model = tiny()
    x = images(batch=1)
    y = x.clone()
    y[..., 12:, 12:] += 1.0  # the last patch
    assert not torch.allclose(model(x), model(y))
    assert math.isfinite(model(x).sum().item())
