"""Swin and the window parts: partition / reverse, the shifted-window mask and the relative position index
against the reference Swin code, window rules, sdpa == math (gradients too), config errors, a tiny model that
learns. (Parity with Hugging Face: tests/interop/test_vision.py.)"""

from __future__ import annotations

import pytest
import torch

from tokenloom.errors import ConfigError, DataError
from tokenloom.models import Swin, SwinConfig
from tokenloom.models.swin import stage_window
from tokenloom.nn import relative_position_index, shifted_window_mask, window_partition, window_reverse
from tokenloom.nn.windows import additive_window_mask, shift_regions


def tiny(**overrides) -> Swin:
    kw = dict(image_size=16, patch_size=2, in_channels=1, num_classes=5, embed_dim=16, depths=[2, 2],
              num_heads=[2, 4], window_size=4)
    return Swin(SwinConfig(**{**kw, **overrides})).eval()


def images(batch: int = 2, channels: int = 1, size: int | tuple[int, int] = 16, seed: int = 0) -> torch.Tensor:
    h, w = (size, size) if isinstance(size, int) else size
    return torch.randn(batch, channels, h, w, generator=torch.Generator().manual_seed(seed))


# ---- the reference Swin code (microsoft/Swin-Transformer, models/swin_transformer.py), written independently ----

def ref_window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window, window, C)


def ref_shift_mask(H: int, W: int, window: int, shift: int) -> torch.Tensor:
    img_mask = torch.zeros((1, H, W, 1))
    slices = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    cnt = 0
    for h in slices:
        for w in slices:
            img_mask[:, h, w, :] = cnt
            cnt += 1
    mask_windows = ref_window_partition(img_mask, window).view(-1, window * window)
    attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
    return attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(attn_mask == 0, 0.0)


def ref_relative_position_index(window: int) -> torch.Tensor:
    coords = torch.stack(torch.meshgrid([torch.arange(window), torch.arange(window)], indexing="ij"))
    coords_flatten = torch.flatten(coords, 1)
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
    relative_coords = relative_coords.permute(1, 2, 0).contiguous()
    relative_coords[:, :, 0] += window - 1
    relative_coords[:, :, 1] += window - 1
    relative_coords[:, :, 0] *= 2 * window - 1
    return relative_coords.sum(-1)


# ---- windows ------------------------------------------------------------------------------------------------

def test_window_partition_and_reverse_round_trip():
    x = torch.randn(2, 8, 12, 3)
    windows = window_partition(x, 4)
    assert windows.shape == (2 * 2 * 3, 16, 3)
    torch.testing.assert_close(windows, ref_window_partition(x, 4).view(-1, 16, 3), atol=0, rtol=0)
    assert torch.equal(windows[1].view(4, 4, 3), x[0, 0:4, 4:8])  # image 0, window (0, 1)
    assert torch.equal(windows[6].view(4, 4, 3), x[1, 0:4, 0:4])  # image 1, window (0, 0)
    assert torch.equal(window_reverse(windows, 4, 8, 12), x)


