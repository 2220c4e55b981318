"""How much memory a model of a config takes, estimated from the config alone (nothing is built), for the
resource budgets (:mod:`tokenloom.budget`).

The estimate counts the big tensors, each as ``values x 4 bytes`` (float32, the dtype models are built in):

* per attention layer ``2 C^2 + 2 C Hkv D`` (query and output projections, keys and values), per MLP
  ``2 C F`` (``3 C F`` for swiglu), ``F`` the MLP width; Linformer adds ``2 k max_len`` per attention;
* per recurrent layer ``G H (I + H)`` (G gates: 4 for an LSTM, 3 for a GRU; I its input width, E or H; per
  direction of a bidirectional encoder); a recurrent encoder-decoder's attention, ``W_c`` and bridge;
* embeddings ``V C`` (twice when not tied or shared), GPT's value embeddings ``k V Hkv D``, the classifier ``C K``,
  the patch projection;
* position tables: learned and sinusoidal ``max_len x C`` (a sinusoid is computed in float64: 12 bytes a value
  while it is built), RoPE's cos and sin ``2 x max_len x D``; Swin's relative-position tables and indices.

Biases and norms (a few values per layer) are left out, so the estimate is a lower bound within a few percent.
Each part names the config fields it grows with, so an error can say which setting is too large.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..nn.attention import backend_options
from .gpt import GPTConfig
from .rnn import RNNConfig
from .rnn_seq2seq import RNNSeq2SeqConfig
from .seq2seq import Seq2SeqConfig
from .swin import SwinConfig
from .universal import UniversalConfig
from .vit import ViTConfig

FLOAT32 = 4


@dataclass(frozen=True)
class Part:
    """One group of tensors of a model: the setting it grows with (``model.num_layers=6``), what it is, its
    values, bytes per value while built, and whether they are trained parameters (a trainer adds gradients and
    optimizer moments for those)."""

    setting: str
    what: str
    values: int
    bytes_per_value: int = FLOAT32
    parameter: bool = True

    @property
    def bytes(self) -> int:
        return self.values * self.bytes_per_value


def _attention(c: Any, kv_heads: int, max_len: int) -> int:
    values = 2 * c.embed_dim * c.embed_dim + 2 * c.embed_dim * kv_heads * c.head_dim
    if getattr(c, "attention", None) == "linformer":
        values += 2 * backend_options("linformer", c.attention_options)["k"] * max_len
    return values


def _mlp(embed_dim: int, hidden: int, kind: str) -> int:
    return (3 if kind == "swiglu" else 2) * embed_dim * hidden


def _positions(prefix: str, field: str, position: str, max_len: int, c: Any) -> list[Part]:
    setting, what = f"{prefix}{field}={max_len}", f"{position} position table of {max_len} positions"
    if position == "learned":
        return [Part(setting, what, max_len * c.embed_dim)]
    if position.startswith("sinusoidal"):
        return [Part(setting, what, max_len * c.embed_dim, 8 + FLOAT32, parameter=False)]
    if position == "rope":
        return [Part(setting, what, 2 * max_len * c.head_dim, parameter=False)]
    return []  # alibi, t5, none: nothing per position


def _gpt(c: GPTConfig, prefix: str) -> list[Part]:
    kv = c.num_kv_heads or c.num_heads
    block = _attention(c, kv, c.max_seq_len) + _mlp(c.embed_dim, c.mlp_hidden, c.mlp)
    return [Part(f"{prefix}num_layers={c.num_layers}", f"{c.num_layers} blocks of width {c.embed_dim}",
                 c.num_layers * block),
            Part(f"{prefix}vocab_size={c.vocab_size}", f"embeddings of {c.vocab_size} tokens",
                 c.vocab_size * c.embed_dim * (1 if c.tie_embeddings else 2)),
            *_positions(prefix, "max_seq_len", c.position, c.max_seq_len, c),
            *([Part(f"{prefix}value_embeddings={c.value_embeddings}", f"{c.value_embeddings} value-embedding tables",
                    c.value_embeddings * c.vocab_size * kv * c.head_dim)] if c.value_embeddings else [])]


def _universal(c: UniversalConfig, prefix: str) -> list[Part]:
    kv = c.num_kv_heads or c.num_heads
    block = _attention(c, kv, c.max_seq_len) + _mlp(c.embed_dim, c.mlp_hidden, c.mlp)
    return [Part(f"{prefix}embed_dim={c.embed_dim}", f"one shared block of width {c.embed_dim}", block),
            Part(f"{prefix}vocab_size={c.vocab_size}", f"embeddings of {c.vocab_size} tokens",
                 c.vocab_size * c.embed_dim * (1 if c.tie_embeddings else 2)),
            *_positions(prefix, "max_seq_len", c.position, c.max_seq_len, c)]


def _seq2seq(c: Seq2SeqConfig, prefix: str) -> list[Part]:
    kv = c.num_kv_heads or c.num_heads
    longest = max(c.max_source_len, c.max_target_len)
    attention, mlp = _attention(c, kv, longest), _mlp(c.embed_dim, c.mlp_hidden, c.mlp)
    matrices = (1 if c.share_embeddings else 2) + (0 if c.tie_embeddings else 1)
    return [Part(f"{prefix}encoder_layers={c.encoder_layers}", f"{c.encoder_layers} encoder blocks of width "
                 f"{c.embed_dim}", c.encoder_layers * (attention + mlp)),
            Part(f"{prefix}decoder_layers={c.decoder_layers}", f"{c.decoder_layers} decoder blocks of width "
                 f"{c.embed_dim}", c.decoder_layers * (2 * attention + mlp)),
            Part(f"{prefix}vocab_size={c.vocab_size}", f"embeddings of {c.vocab_size} tokens",
                 matrices * c.vocab_size * c.embed_dim),
            *_positions(prefix, "max_source_len", c.position, c.max_source_len, c),
            *_positions(prefix, "max_target_len", c.position, c.max_target_len, c)]


def _vit(c: ViTConfig, prefix: str) -> list[Part]:
    tokens = c.grid_size[0] * c.grid_size[1] + c.num_prefix_tokens
    block = _attention(c, c.num_heads, tokens) + _mlp(c.embed_dim, c.mlp_hidden, c.mlp)
    return [Part(f"{prefix}num_layers={c.num_layers}", f"{c.num_layers} blocks of width {c.embed_dim}",
                 c.num_layers * block),
            Part(f"{prefix}image_size={c.image_size}", f"position table of {tokens} patches",  # sincos: no class token
                 (tokens if c.position == "learned" else tokens - c.num_prefix_tokens) * c.embed_dim,
                 parameter=c.position == "learned"),
            Part(f"{prefix}patch_size={c.patch_size}", "patch projection",
                 c.in_channels * c.patch_size ** 2 * c.embed_dim),
            Part(f"{prefix}num_classes={c.num_classes}", "classifier", c.num_classes * c.embed_dim)]


def _swin(c: SwinConfig, prefix: str) -> list[Part]:
    window, blocks, tables = c.window_size, 0, 0
    for i, (dim, depth, heads) in enumerate(zip(c.stage_dims, c.depths, c.num_heads, strict=True)):
        merge = 8 * dim * dim if i < len(c.depths) - 1 else 0  # patch merging: 4C -> 2C
        blocks += depth * (4 * dim * dim + _mlp(dim, int(c.mlp_ratio * dim), c.mlp)) + merge
        tables += depth * (2 * window - 1) ** 2 * heads
    indices = sum(c.depths) * window ** 4  # each block's (M^2, M^2) int64 relative-position index
    return [Part(f"{prefix}depths={c.depths}", f"{sum(c.depths)} blocks from width {c.embed_dim}", blocks),
            Part(f"{prefix}window_size={window}", "relative position tables", tables),
            Part(f"{prefix}window_size={window}", "relative position indices", indices, 8, parameter=False),
            Part(f"{prefix}patch_size={c.patch_size}", "patch projection",
                 c.in_channels * c.patch_size ** 2 * c.embed_dim),
            Part(f"{prefix}num_classes={c.num_classes}", "classifier", c.num_classes * c.num_features)]


def _rnn(c: RNNConfig, prefix: str) -> list[Part]:
    gates = 4 if c.cell == "lstm" else 3  # LSTM: input, forget, cell, output; GRU: reset, update, new
    E, H = c.embed_dim, c.hidden
    layers = gates * H * (E + H) + (c.num_layers - 1) * gates * H * 2 * H
    head = H * E if c.tie_embeddings and H != E else 0 if c.tie_embeddings else H * c.vocab_size
    return [Part(f"{prefix}num_layers={c.num_layers}", f"{c.num_layers} {c.cell} layers of width {H}", layers),
            Part(f"{prefix}vocab_size={c.vocab_size}", f"embeddings of {c.vocab_size} tokens", c.vocab_size * E + head)]


def _rnn_seq2seq(c: RNNSeq2SeqConfig, prefix: str) -> list[Part]:
    gates = 4 if c.cell == "lstm" else 3
    E, H, L = c.embed_dim, c.hidden_dim, c.num_layers
    D = 2 if c.bidirectional else 1
    Hd = H // D  # the encoder's width per direction
    encoder = D * gates * Hd * (E + Hd) + (c.encoder_layers - 1) * D * gates * Hd * (H + Hd)
    decoder = gates * H * (E + 2 * H) + (L - 1) * gates * H * 2 * H  # input feeding: [embedding; h~]
    attention = {"general": H * H, "dot": 0, "concat": 2 * H * H + H}[c.attention]
    bridge = (2 if c.cell == "lstm" else 1) * L * H * H if c.bridge == "linear" else 0
    head = H * E if c.tie_embeddings and H != E else 0 if c.tie_embeddings else H * c.vocab_size
    return [Part(f"{prefix}encoder_layers={c.encoder_layers}", f"{c.encoder_layers} {c.cell} encoder layers of "
                 f"width {H}", encoder),
            Part(f"{prefix}num_layers={L}", f"{L} {c.cell} decoder layers of width {H}", decoder),
            Part(f"{prefix}hidden_dim={H}", f"attention, attentional layer and bridge of width {H}",
                 attention + 2 * H * H + bridge),
            Part(f"{prefix}vocab_size={c.vocab_size}", f"embeddings of {c.vocab_size} tokens",
                 (1 if c.share_embeddings else 2) * c.vocab_size * E + head)]


_ESTIMATES: list[tuple[type, Callable[[Any, str], list[Part]]]] = [
    (GPTConfig, _gpt), (Seq2SeqConfig, _seq2seq), (ViTConfig, _vit), (SwinConfig, _swin),
    (RNNConfig, _rnn), (RNNSeq2SeqConfig, _rnn_seq2seq), (UniversalConfig, _universal)]  # NATConfig: seq2seq


def model_parts(config: Any, prefix: str = "model.") -> list[Part]:
    """The model's big tensors as :class:`Part` s (empty for a config this module does not know)."""
    for cls, estimate in _ESTIMATES:
        if isinstance(config, cls):
            return estimate(config, prefix)
    return []


