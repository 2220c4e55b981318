"""REWARDS: each programmatic reward on hand-made completions, the weighted sum, the reward-model reward against
the reward model's own scorer, and one-line errors naming the setting."""

import pytest

from tokenloom.config import to_dict
from tokenloom.data.tokenizers import Tokenizer
from tokenloom.errors import ConfigError, DataError
from tokenloom.tasks.rewards import REWARDS, RewardSet, RewardSpec


def one(spec: dict, completion: str, example: dict | None = None, prompt: str = "p") -> float:
    return RewardSet([spec]).score([prompt], [completion], [example or {}])[0][0]


def test_registry_names():
    assert REWARDS.names() == ["contains", "exact", "length", "regex", "reward_model"]


@pytest.mark.parametrize("options, completion, expected", [
    ({"pattern": "a+b"}, "aab", 1.0),
    ({"pattern": "a+b"}, "aabc", 0.0),  # full match: trailing text fails
    ({"pattern": "a+b"}, "  aab \n", 1.0),  # stripped first
    ({"pattern": "a+b", "strip": False}, " aab", 0.0),
    ({"pattern": "a+b", "full": False}, "xxaabyy", 1.0),  # search anywhere
    ({"pattern": "A+B", "flags": "i"}, "aab", 1.0),
    ({"pattern": "a.b", "flags": "s"}, "a\nb", 1.0),
    ({"pattern": "a.b"}, "a\nb", 0.0),
    ({"pattern": r"\d{3}-\d{4}"}, "555-1234", 1.0),
])
def test_regex(options, completion, expected):
    assert one({"name": "regex", "options": options}, completion) == expected


def test_exact_and_contains():
    ex = {"answer": "Paris"}
    assert one({"name": "exact"}, " Paris\n", ex) == 1.0
    assert one({"name": "exact"}, "paris", ex) == 0.0
    assert one({"name": "exact", "options": {"ignore_case": True}}, "paris", ex) == 1.0
    assert one({"name": "exact"}, "It is Paris", ex) == 0.0
    assert one({"name": "contains"}, "It is Paris.", ex) == 1.0
    assert one({"name": "contains"}, "It is Rome.", ex) == 0.0
    assert one({"name": "contains", "options": {"ignore_case": True}}, "PARIS!", ex) == 1.0
    # a list holds accepted answers; numbers compare as text; another field by name
    assert one({"name": "exact"}, "NYC", {"answer": ["New York", "NYC"]}) == 1.0
    assert one({"name": "exact"}, "42", {"answer": 42}) == 1.0
    assert one({"name": "contains", "options": {"field": "city"}}, "in Oslo", {"city": "Oslo"}) == 1.0


@pytest.mark.parametrize("completion, expected", [("", 0.0), ("ab", 1.0), ("abcd", 1.0), ("abcde", 0.0),
                                                  ("  ab  ", 1.0)])
def test_length(completion, expected):
    assert one({"name": "length", "options": {"min": 2, "max": 4}}, completion) == expected


def test_weighted_sum_and_best():
    rewards = RewardSet([{"name": "regex", "weight": 2.0, "options": {"pattern": "a.*"}},
                         {"name": "length", "weight": -0.5, "options": {"max": 3}},
                         {"name": "contains", "weight": 1.0}])
    completions = ["abc", "abcdef", "xyz", "answer"]
    examples = [{"answer": "b"}, {"answer": "f"}, {"answer": "q"}, {"answer": "swe"}]
    totals, parts = rewards.score(["p"] * 4, completions, examples)
    assert parts == [[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]]
    expected = [2 * a - 0.5 * b + c for a, b, c in zip(*parts, strict=True)]
    assert totals == pytest.approx(expected)
    # each reward in [0, 1]: the best total takes the positive weights' highs and the negative weights' lows
    assert rewards.best == pytest.approx(3.0)
    assert rewards.names == ["regex", "length", "contains"]


def test_specs_round_trip_through_plain_yaml_values():
    spec = RewardSpec(name="regex", weight=0.5, options={"pattern": "x+"})
    again = RewardSet([to_dict(spec)])
    assert again.score(["p"], ["xx"], [{}])[0] == [0.5]


