"""Logits processors and GenerationConfig validation, against hand-computed expectations."""

import math

import pytest
import torch

from tokenloom.errors import ConfigError
from tokenloom.generation import (
    GenerationConfig,
    LogitsProcessorList,
    RepetitionPenaltyProcessor,
    TemperatureProcessor,
    TopKProcessor,
    TopPProcessor,
    create_processors,
)

NO_IDS = torch.zeros(1, 0, dtype=torch.long)


def kept(scores):
    """Indices of the finite scores of a (1, V) tensor, as a sorted list."""
    return sorted(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def log_probs(*probs):
    return torch.tensor([[math.log(p) for p in probs]])


# p stays off the cumulative sums (0.5, 0.8, 0.95): log(0.5) -> softmax -> cumsum lands on 0.5 or one float step
# beside it depending on the CPU's exp kernel; the exact boundary is tested where it is exact (uniform 0.25s below)
@pytest.mark.parametrize("p, expected", [(0.3, [0]), (0.49, [0]), (0.51, [0, 1]), (0.7, [0, 1]),
                                         (0.81, [0, 1, 2]), (0.96, [0, 1, 2, 3])])
def test_top_p_keeps_smallest_set_reaching_p(p, expected):
    # probabilities 0.5, 0.3, 0.15, 0.05, given out of order: token ids 2, 0, 3, 1
    scores = log_probs(0.3, 0.05, 0.5, 0.15)
    order = [2, 0, 3, 1]  # most likely first
    out = TopPProcessor(p)(NO_IDS, scores)
    assert kept(out) == sorted(order[:len(expected)])
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], scores[finite])  # kept scores are unchanged


def test_top_p_ties_and_edges():
    uniform = torch.zeros(1, 4)  # four tokens of probability 0.25 each
    assert kept(TopPProcessor(0.5)(NO_IDS, uniform)) == [0, 1]  # 0.25 + 0.25 reaches 0.5: two, lower ids
    assert kept(TopPProcessor(0.26)(NO_IDS, uniform)) == [0, 1]
    assert kept(TopPProcessor(0.25)(NO_IDS, uniform)) == [0]
    peaked = torch.tensor([[0.0, 30.0, -30.0]])  # the top token alone has probability ~1
    assert kept(TopPProcessor(1e-6)(NO_IDS, peaked)) == [1]  # always at least the top token
    tiny = torch.tensor([[0.0, 0.0, -60.0]])  # a token of probability ~1e-26
    assert kept(TopPProcessor(1.0)(NO_IDS, tiny)) == [0, 1, 2]  # p = 1 keeps everything
    batch = torch.stack([log_probs(0.6, 0.3, 0.1)[0], log_probs(0.1, 0.2, 0.7)[0]])
    out = TopPProcessor(0.8)(NO_IDS, batch)
    assert torch.isfinite(out).tolist() == [[True, True, False], [False, True, True]]


def test_top_k():
    scores = torch.tensor([[0.1, 2.0, -1.0, 3.0, 0.5]])
    assert kept(TopKProcessor(2)(NO_IDS, scores)) == [1, 3]
    assert kept(TopKProcessor(1)(NO_IDS, scores)) == [3]
    assert kept(TopKProcessor(10)(NO_IDS, scores)) == [0, 1, 2, 3, 4]
    out = TopKProcessor(3)(NO_IDS, scores)
    assert out[0, 4] == 0.5 and out[0, 0] == -math.inf


def test_repetition_penalty_formula():
    scores = torch.tensor([[2.0, -2.0, 0.5, -0.5, 3.0], [1.0, 1.0, 1.0, -1.0, -1.0]])
    ids = torch.tensor([[0, 1, 1, 3], [4, 4, 4, 4]])  # repeats count once
    out = RepetitionPenaltyProcessor(2.0)(ids, scores)
    expected = torch.tensor([[1.0, -4.0, 0.5, -1.0, 3.0], [1.0, 1.0, 1.0, -1.0, -2.0]])
    assert torch.equal(out, expected)
    assert torch.equal(scores[0], torch.tensor([2.0, -2.0, 0.5, -0.5, 3.0]))  # input untouched


