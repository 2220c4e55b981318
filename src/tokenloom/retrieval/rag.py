"""Retrieval-augmented generation: retrieve the top-k passages for a question, put them in the prompt, generate the
answer, and return it with its citations (and, asked for, a fact check).

**The prompt** is :data:`DEFAULT_TEMPLATE` with ``{passages}`` replaced by the retrieved passages in rank order (the
best first), each written as :data:`DEFAULT_PASSAGE_TEMPLATE` (``[<passage id>] <content>``), one a line, and
``{question}`` by the question::

    [kb/ada.txt] Ada Lovelace was born in London in 1815.
    [kb/turing.txt#0] Alan Turing was born in Maida Vale.

    Question: Where was Ada Lovelace born?
    Answer:

Both templates can be replaced (:class:`RagConfig`); the placeholders are filled in one pass, so braces in a
passage or the question are kept as they are. **Fitting the context**: the prompt must leave room for
``answer_tokens`` new tokens (or ``max_new_tokens`` when fewer) in the model's context; while it does not, the
lowest-ranked passage is dropped (the result names the dropped ids). The question is never cut: one that does not
fit even without passages is a one-line :class:`~tokenloom.errors.GenerationError`.

**The answer** is the generated text up to the first stop string (default a line break) or the end-of-text token,
stripped. **Citations** are the ids, in rank order, of the passages in the prompt that support some span of the
answer lexically (:func:`~tokenloom.retrieval.factcheck.fact_check`: the passage holds at least 70% of the span's
content words that the question does not).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from ..config import check
from ..errors import ConfigError, GenerationError, TokenizerError
from ..generation import GenerationConfig, generate
from .factcheck import METHODS, SUPPORT_THRESHOLD, FactCheck, fact_check, model_fact_check
from .search import DEFAULT_ALPHA, Hit, Retriever, check_method

DEFAULT_TEMPLATE = "{passages}\n\nQuestion: {question}\nAnswer:"
DEFAULT_PASSAGE_TEMPLATE = "[{id}] {text}"
_PLACEHOLDER = re.compile(r"\{(passages|question)\}")
_PASSAGE_PLACEHOLDER = re.compile(r"\{(id|text)\}")


@dataclass
class RagConfig:
    """What retrieval-augmented generation retrieves and how it writes the prompt."""

    top_k: int = 3  # passages retrieved
    retriever: str = "bm25"  # bm25 | dense | hybrid
    alpha: float = DEFAULT_ALPHA  # hybrid: the weight of the dense score (tokenloom.retrieval.search)
    template: str = DEFAULT_TEMPLATE  # the prompt; holds {passages} and {question} once each
    passage_template: str = DEFAULT_PASSAGE_TEMPLATE  # one passage's line; holds {id} and {text}
    answer_tokens: int = 32  # new tokens the prompt must leave room for (passages are dropped until it does)
    stop: tuple[str, ...] = ("\n",)  # the answer ends at the first of these (when the generation config has none)
    threshold: float = SUPPORT_THRESHOLD  # lexical support a citation or a supported span needs
    fact_check: str | None = None  # None (no check), lexical or model

    def __post_init__(self) -> None:
        check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 1,
              f"top-k passages must be an integer >= 1, got {self.top_k!r}")
        check_method(self.retriever)
        check(isinstance(self.alpha, (int, float)) and 0 <= self.alpha <= 1, f"alpha must be in [0, 1], got "
                                                                             f"{self.alpha!r}")
        for name in ("passages", "question"):
            check(self.template.count("{" + name + "}") == 1,
                  f"the RAG template must hold {{{name}}} exactly once, got {self.template!r}")
        check("{text}" in self.passage_template and "{id}" in self.passage_template,
              f"the passage template must hold {{id}} and {{text}}, got {self.passage_template!r}")
        check(isinstance(self.answer_tokens, int) and self.answer_tokens >= 1,
              f"answer_tokens must be an integer >= 1, got {self.answer_tokens!r}")
        check(0 < self.threshold <= 1, f"threshold must be in (0, 1], got {self.threshold!r}")
        check(self.fact_check is None or self.fact_check in METHODS,
              f"fact_check must be null or one of {', '.join(METHODS)}, got {self.fact_check!r}")


def render_passage(hit: Hit, passage_template: str = DEFAULT_PASSAGE_TEMPLATE) -> str:
    values = {"id": hit.passage.id, "text": hit.passage.content}
    return _PASSAGE_PLACEHOLDER.sub(lambda m: values[m.group(1)], passage_template)


def build_prompt(question: str, hits: list[Hit], config: RagConfig | None = None) -> str:
    """The prompt of ``question`` with ``hits`` in the given (rank) order, by the config's templates."""
    config = config or RagConfig()
    values = {"passages": "\n".join(render_passage(h, config.passage_template) for h in hits), "question": question}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], config.template)


