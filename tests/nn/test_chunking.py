"""Encoding in overlapping chunks: the chunk grid and its coverage, the fusions and poolings against the formulas
computed chunk by chunk, padding, grouping, the argument checks, and the encoder-decoder's encode_chunked."""

from __future__ import annotations

import pytest
import torch

from tokenloom import EncoderDecoder, GenerationConfig, Seq2SeqConfig, generate
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.nn import Chunks, encode_chunks, encode_in_chunks, fuse_chunks, pool_chunks, split_chunks
from tokenloom.nn.chunking import chunk_starts


def make(max_source_len: int = 8, **overrides) -> EncoderDecoder:
    torch.manual_seed(0)
    config = dict(vocab_size=50, encoder_layers=2, decoder_layers=2, num_heads=4, embed_dim=32,
                  max_source_len=max_source_len, max_target_len=12, dropout=0.0)
    return EncoderDecoder(Seq2SeqConfig(**{**config, **overrides})).eval()


def ids(rows: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 50, (rows, length), generator=torch.Generator().manual_seed(seed))


def padded(lengths: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = ids(len(lengths), T)
    mask = torch.zeros_like(src)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        src[row, length:] = 0
    return src, mask


@pytest.mark.parametrize(("length", "chunk", "overlap", "starts", "coverage"), [
    (10, 4, 2, [0, 2, 4, 6], [1, 1, 2, 2, 2, 2, 2, 2, 1, 1]),
    (11, 4, 1, [0, 3, 6, 7], [1, 1, 1, 2, 1, 1, 2, 2, 2, 2, 1]),  # the tail chunk aligned to end at 11
    (9, 3, 0, [0, 3, 6], [1] * 9),
    (5, 8, 3, [0], [1] * 5),
])
def test_chunk_grid_and_coverage(length, chunk, overlap, starts, coverage):
    assert chunk_starts(length, chunk, overlap) == starts
    chunks = split_chunks(ids(2, length), chunk=chunk, overlap=overlap)
    assert chunks.row.tolist() == [0] * len(starts) + [1] * len(starts)
    assert chunks.start.tolist() == starts * 2 and chunks.ids.shape == (2 * len(starts), min(chunk, length))
    assert chunks.coverage().tolist() == [coverage, coverage]


def test_every_position_is_covered_as_the_grid_says():
    """For every length, chunk and overlap: the chunks lie inside the row, advance by the stride (the last one
    aligned to the end), and each position is in exactly the chunks whose span holds it."""
    for length in range(1, 23):
        for chunk in range(1, 9):
            for overlap in range(chunk):
                starts = chunk_starts(length, chunk, overlap)
                stride = chunk - overlap
                if length <= chunk:
                    assert starts == [0]
                    continue
                assert starts[-1] == length - chunk and all(0 <= s <= length - chunk for s in starts)
                assert all(b - a == stride for a, b in zip(starts[:-2], starts[1:-1], strict=True))
                assert 0 < starts[-1] - starts[-2] <= stride
                chunks = split_chunks(ids(1, length), chunk=chunk, overlap=overlap)
                expected = [sum(s <= t < s + chunk for s in starts) for t in range(length)]
                assert chunks.coverage()[0].tolist() == expected
                assert min(expected) >= 1


@pytest.mark.parametrize("fusion", ["mean", "max_context"])
def test_one_chunk_is_a_plain_encode(fusion):
    model = make(max_source_len=16)
    src, mask = padded([7, 5], 7)
    with torch.no_grad():
        for m in (None, mask):
            plain = model.encode(src, m)
            assert torch.equal(encode_in_chunks(model.encode, src, m, chunk=16, overlap=4, fusion=fusion), plain)
            assert torch.equal(encode_in_chunks(model.encode, src, m, chunk=7, overlap=0, fusion=fusion), plain)
            assert torch.equal(model.encode_chunked(src, m, overlap=3), plain)
            chunks = split_chunks(src, m, chunk=16, overlap=4)  # the general path: one chunk per row
            fused = fuse_chunks(encode_chunks(model.encode, chunks), chunks, fusion)
            torch.testing.assert_close(fused[0], plain[0])
            torch.testing.assert_close(fused[1, :5], plain[1, :5])


def test_mean_fusion_equals_the_chunks_averaged_by_hand():
    model = make()
    src = ids(2, 19)  # chunk 8, overlap 3: starts 0, 5, 10, 11
    with torch.no_grad():
        fused = encode_in_chunks(model.encode, src, chunk=8, overlap=3)
        total, count = torch.zeros(2, 19, 32), torch.zeros(19)
        for start in (0, 5, 10, 11):
            total[:, start:start + 8] += model.encode(src[:, start:start + 8])
            count[start:start + 8] += 1
    torch.testing.assert_close(fused, total / count[None, :, None])
    assert count.tolist() == [1] * 5 + [2] * 3 + [1] * 2 + [2] + [3] * 2 + [2] * 5 + [1]


def test_max_context_fusion_takes_the_most_central_chunk():
    model = make()
    src = ids(2, 19)
    starts = (0, 5, 10, 11)
    with torch.no_grad():
        fused = encode_in_chunks(model.encode, src, chunk=8, overlap=3, fusion="max_context")
        states = {s: model.encode(src[:, s:s + 8]) for s in starts}
    for t in range(19):  # the earliest of the chunks with the most context on the nearer side
        best = max((s for s in starts if s <= t < s + 8), key=lambda s: (min(t - s, s + 7 - t), -s))
        torch.testing.assert_close(fused[:, t], states[best][:, t - best])


@pytest.mark.parametrize("fusion", ["mean", "max_context"])
def test_padded_batch_equals_each_row_alone(fusion):
    """Each row is cut by its own length: a row shorter than a chunk is one chunk, a long one gets its own tail."""
    model = make()
    lengths = [23, 6, 17, 8]
    src, mask = padded(lengths, 23)
    with torch.no_grad():
        batch = encode_in_chunks(model.encode, src, mask, chunk=8, overlap=2, fusion=fusion)
        for row, length in enumerate(lengths):
            alone = encode_in_chunks(model.encode, src[row:row + 1, :length], chunk=8, overlap=2, fusion=fusion)
            torch.testing.assert_close(batch[row:row + 1, :length], alone, atol=1e-5, rtol=1e-5)
    chunks = split_chunks(src, mask, chunk=8, overlap=2)
    coverage = chunks.coverage()
    assert coverage[2, 17:].eq(0).all() and coverage[1, 6:8].eq(1).all()  # padding past the last chunk: none
    assert batch[2, 17:].eq(0).all()


def test_chunks_encoded_in_groups_equal_one_batch():
    model = make()
    src, mask = padded([30, 21], 30)
    with torch.no_grad():
        whole = encode_in_chunks(model.encode, src, mask, chunk=8, overlap=4)
        calls = []

        def encode(x, m):
            calls.append(x.shape[0])
            return model.encode(x, m)

        grouped = encode_in_chunks(encode, src, mask, chunk=8, overlap=4, max_batch=3)
    torch.testing.assert_close(grouped, whole, atol=1e-5, rtol=1e-5)
    assert max(calls) == 3 and sum(calls) == len(split_chunks(src, mask, chunk=8, overlap=4).row) == 7 + 5


@pytest.mark.parametrize("how", ["mean", "max"])
def test_pooling_equals_the_formula(how):
    model = make()
    src, mask = padded([19, 6], 19)
    chunks = split_chunks(src, mask, chunk=8, overlap=3)
    with torch.no_grad():
        states = encode_chunks(model.encode, chunks)
        pooled = pool_chunks(states, chunks, how)
        rows = []
        for row, spans in ((0, [(0, 8), (5, 13), (10, 18), (11, 19)]), (1, [(0, 8)])):
            vectors = []
            for a, b in spans:
                out = model.encode(src[row:row + 1, a:b], mask[row:row + 1, a:b])[0]  # (8, C)
                tokens = mask[row, a:b].bool()
                vectors.append(out[tokens].mean(0))
            stacked = torch.stack(vectors)
            rows.append(stacked.mean(0) if how == "mean" else stacked.max(0).values)
    assert pooled.shape == (2, 32)
    torch.testing.assert_close(pooled, torch.stack(rows), atol=1e-5, rtol=1e-5)
    unmasked = split_chunks(src[:1], chunk=8, overlap=3)
    assert unmasked.mask is None
    torch.testing.assert_close(pool_chunks(encode_chunks(model.encode, unmasked), unmasked, how), pooled[:1],
                               atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_one_line_errors():
    def encode(x, m):
        return torch.zeros(*x.shape, 4)

    src = ids(1, 10)
    cases = [(dict(chunk=0, overlap=0), "chunk must be a positive integer, got 0"),
             (dict(chunk=4, overlap=4), r"overlap must be an integer in \[0, chunk=4\), got 4"),
             (dict(chunk=4, overlap=-1), r"overlap must be an integer in \[0, chunk=4\), got -1"),
             (dict(chunk=4, overlap=1, fusion="sum"), "fusion must be one of mean, max_context, got 'sum'"),
             (dict(chunk=4, overlap=1, max_batch=0), "max_batch must be a positive integer or null, got 0")]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            encode_in_chunks(encode, src, **kwargs)
        assert "\n" not in str(err.value)
    chunks = split_chunks(src, chunk=4, overlap=1)
    assert isinstance(chunks, Chunks)
    with pytest.raises(ConfigError, match="how must be one of mean, max, got 'min'"):
        pool_chunks(encode_chunks(encode, chunks), chunks, "min")
    left = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="mask must be right-padded"):
        encode_in_chunks(encode, src, left, chunk=4, overlap=1)
    with pytest.raises(ValueError, match=r"mask of shape \(1, 9\) does not match ids of 10 positions"):
        split_chunks(src, left[:, 1:], chunk=4, overlap=1)
    with pytest.raises(ValueError, match=r"encode gave states of shape \(1, 4\) for 3 chunks of 4 positions"):
        encode_chunks(lambda x, m: torch.zeros(1, 4), chunks)


def test_encode_chunked_translates_a_source_longer_than_the_encoder():
    model = make()  # max_source_len 8
    src, mask = padded([20, 13], 20)
    with pytest.raises(GenerationError, match="source of 20 tokens exceeds the model's limit of 8"):
        model.encode(src, mask)  # the default is unchanged
    with torch.no_grad():
        memory = model.encode_chunked(src, mask, overlap=2)
        torch.testing.assert_close(memory, encode_in_chunks(model.encode, src, mask, chunk=8, overlap=2))
        torch.testing.assert_close(model.encode_chunked(src, mask, overlap=2, fusion="max_context", max_batch=2),
                                   encode_in_chunks(model.encode, src, mask, chunk=8, overlap=2,
                                                    fusion="max_context"))
    decoder = model.decoder_for(src, mask, chunk_overlap=2)
    torch.testing.assert_close(decoder.memory, memory)
    bos = torch.full((2, 1), model.config.bos_id)
    config = GenerationConfig(max_new_tokens=5, do_sample=False)
    out = generate(decoder, bos, config)
    assert out.shape == (2, 6)
    one = generate(model.decoder_for(src[1:2, :13], chunk_overlap=2), bos[:1], config)
    assert torch.equal(out[1], one[0])  # batched == one sentence at a time
