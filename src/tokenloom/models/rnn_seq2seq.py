"""The recurrent encoder-decoder with global attention (Luong et al. 2015): the translation baseline the
Transformer is measured against.

Shape legend: B decoder rows, Bm source sentences (B = Bm * g, g rows per sentence: beams), S source length,
T target positions in this call, E embed_dim, H hidden_dim, L num_layers, V vocab_size.

* ``encode(source (B, S), source_mask) -> Encoded``: embeddings -> a bidirectional (by default) LSTM or GRU of
  ``encoder_layers``, each direction H / 2 wide so the memory is (B, S, H). A right-padded source runs packed
  (``pack_padded_sequence``): each sentence gets exactly the states it gets alone, the backward direction starting
  at its own last token. The decoder's initial state comes from the encoder's final states through the ``bridge``:
  ``linear`` (default) maps the top layer's last forward and first backward states, (B, H), to every decoder
  layer's h (and an LSTM's c) with one tanh-activated linear layer; ``zeros`` starts from zeros.
* ``decode(target (B, T), encoded) -> logits (B, T, V)``: per step t, an ``num_layers`` LSTM / GRU reads
  ``[embed(y_t); h~_{t-1}]`` (input feeding, h~_0 = 0); global attention scores its top output h_t against the
  memory (``attention``: ``general`` h^T W_a s, ``dot`` h^T s, ``concat`` v^T tanh(W_1 h + W_2 s), Bahdanau's
  additive form), source padding masked out; the context c_t gives the attentional state
  ``h~_t = tanh(W_c [c_t; h_t])``, which (after dropout) is fed to the next step and projected to the vocabulary.
  The output projection is the target embedding matrix (``tie_embeddings``; through a Linear(H, E) when H != E,
  as the recurrent LM does) plus a bias over the vocabulary (OpenNMT's generator); source and target share one
  embedding over the joint vocabulary (``share_embeddings``). Weights start uniform in +-0.1 (Luong et al.), the
  embeddings N(0, 1) (:meth:`RNNEncoderDecoder._init_weights` says why).
* ``forward(source, target_in, source_mask)``: both, for teacher forcing (the ``translation`` task).

Decoding goes through :meth:`RNNEncoderDecoder.decoder_for`, which encodes the sources once and returns an
:class:`RNNSeq2SeqDecoder` with the decoder-only model protocol (``__call__(ids, positions=, attention_mask=,
cache=)``, ``create_cache``, ``config``), as the Transformer's :class:`~tokenloom.models.seq2seq.Seq2SeqDecoder`
does, so greedy, sampling and beam search from :mod:`tokenloom.generation` and ``translate`` work unchanged. Its
cache (:class:`RNNSeq2SeqCache`) is a :class:`~tokenloom.nn.recurrent.RecurrentState` (each row's h, c) plus each
row's attentional vector h~ and, per source sentence, the memory and its precomputed attention keys, shared by
that sentence's ``group`` rows (beams fold into the queries of one attention call).

The recurrences run torch's fused ``nn.LSTM`` / ``nn.GRU``; on a CPU under autocast they run in the weights' dtype
(oneDNN has no bf16 LSTM primitive there, as in :mod:`tokenloom.models.rnn`), the linear layers under autocast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..config import check, check_choice
from ..errors import GenerationError
from ..nn.dropout import Dropout
from ..nn.recurrent import RECURRENT_CELLS, RecurrentState, State, without_cpu_autocast
from ..registry import Registry
from .registry import MODELS, declare_decoding
from .sentence_groups import check_reorder, kept_sentences

# ---- parts: attention scores and bridges ------------------------------------------------------------

RNN_ATTENTIONS: Registry[type[nn.Module]] = Registry("recurrent attention")
BRIDGES: Registry[type[nn.Module]] = Registry("bridge")


@RNN_ATTENTIONS.register("dot")
class DotAttention(nn.Module):
    """Luong's dot score h^T s: ``keys(memory (Bm, S, H)) -> (Bm, S, A)`` once per source, then
    ``scores(query (Bm, g, H), keys) -> (Bm, g, S)`` per step."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()

    def keys(self, memory: Tensor) -> Tensor:
        return memory

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        return query @ keys.transpose(1, 2)  # (Bm, g, H) @ (Bm, H, S) -> (Bm, g, S)


