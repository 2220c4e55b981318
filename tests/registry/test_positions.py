"""Every registered position scheme (``tokenloom.nn.POSITIONS``) in a shrunk GPT (forward, backward, cached ==
uncached, a left-padded batch == its rows alone) and in the sequence-to-sequence models, which either take the
scheme (then the same checks through ``decoder_for``) or refuse it at config time in one line naming the field.
A scheme is tested by being registered."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.registry.helpers import (
    assert_close,
    build,
    cached_logits,
    check_gradients,
    left_pad,
    outputs,
    source_batch,
    weighted_loss,
)
from tokenloom.errors import ConfigError
from tokenloom.models.gpt import GPT_PRESETS
from tokenloom.models.registry import MODELS, decoding_of
from tokenloom.nn import POSITIONS

NAMES = POSITIONS.names()
TINY = GPT_PRESETS["tiny"]
# the model families that take a sequence position scheme: every registered family whose config has a
# ``position`` field accepting these names (vision models have their own image positions: learned / sincos2d)
SEQ2SEQ = [f for f in MODELS if decoding_of(MODELS.get(f)[1]) in ("encoder_decoder", "parallel")
           and "position" in {field.name for field in dataclasses.fields(MODELS.get(f)[0])}]  # not the LSTM's


def test_positions_and_families_are_found():
    # An empty parametrization would pass vacuously.
    assert {"learned", "rope", "none"} <= set(NAMES) and SEQ2SEQ


@pytest.mark.parametrize("position", NAMES)
def test_gpt_forward_backward(position):
    # A scheme that produces NaNs (a bias of -inf over a whole row), is not applied (its parameters get no
    # gradient: a learned table or a T5 bias never read) or breaks the shapes fails here.
    model = build("gpt", TINY, position=position).train()
    check_gradients(model, weighted_loss(outputs("gpt", model)))


@pytest.mark.parametrize("position", NAMES)
def test_gpt_cached_equals_uncached(position):
    # The cache path computes positions from the cache length (and, padded, from the attention mask): an offset
    # off by one, a rotary table indexed from 0 at every step, a bias over the wrong key range or a causal mask
    # missing for a multi-token call after a prefill all change the logits.
    model = build("gpt", TINY, position=position).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        full = model(ids)
    for prefill in (1, 5):
        assert_close(cached_logits(model, ids, prefill), full, what=f"{position} prefill {prefill}")
    # changing a later token changes no earlier logit (a scheme leaking the future, e.g. a bidirectional bias)
    changed = ids.clone()
    changed[:, 7] = (ids[:, 7] + 1) % model.config.vocab_size
    with torch.no_grad():
        other = model(changed)
    assert_close(other[:, :7], full[:, :7], what="earlier positions")
    assert not torch.allclose(other[:, 7:], full[:, 7:], atol=1e-4)


@pytest.mark.parametrize("position", NAMES)
def test_gpt_left_padded_batch_equals_rows_alone(position):
    # Left padding must shift positions (each row counts from its first real token) and hide the pad keys: a scheme
    # indexed by the absolute column, or a bias computed over columns, differs from the row run alone.
    model = build("gpt", TINY, position=position).eval()
    rows = [torch.randint(0, model.config.vocab_size, (n,)) for n in (9, 4, 7)]
    ids, mask = left_pad(rows, pad=3)
    got = cached_logits(model, ids, prefill=5, attention_mask=mask)
    T = ids.shape[1]
    for i, row in enumerate(rows):
        with torch.no_grad():
            alone = model(row[None])[0]
        assert_close(got[i, T - len(row):], alone, what=f"{position} row {i}")


def _build_or_refusal(family: str, position: str):
    """The shrunk default model of ``family`` with ``position``, or None after checking the refusal is a
    one-line ConfigError naming the field."""
    try:
        return build(family, {}, position=position)
    except ConfigError as err:
        message = str(err)
        assert "position" in message and position in message and "\n" not in message, message
        return None


@pytest.mark.parametrize("position", NAMES)
@pytest.mark.parametrize("family", SEQ2SEQ)
def test_sequence_to_sequence_takes_it_or_refuses_it(family, position):
    # Accepted: forward/backward reach every parameter (both the encoder's and the decoder's position modules), an
    # autoregressive decoder's cached decoding equals teacher forcing, and a padded source row equals the row alone
    # (a bias or a table built over the padded length would differ). Refused: only at config time, in one line.
    model = _build_or_refusal(family, position)
    if model is None:
        return
    model.train()
    check_gradients(model, weighted_loss(outputs(family, model)))
    if decoding_of(model) != "encoder_decoder":
        return
    model.eval()
    c = model.config
    gen = torch.Generator().manual_seed(4)
    src, mask = source_batch(c, gen)
    tgt = torch.randint(3, c.vocab_size, (src.shape[0], 8), generator=gen)
    tgt[:, 0] = c.bos_id
    with torch.no_grad():
        full = model(src, tgt, mask)
    got = cached_logits(model.decoder_for(src, mask), tgt, prefill=3)
    assert_close(got, full, what=f"{family} {position} cached vs teacher forcing")
    with torch.no_grad():
        n = int(mask[1].sum())
        alone = model(src[1:2, :n], tgt[1:2])[0]
    assert_close(full[1], alone, what=f"{family} {position} padded source row")


def test_gpt_accepts_every_scheme():
    # GPT is the reference decoder: a registered scheme it refuses would be untestable above (and would fail
    # there with a ConfigError), so state it plainly.
    for position in NAMES:
        build("gpt", TINY, position=position)
