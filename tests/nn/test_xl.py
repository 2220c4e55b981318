"""Transformer-XL: the relative attention against the paper's formula, the segment memory against the explicit
concatenation, no gradient into the memory, decoding with memory, streams of data, and the config checks."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.errors import ConfigError, GenerationError
from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.nn.attention import Context, MultiHeadAttention
from tokenloom.nn.kv_cache import SegmentMemory
from tokenloom.nn.masks import KeySpan, attention_mask
from tokenloom.nn.positions import XLPosition


def xl(memory_len=8, max_seq_len=16, **kw) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, num_layers=2, num_heads=4, embed_dim=32, max_seq_len=max_seq_len,
                          position="xl", memory_len=memory_len, **kw)).double().eval()
    with torch.no_grad():  # u and v start at zero: make them matter
        model.position.content_bias.normal_()
        model.position.position_bias.normal_()
    return model


def test_relative_attention_equals_the_formula():
    """score(i, j) = (q_i + u) . k_j + (q_i + v) . W_r r_{i-j}, over S keys of which the queries are the last T."""
    torch.manual_seed(1)
    H, D, C, T, S = 2, 4, 8, 3, 7
    position = XLPosition(embed_dim=C, num_heads=H, head_dim=D, max_seq_len=8, num_layers=1).double()
    with torch.no_grad():
        position.content_bias.normal_()
        position.position_bias.normal_()
    attention = MultiHeadAttention(C, H).double()
    x = torch.randn(1, S, C, dtype=torch.float64)
    span = KeySpan(S - T, S)
    mask, _ = attention_mask(span, T, causal=True, position=position, dtype=torch.float64, device=x.device)

    class Ahead:  # hands attention the keys of all S positions, as a memory would
        def update(self, k, v):
            return k_all, v_all

    with torch.no_grad():
        q_all, k_all, v_all = attention.qkv_proj(x).view(1, S, 3, H, D).permute(2, 0, 3, 1, 4)
        relative = position.relative(0, torch.arange(S - T, S)[None])
        got, _ = attention(x[:, S - T:], Context(mask, False, cache=Ahead(), relative=relative))
        u, v_bias = position.content_bias[0], position.position_bias[0]
        r = position.projections[0](position.table[:S]).view(S, H, D)  # by distance
        scores = torch.full((H, T, S), float("-inf"), dtype=torch.float64)
        for h in range(H):
            for i in range(T):
                qi = q_all[0, h, S - T + i]
                for j in range(S - T + i + 1):
                    scores[h, i, j] = ((qi + u[h]) @ k_all[0, h, j] + (qi + v_bias[h]) @ r[S - T + i - j, h]) / \
                        math.sqrt(D)
        heads = scores.softmax(-1) @ v_all[0]  # (H, T, D)
        expected = attention.out_proj(heads.transpose(0, 1).reshape(1, T, H * D))
    torch.testing.assert_close(got, expected)


def test_memory_over_two_segments_equals_one_forward_over_their_concatenation():
    """With a memory as long as the first segment, the second segment's queries see exactly what they would in one
    causal forward over both: the memory holds the first segment's keys and values, layer by layer."""
    model = xl(memory_len=10)
    ids = torch.randint(0, 40, (2, 16))
    memory = model.create_cache(2)
    assert isinstance(memory, SegmentMemory)
    with torch.no_grad():
        parts = torch.cat((model(ids[:, :10], cache=memory), model(ids[:, 10:], cache=memory)), dim=1)
        torch.testing.assert_close(parts, model(ids))


def test_a_short_memory_keeps_the_last_positions_of_each_layer():
    short, long = xl(memory_len=3), xl(memory_len=10)
    ids = torch.randint(0, 40, (1, 14))
    with torch.no_grad():
        memory, reference = short.create_cache(1), long.create_cache(1)
        short(ids[:, :8], cache=memory)
        long(ids[:, :8], cache=reference)
        for layer in reference.layers:  # the long memory cut to its last 3 positions by hand
            layer.k, layer.v = layer.k[:, :, -3:], layer.v[:, :, -3:]
        reference.memory_len = 3
        torch.testing.assert_close(short(ids[:, 8:], cache=memory), long(ids[:, 8:], cache=reference))
    assert all(layer.k.shape[2] == 3 for layer in memory.layers)


def test_memory_len_zero_is_the_plain_relative_model():
    """A memory of 0 positions remembers nothing: each segment is the plain relative-position model's forward; and a
    model with a memory gives the plain model's output on its first segment (an empty memory)."""
    plain, remembering = xl(memory_len=0), xl(memory_len=8)
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        memory = SegmentMemory(2, 2, 0)
        plain(ids[:, :6], cache=memory)
        torch.testing.assert_close(plain(ids[:, 6:], cache=memory), plain(ids[:, 6:]))
        torch.testing.assert_close(remembering(ids[:, :6], cache=remembering.create_cache(2)), plain(ids[:, :6]))


def test_no_gradient_flows_into_the_memory():
    model = xl(memory_len=8, tie_embeddings=False).train()
    ids = torch.randint(0, 40, (1, 16))
    memory = model.create_cache(1)
    model(ids[:, :8], cache=memory)
    assert all(not layer.k.requires_grad and not layer.v.requires_grad for layer in memory.layers)
    embeddings = []
    handle = model.tok_embed.register_forward_hook(lambda m, i, out: embeddings.append(out))
    model(ids[:, 8:], cache=memory).sum().backward()
    handle.remove()
    grad = model.tok_embed.weight.grad
    assert grad is not None and grad[ids[0, 8:]].abs().sum() > 0
    only_first = sorted(set(ids[0, :8].tolist()) - set(ids[0, 8:].tolist()))
    assert only_first and grad[only_first].abs().sum() == 0  # the first segment's tokens got nothing


def test_decoding_with_memory_equals_the_uncached_forward_while_it_holds_everything():
    model = xl(memory_len=32)
    ids = torch.randint(0, 40, (2, 30))
    memory = model.create_cache(2)
    with torch.no_grad():
        steps = [model(ids[:, :5], cache=memory)] + [model(ids[:, t:t + 1], cache=memory) for t in range(5, 30)]
        torch.testing.assert_close(torch.cat(steps, 1), model(ids))


def test_generation_runs_past_the_segment_with_memory():
    from tokenloom.generation import GenerationConfig, generate

    model = xl(memory_len=8, max_seq_len=16)
    out = generate(model, torch.randint(0, 40, (2, 20)), GenerationConfig(max_new_tokens=50, do_sample=False))
    assert out.shape == (2, 70)  # a prompt longer than the segment runs as segments; decoding past it
    with pytest.raises(GenerationError, match="cannot carry padded rows"):
        mask = torch.ones(2, 5, dtype=torch.long)
        mask[0, 0] = 0
        generate(model, torch.randint(0, 40, (2, 5)), GenerationConfig(max_new_tokens=3, do_sample=False),
                 attention_mask=mask)


def test_memory_config_errors():
    with pytest.raises(ConfigError, match="needs a relative position scheme"):
        GPTConfig(position="rope", memory_len=8)
    with pytest.raises(ConfigError, match="cannot be combined"):
        GPTConfig(position="xl", memory_len=8, attention_window=4)
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        GPTConfig(position="xl", memory_len=8, gradient_checkpointing=True)
    with pytest.raises(ConfigError, match="memory_len must be a non-negative integer"):
        GPTConfig(position="xl", memory_len=-1)