def test_temperature():
    scores = torch.tensor([[1.0, 2.0, 4.0]])
    # scores / t, shifted so the largest is 0 (softmax and the filters after it do not see a shift)
    assert torch.equal(TemperatureProcessor(0.5)(NO_IDS, scores), torch.tensor([[2.0, 4.0, 8.0]]) - 8.0)
    sharp = TemperatureProcessor(0.5)(NO_IDS, scores).softmax(-1)
    flat = TemperatureProcessor(2.0)(NO_IDS, scores).softmax(-1)
    assert sharp[0, 2] > scores.softmax(-1)[0, 2] > flat[0, 2]


def test_processor_list_applies_in_order():
    calls = []

    def add(value):
        def processor(ids, scores):
            calls.append(value)
            return scores + value
        return processor

    out = LogitsProcessorList([add(1.0), add(10.0)])(NO_IDS, torch.zeros(1, 2))
    assert calls == [1.0, 10.0] and torch.equal(out, torch.full((1, 2), 11.0))


def test_create_processors_skips_no_ops():
    assert create_processors(GenerationConfig()) == []
    assert create_processors(GenerationConfig(top_p=1.0, top_k=None, temperature=1.0)) == []
    full = create_processors(GenerationConfig(repetition_penalty=1.3, temperature=0.7, top_k=5, top_p=0.9))
    assert [type(p) for p in full] == [RepetitionPenaltyProcessor, TemperatureProcessor, TopKProcessor,
                                       TopPProcessor]
    greedy = create_processors(GenerationConfig(do_sample=False, repetition_penalty=1.3, temperature=0.7,
                                                top_k=5))
    assert [type(p) for p in greedy] == [RepetitionPenaltyProcessor]
    assert [type(p) for p in create_processors(GenerationConfig(temperature=0.0, top_k=3))] == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=1.5), "top_p must be in (0, 1] or None, got 1.5"),
    (dict(top_p=0.0), "top_p must be in (0, 1] or None, got 0.0"),
    (dict(top_k=0), "top_k must be a positive integer or None, got 0"),
    (dict(temperature=-0.5), "temperature must be 0 (greedy) or a finite number >= 1.18e-38 and <= 3.4e+38 "
                             "(normal float32, the dtype it divides in), got -0.5"),
    (dict(temperature=1e-39), "temperature must be 0 (greedy) or a finite number >= 1.18e-38 and <= 3.4e+38 "
                              "(normal float32, the dtype it divides in), got 1e-39"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a number in [1.18e-38, 3.4e+38] (1 = off; normal "
                                   "float32, the dtype it scales the logits in), got 0.0"),
    (dict(temperature=1e39), "temperature must be 0 (greedy) or a finite number >= 1.18e-38 and <= 3.4e+38 "
                             "(normal float32, the dtype it divides in), got 1e+39"),
    (dict(eos_token_id=-1), "eos_token_id must be a token id in [0, 2^63) or None, got -1"),
    (dict(stop_strings="\n"), "stop_strings must be a list of strings, got '\\n'"),
    (dict(stop_strings=[""]), "stop_strings must hold non-empty strings, got ''"),
    (dict(seed=1.5), "seed must be an integer in [0, 2^64) or None, got 1.5"),
    (dict(seed=2 ** 64), "seed must be an integer in [0, 2^64) or None, got 18446744073709551616"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ConfigError) as err:
        GenerationConfig(**kwargs)
    assert str(err.value) == message


def test_config_greedy_flag():
    assert GenerationConfig(do_sample=False).greedy
    assert GenerationConfig(temperature=0).greedy
    assert not GenerationConfig().greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_accepted_settings_still_give_a_distribution(dtype):
    """Any accepted temperature and top_p yields scores that sample: the smallest temperature (logits divided in
    float32 or bf16 overflowed to inf, then NaN) and a top_p that is 0 once cast (it removed even the top token)."""
    from tokenloom.generation.config import MIN_TEMPERATURE, GenerationConfig

    scores = torch.tensor([[3.0, -1.0, 7.5, 7.0, -80.0]], dtype=dtype)
    for config in (GenerationConfig(temperature=MIN_TEMPERATURE), GenerationConfig(top_p=1e-300),
                   GenerationConfig(temperature=MIN_TEMPERATURE, top_p=1e-46, top_k=2)):
        out = create_processors(config)(NO_IDS, scores.clone())
        probs = out.float().softmax(-1)
        assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)
        assert int(torch.multinomial(probs, 1)) == int(scores.float().argmax())