def fit_prompt(tokenizer, question: str, hits: list[Hit], context: int, new_tokens: int,  # noqa: ANN001
               config: RagConfig | None = None) -> tuple[str, list[int], list[Hit], list[Hit]]:
    """(prompt, its ids, the hits in it, the hits dropped): the most passages, in rank order, whose prompt leaves
    ``min(answer_tokens, new_tokens)`` positions free in ``context``."""
    config = config or RagConfig()
    room = min(config.answer_tokens, new_tokens)
    for n in range(len(hits), -1, -1):
        prompt = build_prompt(question, hits[:n], config)
        try:
            ids = tokenizer.encode(prompt)
        except TokenizerError as err:
            raise TokenizerError(f"the RAG prompt (question and passages {[h.passage.id for h in hits[:n]]}) "
                                 f"cannot be encoded: {err}") from None
        if len(ids) + room <= context:
            return prompt, ids, hits[:n], hits[n:]
    raise GenerationError(f"the question with the RAG template is {len(ids)} tokens: with {room} new tokens it "
                          f"does not fit the model's context of {context} (shorten the question or lower "
                          "--max-new-tokens)")


@dataclass
class RagAnswer:
    """An answer with what it rests on."""

    question: str  # the question asked
    answer: str  # the generated answer (up to the first stop string, stripped)
    citations: list[str]  # ids of the passages in the prompt that support a span of the answer, in rank order
    hits: list[Hit]  # every retrieved passage, in rank order
    dropped: list[str]  # ids of retrieved passages left out of the prompt to fit the context
    prompt: str  # the prompt the model continued
    fact_check: FactCheck | None = None  # the span-by-span check, when asked for
    new_tokens: int = 0  # tokens generated
    notes: list[str] = field(default_factory=list)  # what was changed to fit (passages dropped)

    def to_dict(self, prompt: bool = False) -> dict:
        out = {"question": self.question, "answer": self.answer, "citations": self.citations,
               "passages": [{"id": h.passage.id, "score": h.score, "rank": h.rank, "text": h.passage.content}
                            for h in self.hits],
               "dropped": self.dropped, "notes": self.notes,
               "fact_check": None if self.fact_check is None else self.fact_check.to_dict()}
        if prompt:
            out["prompt"] = self.prompt
        return out


def answer_text(raw: str, stops: list[str] | tuple[str, ...]) -> str:
    """The generated text up to the first stop string, stripped."""
    cut = min((i for i in (raw.find(s) for s in stops if s) if i >= 0), default=len(raw))
    return raw[:cut].strip()


def continuation(tokenizer, prompt: list[int], new: list[int]) -> str:  # noqa: ANN001
    """The text ``new`` adds after ``prompt`` (decoded together: tokenizers whose decoding depends on the position
    print it right)."""
    head = tokenizer.decode(prompt[-64:])
    whole = tokenizer.decode(prompt[-64:] + new)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new)


def rag_generate(model, tokenizer, retriever: Retriever, question: str,  # noqa: ANN001
                 config: RagConfig | None = None, generation: GenerationConfig | None = None) -> RagAnswer:
    """Retrieve, build the prompt, generate with :func:`tokenloom.generation.generate`, cite and check."""
    config = config or RagConfig()
    generation = generation or GenerationConfig(max_new_tokens=64, do_sample=False)
    if not question.strip():
        raise ConfigError("the question is empty")
    hits = retriever.search(question, config.top_k, config.retriever, config.alpha)
    context = int(model.config.max_seq_len)
    prompt, ids, kept, dropped = fit_prompt(tokenizer, question, hits, context, generation.max_new_tokens, config)
    stops = list(generation.stop_strings) or list(config.stop)
    gen = replace(generation, max_new_tokens=min(generation.max_new_tokens, context - len(ids)), stop_strings=stops,
                  eos_token_id=generation.eos_token_id if generation.eos_token_id is not None else tokenizer.eos_id)
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = generate(model, torch.tensor([ids], device=device), gen, tokenizer=tokenizer)
    new = out[0, len(ids):].tolist()
    if gen.eos_token_id is not None and gen.eos_token_id in new:
        new = new[:new.index(gen.eos_token_id)]
    raw = continuation(tokenizer, ids, new)
    answer = answer_text(raw, stops)
    return finish(RagAnswer(question, answer, [], hits, [h.passage.id for h in dropped], prompt,
                            new_tokens=len(new)), kept, config, model, tokenizer, raw)


def finish(result: RagAnswer, kept: list[Hit], config: RagConfig, model=None, tokenizer=None,  # noqa: ANN001
           raw: str | None = None) -> RagAnswer:
    """Fill in a generated answer's citations, notes and (``config.fact_check``) fact check; ``kept``: the hits in
    its prompt. The model-scored check needs the model, its tokenizer and the raw continuation."""
    pairs = [(h.passage.id, h.passage.content) for h in kept]
    lexical = fact_check(result.answer, pairs, result.question, config.threshold)
    cited = {pid for span in lexical.spans for pid in span.passages}
    result.citations = [pid for pid, _ in pairs if pid in cited]
    if result.dropped:
        result.notes.append(f"{len(result.dropped)} of {len(result.hits)} retrieved passages left out of the prompt "
                            f"to fit the model's context: {', '.join(result.dropped)}")
    if config.fact_check == "lexical" or (config.fact_check == "model" and model is None):
        result.fact_check = lexical
    elif config.fact_check == "model":
        raw = result.answer if raw is None else raw
        lead = raw[:len(raw) - len(raw.lstrip())]  # the whitespace the model wrote before the answer
        without = build_prompt(result.question, [], config)
        result.fact_check = model_fact_check(model, tokenizer, result.answer, result.prompt + lead, without + lead,
                                             pairs, result.question, config.threshold)
    return result