@RNN_ATTENTIONS.register("general")
class GeneralAttention(DotAttention):
    """Luong's general score h^T W_a s, W_a s computed once per source."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__(hidden_dim)
        self.memory_proj = nn.Linear(hidden_dim, hidden_dim, bias=False)

    def keys(self, memory: Tensor) -> Tensor:
        return self.memory_proj(memory)


@RNN_ATTENTIONS.register("concat")
class ConcatAttention(nn.Module):
    """The additive score v^T tanh(W_1 h + W_2 s) (Bahdanau et al.; Luong's concat), W_2 s computed once per
    source."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.memory_proj = nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.query_proj = nn.Linear(hidden_dim, hidden_dim)
        self.v = nn.Linear(hidden_dim, 1, bias=False)

    def keys(self, memory: Tensor) -> Tensor:
        return self.memory_proj(memory)

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        mixed = torch.tanh(self.query_proj(query)[:, :, None] + keys[:, None])  # (Bm, g, S, H)
        return self.v(mixed).squeeze(-1)  # (Bm, g, S)


@BRIDGES.register("linear")
class LinearBridge(nn.Module):
    """The encoder's summary (B, H) -> every decoder layer's initial h (and c): tanh(W_b summary + b)."""

    def __init__(self, hidden_dim: int, num_layers: int, cell_state: bool) -> None:
        super().__init__()
        self.num_layers, self.parts = num_layers, 2 if cell_state else 1
        self.proj = nn.Linear(hidden_dim, self.parts * num_layers * hidden_dim)

    def forward(self, summary: Tensor) -> State:
        B, H = summary.shape
        x = torch.tanh(self.proj(summary)).view(B, self.parts, self.num_layers, H)
        x = x.permute(1, 2, 0, 3).contiguous()  # (parts, L, B, H)
        return x[0] if self.parts == 1 else (x[0], x[1])


@BRIDGES.register("zeros")
class ZeroBridge(nn.Module):
    """Every decoder layer starts from zeros (the encoder reaches the decoder through attention only)."""

    def __init__(self, hidden_dim: int, num_layers: int, cell_state: bool) -> None:
        super().__init__()
        self.num_layers, self.cell_state = num_layers, cell_state

    def forward(self, summary: Tensor) -> State:
        h = summary.new_zeros(self.num_layers, *summary.shape)  # (L, B, H)
        return (h, torch.zeros_like(h)) if self.cell_state else h


# ---- config -----------------------------------------------------------------------------------------

@dataclass
class RNNSeq2SeqConfig:
    """The recurrent encoder-decoder with attention (``model:`` with ``family: rnn_seq2seq``), Luong et al. 2015
    with a bidirectional encoder."""

    vocab_size: int = 8000  # joint source/target vocabulary
    cell: str = "lstm"  # lstm | gru (torch's fused nn.LSTM / nn.GRU), encoder and decoder
    embed_dim: int = 256  # token embedding width, E
    hidden_dim: int = 256  # decoder state and attentional width, H; the encoder's outputs too (H / 2 per
    #   direction when bidirectional)
    encoder_layers: int = 2  # stacked encoder layers
    bidirectional: bool = True  # the encoder reads the source both ways
    num_layers: int = 2  # stacked decoder layers
    attention: str = "general"  # general (h^T W_a s) | dot (h^T s) | concat (v^T tanh(W_1 h + W_2 s), additive)
    bridge: str = "linear"  # the decoder's initial state: linear (tanh of a linear map of the encoder's final
    #   states) | zeros
    dropout: float = 0.2  # on embeddings, between recurrent layers and on the attentional state h~
    share_embeddings: bool = True  # source and target embeddings are one matrix (joint vocabulary)
    tie_embeddings: bool = True  # the output projection is the target embedding matrix (through a
    #   Linear(hidden_dim, embed_dim) when the widths differ)
    max_source_len: int = 256  # longest source (tokens, EOS included) the encoder accepts
    max_target_len: int = 256  # longest target (BOS + tokens + EOS) the decoder produces
    pad_id: int = 0  # the padding token's id (the tokenizer's, filled in by training)
    bos_id: int = 1  # the id the decoder starts from
    eos_id: int = 2  # the id that ends a sentence

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "hidden_dim", "encoder_layers", "num_layers", "max_source_len",
                     "max_target_len"):
            value = getattr(self, name)
            check(value >= 1, f"{name} must be a positive integer, got {value}")
        check(not self.bidirectional or self.hidden_dim % 2 == 0,
              f"hidden_dim must be even with bidirectional: true (each direction is hidden_dim / 2 wide), got "
              f"{self.hidden_dim}")
        check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        check_choice("cell", self.cell, RECURRENT_CELLS)
        check_choice("attention", self.attention, RNN_ATTENTIONS)
        check_choice("bridge", self.bridge, BRIDGES)
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            check(0 <= value < self.vocab_size, f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def max_seq_len(self) -> int:
        """The decoder's context (the decode protocol's name for it)."""
        return self.max_target_len

    @property
    def decoder_layers(self) -> int:
        """The decoder's depth under the Transformer encoder-decoder's name for it."""
        return self.num_layers


# ---- model ------------------------------------------------------------------------------------------

class Encoded(NamedTuple):
    """What the encoder gives the decoder, per source sentence."""

    states: Tensor  # (Bm, S, H) the top layer's outputs (both directions), zeros at padding
    mask: Tensor | None  # (Bm, S) bool, True = a real token; None = no padding
    initial: State  # the decoder's initial state: h (L, Bm, H), or an LSTM's (h, c)


class AttentionMemory(NamedTuple):
    """The memory as the attention reads it, per source sentence: states, their precomputed keys, the mask."""

    states: Tensor  # (Bm, S, H)
    keys: Tensor  # (Bm, S, A)
    mask: Tensor | None  # (Bm, S) bool | None

    def select(self, sentences: Tensor) -> AttentionMemory:
        return AttentionMemory(self.states.index_select(0, sentences), self.keys.index_select(0, sentences),
                               None if self.mask is None else self.mask.index_select(0, sentences))


def _run(rnn: nn.RNNBase, x: Tensor, state: State | None, lengths: Tensor | None = None) -> tuple[Tensor, State]:
    """``rnn`` (batch_first) over ``x`` (B, T, I) from ``state`` (None: zeros) -> outputs (B, T, H * directions)
    and the final state. ``lengths`` (B,) marks right padding: the rows run packed, each over its own tokens (zeros
    out at padding). On a CPU under autocast the recurrence runs in the weights' dtype (see the module docstring)."""
    dtype = next(iter(rnn.parameters())).dtype
    with without_cpu_autocast(x):
        x = x.to(dtype)
        if state is not None:
            state = _map(state, lambda s: s.to(dtype))
        if lengths is None:
            return rnn(x, state)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, final = rnn(packed, state)
        return pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0], final


