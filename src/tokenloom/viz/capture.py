"""Attention maps as data, whatever the backend: :func:`capture_attention`.

The model runs as usual (fused SDPA kernels included); for the requested layers only, each attention call's
probabilities are recomputed from the same q and k (rotated by RoPE), the same mask and score bias (padding,
causal, ALiBi, T5) that the kernel is given (:func:`tokenloom.nn.attention.attention_probs`), and returned in an
:class:`AttentionCapture`; nothing is stored on the modules. Layers are grouped by kind:

* ``self``: a decoder-only or encoder-only model's self-attention (GPT, ViT);
* ``encoder``, ``decoder``, ``cross``: an encoder-decoder's encoder and decoder self-attention and the
  decoder's cross-attention (rows: target positions, columns: source positions).

One-token decode steps (the decode plans) and ``torch.compile``-d forwards are not captured: capture on a
full eager forward (fused kernels and all).

Example::

    with capture_attention(model, layers=[0, 3]) as maps:
        model(ids)
    maps.get("self", 0)      # (B, H, T, T) float32, rows sum to 1
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import Tensor, nn

from ..errors import ConfigError
from ..nn.attention import MultiHeadAttention, capture_attention_of

KINDS = ("self", "encoder", "decoder", "cross")


def attention_layers(model: nn.Module) -> dict[str, list[tuple[str, MultiHeadAttention]]]:
    """The model's attention modules by kind (see the module docstring), each list in layer order."""
    groups: dict[str, list[tuple[str, MultiHeadAttention]]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, MultiHeadAttention):
            continue
        top = name.split(".", 1)[0]
        kind = "cross" if module.cross else top if top in ("encoder", "decoder") else "self"
        groups.setdefault(kind, []).append((name, module))
    if not groups:
        raise ConfigError(f"{type(model).__name__} has no tokenloom MultiHeadAttention layers to capture "
                          "(Swin's window attention is not captured)")
    return groups


@dataclass
class AttentionCapture:
    """Captured probabilities: ``records[(kind, layer)]`` holds one (B, H, Tq, Tk) float32 tensor per call
    of that layer during the ``with`` block (one for a single forward)."""

    names: dict[tuple[str, int], str]  # (kind, layer) -> module name
    records: dict[tuple[str, int], list[Tensor]] = field(default_factory=dict)

    def get(self, kind: str, layer: int, call: int = -1) -> Tensor:
        """The probabilities of ``layer`` of ``kind`` at its ``call``-th forward (default: the last)."""
        calls = self.records.get((kind, layer))
        if calls is None:
            known = ", ".join(f"{k} {i}" for k, i in self.names) or "none"
            raise ConfigError(f"no capture for {kind} layer {layer}; captured: {known}")
        if not calls:
            raise ConfigError(f"{kind} layer {layer} ({self.names[(kind, layer)]}) did not run inside the block "
                              "(one-token decode steps are not captured: run a full forward)")
        return calls[call]

    def layers(self, kind: str) -> list[int]:
        return sorted(i for k, i in self.names if k == kind)

    def kinds(self) -> list[str]:
        return [k for k in KINDS if any(kind == k for kind, _ in self.names)]


def select_layers(model: nn.Module, layers: Iterable[int] | None = None,
                  kinds: Iterable[str] | None = None) -> dict[tuple[str, int], MultiHeadAttention]:
    """(kind, layer) -> module for ``layers`` (None = all; negative indices count from the end) of each of
    ``kinds`` (None = every kind the model has); an index out of range names the valid range."""
    groups = attention_layers(model)
    chosen = list(kinds) if kinds is not None else [k for k in KINDS if k in groups]
    for kind in chosen:
        if kind not in groups:
            raise ConfigError(f"{type(model).__name__} has no {kind!r} attention; it has: {', '.join(groups)}")
    out: dict[tuple[str, int], MultiHeadAttention] = {}
    for kind in chosen:
        n = len(groups[kind])
        for layer in (range(n) if layers is None else layers):
            if not -n <= layer < n:
                raise ConfigError(f"layer {layer} is out of range: the model has {n} {kind} attention layers "
                                  f"(0..{n - 1})")
            out[(kind, layer % n)] = groups[kind][layer % n][1]
    return out


@contextmanager
def capture_attention(model: nn.Module, layers: Iterable[int] | None = None,
                      kinds: Iterable[str] | None = None) -> Iterator[AttentionCapture]:
    """Capture the attention probabilities of ``layers`` (None = all) of ``kinds`` (None = all) during the
    ``with`` block; see the module docstring."""
    chosen = select_layers(model, layers, kinds)
    groups = attention_layers(model)
    capture = AttentionCapture(names={(kind, i): groups[kind][i][0] for kind, i in chosen})
    with capture_attention_of(list(chosen.values())) as records:
        capture.records = {key: records[id(module)] for key, module in chosen.items()}
        yield capture