def parameter_count(config: Any) -> int:
    """About how many trained parameters the model of ``config`` has (a lower bound; see the module docstring)."""
    return sum(p.values for p in model_parts(config) if p.parameter)


def training_flops_per_token(config: Any, parameters: int, seq_len: int | None = None) -> float | None:
    """Training FLOPs per token (forward + backward) of a GPT of ``parameters`` parameters over windows of
    ``seq_len`` tokens (None: ``max_seq_len``): ``6 N`` for the matrix products of the N parameters plus
    ``12 L C T`` for attention's scores and weighted sums (Chowdhery et al. 2022, appendix B; nanoGPT's
    ``estimate_mfu``). None for the other families (no estimate: no MFU)."""
    if not isinstance(config, GPTConfig):
        return None
    return 6 * parameters + 12 * config.num_layers * config.embed_dim * (seq_len or config.max_seq_len)


def check_model_memory(config: Any, prefix: str = "model.") -> None:
    """Refuse to build a model that cannot fit in memory (:func:`tokenloom.budget.check_memory`), naming the
    setting of its largest part: ``model.num_layers=1000000000: the model needs about 6.4 PiB of memory ...``."""
    from ..budget import check_memory

    parts = model_parts(config, prefix)
    if parts:
        largest = max(parts, key=lambda p: p.bytes)
        check_memory(f"{largest.setting}: the model", ((p.what, p.bytes) for p in parts))


