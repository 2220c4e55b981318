"""Batched augmentations: shapes, seeded determinism, identity at zero strength, mixup / cutmix targets."""

import pytest
import torch

from tokenloom.data.augment import (
    AugmentConfig,
    augment,
    mix_batch,
    random_affine,
    random_crop,
    random_erasing,
    random_hflip,
)
from tokenloom.errors import ConfigError

FULL = AugmentConfig(crop_padding=2, hflip=True, rotation=15, translate=0.1, scale=0.1, erasing=0.5)


def images(B=6, C=1, H=12, W=10):
    return torch.rand(B, C, H, W, generator=torch.Generator().manual_seed(0))


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_shapes_and_determinism():
    x = images()
    a = augment(x, FULL, gen(1))
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, augment(x, FULL, gen(1)))
    assert not torch.equal(a, augment(x, FULL, gen(2)))
    assert not torch.equal(a, x)


def test_zero_strength_is_identity_and_draws_nothing():
    x = images()
    g = gen(3)
    state = g.get_state()
    assert torch.equal(augment(x, AugmentConfig(), g), x)
    assert torch.equal(random_affine(x, g), x) and torch.equal(random_crop(x, 0, g), x)
    assert torch.equal(random_erasing(x, 0.0, g), x)
    assert torch.equal(g.get_state(), state)
    out, targets = mix_batch(x, torch.arange(6), 10, AugmentConfig(), g)
    assert out is x and targets is None


def test_crop_is_a_shift_with_zero_fill():
    x = images(B=50)
    out = random_crop(x, 2, gen(4))
    for i in range(50):  # every output is x shifted by some (dy, dx) in [-2, 2], zeros shifted in
        padded = torch.nn.functional.pad(x[i], (2, 2, 2, 2))
        assert any(torch.equal(out[i], padded[:, dy:dy + 12, dx:dx + 10]) for dy in range(5) for dx in range(5))


def test_hflip_mirrors_some_images():
    x = images(B=40)
    out = random_hflip(x, gen(5))
    flipped = [torch.equal(out[i], x[i].flip(-1)) for i in range(40)]
    assert all(f or torch.equal(out[i], x[i]) for i, f in enumerate(flipped)) and 5 < sum(flipped) < 35


def test_affine_keeps_mass_roughly_and_moves_pixels():
    x = torch.zeros(8, 1, 28, 28)
    x[:, :, 10:18, 10:18] = 1.0  # a centred square: small jitter keeps it inside the image
    out = random_affine(x, gen(6), rotation=10, translate=0.05, scale=0.1)
    ratio = out.sum((1, 2, 3)) / x.sum((1, 2, 3))
    assert ((ratio > 0.7) & (ratio < 1.35)).all() and not torch.allclose(out, x)
    assert out.min() >= 0 and out.max() <= 1 + 1e-6


def test_erasing_blanks_one_rectangle():
    x = torch.ones(30, 1, 16, 16)
    out = random_erasing(x, 1.0, gen(7), area=(0.1, 0.2))
    for img in out[:, 0]:
        zero = img == 0
        rows, cols = zero.any(1).nonzero().flatten(), zero.any(0).nonzero().flatten()
        assert 1 <= zero.sum() <= 0.2 * 256 * 1.5
        box = img[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
        assert (box == 0).all()  # the blanked pixels form one rectangle


@pytest.mark.parametrize("config", [AugmentConfig(mixup_alpha=0.4), AugmentConfig(cutmix_alpha=1.0),
                                    AugmentConfig(mixup_alpha=0.2, cutmix_alpha=1.0)])
def test_mix_targets_sum_to_one_and_match_the_mixture(config):
    x, labels = images(B=8, H=16, W=16), torch.arange(8) % 5
    for seed in range(6):
        mixed, targets = mix_batch(x, labels, 5, config, gen(seed))
        assert mixed.shape == x.shape and targets.shape == (8, 5)
        torch.testing.assert_close(targets.sum(1), torch.ones(8))
        lam = float(targets[0, labels[0]]) if labels[0] != labels[-1] else None
        if lam is not None and config.cutmix_alpha == 0:  # mixup: pixels mixed with the same lambda
            torch.testing.assert_close(mixed, lam * x + (1 - lam) * x.flip(0))
        if lam is not None and config.mixup_alpha == 0:  # cutmix: the pasted area is 1 - lambda
            pasted = (mixed[0] != x[0]).float().mean()
            assert abs(float(pasted) - (1 - lam)) < 1e-6
    assert torch.equal(mix_batch(x, labels, 5, config, gen(9))[1], mix_batch(x, labels, 5, config, gen(9))[1])


def test_mix_prob_zero_and_config_checks():
    x = images()
    assert mix_batch(x, torch.arange(6), 6, AugmentConfig(mixup_alpha=1.0, mix_prob=0.0), gen())[1] is None
    for kwargs, message in [({"rotation": -1}, "data.augment.rotation"), ({"erasing": 2}, "data.augment.erasing"),
                            ({"erasing_area": [0.3, 0.1]}, "erasing_area"), ({"mixup_alpha": -1}, "mixup_alpha")]:
        with pytest.raises(ConfigError, match=message):
            AugmentConfig(**kwargs)
