"""The encoder-decoder's sliding-window encoder (encoder_attention_window / encoder_attention_global): the block-wise
and dense paths against a mask written from the definition, the reach of L layers, padding, a window covering the
source, the full-attention decoder, and the config checks."""

from __future__ import annotations

import pytest
import torch

from tokenloom import EncoderDecoder, Seq2SeqConfig
from tokenloom.errors import ConfigError
from tokenloom.interop import HF_CONVERTERS
from tokenloom.nn import sliding as sliding_module
from tokenloom.nn.attention import Context, capture_attention_of
from tokenloom.nn.masks import additive_mask
from tokenloom.nn.sliding import Band

VARIANTS = {
    "paper": {},
    "modern": dict(norm_placement="pre", position="rope", norm="rmsnorm", mlp="swiglu", num_kv_heads=2, bias=False),
    "t5": dict(position="t5"),
    "alibi": dict(position="alibi"),
}
S = 100  # long enough for the block-wise path at W = 8 (blocks of 16)


def make(seed: int = 0, **overrides) -> EncoderDecoder:
    torch.manual_seed(seed)
    config = dict(vocab_size=50, encoder_layers=2, decoder_layers=2, num_heads=4, embed_dim=32, max_source_len=128,
                  max_target_len=20, dropout=0.0, encoder_attention_window=8)
    model = EncoderDecoder(Seq2SeqConfig(**{**config, **overrides})).eval()
    if model.config.position == "t5":  # a bias that is not zero
        torch.nn.init.normal_(model.src_position.weight.weight)
    return model


def source(rows: int = 2, length: int = S, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 50, (rows, length), generator=torch.Generator().manual_seed(seed))


