"""Property fuzzers for decoding (issue 23): every GenerationConfig a caller can build either is refused with a
one-line error, or ``generate`` returns valid token ids of the right length; the logits processors keep a valid
distribution for every legitimate score tensor.

What counts as a legitimate score: any finite value (huge ones included: an fp32 or bf16 model can produce
+-3e38) and ``-inf`` (a token banned by an earlier processor or past the tokenizer's vocabulary), with at least
one finite score per row. NaN or +inf logits are a model bug, not an input, and are not fed.
"""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tokenloom import GPT, GPTConfig  # noqa: E402
from tokenloom.errors import TokenloomError  # noqa: E402
from tokenloom.generation import (  # noqa: E402
    GenerationConfig,
    RepetitionPenaltyProcessor,
    TemperatureProcessor,
    TopKProcessor,
    TopPProcessor,
    create_processors,
    generate,
)

from .strategies import (  # noqa: E402
    EDGE_FLOATS,
    F32_MAX,
    F32_MIN_NORMAL,
    assert_one_line,
    floats,
    ints,
    note,
    yaml_values,
)

pytestmark = pytest.mark.fuzz

VOCAB, CONTEXT = 8, 24


class CharTokenizer:
    """Token i is the letter 'a' + i; ``vocab_size`` may be smaller than the model's (a padded vocabulary)."""

    def __init__(self, vocab_size: int = VOCAB) -> None:
        self.vocab_size = vocab_size

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i) if 0 <= i < 26 else "?" for i in ids)


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, num_layers=1, num_heads=2, embed_dim=16, max_seq_len=CONTEXT,
                         tie_embeddings=False)).eval()


# each field: (values of the right kind, edge cases of that kind, some of them refused)
FIELDS = {
    "max_new_tokens": (st.integers(1, 6), ints),
    "do_sample": (st.booleans(), st.booleans()),
    "temperature": (st.sampled_from([0.0, 0.7, 1.0, 1.3]), floats),
    "top_k": (st.none() | st.integers(1, VOCAB + 2), ints),
    "top_p": (st.none() | st.floats(0, 1), floats),
    "repetition_penalty": (st.sampled_from([1.0, 1.2, 0.8]), floats),
    "eos_token_id": (st.none() | st.integers(0, VOCAB - 1), ints),
    "pad_token_id": (st.integers(0, VOCAB - 1), ints),
    "stop_strings": (st.lists(st.text("abcdefgh", min_size=1, max_size=3), max_size=2),
                     st.lists(st.text(max_size=3), max_size=2)),
    "seed": (st.none() | st.integers(0, 2 ** 64 - 1), ints),
    "num_beams": (st.integers(1, 3), st.integers(-2, 0)),  # no wide beams: memory budgets are another test's
    "length_penalty": (st.sampled_from([1.0, 0.0, -1.0, 2.0]), floats),
    "early_stopping": (st.sampled_from([True, False, "never"]), st.sampled_from([0, 1, "always", None])),
    "num_return_sequences": (st.integers(1, 2), ints),
    "no_repeat_ngram_size": (st.integers(0, 3), ints),
    "compile": (st.just(False), st.just(False)),  # never True: too slow to fuzz (tests/generation/test_compiled.py)
}


@st.composite
def settings_strategy(draw: st.DrawFn) -> dict:
    """GenerationConfig keyword arguments: a decoding mode (sampling, greedy, beam search) whose settings are of
    the right kind, about one in five an edge case of that kind; then, one time in three, one or two fields set to
    any YAML/JSON-shaped value."""
    mode = draw(st.sampled_from(["sampling", "greedy", "beam"]), label="mode")
    names = draw(st.sets(st.sampled_from(sorted(FIELDS))), label="fields set") | {"max_new_tokens"}
    settings = {}
    for name in sorted(names):
        valid, edge = FIELDS[name]
        settings[name] = draw(edge if draw(st.integers(0, 4)) == 0 else valid, label=name)
    if mode == "greedy":
        settings["do_sample"] = False
    elif mode == "beam":
        settings.update(do_sample=False, num_beams=draw(st.integers(2, 3)))
        for name in ("repetition_penalty", "stop_strings"):
            settings.pop(name, None)
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 1, 2]))):
        settings[draw(st.sampled_from(sorted(FIELDS)))] = draw(yaml_values, label="wild value")
    return settings


