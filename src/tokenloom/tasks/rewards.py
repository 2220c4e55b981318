"""``REWARDS``: programmatic rewards for policy optimisation (the ``grpo`` task), named in a recipe.

A reward scores one completion: ``reward(prompt, completion, example) -> float``, where ``completion`` is the
generated text up to (not including) the chat template's end marker and ``example`` the JSONL row the prompt came
from (its extra fields, such as ``answer``). Each is configured from YAML with plain options (no import strings, no
user code)::

    rewards:
      - {name: regex, options: {pattern: "[A-Z][a-z]+\\\\."}}        # 1 if the completion fully matches
      - {name: exact, weight: 2.0}                                  # 1 if it equals the example's "answer"
      - {name: contains, options: {field: answer, ignore_case: true}}
      - {name: length, weight: 0.5, options: {min: 1, max: 40}}    # 1 if 1 <= characters <= 40
      - {name: reward_model, options: {checkpoint: runs/rm}}        # a reward model's scalar score

The total reward is the weighted sum (:class:`RewardSet`). A reward declares its range (``bounds``): the
programmatic ones lie in [0, 1], so a recipe's highest total is known (what "satisfied" means in evaluation); a
reward model's score is unbounded (``bounds = None``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..config import check, check_choice, from_dict
from ..errors import ConfigError, DataError
from ..registry import Registry

REWARDS: Registry[type] = Registry("reward")
REGEX_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL}


class Reward:
    """Base of every reward: ``__call__`` scores one completion, :meth:`score_batch` many (a model-based reward
    overrides it to score in batches). ``fields_needed`` names the example fields it reads (checked when the data is
    read), ``bounds`` its (lowest, highest) value or None when unbounded."""

    bounds: ClassVar[tuple[float, float] | None] = (0.0, 1.0)

    def __call__(self, prompt: str, completion: str, example: dict[str, Any]) -> float:
        raise NotImplementedError

    def fields_needed(self) -> tuple[str, ...]:
        return ()

    def prepare(self, device: Any = "cpu") -> None:
        """Load what the reward needs (a reward model) before the first score; programmatic rewards need nothing."""

    def score_batch(self, prompts: Sequence[str], completions: Sequence[str],
                    examples: Sequence[dict[str, Any]]) -> list[float]:
        return [float(self(p, c, e)) for p, c, e in zip(prompts, completions, examples, strict=True)]


def _compile(pattern: str, flags: str, where: str) -> re.Pattern:
    bad = [f for f in flags if f not in REGEX_FLAGS]
    check(not bad, f"{where}flags: unknown regex flag(s) {''.join(bad)!r}; use any of i (ignore case), m (multiline), "
                   "s (dot matches newline)")
    value = 0
    for letter in flags:
        value |= REGEX_FLAGS[letter]
    try:
        return re.compile(pattern, value)
    except re.error as err:
        raise ConfigError(f"{where}pattern: {pattern!r} is not a valid regular expression ({err})") from None


@REWARDS.register("regex")
@dataclass
class RegexReward(Reward):
    """1.0 when the completion (surrounding whitespace stripped unless ``strip`` is off) matches ``pattern`` as a
    whole (``re.fullmatch``; ``full: false``: anywhere, ``re.search``), else 0.0. Python's ``re`` syntax; the
    pattern is data, compiled once, never code."""

    pattern: str = ""  # a Python regular expression
    flags: str = ""  # letters among i (ignore case), m (multiline: ^ $ at each line), s (. matches a newline)
    full: bool = True  # the whole completion must match (re.fullmatch); false: a match anywhere (re.search)
    strip: bool = True  # strip surrounding whitespace from the completion first

    def __post_init__(self) -> None:
        check(bool(self.pattern), "pattern must be a non-empty regular expression, got ''")
        self._regex = _compile(self.pattern, self.flags, "")

    def __call__(self, prompt: str, completion: str, example: dict[str, Any]) -> float:
        text = completion.strip() if self.strip else completion
        found = self._regex.fullmatch(text) if self.full else self._regex.search(text)
        return 1.0 if found is not None else 0.0


def _answers(example: dict[str, Any], name: str) -> list[str]:
    """The example's ``name`` field as a list of accepted answers (a string, a number or a list of them)."""
    value = example.get(name)
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def check_answer_field(value: Any) -> bool:
    """Whether an example's answer field is a string, a number or a non-empty list of them."""
    scalar = (str, int, float)
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, scalar) and not isinstance(v, bool) for v in value)
    return isinstance(value, scalar) and not isinstance(value, bool)


