"""capture_attention: the probabilities recorded on the fused path equal the math backend's weights."""

import pytest
import torch

from tests.generation.helpers import POSITIONS, left_pad
from tokenloom import GPT, GPTConfig
from tokenloom.errors import ConfigError
from tokenloom.models import EncoderDecoder, Seq2SeqConfig, ViT, ViTConfig
from tokenloom.nn import attention as attention_module
from tokenloom.viz import attention_layers, capture_attention


def math_weights(model):
    """Switch every attention layer of ``model`` (built with attention="math") to record the math backend's
    own returned weights, per module name."""
    recorded = {}
    for name, module in model.named_modules():
        if isinstance(module, attention_module.MultiHeadAttention):
            def backend(q, k, v, mask, causal, p, need, name=name):
                out, weights = attention_module.math_attention(q, k, v, mask, causal, p, True)
                recorded[name] = weights.float()
                return out, None
            module.backend = backend
    return recorded


def twins(make, **config):
    """The same weights with the sdpa and the math backend."""
    torch.manual_seed(0)
    fused = make(attention="sdpa", **config)
    math = make(attention="math", **config)
    math.load_state_dict(fused.state_dict())
    return fused.eval(), math.eval()


def gpt(**kw):
    base = dict(vocab_size=40, num_layers=3, num_heads=4, embed_dim=32, max_seq_len=32, tie_embeddings=False)
    return GPT(GPTConfig(**{**base, **kw}))


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_gpt_capture_equals_math_weights_with_padding(position, kv_heads):
    fused, math = twins(gpt, position=position, num_kv_heads=kv_heads)
    ids, mask = left_pad([torch.randint(0, 40, (9,)), torch.randint(0, 40, (5,))])
    recorded = math_weights(math)
    with torch.no_grad():
        math(ids, attention_mask=mask)
        with capture_attention(fused) as maps:
            fused(ids, attention_mask=mask)
    assert maps.layers("self") == [0, 1, 2]
    for i in range(3):
        got = maps.get("self", i)
        assert got.shape == (2, 4, 9, 9)
        torch.testing.assert_close(got, recorded[f"blocks.{i}.attn"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.sum(-1), torch.ones(2, 4, 9))


@pytest.mark.parametrize("position", ["sinusoidal", "learned", "rope", "alibi", "t5"])
def test_encoder_decoder_capture_equals_math_weights(position):
    def make(**kw):
        return EncoderDecoder(Seq2SeqConfig(vocab_size=50, encoder_layers=2, decoder_layers=2, num_heads=4,
                                            embed_dim=32, max_source_len=20, max_target_len=20, **kw))
    fused, math = twins(make, position=position)
    src = torch.randint(3, 50, (2, 7))
    src_mask = torch.ones(2, 7, dtype=torch.long)
    src_mask[1, 5:] = 0
    tgt = torch.randint(3, 50, (2, 6))
    recorded = math_weights(math)
    with torch.no_grad():
        math(src, tgt, src_mask)
        with capture_attention(fused) as maps:
            fused(src, tgt, src_mask)
    assert maps.kinds() == ["encoder", "decoder", "cross"]
    for kind, name in (("encoder", "encoder.{}.attn"), ("decoder", "decoder.{}.attn"),
                       ("cross", "decoder.{}.cross_attn")):
        for i in range(2):
            torch.testing.assert_close(maps.get(kind, i), recorded[name.format(i)], rtol=1e-5, atol=1e-6)
    assert maps.get("cross", 0).shape == (2, 4, 6, 7)
    assert maps.get("cross", 1)[1, :, :, 5:].abs().max() == 0  # the source's padding gets nothing


def test_vit_capture_equals_math_weights():
    def make(**kw):
        return ViT(ViTConfig(image_size=16, patch_size=4, in_channels=1, num_classes=5, embed_dim=32, num_layers=2,
                             num_heads=4, **kw))
    fused, math = twins(make)
    images = torch.randn(2, 1, 16, 16)
    recorded = math_weights(math)
    with torch.no_grad():
        math.forward_features(images)
        with capture_attention(fused, layers=[-1]) as maps:
            fused.forward_features(images)
    assert maps.layers("self") == [1]
    torch.testing.assert_close(maps.get("self", 1), recorded["blocks.1.attn"], rtol=1e-5, atol=1e-6)


def test_capture_leaves_no_state_and_only_records_the_requested_layers():
    model = gpt().eval()
    ids = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        before = model(ids)
        with capture_attention(model, layers=[1]) as maps:
            during = model(ids)
        after = model(ids)  # recorded nothing more: the capture ended with the block
    assert torch.equal(before, during) and torch.equal(before, after)
    assert list(maps.records) == [("self", 1)] and len(maps.records[("self", 1)]) == 1
    assert not any(k.startswith("_") and "capture" in k for m in model.modules() for k in vars(m))


def test_bad_layer_and_kind_requests_are_one_line_errors():
    model = gpt()
    with pytest.raises(ConfigError, match=r"^layer 3 is out of range: the model has 3 self attention layers "
                                          r"\(0\.\.2\)$"):
        with capture_attention(model, layers=[3]):
            pass
    with pytest.raises(ConfigError, match="GPT has no 'cross' attention; it has: self"):
        with capture_attention(model, kinds=["cross"]):
            pass
    with capture_attention(model, layers=[0]) as maps:
        pass
    with pytest.raises(ConfigError, match="did not run inside the block"):
        maps.get("self", 0)
    assert [name for name, _ in attention_layers(model)["self"]] == ["blocks.0.attn", "blocks.1.attn",
                                                                   "blocks.2.attn"]