@pytest.mark.parametrize("H, W, window, shift", [(14, 14, 7, 3), (8, 8, 4, 2), (12, 8, 4, 2), (6, 9, 3, 1)])
def test_shifted_window_mask_blocks_exactly_the_reference_pairs(H, W, window, shift):
    allowed = shifted_window_mask(H, W, window, shift)
    assert allowed.shape == ((H // window) * (W // window), window * window, window * window)
    torch.testing.assert_close(additive_window_mask(allowed, torch.float32), ref_shift_mask(H, W, window, shift),
                               atol=0, rtol=0)
    assert allowed.diagonal(dim1=1, dim2=2).all()  # every token sees itself
    assert not allowed[-1].all()  # the last window mixes regions of the rolled map
    assert shifted_window_mask(H, W, window, 0) is None


def test_shift_regions_are_the_reference_labels():
    labels = shift_regions(6, 9, 3, 1)
    assert labels[0, 0] == 0 and labels[3, 0] == 3 and labels[5, 0] == 6 and labels[0, 8] == 2 and labels[5, 8] == 8


@pytest.mark.parametrize("window", [1, 2, 4, 7])
def test_relative_position_index_is_the_reference_one(window):
    assert torch.equal(relative_position_index(window), ref_relative_position_index(window))


def test_a_smaller_window_reads_the_same_offsets_of_the_table():
    full, small = relative_position_index(7), relative_position_index(3, 7)
    tokens = [r * 7 + c for r in range(3) for c in range(3)]  # the top-left 3x3 of a 7x7 window
    assert torch.equal(small, full[tokens][:, tokens])


def test_stage_window_rule():
    assert stage_window((14, 14), 7) == (7, 3)
    assert stage_window((7, 7), 7) == (7, 0)
    assert stage_window((4, 9), 7) == (4, 0)
    assert stage_window((8, 8), 4) == (4, 2)


# ---- the model ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [16, 14, (12, 20), 6])
def test_shapes_for_sizes_that_need_padding(size):
    """16: windows 4 shifted, then 4x4 (one window); 14: a 7x7 grid padded to 8, merged from odd 7 to 4;
    (12, 20): non-square; 6: a 3x3 grid below the window."""
    model = tiny()
    features = model.forward_features(images(size=size))
    h, w = (size, size) if isinstance(size, int) else size
    gh, gw = -(-h // 2), -(-w // 2)
    assert features.shape == (2, -(-gh // 2) * -(-gw // 2), 32)
    torch.testing.assert_close(model.forward_head(features), model(images(size=size)))
    assert model(images(size=size)).shape == (2, 5)


def test_images_are_independent_and_sdpa_equals_math_with_gradients():
    torch.manual_seed(1)
    model = tiny(depths=[2, 1], image_size=14).train()
    for p in model.parameters():  # a non-zero bias table, so its gradient shows
        p.data.add_(torch.randn_like(p) * 0.05)
    slow = tiny(depths=[2, 1], image_size=14, attention="math").train()
    slow.load_state_dict(model.state_dict())
    x = images(batch=3, size=14)
    out, ref = model(x), slow(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), slow.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    table = model.stages[0].blocks[1].attn.relative_position_bias_table
    assert table.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([model(x[i:i + 1]) for i in range(3)]), model(x), atol=1e-5, rtol=1e-5)


def test_shifted_block_matches_a_direct_reference():
    """One shifted block against the reference recipe written out: roll, partition, attention with bias + mask,
    reverse, roll back."""
    torch.manual_seed(0)
    model = tiny(depths=[2], num_heads=[2], image_size=8)  # a 4x4 grid... window 4 = the grid: no shift
    block = tiny(depths=[2], num_heads=[2], image_size=16).stages[0].blocks[1]  # 8x8 grid, window 4, shift 2
    with torch.no_grad():
        block.attn.relative_position_bias_table.normal_()
    x = torch.randn(2, 64, 16)
    with torch.no_grad():
        out = block(x, (8, 8), 4, 2, additive_window_mask(shifted_window_mask(8, 8, 4, 2), torch.float32)[:, None])
        h = block.norm1(x).view(2, 8, 8, 16).roll((-2, -2), (1, 2))
        win = ref_window_partition(h, 4).view(-1, 16, 16)  # (B*nW, N, C)
        q, k, v = block.attn.qkv_proj(win).view(-1, 16, 3, 2, 8).permute(2, 0, 3, 1, 4)
        bias = block.attn.relative_position_bias_table[ref_relative_position_index(4).view(-1)].view(16, 16, 2)
        scores = q @ k.transpose(-2, -1) / 8 ** 0.5 + bias.permute(2, 0, 1)
        scores = scores.view(2, 4, 2, 16, 16) + ref_shift_mask(8, 8, 4, 2)[None, :, None]
        attn = (scores.softmax(-1).view(8, 2, 16, 16) @ v).transpose(1, 2).reshape(8, 16, 16)
        attn = block.attn.out_proj(attn).view(2, 2, 2, 4, 4, 16).permute(0, 1, 3, 2, 4, 5).reshape(2, 8, 8, 16)
        y = x + attn.roll((2, 2), (1, 2)).reshape(2, 64, 16)
        y = y + block.mlp(block.norm2(y))
    torch.testing.assert_close(out, y, atol=1e-5, rtol=1e-5)
    assert model(images(size=8)).shape == (2, 5)


@pytest.mark.parametrize("training", [True, False])
def test_window_layout_stage_equals_the_block_by_block_path(training):
    """A stage on a map the windows tile runs its blocks in window layout (one gather between blocks, fused
    residuals in eval mode); each block's own pad / roll / partition / reverse path gives the same output and
    gradients."""
    torch.manual_seed(0)
    stage = tiny(depths=[3], num_heads=[2]).stages[0].train(training)  # 8x8 grid, window 4: plain, shifted, plain
    for p in stage.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    x = torch.randn(2, 64, 16, requires_grad=True)
    out, grid = stage(x, (8, 8))
    window, shift = stage_window((8, 8), 4)
    mask = additive_window_mask(shifted_window_mask(8, 8, window, shift), torch.float32)[:, None]
    ref = x
    for block in stage.blocks:
        ref = block(ref, (8, 8), window, shift if block.shifted else 0, mask if block.shifted else None)
    assert grid == (8, 8) and shift == 2
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    weight = torch.randn_like(out)
    (g,) = torch.autograd.grad((out * weight).sum(), x)
    (r,) = torch.autograd.grad((ref * weight).sum(), x)
    torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_patch_merging_order():
    """x0 = (0, 0), x1 = (1, 0), x2 = (0, 1), x3 = (1, 1) offsets as (row, column), Hugging Face's order."""
    merge = tiny().stages[0].downsample
    x = torch.arange(16.0).view(1, 16, 1).expand(1, 16, 16).contiguous()  # token value = its index on a 4x4 grid
    with torch.no_grad():
        merge.norm.weight.fill_(1.0)
        merge.norm.bias.zero_()
        captured = {}

        def keep_input(module, args, out) -> None:
            captured["in"] = args[0]

        merge.norm.register_forward_hook(keep_input)
        _, grid = merge(x, (4, 4))
    assert grid == (2, 2)
    assert captured["in"][0, 0, ::16].tolist() == [0.0, 4.0, 1.0, 5.0]  # (0,0), (1,0), (0,1), (1,1) of a 4-wide grid


def test_drop_path_only_in_training():
    model = tiny(drop_path=0.5)
    assert model.stages[1].blocks[1].drop_path.p == 0.5 and model.stages[0].blocks[0].drop_path.p == 0.0
    x = images()
    torch.testing.assert_close(model(x), model(x))


def test_wrong_channels_is_a_one_line_data_error():
    with pytest.raises(DataError) as err:
        tiny()(images(channels=3))
    assert "\n" not in str(err.value) and "3 channel(s)" in str(err.value) and "in_channels=1" in str(err.value)


@pytest.mark.parametrize("overrides, needle", [
    (dict(depths=[2, 2], num_heads=[2]), "num_heads=[2] must give one head count per stage"),
    (dict(num_heads=[2, 3]), "num_heads[1]=3 must divide stage 1's width 32"),
    (dict(depths=[]), "depths must be a non-empty list"),
    (dict(window_size=0), "window_size must be a positive integer, got 0"),
    (dict(patch_size=0), "patch_size must be a positive integer, got 0"),
    (dict(image_size=0), "image_size must be a positive integer or a (height, width) pair"),
    (dict(drop_path=1.0), "drop_path must be in [0, 1)"),
    (dict(attention="flash"), "attention: unknown attention backend 'flash'"),
])
def test_config_errors_name_the_field(overrides, needle):
    with pytest.raises(ConfigError) as err:
        tiny(**overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_presets():
    config = SwinConfig.from_name("swin-mnist-tiny")
    assert (config.image_size, config.in_channels, config.num_classes) == (28, 1, 10)
    assert config.stage_dims == [64, 128] and config.num_features == 128
    with pytest.raises(ConfigError, match="unknown Swin preset"):
        SwinConfig.from_name("swin-huge")
