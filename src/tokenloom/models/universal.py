"""Universal Transformer language model (Dehghani et al. 2019) with Adaptive Computation Time (Graves 2016).

Shape legend: B batch, T new positions in this call, S = cached + new positions, C embed_dim, H num_heads,
D head_dim, V vocab_size, M max_steps.

One shared block is applied up to M times (recurrence in depth). Before step m every position's state gets the
coordinate signal again: its position's embedding (where the position scheme adds one) and a sinusoidal timestep
embedding of m. With ``act`` each position halts on its own (:mod:`tokenloom.nn.act`): a halting unit reads the
state after each step, and the output is the halting-weighted sum of the states; a position that halted keeps its
state unchanged in later steps (the block still runs over it, so it still serves as keys and values to the
positions that run on). Without ``act`` the block runs exactly M times (the same-size fixed-depth baseline).

The model follows the causal decoding protocol of :class:`~tokenloom.models.gpt.GPT` (generate, beam search,
the server): ``forward(ids, positions=, attention_mask=, cache=) -> (B, T, V)`` and ``create_cache``, a dense
:class:`~tokenloom.nn.KVCache` with one layer per step. Every call runs all M steps over its new positions (a
halted position's frozen state still writes its keys and values of the later steps), so step m of a new
token attends over exactly the step-m keys and values the full forward computes, and cached decoding equals the
uncached forward. Only a pass without a cache stops early, once every position halted (its output is final).

The ponder count N + R per position comes out as data (:meth:`UniversalTransformer.forward_ponder`); the
model is declared to ponder (:func:`~tokenloom.models.registry.declare_ponder`), so the language-modelling
task adds ``ponder_cost * mean(N + R)`` to its training loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..config import check
from ..nn import POSITIONS, KVCache, create_block, create_norm
from ..nn.act import HaltingUnit, act_step
from ..nn.attention import Context
from ..nn.block import StepFunctions, step_functions
from ..nn.dropout import Dropout
from ..nn.kv_cache import DecodeCache
from ..nn.positions import sinusoid_table
from .counting import CountsParameters
from .gpt import causal_context, causal_span, init_gpt_weights, mask_dtype
from .options import attention_options, check_block_options
from .registry import MODELS, declare_decoding, declare_documents, declare_ponder


@dataclass
class UniversalConfig:
    """A Universal Transformer LM: one shared block applied up to ``max_steps`` times, with ACT halting per
    position (``model:`` with ``family: universal``)."""

    vocab_size: int = 65  # number of token ids
    max_steps: int = 6  # most applications of the shared block (M); the KV cache has one layer per step
    act: bool = True  # adaptive computation time: each position halts on its own (False: exactly max_steps steps)
    act_eps: float = 0.01  # ACT's epsilon: a position halts once its halting probabilities sum to 1 - act_eps
    ponder_cost: float = 0.01  # tau: the training loss adds tau * mean(N + R), the mean ponder count
    scale_embeddings: bool = True  # multiply token embeddings by sqrt(embed_dim), as the original Transformer and
    #   the Universal Transformer do: the position and timestep signals added before every step have amplitude 1
    halting_bias: float = 1.0  # initial bias of the halting unit (higher: higher first probabilities, fewer steps)
    num_heads: int = 6  # query heads of the attention layer
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = num_heads
    embed_dim: int = 384  # width of the residual stream, C
    max_seq_len: int = 256  # longest context the model accepts
    position: str = "sinusoidal"  # sinusoidal | learned | rope | alibi | t5 | none: the position signal (an added
    #   one is added before every step, with the timestep signal)
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_placement: str = "pre"  # pre (GPT-2) | post (original Transformer, as in the Universal Transformer)
    norm_eps: float = 1e-5  # epsilon of every norm layer
    mlp: str = "gelu"  # gelu | gelu_tanh | relu | swiglu
    mlp_ratio: float = 4.0  # MLP hidden width = mlp_ratio * embed_dim (swiglu: 2/3 of it, a multiple of 8)
    mlp_hidden_dim: int | None = None  # exact MLP hidden width (swiglu: gate/up width); None = from mlp_ratio
    attention: str = "sdpa"  # attention backend: sdpa (fused) | math (explicit, can return weights) | performer
    attention_options: dict | None = None  # the backend's own options: performer {features, redraw}
    dropout: float = 0.0  # dropout on embeddings, attention probabilities and residual branches
    attention_dropout: float | None = None  # dropout on attention probabilities; None = dropout
    bias: bool = True  # biases in linear and norm layers
    tie_embeddings: bool = True  # output projection shares the token embedding matrix
    rope_base: float = 10000.0  # RoPE frequency base
    rope_scaling: dict | None = None  # RoPE frequency scaling, e.g. {type: linear, factor: 2.0}
    head_dim: int = field(init=False, default=0)  # derived: embed_dim // num_heads
    mlp_hidden: int = field(init=False, default=0)  # derived: the MLP hidden width the model builds
    max_positions: int = field(init=False, default=0)  # derived: the most positions a sequence may reach

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_heads", "embed_dim", "max_seq_len"):
            value = getattr(self, name)
            check(value >= 1, f"{name} must be a positive integer, got {value}")
        check(isinstance(self.max_steps, int) and self.max_steps >= 1,
              f"max_steps must be >= 1, got {self.max_steps}")
        check(self.ponder_cost >= 0, f"ponder_cost (tau) must be >= 0, got {self.ponder_cost}")
        check(0 < self.act_eps < 1, f"act_eps must be in (0, 1), got {self.act_eps}")
        check(self.position != "xl", "position 'xl' needs a segment memory (GPT's memory_len); use sinusoidal, "
                                     "learned, rope, alibi, t5 or none")
        check(self.attention != "linformer", "attention 'linformer' is non-causal (its projections mix all "
                                             "positions) and this model attends causally; use performer or sdpa")
        check_block_options(self)
        self.max_positions = self.max_seq_len


def timing_signal_table(max_steps: int, embed_dim: int) -> Tensor:
    """(M, C) the sinusoidal timestep signal: row m is added to every position's state before step m (0-based)."""
    return sinusoid_table(max_steps, embed_dim)


