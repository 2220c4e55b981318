"""Parity with Hugging Face Marian (MarianMTModel) <-> tokenloom EncoderDecoder: logits, round trips, and
beam search giving the same translations."""

from __future__ import annotations

import pytest
import torch

from tokenloom.errors import ConfigError
from tokenloom.generation import GenerationConfig, beam_search
from tokenloom.interop import HF_CONVERTERS, export_hf, from_hf, to_hf

transformers = pytest.importorskip("transformers")

PAD, EOS = 99, 0


def marian(seed: int = 0, std: float = 0.3, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = dict(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  pad_token_id=PAD, decoder_start_token_id=PAD, eos_token_id=EOS, forced_eos_token_id=None,
                  scale_embedding=True, activation_function="swish")
    hf = transformers.MarianMTModel(transformers.MarianConfig(**{**config, **overrides})).eval()
    with torch.no_grad():  # random values everywhere (biases, norms, the logits bias) so every mapping is tested
        for name, p in hf.named_parameters():
            if "embed_positions" not in name:
                p.copy_(torch.randn(p.shape) * std + (1.0 if name.endswith("layer_norm.weight") else 0.0))
        hf.final_logits_bias.normal_(0, 0.5)
    return hf


def batch(vocab: int = 100, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(1, vocab - 1, (3, 9), generator=gen)
    mask = torch.ones_like(src)
    src[1, 6:], mask[1, 6:] = PAD, 0
    src[2, 4:], mask[2, 4:] = PAD, 0
    tgt = torch.randint(1, vocab - 1, (3, 7), generator=gen)
    tgt[:, 0] = PAD  # Marian's decoder start
    return src, mask, tgt


SHAPES = [
    {},
    dict(activation_function="gelu", scale_embedding=False),
    dict(activation_function="relu", encoder_layers=1, decoder_layers=3, d_model=48, encoder_attention_heads=3,
         decoder_attention_heads=3, encoder_ffn_dim=40, decoder_ffn_dim=40),
]


@pytest.mark.parametrize("overrides", SHAPES)
def test_from_hf_directory_same_logits(tmp_path, overrides):
    hf = marian(**overrides)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert model.config.position == "sinusoidal_halves" and model.config.norm_placement == "post"
    src, mask, tgt = batch()
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        torch.testing.assert_close(model(src, tgt, mask), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides", SHAPES)
def test_to_hf_same_logits_and_round_trip(tmp_path, overrides):
    model = from_hf(marian(seed=3, **overrides))
    hf = to_hf(model).eval()
    src, mask, tgt = batch(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits,
                                   model(src, tgt, mask), atol=1e-4, rtol=1e-4)
    export_hf(model, tmp_path / "out")
    reloaded = transformers.MarianMTModel.from_pretrained(tmp_path / "out")
    back = from_hf(reloaded)
    assert back.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, back.state_dict()[name]), name


@pytest.mark.parametrize("num_beams, length_penalty, early_stopping", [(4, 1.0, False), (4, 0.6, True),
                                                                        (1, 1.0, False)])
def test_beam_search_gives_transformers_translations(num_beams, length_penalty, early_stopping):
    """Same weights, same settings: tokenloom's beam search over the encoder-decoder returns the sequences
    transformers' generate returns (Marian's forced EOS at max length is switched off on both sides:
    tokenloom has no forced_eos_token_id)."""
    hf = marian(seed=6, std=0.5)
    with torch.no_grad():
        hf.model.shared.weight.mul_(1.5)  # peaked logits: no near-ties for float noise to flip
    model = from_hf(hf)
    src, mask, _ = batch(seed=4)
    theirs = hf.generate(input_ids=src, attention_mask=mask, num_beams=num_beams, do_sample=False, max_new_tokens=12,
                         length_penalty=length_penalty, early_stopping=early_stopping, forced_eos_token_id=None,
                         bad_words_ids=None, decoder_start_token_id=PAD, eos_token_id=EOS, pad_token_id=PAD)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, num_beams=num_beams, length_penalty=length_penalty,
                              early_stopping=early_stopping, eos_token_id=EOS, pad_token_id=PAD)
    start = torch.full((3, 1), PAD)
    ours = beam_search(model.decoder_for(src, mask), start, config).sequences[:, 0] if num_beams > 1 else \
        __import__("tokenloom").generate(model.decoder_for(src, mask), start, config)
    for row in range(3):
        a, b = theirs[row].tolist(), ours[row].tolist()
        n = min(len(a), len(b))
        assert a[:n] == b[:n] and all(t == PAD for t in a[n:] + b[n:]), (row, a, b)
    assert len({tuple(r) for r in theirs.tolist()}) == 3  # three different translations


def test_unsupported_marian_settings():
    conv = HF_CONVERTERS.get("marian")
    base = {**conv.hf_defaults}
    for change, field in [(dict(decoder_attention_heads=8), "decoder_attention_heads"),
                          (dict(share_encoder_decoder_embeddings=False), "share_encoder_decoder_embeddings"),
                          (dict(activation_function="tanh"), "activation_function"),
                          (dict(activation_dropout=0.1), "activation_dropout")]:
        with pytest.raises(ConfigError, match=field) as err:
            conv.config_from_hf({**base, **change})
        assert "\n" not in str(err.value)
