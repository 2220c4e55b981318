"""OpenAI's presence / frequency penalties and logit_bias: the processors against hand computations, their place in
create_processors, greedy decoding they change, and GenerationConfig's checks of them."""

import math

import pytest
import torch

from tests.generation.helpers import left_pad, small_model
from tokenloom.errors import ConfigError, GenerationError
from tokenloom.generation import (
    GenerationConfig,
    LogitBiasProcessor,
    PresenceFrequencyProcessor,
    RepetitionPenaltyProcessor,
    TemperatureProcessor,
    TopKProcessor,
    TopPProcessor,
    create_processors,
    generate,
)


def test_presence_and_frequency_subtract_the_hand_computed_amounts():
    processor = PresenceFrequencyProcessor(presence=0.5, frequency=0.25)
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, -math.inf]])
    prompt = torch.tensor([[1, 2, 2]])
    assert torch.equal(processor(prompt, scores), scores)  # the first call: the prompt, nothing generated yet
    assert processor.prompt_len == 3
    history = torch.tensor([[1, 2, 2, 4, 4, 2, 5]])  # generated: 4 twice, 2 once, 5 once
    out = processor(history, scores)
    # token 1 only in the prompt: untouched; 2: 0.5 + 0.25 * 1; 4: 0.5 + 0.25 * 2; 5: 0.5 + 0.25 * 1 (from -inf)
    expected = torch.tensor([[1.0, 2.0, 3.0 - 0.75, 4.0, 5.0 - 1.0, -math.inf]])
    assert torch.equal(out, expected)


def test_penalties_count_each_row_and_negative_values_encourage():
    processor = PresenceFrequencyProcessor(presence=-1.0, frequency=-0.5)
    scores = torch.zeros(2, 4)
    processor(torch.tensor([[3, 3], [0, 1]]), scores)  # prompt length 2
    out = processor(torch.tensor([[3, 3, 0, 0, 0], [0, 1, 2, 1, 1]]), scores)
    assert out.tolist() == [[2.5, 0.0, 0.0, 0.0], [0.0, 2.0, 1.5, 0.0]]  # row 2: 1 twice, 2 once


def test_penalties_ignore_ids_outside_the_vocabulary():
    processor = PresenceFrequencyProcessor(presence=1.0)
    scores = torch.zeros(1, 3)
    processor(torch.tensor([[0]]), scores)
    out = processor(torch.tensor([[0, 1, -5, 7]]), scores)  # a pad id past the vocabulary after a finished row
    assert out.tolist() == [[0.0, -1.0, 0.0]]


def test_logit_bias_adds_to_the_named_ids():
    processor = LogitBiasProcessor({1: 2.5, 3: -100, 4: 100})
    scores = torch.tensor([[0.5, 1.0, 2.0, 3.0, -math.inf], [1.0, 1.0, 1.0, 1.0, 1.0]])
    out = processor(torch.zeros(2, 0, dtype=torch.long), scores)
    assert torch.equal(out, torch.tensor([[0.5, 3.5, 2.0, -97.0, -math.inf], [1.0, 3.5, 1.0, -99.0, 101.0]]))
    with pytest.raises(GenerationError, match="logit_bias names token id 9, outside the model's vocabulary of 5"):
        LogitBiasProcessor({9: 1.0})(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 5))


def test_create_processors_order_and_greedy_keeps_bias_and_penalties():
    every = dict(logit_bias={1: 1.0}, presence_penalty=0.5, frequency_penalty=0.1, repetition_penalty=1.2,
                 temperature=0.7, top_k=5, top_p=0.9)
    kinds = [type(p) for p in create_processors(GenerationConfig(**every))]
    assert kinds == [LogitBiasProcessor, PresenceFrequencyProcessor, RepetitionPenaltyProcessor,
                     TemperatureProcessor, TopKProcessor, TopPProcessor]
    kinds = [type(p) for p in create_processors(GenerationConfig(**every, do_sample=False))]
    assert kinds == [LogitBiasProcessor, PresenceFrequencyProcessor, RepetitionPenaltyProcessor]
    assert [type(p) for p in create_processors(GenerationConfig(frequency_penalty=-0.3, temperature=0))] == \
        [PresenceFrequencyProcessor]
    assert not create_processors(GenerationConfig(logit_bias={}, presence_penalty=0.0))  # no-ops left out
    first, second = create_processors(GenerationConfig(presence_penalty=1.0)), \
        create_processors(GenerationConfig(presence_penalty=1.0))
    assert first[0] is not second[0]  # a fresh (stateful) processor per call