TRAINING_BYTES_PER_PARAMETER = 16  # float32 weights, their gradients, AdamW's two moments (bf16 masters add more)
ACTIVATION_VALUES_PER_LAYER = 16  # values of width C a GPT block keeps per token for backward (about: the norms'
#   inputs, q, k, v, the attention output, the MLP's input, its hidden activations before and after the non-linearity)


def training_parts(config: Any, batch_size: int, seq_len: int | None, *, activation_checkpointing: bool = False,
                   prefix: str = "model.") -> list[Part]:
    """What training the model of ``config`` holds at once: every trained parameter at
    ``TRAINING_BYTES_PER_PARAMETER``, the tables as built, and for a GPT the activations of a micro-batch of
    ``batch_size x seq_len`` tokens (``seq_len`` None: ``max_seq_len``): ``ACTIVATION_VALUES_PER_LAYER x C`` per
    token and layer (one layer's worth plus each block's input under activation checkpointing), plus the logits,
    4 bytes each. Other families count their parameters and tables only."""
    parts = model_parts(config, prefix)
    params = sum(p.values for p in parts if p.parameter)
    out = [Part(p.setting, p.what, p.values, p.bytes_per_value) for p in parts if not p.parameter]
    if params:
        largest = max((p for p in parts if p.parameter), key=lambda p: p.values)
        out.append(Part(largest.setting, f"weights, gradients and AdamW moments of {params:,} parameters", params,
                        TRAINING_BYTES_PER_PARAMETER))
    if isinstance(config, GPTConfig):
        T = seq_len or config.max_seq_len
        C, L = config.embed_dim, config.num_layers
        per_token = (L + ACTIVATION_VALUES_PER_LAYER) * C if activation_checkpointing else \
            L * ACTIVATION_VALUES_PER_LAYER * C
        # named after the largest of its factors: the batch, the sequence, or the depth
        _, setting = max((batch_size, f"train.batch_size={batch_size}"),
                         (T, f"train.seq_len={seq_len}" if seq_len else f"{prefix}max_seq_len={config.max_seq_len}"),
                         (L, f"{prefix}num_layers={L}"))
        out.append(Part(setting, f"activations of {batch_size} x {T} tokens through {L} layers",
                        batch_size * T * (per_token + config.vocab_size)))
    return out