def with_coordinates(x: Tensor, signal: Tensor | None, timestep: Tensor, step: int) -> Tensor:
    """(..., C) states ``x`` plus the coordinate signal of ``step`` (0-based), what the shared block reads before
    every step: the positions' embedding ``signal`` (..., C), None where the position scheme adds none (RoPE,
    ALiBi, T5), and row ``step`` of the (M, C) ``timestep`` table (:func:`timing_signal_table`)."""
    return x + timestep[step] if signal is None else x + signal + timestep[step]


class PonderOutput(NamedTuple):
    """:meth:`UniversalTransformer.forward_ponder`'s result."""

    logits: Tensor  # (B, T, V)
    ponder: Tensor  # (B, T) the ponder count N + R of each position (max_steps everywhere without ACT)


class _Pass(NamedTuple):
    hidden: Tensor  # (B, T, C) final hidden states (final norm applied)
    ponder: Tensor  # (B, T)
    weights: list[Tensor | None]  # per step: attention probabilities (B, H, T, S) where asked for and given


@declare_ponder
@declare_documents
@declare_decoding("causal_lm")
class UniversalTransformer(CountsParameters, nn.Module):
    """Token embedding -> the shared block, up to ``max_steps`` times (ACT) -> final norm -> vocabulary logits."""

    def __init__(self, config: UniversalConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tok_embed = nn.Embedding(c.vocab_size, c.embed_dim)
        self.position = POSITIONS.get(c.position)(
            embed_dim=c.embed_dim, num_heads=c.num_heads, head_dim=c.head_dim, max_seq_len=c.max_seq_len,
            num_layers=c.max_steps, memory_len=0,
            **({"base": c.rope_base, "scaling": c.rope_scaling} if c.position == "rope" else {}))
        self.embed_dropout = Dropout(c.dropout)
        self.block = create_block(c.norm_placement, c.embed_dim, c.num_heads, c.num_kv_heads,
                                  hidden_dim=c.mlp_hidden, mlp=c.mlp, norm=c.norm, attention=c.attention,
                                  dropout=c.dropout, bias=c.bias, norm_eps=c.norm_eps,
                                  attention_dropout=c.attention_dropout,
                                  attention_options=attention_options(c, c.max_seq_len))
        self.final_norm = create_norm(c.norm, c.embed_dim, bias=c.bias, eps=c.norm_eps) \
            if c.norm_placement == "pre" else nn.Identity()
        self.lm_head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)
        init_gpt_weights(self, c.max_steps)
        self.halting = HaltingUnit(c.embed_dim, c.halting_bias) if c.act else None  # (its own initialisation)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight
        self.embed_scale = c.embed_dim ** 0.5 if c.scale_embeddings else 1.0
        self.register_buffer("timestep", timing_signal_table(c.max_steps, c.embed_dim), persistent=False)  # (M, C)

    @property
    def ponder_cost(self) -> float:
        """tau, the weight of the mean ponder count in the training loss (0 without ACT: nothing to learn)."""
        return self.config.ponder_cost if self.config.act else 0.0

    def create_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None, rolling: bool | None = None) -> KVCache:
        """A dense cache of ``max_steps`` layers (one per step) for ``batch_size`` sequences of up to ``max_len``
        positions (default max_seq_len). ``rolling`` is accepted for the protocol (no sliding window here)."""
        c, ref = self.config, self.tok_embed.weight
        return KVCache(c.max_steps, batch_size, c.num_kv_heads or c.num_heads, max_len or c.max_seq_len, c.head_dim,
                       dtype=dtype or ref.dtype, device=device or ref.device)

    def forward_features(self, input_ids: Tensor, *, positions: Tensor | None = None,
                         attention_mask: Tensor | None = None, cache: DecodeCache | None = None,
                         need_weights: bool = False, documents: Tensor | None = None
                         ) -> tuple[Tensor, list[Tensor | None]]:
        """(B, T) ids -> (B, T, C) final hidden states (the ACT-weighted sum of the steps' states, normed), and
        per step the attention probabilities (B, H, T, S) when ``need_weights`` and the backend returns them
        (``math``). ``positions``, ``attention_mask``, ``cache`` and ``documents`` as in :meth:`GPT.forward_features
        <tokenloom.models.gpt.GPT.forward_features>`."""
        out = self._run(input_ids, positions, attention_mask, cache, need_weights,
                        self._steps(cache, input_ids.shape[1], need_weights), documents)
        return out.hidden, out.weights

    def forward_head(self, hidden: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, V) logits."""
        return self.lm_head(hidden)

    def forward_ponder(self, input_ids: Tensor, *, positions: Tensor | None = None,
                       attention_mask: Tensor | None = None, cache: DecodeCache | None = None,
                       documents: Tensor | None = None) -> PonderOutput:
        """(B, T) token ids -> (B, T, V) logits and (B, T) ponder counts N + R."""
        steps = self._steps(cache, input_ids.shape[1])
        out = self._run(input_ids, positions, attention_mask, cache, False, steps, documents)
        logits = steps.head(out.hidden[:, 0])[:, None] if steps is not None else self.forward_head(out.hidden)
        return PonderOutput(logits, out.ponder)

    def forward(self, input_ids: Tensor, *, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: DecodeCache | None = None, documents: Tensor | None = None) -> Tensor:
        """(B, T) token ids -> (B, T, V) logits; ``documents`` (B, T): packed examples' ids (as GPT's)."""
        return self.forward_ponder(input_ids, positions=positions, attention_mask=attention_mask, cache=cache,
                                   documents=documents).logits

    def _steps(self, cache: DecodeCache | None, T: int, need_weights: bool = False) -> StepFunctions | None:
        """The plain one-token step functions (the shared block bound once) for ``cache``, or None where the
        modules run (training, more than one position, weights asked for, hooks; as GPT)."""
        if T != 1 or cache is None or not cache.plain or need_weights or self.training:
            return None
        return step_functions(self, cache, self._decoder_parts)

    def _decoder_parts(self) -> tuple[list[nn.Module], nn.Module, nn.Linear]:
        return [self.block], self.final_norm, self.lm_head

    def _run(self, input_ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None,
             cache: DecodeCache | None, need_weights: bool, steps: StepFunctions | None,
             documents: Tensor | None = None) -> _Pass:
        """The recurrence over the steps, through the modules or (``steps``) the plain one-token functions."""
        c = self.config
        B, T = input_ids.shape
        position = self.position
        span, positions = causal_span(input_ids, positions, attention_mask, cache, position, c.max_positions,
                                      c.max_seq_len, documents)
        x = self.tok_embed(input_ids) * self.embed_scale  # (B, T, C)
        if self.training:
            x = self.embed_dropout(x)
        signal = position.embed(positions)  # (B, T, C) or None: added before every step
        ctx = causal_context(span, positions, T, position, None, mask_dtype(x), need_weights)
        layers = cache.layers if cache is not None else [None] * c.max_steps
        if steps is not None:  # one position per row: (B, C)
            x = x.view(B, -1)
            signal = signal.view(B, -1) if signal is not None else None
            block = steps.blocks[0]

            def run(h: Tensor, layer) -> tuple[Tensor, None]:
                return block(h, Context(ctx.mask, False, ctx.rope, layer, ragged=span.ragged, band=ctx.band)), None
        else:
            def run(h: Tensor, layer) -> tuple[Tensor, Tensor | None]:
                return self.block(h, ctx._replace(cache=layer), need_weights=need_weights)

        acc, weights = None, []
        for m, layer in enumerate(layers):
            y, w = run(with_coordinates(x, signal, self.timestep, m), layer)
            weights.append(w)
            if self.halting is None:
                x = y
                continue
            p = self.halting(y).float()  # (B, T) | (B,): ACT's sums in float32 (also under autocast)
            acc = act_step(acc, p, y, c.act_eps, last=m == c.max_steps - 1)
            x = torch.where(acc.ran.unsqueeze(-1), y, x)  # a halted position keeps its state
            if cache is None and not need_weights and not bool(acc.running.any()):
                break  # every position halted: later steps change no output (no cache to fill)
        if cache is not None:
            cache.advance(T)
        if acc is None:
            hidden, ponder = x, torch.full(x.shape[:-1], float(c.max_steps), device=x.device)
        else:
            hidden, ponder = acc.output.to(y.dtype), acc.ponder  # (ACT sums in float32; back to the states' dtype)
        if steps is not None:
            return _Pass(steps.final_norm(hidden).view(B, 1, -1), ponder.view(B, 1), weights)
        return _Pass(self.final_norm(hidden), ponder, weights)


MODELS.register("universal")((UniversalConfig, UniversalTransformer))