@torch.no_grad()
def reference_penalized_greedy(model, prompt: list[int], n: int, presence: float, frequency: float,
                               bias: dict[int, float]) -> list[int]:
    """Greedy decoding re-running the whole sequence each step, the penalties and bias applied element by element
    over the generated tokens only."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq]))[0, -1].tolist()
        for token, value in bias.items():
            logits[token] += value
        generated = seq[len(prompt):]
        for token in set(generated):
            logits[token] -= presence + frequency * generated.count(token)
        seq.append(max(range(len(logits)), key=logits.__getitem__))
    return seq[len(prompt):]


@pytest.mark.parametrize("presence, frequency, bias", [(1.5, 0.0, {}), (0.0, 2.0, {}), (0.7, 0.4, {3: 1.5, 5: -2.0}),
                                                       (-2.0, -1.0, {})])
def test_greedy_generate_with_penalties_equals_the_reference(presence, frequency, bias):
    model = small_model()
    prompt = [4, 9, 4, 4, 17, 9]  # repeated ids in the prompt: they must not count
    config = GenerationConfig(max_new_tokens=14, do_sample=False, presence_penalty=presence,
                              frequency_penalty=frequency, logit_bias=bias or None)
    out = generate(model, torch.tensor([prompt]), config)[0, len(prompt):].tolist()
    assert out == reference_penalized_greedy(model, prompt, 14, presence, frequency, bias)
    plain = generate(model, torch.tensor([prompt]), GenerationConfig(max_new_tokens=14, do_sample=False))
    assert out != plain[0, len(prompt):].tolist()  # (each setting changes this model's greedy output)


def test_penalties_count_only_generated_tokens_not_the_prompt():
    model = small_model()
    prompt = [4, 9, 4, 4, 17, 9]
    plain = generate(model, torch.tensor([prompt]), GenerationConfig(max_new_tokens=1, do_sample=False))
    penalized = generate(model, torch.tensor([prompt]), GenerationConfig(max_new_tokens=1, do_sample=False,
                                                                         presence_penalty=2.0, frequency_penalty=2.0))
    assert torch.equal(plain, penalized)  # the first token: nothing generated yet, the prompt is not counted


def test_batched_left_padded_penalties_equal_one_by_one():
    model = small_model()
    rows = [torch.tensor([4, 9, 4]), torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([11])]
    config = GenerationConfig(max_new_tokens=10, do_sample=False, presence_penalty=0.8, frequency_penalty=0.6,
                              logit_bias={2: 0.5})
    ids, mask = left_pad(rows, pad=0)
    out = generate(model, ids, config, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = generate(model, row[None], config)[0, len(row):]
        assert torch.equal(out[i, ids.shape[1]:], alone), i


def test_a_big_bias_changes_greedy_decoding():
    model = small_model()
    prompt = torch.tensor([[4, 9, 4]])
    plain = generate(model, prompt, GenerationConfig(max_new_tokens=8, do_sample=False))[0, 3:].tolist()
    target = next(t for t in range(40) if t not in plain)
    forced = generate(model, prompt, GenerationConfig(max_new_tokens=8, do_sample=False,
                                                      logit_bias={target: 100}))[0, 3:].tolist()
    assert forced == [target] * 8


def test_a_bias_of_minus_100_bans_a_token_greedy_and_sampled():
    model = small_model()
    prompt = torch.tensor([[4, 9, 4]])
    plain = generate(model, prompt, GenerationConfig(max_new_tokens=12, do_sample=False))[0, 3:].tolist()
    banned = {t: -100 for t in set(plain)}
    out = generate(model, prompt, GenerationConfig(max_new_tokens=12, do_sample=False, logit_bias=banned))
    assert not set(out[0, 3:].tolist()) & set(banned)
    sampled = generate(model, prompt.expand(16, 3), GenerationConfig(max_new_tokens=12, temperature=1.5, seed=0,
                                                                      logit_bias=banned))
    assert not set(sampled[:, 3:].flatten().tolist()) & set(banned)


@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be a number in [-2, 2] (0 = off), got 2.5"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be a number in [-2, 2] (0 = off), got -2.01"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a number in [-2, 2] (0 = off), got nan"),
    (dict(presence_penalty=True), "presence_penalty must be a number in [-2, 2] (0 = off), got True"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a dict of token id -> number or None, got [1, 2]"),
    (dict(logit_bias={"5": 1.0}), "logit_bias keys must be token ids (integers in [0, 2^63)), got '5'"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids (integers in [0, 2^63)), got -1"),
    (dict(logit_bias={5: 100.5}), "logit_bias[5] must be a number in [-100, 100], got 100.5"),
    (dict(logit_bias={5: "up"}), "logit_bias[5] must be a number in [-100, 100], got 'up'"),
    (dict(num_beams=2, do_sample=False, presence_penalty=0.5), "presence_penalty=0.5 does not apply to beam search"),
    (dict(num_beams=2, do_sample=False, logit_bias={1: 1.0}), "logit_bias does not apply to beam search"),
    (dict(prompt_lookup=3, frequency_penalty=0.5), "prompt_lookup=3: speculative decoding pads the histories"),
])
def test_config_refuses_bad_penalties_and_bias_in_one_line(kwargs, message):
    with pytest.raises(ConfigError) as err:
        GenerationConfig(**kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_config_accepts_the_limits():
    config = GenerationConfig(presence_penalty=-2, frequency_penalty=2.0, logit_bias={0: -100, 7: 100.0})
    assert config.logit_bias == {0: -100, 7: 100.0}
    assert config.speculative_conflict() is not None
    assert GenerationConfig(logit_bias={3: 1.0}).speculative_conflict() is None  # a bias has no history