@dataclass
class _AnswerReward(Reward):
    field: str = "answer"  # the example field holding the answer (a string, a number or a list of accepted ones)
    ignore_case: bool = False  # compare case-insensitively
    strip: bool = True  # strip surrounding whitespace from the completion and the answer first

    def __post_init__(self) -> None:
        check(bool(self.field), "field must name an example field, got ''")

    def fields_needed(self) -> tuple[str, ...]:
        return (self.field,)

    def _norm(self, text: str) -> str:
        text = text.strip() if self.strip else text
        return text.casefold() if self.ignore_case else text


@REWARDS.register("exact")
@dataclass
class ExactReward(_AnswerReward):
    """1.0 when the completion equals the example's answer (any of them, when it is a list), else 0.0."""

    def __call__(self, prompt: str, completion: str, example: dict[str, Any]) -> float:
        text = self._norm(completion)
        return 1.0 if any(text == self._norm(a) for a in _answers(example, self.field)) else 0.0


@REWARDS.register("contains")
@dataclass
class ContainsReward(_AnswerReward):
    """1.0 when the completion contains the example's answer (any of them, when it is a list), else 0.0."""

    def __call__(self, prompt: str, completion: str, example: dict[str, Any]) -> float:
        text = self._norm(completion)
        return 1.0 if any(self._norm(a) in text for a in _answers(example, self.field)) else 0.0


@REWARDS.register("length")
@dataclass
class LengthReward(Reward):
    """1.0 when the completion has between ``min`` and ``max`` characters (inclusive), else 0.0."""

    min: int = 0  # the fewest characters
    max: int | None = None  # the most characters; None = no limit
    strip: bool = True  # count the characters after stripping surrounding whitespace

    def __post_init__(self) -> None:
        check(self.min >= 0, f"min must be >= 0, got {self.min}")
        check(self.max is None or self.max >= self.min, f"max must be >= min={self.min}, got {self.max}")

    def __call__(self, prompt: str, completion: str, example: dict[str, Any]) -> float:
        n = len(completion.strip() if self.strip else completion)
        return 1.0 if self.min <= n and (self.max is None or n <= self.max) else 0.0


@REWARDS.register("reward_model")
@dataclass
class RewardModelReward(Reward):
    """The scalar score of a trained reward model (``tokenloom train`` with task ``reward``) for the prompt and the
    completion, through :func:`tokenloom.tasks.reward.load_scorer` (rendered with the chat template the reward model
    was trained with). The prompt it reads is the example's own ``prompt`` (a string or a list of messages: the
    whole conversation) when the example has one, else the prompt text. Loaded by :meth:`prepare` (the task calls it
    at setup, and with the policy's device before scoring), scored in batches; unbounded."""

    bounds: ClassVar[tuple[float, float] | None] = None
    checkpoint: str = ""  # the reward model's checkpoint directory
    batch_size: int = 16  # completions scored per forward pass

    def __post_init__(self) -> None:
        check(bool(self.checkpoint), "checkpoint must name a reward-model checkpoint directory, got ''")
        check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        self._scorer: Any = None

    def prepare(self, device: Any = "cpu") -> None:
        if self._scorer is None:
            from .reward import load_scorer

            self._scorer = load_scorer(self.checkpoint, device=device, batch_size=self.batch_size)
        else:
            self._scorer.model.to(device)

    def __call__(self, prompt: str, completion: str, example: dict[str, Any]) -> float:
        return self.score_batch([prompt], [completion], [example])[0]

    def score_batch(self, prompts: Sequence[str], completions: Sequence[str],
                    examples: Sequence[dict[str, Any]]) -> list[float]:
        if self._scorer is None:
            self.prepare()
        conversations = [e["prompt"] if isinstance(e.get("prompt"), (str, list)) else p
                         for p, e in zip(prompts, examples, strict=True)]
        return [float(s) for s in self._scorer(conversations, list(completions))]


