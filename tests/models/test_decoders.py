"""What a model can decode is declared in the DECODERS registry where its class is defined (issue 24): every
registered family is covered by being registered, and the callers (translate, distill, the server) ask
``decoding_of`` instead of probing attributes with hasattr."""

import pytest

import tokenloom.models  # noqa: F401 - registers the families
from tokenloom.errors import RegistryError
from tokenloom.models.registry import DECODERS, MODELS, declare_decoding, decoding_of

EXPECTED = {"gpt": "causal_lm", "seq2seq": "encoder_decoder", "nat": "parallel", "semi_ar": "semi_autoregressive",
            "vit": None, "swin": None, "universal": "causal_lm", "universal_seq2seq": "encoder_decoder",
            "rnn": "causal_lm", "rnn_seq2seq": "encoder_decoder",
            "gpt_reward": "causal_lm"}  # (a reward model keeps its language model's decoding; its score is extra)


@pytest.mark.parametrize("family", MODELS.names())
def test_every_registered_family_declares_how_it_decodes(family):
    assert family in EXPECTED, f"a new family {family!r}: say here how it decodes"
    _, model_cls = MODELS.get(family)
    assert decoding_of(model_cls) == EXPECTED[family]
    assert decoding_of(model_cls) is None or decoding_of(model_cls) in DECODERS


def test_instances_and_subclasses_inherit_the_declaration_unless_they_declare_their_own():
    from tokenloom.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=8, max_seq_len=8, num_layers=1, num_heads=1, embed_dim=8))
    assert decoding_of(model) == "causal_lm"

    class Custom(GPT):
        pass

    assert decoding_of(Custom) == "causal_lm"

    @declare_decoding("parallel")
    class Parallel(GPT):
        pass

    assert decoding_of(Parallel) == "parallel" and decoding_of(GPT) == "causal_lm"
    assert decoding_of(object()) is None


def test_an_unknown_kind_is_a_one_line_error_with_the_closest_name():
    with pytest.raises(RegistryError, match="causal_lm"):
        declare_decoding("causal")