@st.composite
def prompts(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) ids in the vocabulary and, sometimes, a left-padding mask."""
    B, T = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    ids = torch.tensor(draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=T, max_size=T), min_size=B,
                                     max_size=B)))
    if not draw(st.booleans()):
        return ids, None
    lengths = draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    mask = torch.tensor([[0] * (T - n) + [1] * n for n in lengths])
    return ids, mask


def _config_or_error(settings: dict) -> GenerationConfig | None:
    try:
        return GenerationConfig(**settings)
    except TokenloomError as err:
        assert_one_line(err)
        note(f"refused: {str(err).split(' ')[0]}")
        return None


def _check_generation(model: GPT, settings: dict, ids: torch.Tensor, mask: torch.Tensor | None,
                      tokenizer_vocab: int) -> str:
    """The property: a one-line refusal, or valid ids of the right length. Returns what happened."""
    config = _config_or_error(settings)
    if config is None:
        return "refused"
    note("beam search" if config.num_beams > 1 else "greedy" if config.greedy else "sampling")
    tokenizer = CharTokenizer(tokenizer_vocab)
    try:
        out = generate(model, ids, config, attention_mask=mask, tokenizer=tokenizer)
    except TokenloomError as err:
        assert_one_line(err)
        note(f"generate refused it: {str(err)[:40]}")
        return "refused"
    B, T = ids.shape
    assert out.dtype == torch.long and out.shape[0] == B
    n = out.shape[1] - T
    # beam search with n-gram bans that leave no token for some step finds no hypothesis: 0 new tokens (documented
    # in tokenloom.generation.beam: "the missing ones have score -inf, length 0")
    banned_out = config.num_beams > 1 and config.no_repeat_ngram_size > 0
    assert (0 if banned_out else 1) <= n <= config.max_new_tokens
    if mask is None:
        assert torch.equal(out[:, :T], ids)
    else:
        assert torch.equal(out[:, :T][mask.bool()], ids[mask.bool()])
    new = out[:, T:]
    valid = (new >= 0) & (new < tokenizer_vocab)
    assert bool((valid | (new == config.pad_token_id)).all()), new
    if config.eos_token_id is None and not config.stop_strings and config.num_beams == 1:
        assert n == config.max_new_tokens and bool(valid.all()), new  # nothing stops a row: no padding
    return "generated"


@given(settings=settings_strategy(), prompt=prompts(), tokenizer_vocab=st.sampled_from([VOCAB, VOCAB - 3]))
def test_any_setting_yields_valid_tokens_or_a_one_line_error(model, settings, prompt, tokenizer_vocab):
    """A GenerationConfig is refused with a one-line error, or generate() returns (B, T + n) ids: the prompt as
    given, then 1 <= n <= max_new_tokens new ids in the tokenizer's vocabulary (pad_token_id after a row
    stopped; n = max_new_tokens when nothing can stop a row; n = 0 only for beam search whose n-gram bans leave no
    token); a request the model cannot serve (too long, n-gram bans without beams) is a one-line error too."""
    _check_generation(model, settings, *prompt, tokenizer_vocab)


BEAM = dict(do_sample=False, num_beams=2)
REGRESSIONS = [  # (settings, what must happen); each raised or misbehaved before (issue 23 and this fuzzer)
    (dict(temperature=1e-38), "refused"),  # issue 23: NaN scores, multinomial raised RuntimeError
    (dict(top_p=1e-45), "generated"),  # issue 23: 0 in float32 removed even the top token
    (dict(seed=2 ** 64), "refused"),  # issue 23: torch.Generator.manual_seed raised RuntimeError
    (dict(repetition_penalty=1e-300), "refused"),  # fuzzer: 0 in float32, score / 0 = inf or NaN
    (dict(repetition_penalty=0.5), "generated"),  # fuzzer: a huge logit / 0.5 = inf (now clamped to the fp32 max)
    (dict(temperature=1e300), "refused"),  # fuzzer: inf in float32, -inf / inf = NaN
    (dict(eos_token_id=2 ** 64), "refused"),  # fuzzer: OverflowError comparing with the int64 tokens
    (dict(pad_token_id=2 ** 63, eos_token_id=1), "refused"),  # fuzzer: RuntimeError filling int64 with it
    (dict(pad_token_id=-(2 ** 64), eos_token_id=1), "refused"),  # fuzzer: OverflowError
    (dict(pad_token_id=-1, eos_token_id=1), "generated"),  # negative pads stay allowed (tests/generation use -1)
    (dict(seed=10 ** 5000), "refused"),  # fuzzer: the message's repr() raised ValueError (4300-digit limit)
    (dict(stop_strings=[10 ** 5000]), "refused"),  # ... the same, inside a list
    (dict(do_sample="no"), "refused"),  # fuzzer: any truthy value silently meant sampling
    (dict(length_penalty=1e308, **BEAM), "refused"),  # fuzzer: 2 ** 1e308 raised OverflowError in beam search
    (dict(length_penalty=-1e308, **BEAM), "refused"),  # fuzzer: every score -inf: 0 new tokens returned
    (dict(length_penalty=10.0, **BEAM), "generated"),
    (dict(top_k=2 ** 70), "generated"),
    (dict(no_repeat_ngram_size=1, **BEAM, max_new_tokens=7), "generated"),  # 6 ids unused by the prompt, 7 wanted
]


@pytest.mark.parametrize(("settings", "outcome"), REGRESSIONS,
                         ids=[f"{i}-{'-'.join(s)}" for i, (s, _) in enumerate(REGRESSIONS)])
def test_found_defects_stay_fixed(model, settings, outcome):
    assert _check_generation(model, {"max_new_tokens": 3, **settings}, torch.tensor([[1, 2]]), None, VOCAB) == outcome


class _PaddedVocabularyModel(torch.nn.Module):
    """The tiny GPT with its last three ids (past the tokenizer's vocabulary) the most likely by far."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt, self.config = gpt, gpt.config

    def create_cache(self, *args, **kwargs):
        return self.gpt.create_cache(*args, **kwargs)

    def forward(self, ids, **kwargs):
        logits = self.gpt(ids, **kwargs).clone()
        logits[..., VOCAB - 3:] += 100.0
        return logits


@pytest.mark.parametrize("settings", [dict(top_k=1), dict(top_k=2), dict(top_p=0.5)])
def test_top_k_and_top_p_choose_among_the_tokenizers_ids(model, settings):
    """Found by the fuzzer: with a vocabulary padded past the tokenizer's, top-k/top-p kept only padded ids, which
    were masked afterwards: every score -inf, and torch.multinomial raised RuntimeError (probability tensor contains
    inf/nan). The padded ids are now masked before the processors."""
    config = GenerationConfig(max_new_tokens=4, seed=0, **settings)
    out = generate(_PaddedVocabularyModel(model), torch.tensor([[1, 2]]), config, tokenizer=CharTokenizer(VOCAB - 3))
    assert out.shape == (1, 6) and bool((out[:, 2:] < VOCAB - 3).all())


# --- the processors on their own ---------------------------------------------------------------------------

def test_a_penalised_huge_score_stays_finite():
    """Found by the fuzzer: a score of 3.4e38 divided by a penalty of 0.5 overflowed to inf, and softmax made NaN
    of the row (multinomial raised RuntimeError). The penalised scores are clamped to the dtype's finite range; a
    banned token stays banned."""
    for dtype in (torch.float32, torch.bfloat16):
        big = torch.finfo(dtype).max
        scores = torch.tensor([[big, big, float("-inf"), -big]], dtype=dtype)
        for penalty in (0.5, 2.0, F32_MIN_NORMAL, F32_MAX):
            out = RepetitionPenaltyProcessor(penalty)(torch.tensor([[0, 2, 3]]), scores)
            assert torch.isfinite(out[0, [0, 1, 3]]).all() and torch.isneginf(out[0, 2]), (dtype, penalty, out)
            assert torch.isfinite(out.float().softmax(-1)).all()


HUGE = [F32_MAX, -F32_MAX, 1e38, -1e38, 3e38, 1e30, -1e30, 0.0, -0.0, 1e-45, -1e-45]


@st.composite
def score_rows(draw: st.DrawFn, dtype: torch.dtype) -> torch.Tensor:
    """(B, V) legitimate scores in ``dtype``: finite values of any size and -inf, at least one finite per row."""
    B, V = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    finite = st.one_of(st.sampled_from(HUGE), st.floats(-F32_MAX, F32_MAX, width=32),
                       st.floats(-30, 30, width=32))
    rows = draw(st.lists(st.lists(finite | st.just(float("-inf")), min_size=V, max_size=V), min_size=B,
                         max_size=B))
    scores = torch.tensor(rows, dtype=torch.float32)
    for b in range(B):
        if not torch.isfinite(scores[b]).any():
            scores[b, draw(st.integers(0, V - 1))] = draw(st.sampled_from([0.0, 5.0, -F32_MAX, F32_MAX]))
    finfo = torch.finfo(dtype)  # bf16: a huge finite fp32 value rounds to inf; it stays finite, the largest bf16
    return torch.where(torch.isfinite(scores), scores.clamp(finfo.min, finfo.max), scores).to(dtype)


processor_settings = st.fixed_dictionaries({
    "do_sample": st.just(True),
    "temperature": st.sampled_from([1.0, 0.5, 2.0, 1e-38, 1.1754943508222875e-38, 1e-20, 1e20, 1e38, 1e300]) | floats,
    "top_k": st.none() | st.integers(1, 14) | st.sampled_from([2 ** 31, 2 ** 70]),
    "top_p": st.none() | st.sampled_from([1e-45, 5e-324, 1e-300, 0.3, 0.9, 1.0]) | floats,
    "repetition_penalty": st.sampled_from([1.0, 1.2, 0.5, 1e-300, 1e-38, 1e38, 1e300]) | floats,
})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@given(data=st.data())
def test_processors_keep_a_distribution(dtype, data):
    """For every accepted setting (GenerationConfig refuses the rest in one line) and legitimate scores, the
    processed scores hold no NaN, keep at least one finite score per row, softmax to a valid distribution that
    torch.multinomial samples from (what generate does), and a banned token (-inf) stays banned."""
    settings = data.draw(processor_settings, label="settings")
    config = _config_or_error(settings)
    if config is None:
        return
    scores = data.draw(score_rows(dtype), label="scores")
    B, V = scores.shape
    S = data.draw(st.integers(1, 6), label="history length")
    history = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, V - 1), min_size=S, max_size=S), min_size=B,
                                              max_size=B), label="history"))  # (B, S) ids seen so far
    out = create_processors(config)(history, scores.clone())
    assert out.shape == scores.shape and out.dtype == dtype
    assert not torch.isnan(out).any(), (scores, out)
    assert torch.isfinite(out).any(-1).all(), (scores, out)
    probs = out.float().softmax(-1)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(B), atol=1e-3)
    assert not (torch.isneginf(scores) & torch.isfinite(out)).any()  # banned stays banned
    assert torch.multinomial(probs, 1).lt(V).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@given(data=st.data())