def _map(state: State, fn: Callable[[Tensor], Tensor]) -> State:
    """``fn`` applied to h, or to an LSTM's h and c."""
    return fn(state) if isinstance(state, Tensor) else (fn(state[0]), fn(state[1]))


def _repeat(state: State, group: int) -> State:
    """Each sentence's state for its ``group`` rows: (L, Bm, H) -> (L, Bm * group, H)."""
    return state if group == 1 else _map(state, lambda s: s.repeat_interleave(group, dim=1))


@declare_decoding("encoder_decoder")
class RNNEncoderDecoder(nn.Module):
    """Source embedding -> (bi)LSTM encoder -> memory and bridge; target embedding + input feeding -> LSTM decoder ->
    global attention -> attentional state h~ -> vocabulary logits."""

    def __init__(self, config: RNNSeq2SeqConfig) -> None:
        super().__init__()
        self.config = c = config
        E, H = c.embed_dim, c.hidden_dim
        directions = 2 if c.bidirectional else 1
        self.tgt_embed = nn.Embedding(c.vocab_size, E, padding_idx=c.pad_id)
        self.src_embed = self.tgt_embed if c.share_embeddings else nn.Embedding(c.vocab_size, E, padding_idx=c.pad_id)
        self.embed_dropout = Dropout(c.dropout)
        cell = RECURRENT_CELLS.get(c.cell)
        self.encoder = cell(E, H // directions, num_layers=c.encoder_layers, batch_first=True,
                            bidirectional=c.bidirectional, dropout=c.dropout if c.encoder_layers > 1 else 0.0)
        self.decoder = cell(E + H, H, num_layers=c.num_layers, batch_first=True,
                            dropout=c.dropout if c.num_layers > 1 else 0.0)  # input: [embedding; h~ of t - 1]
        self.bridge = BRIDGES.get(c.bridge)(H, c.num_layers, isinstance(self.decoder, nn.LSTM))
        self.attention = RNN_ATTENTIONS.get(c.attention)(H)
        self.combine = nn.Linear(2 * H, H, bias=False)  # W_c: [context; h] -> h~
        self.out_dropout = Dropout(c.dropout)
        tied_projection = c.tie_embeddings and H != E
        self.proj = nn.Linear(H, E, bias=False) if tied_projection else nn.Identity()
        self.lm_head = nn.Linear(E if c.tie_embeddings else H, c.vocab_size, bias=True)
        self._init_weights()
        if c.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.weight

    def _init_weights(self) -> None:
        """Luong et al.: every weight uniform in +-0.1, but the embeddings N(0, 1) (torch's default: unit scale into
        the recurrences) with a zero padding row. Embeddings of +-0.1 feed the recurrences too weak a signal: measured
        on a tiny model (E 16, H 24, 300 ids, Adam 1e-2) the loss fell to the batch's unigram loss (3.09) and stayed
        there for 80 steps, the attentional states saturated; with N(0, 1) embeddings it overfit the batch (0.002).
        (Tied to the output, unit-scale rows make the first logits large: the recipe's model starts at a loss of about
        11.4 where a uniform guess scores ln 8000 = 9.0, and is below it within 40 steps.)"""
        for p in self.parameters():
            nn.init.uniform_(p, -0.1, 0.1)
        with torch.no_grad():
            for embed in {id(m): m for m in (self.src_embed, self.tgt_embed)}.values():
                nn.init.normal_(embed.weight)
                embed.weight[self.config.pad_id].zero_()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- encoder ------------------------------------------------------------------------------------

    def encode(self, source: Tensor, source_mask: Tensor | None = None) -> Encoded:
        """(B, S) source ids, right-padded (``source_mask`` 1 = token, 0 = padding) -> :class:`Encoded`: the
        memory (B, S, H) and the decoder's initial state."""
        c = self.config
        B, S = source.shape
        if S > c.max_source_len:
            raise GenerationError(f"source of {S} tokens exceeds the model's limit of {c.max_source_len}")
        mask = lengths = None
        if source_mask is not None and not bool(source_mask.all()):
            mask = source_mask.bool()
            lengths = mask.sum(1)  # (B,)
            if not torch.equal(mask, torch.arange(S, device=mask.device)[None] < lengths[:, None]):
                raise GenerationError("the recurrent encoder needs right-padded sources (each row's tokens first, "
                                      "then its padding)")
            if not bool(lengths.all()):
                raise GenerationError("a source row holds no token (all padding)")
        x = self.embed_dropout(self.src_embed(source))  # (B, S, E)
        states, final = _run(self.encoder, x, None, lengths)  # (B, S, H)
        h = final if isinstance(final, Tensor) else final[0]  # (encoder_layers * directions, B, H / directions)
        directions = 2 if c.bidirectional else 1
        summary = h[-directions:].transpose(0, 1).reshape(B, c.hidden_dim)  # (B, H): top layer, [forward; backward]
        return Encoded(states, mask, self.bridge(summary))

    def attention_memory(self, encoded: Encoded) -> AttentionMemory:
        """The memory with its attention keys (computed once per source)."""
        return AttentionMemory(encoded.states, self.attention.keys(encoded.states), encoded.mask)

    # ---- decoder ------------------------------------------------------------------------------------

    def _attend(self, h: Tensor, memory: AttentionMemory) -> Tensor:
        """The decoder's top output h (B, H) -> the attentional state h~ (B, H), each sentence's rows (B = Bm * g)
        attending to its memory in one call."""
        B, H = h.shape
        Bm = memory.states.shape[0]
        query = h.view(Bm, B // Bm, H)  # (Bm, g, H)
        scores = self.attention.scores(query, memory.keys)  # (Bm, g, S)
        if memory.mask is not None:
            scores = scores.masked_fill(~memory.mask[:, None], float("-inf"))
        context = scores.softmax(-1).to(memory.states.dtype) @ memory.states  # (Bm, g, H)
        return self.out_dropout(torch.tanh(self.combine(torch.cat((context, query), dim=-1)))).view(B, H)

    def _recur(self, embedded: Tensor, state: State, feed: Tensor,
               memory: AttentionMemory) -> tuple[Tensor, State, Tensor]:
        """Decoder steps over (B, T, E) embedded targets from ``state`` and the fed h~ (B, H) -> h~ of every step
        (B, T, H), the new state and the last h~. The one body of teacher forcing and cached decoding."""
        out = []
        for y in embedded.unbind(1):  # (B, E) each (unbind: one gradient op for all steps, not one per slice)
            x = torch.cat((y, feed.to(y.dtype)), dim=-1)[:, None]  # (B, 1, E + H)
            h, state = _run(self.decoder, x, state)  # (B, 1, H)
            feed = self._attend(h[:, 0], memory)  # (B, H)
            out.append(feed)
        return torch.stack(out, dim=1), state, feed

    def forward_head(self, hidden: Tensor) -> Tensor:
        """(B, T, H) attentional states -> (B, T, V) logits."""
        return self.lm_head(self.proj(hidden))

    def decode(self, target: Tensor, memory: Encoded | None = None, source_mask: Tensor | None = None, *,
               positions: Tensor | None = None, cache: RNNSeq2SeqCache | None = None) -> Tensor:
        """(B, T) target ids -> (B, T, V) logits: from the encoder's initial state over ``memory`` (its Bm
        sentences' g = B / Bm rows each; ``source_mask`` is already in it), or on from a ``cache`` (made by
        :meth:`RNNSeq2SeqDecoder.create_cache`), which takes the new state. ``positions`` are accepted and
        ignored (the order is the recurrence itself)."""
        B, T = target.shape
        past = cache.length if cache is not None else 0
        if past + T > self.config.max_target_len:
            raise GenerationError(f"target of {past + T} positions exceeds the model's limit of "
                                  f"{self.config.max_target_len}")
        embedded = self.embed_dropout(self.tgt_embed(target))  # (B, T, E)
        if cache is not None:
            hidden, state, feed = self._recur(embedded, cache.state, cache.feed, cache.memory)
            cache.store(state)
            cache.feed = feed.detach()
            cache.advance(T)
            return self.forward_head(hidden)
        if memory is None:
            raise GenerationError("decode needs the encoded sources (encode's result) or a cache")
        Bm = memory.states.shape[0]
        if B % Bm:
            raise GenerationError(f"batch of {B} rows is not a multiple of the {Bm} encoded sources")
        attention = self.attention_memory(memory)
        feed = memory.states.new_zeros(B, self.config.hidden_dim)
        hidden, _, _ = self._recur(embedded, _repeat(memory.initial, B // Bm), feed, attention)
        return self.forward_head(hidden)

    def forward(self, source: Tensor, target_in: Tensor, source_mask: Tensor | None = None) -> Tensor:
        """Teacher forcing: (B, S) sources and (B, T) decoder inputs (BOS + target) -> (B, T, V) logits."""
        return self.decode(target_in, self.encode(source, source_mask))

    # ---- decoding protocol --------------------------------------------------------------------------

    def decoder_for(self, source: Tensor, source_mask: Tensor | None = None, *,
                    chunk_overlap: int | None = None) -> RNNSeq2SeqDecoder:
        """Encode ``source`` once and return the decoder as a decoder-only model for generation. ``chunk_overlap``
        (chunked encoding of long sources) is refused: the recurrent encoder reads each source in one pass."""
        if chunk_overlap is not None:
            raise GenerationError(f"chunk_overlap={chunk_overlap}: the recurrent encoder reads each source in one "
                                  f"pass of at most max_source_len={self.config.max_source_len} tokens (chunked "
                                  "encoding is for Transformer encoders)")
        with torch.inference_mode():
            encoded = self.encode(source, source_mask)
        return RNNSeq2SeqDecoder(self, encoded)


class RNNSeq2SeqCache(RecurrentState):
    """The decoder's recurrent state per row (h, and an LSTM's c, each (L, B, H): a
    :class:`~tokenloom.nn.recurrent.RecurrentState`), each row's attentional vector ``feed`` (B, H) and, for the
    ``Bm`` source sentences, the attention memory and the bridge's initial state; the ``B = Bm * group`` rows are
    that many hypotheses per sentence.

    :meth:`reorder` (beam search) may only permute rows within a sentence's group (the memory is shared);
    :meth:`select` keeps whole sentences, as :class:`~tokenloom.models.seq2seq.Seq2SeqCache` does."""

    def __init__(self, initial: State, memory: AttentionMemory, group: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        h0 = initial if isinstance(initial, Tensor) else initial[0]
        L, Bm, H = h0.shape
        super().__init__(L, Bm * group, H, not isinstance(initial, Tensor), dtype or h0.dtype, device or h0.device)
        self.initial, self.memory, self.group = initial, memory, group  # initial: each sentence's (L, Bm, H)
        self.reset()

    def reset(self) -> None:
        """Every row back to its sentence's initial state; no attentional vector fed yet."""
        dtype, device = self.h.dtype, self.h.device
        self.store(_map(_repeat(self.initial, self.group), lambda s: s.to(device=device, dtype=dtype)))
        self.feed = torch.zeros(self.h.shape[1:], dtype=dtype, device=device)  # (B, H)
        self.length = 0

    def reorder(self, index: Tensor) -> None:
        """Row i <- old row ``index[i]`` (as many rows), each within its sentence's group."""
        check_reorder(index, self.group, self.batch_size, "RNNSeq2SeqCache")
        super().select(index)
        self.feed = self.feed.index_select(0, index)

    def select(self, index: Tensor) -> None:
        """Keep the rows ``index`` of whole sentences (each sentence's ``group`` rows, reordered within the group
        as in :meth:`reorder`) and those sentences' memory."""
        sentences = kept_sentences(index, self.group, "RNNSeq2SeqCache")
        super().select(index)
        self.feed = self.feed.index_select(0, index)
        self.memory = self.memory.select(sentences)
        self.initial = _map(self.initial, lambda s: s.index_select(1, sentences))


class _DecoderConfig:
    """The parts of a config the decoding code reads. No key/value heads: the state has one size however long the
    target, so the key/value memory budget of beam search (:func:`tokenloom.models.sizes.check_kv_cache`) counts
    nothing for it."""

    def __init__(self, config: RNNSeq2SeqConfig) -> None:
        self.vocab_size = config.vocab_size
        self.max_seq_len = config.max_target_len
        self.bos_id, self.eos_id, self.pad_id = config.bos_id, config.eos_id, config.pad_id
        self.num_layers, self.hidden_dim = config.num_layers, config.hidden_dim


class RNNSeq2SeqDecoder:
    """The recurrent decoder bound to encoded sources, with the decoder-only model protocol."""

    def __init__(self, model: RNNEncoderDecoder, encoded: Encoded) -> None:
        self.model, self.encoded = model, encoded
        self.config = _DecoderConfig(model.config)

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> RNNSeq2SeqDecoder:
        self.model.train(mode)
        return self

    def eval(self) -> RNNSeq2SeqDecoder:
        return self.train(False)

    def parameters(self):
        return self.model.parameters()

    def modules(self):
        return self.model.modules()

    def create_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> RNNSeq2SeqCache:
        """A cache for ``batch_size`` rows: a multiple of the number of sources (beams per sentence). ``max_len``
        is accepted for the protocol and changes nothing."""
        Bm = self.encoded.states.shape[0]
        if batch_size % Bm:
            raise GenerationError(f"batch of {batch_size} rows is not a multiple of the {Bm} encoded sources")
        with torch.inference_mode():
            memory = self.model.attention_memory(self.encoded)
        return RNNSeq2SeqCache(self.encoded.initial, memory, batch_size // Bm, dtype, device)

    def __call__(self, input_ids: Tensor, *, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                 cache: RNNSeq2SeqCache | None = None) -> Tensor:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise GenerationError("decoder prompts cannot be padded (they all start with BOS)")
        if cache is None:
            return self.model.decode(input_ids, self.encoded)
        return self.model.decode(input_ids, cache=cache)


MODELS.register("rnn_seq2seq")((RNNSeq2SeqConfig, RNNEncoderDecoder))