def check_kv_cache(config: Any, rows: int, length: int, bytes_per_value: int, what: str, *, copies: int = 1,
                   extra: Iterable[tuple[str, float]] = (), error: type | None = None) -> None:
    """Refuse a preallocated key/value cache of ``rows`` sequences of ``length`` positions
    (:func:`tokenloom.budget.kv_cache_bytes`: the decoder's layers x 2 x rows x key/value heads x length x head_dim
    values; ``copies`` of it held at once) that cannot fit in memory, before it is allocated, with the ``extra``
    (label, bytes) allocated alongside; ``what`` names the request (``'--max-batch 100000'``).
    An encoder-decoder's cross-attention keys and values (per source position) are not counted."""
    from ..budget import check_memory, describe_kv_cache, kv_cache_bytes
    from ..errors import GenerationError

    layers = config.decoder_layers if isinstance(config, Seq2SeqConfig) else \
        config.max_steps if isinstance(config, UniversalConfig) else getattr(config, "num_layers", 0)  # (UT: a layer
    #   of the cache per step)
    heads = getattr(config, "num_kv_heads", None) or getattr(config, "num_heads", 0)
    shape = (layers, rows, heads, length, getattr(config, "head_dim", 0), bytes_per_value)
    label = describe_kv_cache(*shape) if copies == 1 else f"{copies} x {describe_kv_cache(*shape)}"
    check_memory(what, [(label, copies * kv_cache_bytes(*shape)), *extra], error=error or GenerationError)