def reference_encode(model: EncoderDecoder, src: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The encoder run with the (S, S) mask written from the definition, position by position: |i - j| <= W // 2,
    or either one among the first g (global) positions; padding keys hidden."""
    c = model.config
    B, T = src.shape
    half, g = c.encoder_attention_window // 2, c.encoder_attention_global
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            allowed[i, j] = abs(i - j) <= half or i < g or j < g
    valid = torch.ones(B, T, dtype=torch.bool) if mask is None else mask.bool()
    attn_mask = additive_mask(allowed[None, None] & valid[:, None, None, :], torch.float32)
    position, index = model.src_position, torch.arange(T)
    if position.has_bias:
        attn_mask = attn_mask + position.bias(index, index)
    positions = index[None].expand(B, T)
    x = model._embed(src, model.src_embed, position, positions)
    ctx = Context(attn_mask, False, position.rotary(positions))
    for block in model.encoder:
        x, _ = block(x, ctx)
    return model.encoder_norm(x)


def dense(monkeypatch) -> None:
    monkeypatch.setattr(sliding_module, "MIN_BANDED_BLOCKS", 10**9)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("globals_", [0, 3])
def test_banded_and_dense_encoders_equal_the_definition(variant, globals_, monkeypatch):
    model = make(encoder_attention_global=globals_, **VARIANTS[variant])
    src = source()
    calls = []
    attend = Band.attend
    monkeypatch.setattr(Band, "attend", lambda self, *args: calls.append(1) or attend(self, *args))
    with torch.no_grad():
        expected = reference_encode(model, src, None)
        banded = model.encode(src)
        assert len(calls) == model.config.encoder_layers  # every encoder layer ran block-wise
        dense(monkeypatch)
        dense_out = model.encode(src)
        assert len(calls) == model.config.encoder_layers
    torch.testing.assert_close(banded, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(dense_out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("banded", [True, False])
def test_a_token_reaches_layers_times_half_the_window(banded, monkeypatch):
    """Position p's output depends on the source tokens within L * (W // 2) of it and on none farther away."""
    if not banded:
        dense(monkeypatch)
    model = make()
    reach = model.config.encoder_layers * (model.config.encoder_attention_window // 2)  # 8
    src, p = source(rows=1), 50
    with torch.no_grad():
        base = model.encode(src)[0, p]
        for offset, changes in ((reach + 1, False), (-reach - 1, False), (reach, True), (-reach, True)):
            changed = src.clone()
            changed[0, p + offset] = 3 if src[0, p + offset] != 3 else 4
            out = model.encode(changed)[0, p]
            assert (not torch.allclose(out, base, atol=1e-6)) == changes, offset


@pytest.mark.parametrize("variant", ["paper", "modern", "t5"])
@pytest.mark.parametrize("globals_", [0, 2])
def test_padded_batch_equals_each_row_alone(variant, globals_):
    model = make(encoder_attention_global=globals_, **VARIANTS[variant])
    src, lengths = source(rows=3), [S, 70, 90]  # 70 alone: too short to run banded
    mask = torch.zeros_like(src)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        src[row, length:] = 0
    with torch.no_grad():
        padded, expected = model.encode(src, mask), reference_encode(model, src, mask)
        for row, length in enumerate(lengths):  # (a padding position's output is unspecified)
            alone = model.encode(src[row:row + 1, :length])
            torch.testing.assert_close(padded[row, :length], expected[row, :length], atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(padded[row:row + 1, :length], alone, atol=2e-5, rtol=1e-5)


def test_a_window_covering_the_source_is_full_attention():
    """A bidirectional window sees W // 2 on each side: it covers S positions when W // 2 >= S - 1 (W = S does
    not)."""
    src = source(length=10)
    full = make(encoder_attention_window=None)
    with torch.no_grad():
        expected = full.encode(src)
        torch.testing.assert_close(make(encoder_attention_window=18).encode(src), expected)
        torch.testing.assert_close(make(encoder_attention_window=10**6).encode(src), expected)
        assert not torch.allclose(make(encoder_attention_window=10).encode(src), expected, atol=1e-4)


def test_the_decoder_attends_fully():
    """The window is the encoder's only: given the same memory, the decoder's logits are those without a window,
    and cached decoding equals teacher forcing."""
    windowed, full = make(), make(encoder_attention_window=None)
    src = source()
    tgt = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        memory = windowed.encode(src)
        logits = windowed.decode(tgt, memory)
        torch.testing.assert_close(logits, full.decode(tgt, memory))
        decoder = windowed.decoder_for(src)
        cache = decoder.create_cache(2)
        steps = torch.cat([decoder(tgt[:, i:i + 1], cache=cache) for i in range(tgt.shape[1])], dim=1)
    torch.testing.assert_close(steps, logits, atol=1e-5, rtol=1e-5)


def test_capture_and_training_paths_give_the_windowed_encoder():
    """Capturing attention maps runs the dense mask (the probabilities are recorded, each row inside its window);
    the module path in training mode (dropout 0, gradient checkpointing) gives the eval output."""
    model = make(gradient_checkpointing=True)
    src = source()
    with torch.no_grad():
        expected = model.encode(src)
        with capture_attention_of([model.encoder[0].attn]) as records:
            captured = model.encode(src)
    torch.testing.assert_close(captured, expected, atol=2e-5, rtol=1e-5)
    (probs,) = records[id(model.encoder[0].attn)]  # (B, H, S, S)
    i = torch.arange(S)
    outside = (i[None] - i[:, None]).abs() > 4
    assert float(probs[..., outside].abs().max()) < 1e-6
    model.train()
    out = model.encode(src)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), expected, atol=2e-5, rtol=1e-5)
    assert model.src_embed.weight.grad is not None


def test_window_config_errors():
    base = dict(vocab_size=50, num_heads=4, embed_dim=32)
    with pytest.raises(ConfigError, match="encoder_attention_window must be a positive integer or null, got 0"):
        Seq2SeqConfig(**base, encoder_attention_window=0)
    with pytest.raises(ConfigError, match="encoder_attention_window must be a positive integer or null, got True"):
        Seq2SeqConfig(**base, encoder_attention_window=True)
    with pytest.raises(ConfigError, match="encoder_attention_global=2 needs an encoder_attention_window"):
        Seq2SeqConfig(**base, encoder_attention_global=2)
    with pytest.raises(ConfigError, match="encoder_attention_global must be a non-negative integer, got -1"):
        Seq2SeqConfig(**base, encoder_attention_window=4, encoder_attention_global=-1)
    with pytest.raises(ConfigError, match="encoder_attention_global=5 must not exceed encoder_attention_window=4"):
        Seq2SeqConfig(**base, encoder_attention_window=4, encoder_attention_global=5)
    with pytest.raises(ConfigError, match="encoder_attention_window needs attention sdpa or math"):
        Seq2SeqConfig(**base, encoder_attention_window=4, attention="performer")
    assert Seq2SeqConfig(**base, encoder_attention_window=4, encoder_attention_global=4).encoder_attention_global == 4


def test_marian_export_refuses_a_windowed_encoder():
    """Marian's encoder has no window: a windowed model is refused, not exported as full attention."""
    config = Seq2SeqConfig(vocab_size=50, num_heads=4, embed_dim=32, position="sinusoidal_halves", output_bias=True,
                           encoder_attention_window=4)
    with pytest.raises(ConfigError, match=r"^Marian cannot express encoder_attention_window=4 \(Marian's encoder "
                                          r"attends to the whole source\)$"):
        HF_CONVERTERS.get("marian").config_to_hf(config)