def test_each_processor_alone(dtype, data):
    """Each processor, on its own over legitimate scores: temperature keeps the argmax and never makes NaN; top-k
    keeps min(k, finite) tokens at least and the best one; top-p keeps the best token; the repetition penalty only
    touches the tokens in the history."""
    scores = data.draw(score_rows(dtype), label="scores")
    B, V = scores.shape
    best = scores.float().argmax(-1)
    t = data.draw(st.sampled_from(EDGE_FLOATS) | st.floats(F32_MIN_NORMAL, F32_MAX), label="temperature")
    if F32_MIN_NORMAL <= t <= F32_MAX:  # what the processor (and GenerationConfig) accept
        out = TemperatureProcessor(t)(None, scores)
        assert not torch.isnan(out).any() and torch.isfinite(out).any(-1).all()
        assert torch.equal(out.float().argmax(-1), best) or bool((out.gather(-1, best[:, None]) == out.amax(-1,
                                                                  keepdim=True)).all())
    k = data.draw(st.integers(1, 2 ** 70), label="top_k")
    out = TopKProcessor(k)(None, scores)
    kept = torch.isfinite(out).sum(-1)
    assert (kept >= torch.isfinite(scores).sum(-1).clamp(max=min(k, V))).all()
    assert torch.isfinite(out.gather(-1, best[:, None])).all()
    p = data.draw(st.sampled_from([5e-324, 1e-45, 1e-300, 0.5, 1.0]) | st.floats(0, 1, exclude_min=True),
                  label="top_p")
    out = TopPProcessor(p)(None, scores)
    assert torch.isfinite(out.gather(-1, best[:, None])).all()
    penalty = data.draw(floats.filter(lambda x: F32_MIN_NORMAL <= x <= F32_MAX), label="penalty")
    history = torch.tensor([[0]] * B)
    out = RepetitionPenaltyProcessor(penalty)(history, scores)
    assert torch.equal(out[:, 1:], scores[:, 1:])
    assert not torch.isnan(out).any() and not torch.isposinf(out).any()
    assert torch.equal(torch.isneginf(out), torch.isneginf(scores))
