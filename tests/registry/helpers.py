"""Shared pieces of the registry tests: presets collected from the registries, shrunk configs, per-family inputs
and the cached-decoding reference.

Everything here goes through public APIs only (``MODELS``, the ``*_PRESETS`` dicts the model modules export,
``from_name``, ``decoding_of``, the decoding protocol ``create_cache`` / ``__call__(ids, cache=)`` and
``decoder_for``), so it keeps working while the model internals change.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch
from torch import Tensor, nn

from tests.generation.helpers import left_pad  # noqa: F401  (re-exported for the registry tests)
from tokenloom.models.registry import MODELS, decoding_of
from tokenloom.models.reward import SequenceScorer

# Shrunk sizes. Only fields the config has are overridden; everything else (position, norm, mlp, norm_placement,
# bias, tying, the kv-head ratio, window size, patch size, kind...) keeps the preset's value.
HEAD_DIM = 8  # embed_dim = heads * HEAD_DIM: even (rope), divisible by 4 (ViT's sincos2d)
MAX_HEADS = 4
SMALL: dict[str, Any] = dict(
    vocab_size=97, num_layers=2, encoder_layers=2, decoder_layers=2, max_seq_len=32, max_source_len=10,
    max_target_len=32,  # 32 >= ctc_upsample (3) * max_source_len: a ctc NAT preset builds too
    num_classes=7, max_length_offset=4, gradient_checkpointing=False,
)
SWIN_EMBED_DIM = 16  # a list-valued num_heads (Swin: one count per stage) is clipped to <= 2 per stage


def collect_presets() -> list[tuple[str, str, dict]]:
    """(family, preset name, preset fields) for every registered model family: each preset of the family's
    ``*_PRESETS`` dict (found in the module that defines the config class, the dict ``from_name`` reads), or
    one ``default`` entry (the config's defaults) for a family without presets. A preset added to a dict,
    or a family added to ``MODELS``, is picked up here without editing a test."""
    out = []
    for family in MODELS:
        config_cls, _ = MODELS.get(family)
        module = sys.modules[config_cls.__module__]
        dicts = {name: value for name, value in vars(module).items()
                 if name.endswith("_PRESETS") and isinstance(value, dict)
                 and all(isinstance(v, dict) for v in value.values())}
        if hasattr(config_cls, "from_name"):
            # a config with from_name must export its presets dict next to it (else this test sees none)
            assert dicts, f"{config_cls.__name__} has from_name but {module.__name__} exports no *_PRESETS dict"
            for presets in dicts.values():
                out.extend((family, name, dict(fields)) for name, fields in presets.items())
        else:
            out.append((family, "default", {}))
    return out


def _field_names(config_cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(config_cls) if f.init}


def shrink(config_cls: type, preset: dict, **extra: Any) -> dict:
    """The preset's fields with sizes overridden to tiny values (only fields ``config_cls`` has), keeping its
    distinctive options; ``extra`` on top."""
    names = _field_names(config_cls)
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)
                if f.init and f.default is not dataclasses.MISSING}
    defaults.update({f.name: f.default_factory() for f in dataclasses.fields(config_cls)
                     if f.init and f.default_factory is not dataclasses.MISSING})
    full = {**defaults, **preset}
    out = dict(preset)
    out.update({k: v for k, v in SMALL.items() if k in names})
    heads = full.get("num_heads")
    if isinstance(heads, list):  # Swin: heads and depths per stage
        out["num_heads"] = [min(h, 2) for h in heads]
        out["depths"] = [min(d, 2) for d in full["depths"]]  # 2 blocks: the second one is shifted
        out["embed_dim"] = SWIN_EMBED_DIM
    elif heads is not None:
        kv = full.get("num_kv_heads")
        if kv is not None and kv != heads:  # grouped-query: keep the ratio heads / kv_heads
            group = heads // kv
            kv = min(kv, 2)
            heads = kv * group
            out["num_kv_heads"] = kv
        else:
            heads = min(heads, MAX_HEADS)
            if kv is not None:
                out["num_kv_heads"] = heads
        out["num_heads"] = heads
        out["embed_dim"] = heads * HEAD_DIM
    if full.get("mlp_hidden_dim") is not None:
        out["mlp_hidden_dim"] = 2 * out["embed_dim"]
    options = full.get("attention_options") or {}
    if options.get("features"):  # performer: at most 16 random features
        out["attention_options"] = {**options, "features": min(options["features"], 16)}
    elif "k" in options:  # linformer: project to 8 positions
        out["attention_options"] = {**options, "k": 8}
    if "image_size" in names:
        patch = full["patch_size"]
        if "window_size" in names and "depths" in names:
            # windows: the first stage 2 x 2 windows (its second block shifted), later stages merged down to one
            # window smaller than M and odd-sided maps (padded by the merging)
            side = patch * full["window_size"] * (2 if len(full["depths"]) > 1 else 1)
        else:
            side = patch * 4  # a 4 x 4 patch grid
        size = full["image_size"]
        preset_side = size if isinstance(size, int) else max(size)
        out["image_size"] = min(side, preset_side)
    for name, offset in (("mask_id", 1), ("blank_id", 2)):  # NAT: <mask> / <blank> past the "tokenizer's" ids
        if name in names and full.get(name, -1) == -1:
            out[name] = out.get("vocab_size", full.get("vocab_size")) - offset
    out.update(extra)
    return out


def build(family: str, preset: dict, seed: int = 0, **extra: Any) -> nn.Module:
    config_cls, model_cls = MODELS.get(family)
    torch.manual_seed(seed)
    return model_cls(config_cls(**shrink(config_cls, preset, **extra)))


# ---- per-family inputs and outputs ---------------------------------------------------------------------------

B = 3


def source_batch(config: Any, gen: torch.Generator, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """(B, S) right-padded sources (ids >= 3: no pad/BOS/EOS) and their 0/1 mask; row 1 is padded; on ``device``."""
    S = min(7, config.max_source_len)
    src = torch.randint(3, config.vocab_size, (B, S), generator=gen)
    mask = torch.ones_like(src)
    src[1, S - 2:], mask[1, S - 2:] = config.pad_id, 0
    return (src, mask) if device is None else (src.to(device), mask.to(device))


def outputs(family: str, model: nn.Module, seed: int = 1, device: torch.device | None = None) -> list[Tensor]:
    """The tensors a model's training loss reads, for inputs of its family (made on the CPU, then moved to
    ``device`` when given), each checked for shape here."""
    c = model.config
    gen = torch.Generator().manual_seed(seed)
    kind = decoding_of(model)
    put = (lambda t: t) if device is None else (lambda t: t.to(device))
    if kind == "causal_lm":
        ids = put(torch.randint(0, c.vocab_size, (B, 12), generator=gen))
        logits = model(ids)
        assert logits.shape == (B, 12, c.vocab_size)
        if isinstance(model, SequenceScorer):  # a reward model: also its sequence score (its head)
            scores = model.score(ids)
            assert scores.shape == (B,)
            return [logits, scores]
        return [logits]
    if kind in ("encoder_decoder", "semi_autoregressive"):  # teacher forcing from [BOS] y (semi_ar shifts it)
        src, mask = source_batch(c, gen, device)
        tgt = torch.randint(3, c.vocab_size, (B, 6), generator=gen)
        tgt[:, 0] = c.bos_id
        logits = model(src, put(tgt), mask)
        assert logits.shape == (B, 6, c.vocab_size)
        return [logits]
    if kind == "parallel":
        src, mask = source_batch(c, gen, device)
        lengths = torch.tensor([5, 3, 6])
        tokens = torch.randint(3, c.vocab_size - 2, (B, 6), generator=gen)
        tokens[:, ::2] = c.mask_id
        logits, target_mask, memory = model(src, mask, put(lengths), put(tokens))
        assert logits.shape == (*target_mask.shape, c.vocab_size) and logits.shape[0] == B
        assert memory.shape == (B, src.shape[1], c.embed_dim)
        out = [logits]
        if model.length_head is not None:  # the length predictor is trained on its own loss term (ctc has none)
            length_logits = model.length_logits(memory, mask)
            assert length_logits.shape == (B, c.num_length_classes)
            out.append(length_logits)
        return out
    if kind is None and hasattr(c, "image_size"):  # image classifiers
        size = c.image_size if isinstance(c.image_size, tuple) else (c.image_size, c.image_size)
        images = put(torch.randn(2, c.in_channels, *size, generator=gen))
        logits = model(images)
        assert logits.shape == (2, c.num_classes)
        return [logits]
    raise AssertionError(f"no inputs for family {family!r} (decoding kind {kind!r}): add a branch to "
                         "tests/registry/helpers.py:outputs")


def weighted_loss(tensors: list[Tensor]) -> Tensor:
    """A random-weighted sum: every output element gets a gradient (a plain sum of logits would give a
    softmax-invariant direction, and a sum over a normalised axis can be constant)."""
    gen = torch.Generator().manual_seed(123)
    return sum((t.float() * torch.randn(t.shape, generator=gen)).sum() for t in tensors)


def check_gradients(model: nn.Module, loss: Tensor) -> None:
    """Backward, then every trainable parameter has a finite gradient that is not identically zero (a
    parameter the forward never reads gets None; one cut off from the loss gets zeros)."""
    loss.backward()
    missing, bad, zero = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            missing.append(name)
        elif not torch.isfinite(p.grad).all():
            bad.append(name)
        elif not p.grad.any():
            zero.append(name)
    assert not missing, f"no gradient: {missing}"
    assert not bad, f"non-finite gradient: {bad}"
    assert not zero, f"all-zero gradient: {zero}"


# ---- cached decoding -----------------------------------------------------------------------------------------


@torch.no_grad()
def cached_logits(decoder: Any, ids: Tensor, prefill: int, attention_mask: Tensor | None = None,
                  rows: int | None = None) -> Tensor:
    """Logits of ``ids`` (B, T) through the decoding protocol: ``prefill`` positions in one call, then one
    position per call, all into ``decoder.create_cache(B, T)``; ``attention_mask`` (B, T) is passed over the
    cached + new positions."""
    Bn, T = ids.shape
    cache = decoder.create_cache(rows or Bn, T)
    chunks = [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]
    out = []
    for start, end in chunks:
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask[:, :end]}
        out.append(decoder(ids[:, start:end], cache=cache, **kwargs))
    return torch.cat(out, dim=1)


def assert_close(got: Tensor, want: Tensor, atol: float = 1e-5, what: str = "") -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= atol and math.isfinite(err), f"{what}: max abs difference {err:.3g} > {atol}"
