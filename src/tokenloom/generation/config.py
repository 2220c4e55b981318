"""Decoding settings: :class:`GenerationConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..config import check, printable


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SEED_LIMIT = 2 ** 64  # torch.Generator.manual_seed takes seeds in [0, 2^64)
MIN_TEMPERATURE = 1.1754943508222875e-38  # the smallest normal float32 (bf16 has the same range): logits are divided
#   by the temperature in that dtype, after the largest is subtracted, so any temperature from here on is finite
INT64_LIMIT = 2 ** 63  # token ids are written into int64 tensors
LENGTH_PENALTY_LIMIT = 10.0  # beam scores divide by length ** length_penalty, a Python float then float32: a huge
#   exponent overflows (OverflowError) or makes every score -inf; within +-10 it stays in float32's range up to
#   lengths of about 6,000 tokens
PENALTY_LIMIT = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)
LOGIT_BIAS_LIMIT = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's range)
MAX_FLOAT32 = 3.4028234663852886e38  # the largest float32: a temperature or repetition penalty beyond it is
#   inf in that dtype (scores / inf: NaN for the -inf of a banned token)


def offset_seed(seed: int | None, k: int) -> int | None:
    """The seed of the k-th sample of a request seeded with ``seed`` (its windows, its n choices): ``seed + k``,
    wrapped into the generator's range so that no derived seed can fail. A ``seed`` outside that range is returned
    as it is, for :class:`GenerationConfig` to refuse."""
    if seed is None or not (isinstance(seed, int) and 0 <= seed < SEED_LIMIT):
        return seed
    return (seed + k) % SEED_LIMIT


@dataclass
class GenerationConfig:
    """How to continue a prompt. Greedy when ``do_sample`` is False or ``temperature`` is 0; beam search
    (:func:`tokenloom.generation.beam_search`) when ``num_beams`` > 1, which needs ``do_sample=False`` and
    takes no ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` or ``stop_strings``
    (``temperature``, ``top_k`` and ``top_p`` are sampling settings: greedy decoding and beam search ignore them;
    the penalties and ``logit_bias`` apply to greedy decoding too, see :mod:`tokenloom.generation.processors`)."""

    max_new_tokens: int = 100  # tokens to generate at most (fewer when every row stops early)
    do_sample: bool = True  # sample from the processed distribution; False = greedy (argmax)
    temperature: float = 1.0  # divide the logits by this before sampling; 0 means greedy
    top_k: int | None = None  # sample only among the k most likely tokens; None = no limit
    top_p: float | None = None  # nucleus: the smallest set of tokens whose probability reaches p; None = all
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the sequence (prompt included)
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted from the logit of every token already generated (OpenAI's
    #   semantics; only the generated tokens count, not the prompt); 0 = off; not with speculative decoding
    frequency_penalty: float = 0.0  # in [-2, 2]: times the number of times a token was already generated, subtracted
    #   from its logit (only the generated tokens count); 0 = off
    logit_bias: dict[int, float] | None = None  # token id -> a number in [-100, 100] added to its logit before
    #   choosing (greedy too; -100 all but bans a token, +100 all but forces it); None = off
    eos_token_id: int | None = None  # a row stops after producing this token; None = never
    pad_token_id: int = 0  # written after a row has stopped
    stop_strings: list[str] = field(default_factory=list)  # a row stops once its new text contains one
    seed: int | None = None  # seeds the sampler's own generator: same seed, same text; None = global RNG
    # beam search (num_beams > 1); see tokenloom.generation.beam for the exact rules
    num_beams: int = 1  # hypotheses kept per prompt; 1 = greedy or sampling
    length_penalty: float = 1.0  # finished score = sum of log-probs / generated_length ** length_penalty
    early_stopping: bool | str = False  # True: a prompt is done once it has num_beams finished hypotheses;
    #   False: ... and the best running one, scored at its current length, cannot beat the worst of them (HF's
    #   heuristic); "never": ... and no running one can beat it at any length (exact)
    num_return_sequences: int = 1  # best hypotheses beam_search returns per prompt (<= num_beams)
    no_repeat_ngram_size: int = 0  # beam search never repeats an n-gram of this size (prompt included); 0 = off
    compile: bool = False  # one-token steps through torch.compile over a static cache (GPT; greedy or sampling)
    exit_threshold: float | None = None  # depth-adaptive early exit (GPT; greedy or sampling): a position leaves
    #   the layer stack once its exit head's largest probability exceeds this, in (0, 1] (1 = never); None = off
    #   (tokenloom.generation.early_exit)
    # speculative decoding (a draft model given to generate, or prompt_lookup): tokenloom.generation.speculative
    num_draft_tokens: int = 4  # k: tokens a drafter proposes per verification pass of the model, >= 1
    prompt_lookup: int = 0  # draft by prompt lookup: a row's last n-gram (n up to this, down to 1) found earlier in
    #   its context proposes the tokens that followed it; 0 = off

    def __post_init__(self) -> None:
        for f in fields(self):  # the messages below quote the values: each must have a repr
            check(printable(getattr(self, f.name)), f"{f.name} holds an integer too long to print (more than 4300 "
                                                    "digits); no setting takes one")
        check(isinstance(self.do_sample, bool),
              f"do_sample must be true or false, got {self.do_sample!r}")
        check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
              f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        check(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
              and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_FLOAT32),
              f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:.3g} and <= {MAX_FLOAT32:.3g} "
              f"(normal float32, the dtype it divides in), got {self.temperature!r}")
        if self.top_k is not None:
            check(_is_int(self.top_k) and self.top_k >= 1,
                  f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None:
            check(isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool)
                  and 0 < self.top_p <= 1, f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        check(isinstance(self.repetition_penalty, (int, float)) and not isinstance(self.repetition_penalty, bool)
              and MIN_TEMPERATURE <= self.repetition_penalty <= MAX_FLOAT32,
              f"repetition_penalty must be a number in [{MIN_TEMPERATURE:.3g}, {MAX_FLOAT32:.3g}] (1 = off; normal "
              f"float32, the dtype it scales the logits in), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool)
                  and -PENALTY_LIMIT <= value <= PENALTY_LIMIT,
                  f"{name} must be a number in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 = off), got {value!r}")
        if self.logit_bias is not None:
            check(isinstance(self.logit_bias, dict),
                  f"logit_bias must be a dict of token id -> number or None, got {self.logit_bias!r}")
            self.logit_bias = dict(self.logit_bias)
            for token, bias in self.logit_bias.items():
                check(_is_int(token) and 0 <= token < INT64_LIMIT,
                      f"logit_bias keys must be token ids (integers in [0, 2^63)), got {token!r}")
                check(isinstance(bias, (int, float)) and not isinstance(bias, bool)
                      and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT,
                      f"logit_bias[{token}] must be a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                      f"got {bias!r}")
        if self.eos_token_id is not None:
            check(_is_int(self.eos_token_id) and 0 <= self.eos_token_id < INT64_LIMIT,
                  f"eos_token_id must be a token id in [0, 2^63) or None, got {self.eos_token_id!r}")
        check(_is_int(self.pad_token_id) and -INT64_LIMIT <= self.pad_token_id < INT64_LIMIT,
              f"pad_token_id must be an integer in [-2^63, 2^63) (an int64), got {self.pad_token_id!r}")
        check(isinstance(self.stop_strings, (list, tuple)),
              f"stop_strings must be a list of strings, got {self.stop_strings!r}")
        self.stop_strings = list(self.stop_strings)
        for s in self.stop_strings:
            check(isinstance(s, str) and s != "", f"stop_strings must hold non-empty strings, got {s!r}")
        if self.seed is not None:
            check(_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT,
                  f"seed must be an integer in [0, 2^64) or None, got {self.seed!r}")
        check(_is_int(self.num_beams) and self.num_beams >= 1,
              f"num_beams must be a positive integer (1 = no beam search), got {self.num_beams!r}")
        check(isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool)
              and -LENGTH_PENALTY_LIMIT <= self.length_penalty <= LENGTH_PENALTY_LIMIT,
              f"length_penalty must be a number in [-{LENGTH_PENALTY_LIMIT:g}, {LENGTH_PENALTY_LIMIT:g}] (1 = average "
              f"log-prob, 0 = sum), got {self.length_penalty!r}")
        check(isinstance(self.early_stopping, bool) or self.early_stopping == "never",
              f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        check(_is_int(self.num_return_sequences) and 1 <= self.num_return_sequences <= self.num_beams,
              f"num_return_sequences must be an integer in [1, num_beams={self.num_beams}], "
              f"got {self.num_return_sequences!r}")
        check(_is_int(self.no_repeat_ngram_size) and self.no_repeat_ngram_size >= 0,
              f"no_repeat_ngram_size must be an integer >= 0 (0 = off), got {self.no_repeat_ngram_size!r}")
        check(isinstance(self.compile, bool), f"compile must be true or false, got {self.compile!r}")
        check(not (self.compile and self.num_beams > 1), f"compile applies to greedy decoding and sampling; beam "
                                                         f"search (num_beams={self.num_beams}) runs eagerly")
        if self.exit_threshold is not None:
            check(isinstance(self.exit_threshold, (int, float)) and not isinstance(self.exit_threshold, bool)
                  and 0 < self.exit_threshold <= 1,
                  f"exit_threshold must be in (0, 1] (1 = never exit) or None (off), got {self.exit_threshold!r}")
            check(self.num_beams == 1, f"exit_threshold applies to greedy decoding and sampling; beam search "
                                       f"(num_beams={self.num_beams}) runs the full model")
            check(not self.compile, "exit_threshold runs eagerly (its layers depend on each step's exits); "
                                    "leave compile off")
        check(_is_int(self.num_draft_tokens) and self.num_draft_tokens >= 1,
              f"num_draft_tokens must be a positive integer (tokens drafted per verification), "
              f"got {self.num_draft_tokens!r}")
        check(_is_int(self.prompt_lookup) and self.prompt_lookup >= 0,
              f"prompt_lookup must be an integer >= 0 (the longest n-gram looked up; 0 = off), "
              f"got {self.prompt_lookup!r}")
        if self.prompt_lookup:
            conflict = self.speculative_conflict()
            check(conflict is None, f"prompt_lookup={self.prompt_lookup}: {conflict}")
        if self.num_beams > 1:
            check(self.greedy, f"num_beams={self.num_beams} (beam search) needs do_sample=False: beam sampling is "
                               "not supported")
            check(self.repetition_penalty == 1.0, f"repetition_penalty={self.repetition_penalty} does not apply to "
                                                  f"beam search (num_beams={self.num_beams}); leave it at 1.0")
            for name in ("presence_penalty", "frequency_penalty"):
                check(getattr(self, name) == 0, f"{name}={getattr(self, name)} does not apply to beam search "
                                                f"(num_beams={self.num_beams}); leave it at 0")
            check(not self.logit_bias, f"logit_bias does not apply to beam search (num_beams={self.num_beams}); "
                                       "leave it out")
            check(not self.stop_strings, f"stop_strings do not apply to beam search (num_beams={self.num_beams}); "
                                         "use eos_token_id")

    def speculative_conflict(self) -> str | None:
        """Why speculative decoding cannot run with these settings (one line), or None."""
        if self.num_beams > 1:
            return f"speculative decoding does not apply to beam search (num_beams={self.num_beams})"
        if self.compile:
            return "speculative decoding runs eagerly (its verification passes are not one-token steps); " \
                   "leave compile off"
        if self.presence_penalty or self.frequency_penalty:
            return "speculative decoding pads the histories it verifies with stand-in tokens, which presence_penalty " \
                   "and frequency_penalty would count as generated; leave them at 0"
        if self.exit_threshold is not None:
            return f"speculative decoding verifies with the full model; leave exit_threshold " \
                   f"({self.exit_threshold}) off"
        return None

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (``do_sample`` off or ``temperature`` 0)."""
        return not self.do_sample or self.temperature == 0