@dataclass
class RewardSpec:
    """One entry of a ``rewards`` list: a reward of :data:`REWARDS` by name, its weight in the total and its options
    (the fields of its class)."""

    name: str = ""  # a reward: regex | exact | contains | length | reward_model
    weight: float = 1.0  # its weight in the total reward (a weighted sum)
    options: dict[str, Any] = field(default_factory=dict)  # the reward's own settings (see its class)

    def __post_init__(self) -> None:
        check_choice("name", self.name, REWARDS)
        check(math.isfinite(self.weight) and self.weight != 0, f"weight must be a finite non-zero number, got "
                                                               f"{self.weight}")
        self.create()  # validates the options (a bad pattern, an unknown key), naming them

    def create(self) -> Reward:
        """A fresh reward built from the options; errors name ``options.<key>``."""
        cls = REWARDS.get(self.name)
        return from_dict(cls, self.options, prefix="options")


class RewardSet:
    """A weighted sum of rewards: :meth:`score` gives each completion's total and the parts."""

    def __init__(self, specs: Sequence[RewardSpec], where: str = "data.rewards") -> None:
        if not specs:
            raise ConfigError(f"{where}: at least one reward is needed (e.g. [{{name: regex, options: {{pattern: "
                              f"...}}}}]); known: {', '.join(REWARDS.names())}")
        specs = [from_dict(RewardSpec, s, prefix=f"{where}[{i}]") if isinstance(s, dict) else s
                 for i, s in enumerate(specs)]
        self.specs = list(specs)
        self.rewards = [s.create() for s in specs]
        self.weights = [s.weight for s in specs]
        self.where = where

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def fields_needed(self) -> dict[str, str]:
        """Example field -> the reward setting that reads it (``data.rewards[0] (exact)``)."""
        needed: dict[str, str] = {}
        for i, (spec, reward) in enumerate(zip(self.specs, self.rewards, strict=True)):
            for name in reward.fields_needed():
                needed.setdefault(name, f"{self.where}[{i}] ({spec.name})")
        return needed

    def check_example(self, example: dict[str, Any], where: str) -> None:
        """A one-line :class:`DataError` naming ``where`` (path:line) when ``example`` lacks a field a reward reads."""
        for name, setting in self.fields_needed().items():
            if name not in example:
                raise DataError(f"{where}: no {name!r} field, which {setting} reads")
            if not check_answer_field(example[name]):
                raise DataError(f"{where}: {name!r} must be a string, a number or a non-empty list of them, got "
                                f"{example[name]!r:.80}")

    @property
    def best(self) -> float | None:
        """The highest total reward when every reward is bounded (each at its best), else None."""
        if any(r.bounds is None for r in self.rewards):
            return None
        return sum(w * (r.bounds[1] if w > 0 else r.bounds[0]) for r, w in zip(self.rewards, self.weights,
                                                                                strict=True))

    def prepare(self, device: Any = "cpu") -> None:
        for reward in self.rewards:
            reward.prepare(device)

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              examples: Sequence[dict[str, Any]]) -> tuple[list[float], list[list[float]]]:
        """(total per completion, [per reward: its value per completion])."""
        parts = [r.score_batch(prompts, completions, examples) for r in self.rewards]
        totals = [sum(w * part[j] for w, part in zip(self.weights, parts, strict=True)) for j in range(len(prompts))]
        return totals, parts


def reward_option_names(name: str) -> list[str]:
    """The option keys reward ``name`` takes (for docs and error hints)."""
    return [f.name for f in fields(REWARDS.get(name)) if f.init]