@pytest.mark.parametrize("spec, needle", [
    ({"name": "regx", "options": {"pattern": "a"}}, "data.rewards[0].name: unknown reward 'regx' (did you mean "
                                                    "'regex'?)"),
    ({"name": "regex", "options": {"pattern": "(a"}}, "data.rewards[0].options.pattern: '(a' is not a valid regular"),
    ({"name": "regex"}, "data.rewards[0].options.pattern must be a non-empty regular expression"),
    ({"name": "regex", "options": {"patern": "a"}}, "unknown key 'data.rewards[0].options.patern' (did you mean "
                                                    "'pattern'?)"),
    ({"name": "regex", "options": {"pattern": "a", "flags": "iq"}}, "data.rewards[0].options.flags: unknown regex "
                                                                    "flag(s) 'q'"),
    ({"name": "length", "options": {"min": 5, "max": 2}}, "data.rewards[0].options.max must be >= min=5, got 2"),
    ({"name": "exact", "weight": 0}, "data.rewards[0].weight must be a finite non-zero number"),
    ({"name": "reward_model"}, "data.rewards[0].options.checkpoint must name a reward-model checkpoint"),
])
def test_bad_settings_are_one_line_errors(spec, needle):
    with pytest.raises(ConfigError) as err:
        RewardSet([spec])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_no_rewards_is_an_error():
    with pytest.raises(ConfigError, match="data.rewards: at least one reward"):
        RewardSet([])


def test_examples_must_hold_the_fields_rewards_read():
    rewards = RewardSet([{"name": "regex", "options": {"pattern": "a"}}, {"name": "exact"}])
    rewards.check_example({"answer": "x"}, "f.jsonl:3")
    with pytest.raises(DataError, match=r"f.jsonl:3: no 'answer' field, which data.rewards\[1\] \(exact\) reads"):
        rewards.check_example({"prompt": "q"}, "f.jsonl:3")
    with pytest.raises(DataError, match="f.jsonl:4: 'answer' must be a string, a number or a non-empty list"):
        rewards.check_example({"answer": {"a": 1}}, "f.jsonl:4")


def test_reward_model_reward_equals_the_scorer(tmp_path):
    """The reward_model reward is the reward model's score of the example's prompt and the completion, as
    tokenloom.tasks.reward.score computes it (the same template), in batches."""
    from tokenloom.checkpoint import write_checkpoint
    from tokenloom.models.gpt import GPTConfig
    from tokenloom.models.reward import GPTReward
    from tokenloom.tasks.reward import score

    tokenizer = Tokenizer.train_char("System: User: Assistant: abcdefghijklmnopqrstuvwxyz?\n")
    config = GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=1, num_heads=2, embed_dim=16, max_seq_len=64)
    model = GPTReward(config).eval()
    section = {"family": "gpt_reward", **to_dict(config)}
    write_checkpoint(tmp_path / "rm", model, {"task": "reward", "model": section, "tokenizer": {}}, tokenizer)
    rewards = RewardSet([{"name": "reward_model", "weight": 2.0,
                          "options": {"checkpoint": str(tmp_path / "rm"), "batch_size": 2}}])
    assert rewards.best is None  # unbounded
    prompts = ["why?", "how?", "who?"]
    completions = ["because", "so", "me and you"]
    examples = [{"prompt": p} for p in prompts]
    totals, _ = rewards.score(prompts, completions, examples)
    expected = [2.0 * score(model, tokenizer, p, c) for p, c in zip(prompts, completions, strict=True)]
    assert totals == pytest.approx(expected, abs=1e-5)
    assert len(set(round(t, 6) for t in totals)) == 3  # different completions, different scores
    # the example's prompt is the whole conversation when it is a list of messages
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]
    got = rewards.score(["why?"], ["because"], [{"prompt": convo}])[0][0]
    assert got == pytest.approx(2.0 * score(model, tokenizer, convo, "because"), abs=1e-5)
    assert got != pytest.approx(totals[0], abs=1e-6)
