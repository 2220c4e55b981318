"""A simple check of an answer against the passages it was given: which of its spans the passages support.

**Spans.** The answer is cut at sentence ends (``.``, ``!``, ``?`` followed by a space or the end), semicolons, line
breaks, and before the clauses that ", and", ", but", ", while", ", which", ", whereas" open; each span is checked
on its own.

**Lexical support** (the default). A span's claim is its content terms (:func:`~tokenloom.retrieval.terms.
content_terms`: lowercased words less function words) that are not in the question (what the question already says
is not a claim of the answer; a span made only of the question's words keeps them all). Its support by a passage is
the fraction of the claim's distinct terms found among the passage's terms. A span is **supported** when some
passage's support reaches ``threshold`` (:data:`SUPPORT_THRESHOLD`, 0.7), and the passages that reach it are named
(in rank order). A span without content terms claims nothing and counts as supported (support 1.0, no passages).
The passages that support some span are the answer's citations (:func:`tokenloom.retrieval.rag.finish`).

**Model-scored support** (``method="model"``). With the language model that answered: a span is supported when the
passages make it more likely, log p(span | prompt with the passages, answer before it) - log p(span | the same
without the passages) > 0; ``support`` is that difference in nats. The passages named are the lexical ones.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch

from ..config import check
from .terms import content_terms, terms

SUPPORT_THRESHOLD = 0.7  # the fraction of a span's claimed terms one passage must hold for it to count as support
METHODS = ("lexical", "model")
_BREAK = re.compile(r"(?<=[.!?])\s+|;\s*|\n+|,\s+(?=(?:and|but|while|which|whereas)\b)")


@dataclass
class SpanCheck:
    """One span of the answer and its verdict."""

    text: str  # the span, stripped
    start: int  # its character offsets in the answer
    end: int
    supported: bool  # whether the passages support it
    support: float  # lexical: the best passage's fraction of the claim; model: the log-likelihood gain in nats
    passages: list[str] = field(default_factory=list)  # the ids of the passages that support it, in rank order


@dataclass
class FactCheck:
    """The verdict on every span of an answer."""

    spans: list[SpanCheck]  # in the answer's order
    method: str = "lexical"  # lexical | model
    threshold: float = SUPPORT_THRESHOLD  # lexical: the support a span needs

    @property
    def supported(self) -> bool:
        """True when every span is supported."""
        return all(s.supported for s in self.spans)

    @property
    def unsupported(self) -> list[SpanCheck]:
        return [s for s in self.spans if not s.supported]

    def to_dict(self) -> dict:
        return {"method": self.method, "threshold": self.threshold, "supported": self.supported,
                "spans": [asdict(s) for s in self.spans]}


def split_spans(text: str) -> list[tuple[int, int]]:
    """The (start, end) character offsets of the answer's spans (sentences and clauses), blank ones left out."""
    out, start = [], 0
    for m in [*_BREAK.finditer(text), None]:
        end = len(text) if m is None else m.start()
        piece = text[start:end]
        if piece.strip():
            lead = len(piece) - len(piece.lstrip())
            out.append((start + lead, start + len(piece.rstrip())))
        if m is not None:
            start = m.end()
    return out


def claim(span: str, question: str = "") -> set[str]:
    """The distinct content terms of ``span`` that the question does not already hold (all of them when every one
    is in the question)."""
    own = set(content_terms(span))
    new = own - set(content_terms(question))
    return new or own


def support(claimed: set[str], passage: str | set[str]) -> float:
    """The fraction of ``claimed`` terms found in ``passage`` (its text, or its set of terms); 1.0 for no claim."""
    if not claimed:
        return 1.0
    words = passage if isinstance(passage, set) else set(terms(passage))
    return len(claimed & words) / len(claimed)


def fact_check(answer: str, passages: list[tuple[str, str]], question: str = "",
               threshold: float = SUPPORT_THRESHOLD) -> FactCheck:
    """Lexical support of each span of ``answer`` by ``passages`` ((id, content) pairs in rank order)."""
    check(0 < threshold <= 1, f"the fact check's threshold must be in (0, 1], got {threshold!r}")
    bags = [(pid, set(terms(content))) for pid, content in passages]
    spans = []
    for start, end in split_spans(answer):
        text = answer[start:end]
        claimed = claim(text, question)
        scores = [(pid, support(claimed, words)) for pid, words in bags]
        best = max((s for _, s in scores), default=0.0 if claimed else 1.0)
        named = [pid for pid, s in scores if s >= threshold] if claimed else []
        spans.append(SpanCheck(text, start, end, best >= threshold, round(best, 4), named))
    return FactCheck(spans, "lexical", threshold)


@torch.inference_mode()
def continuation_logprob(model, tokenizer, prefix: str, text: str) -> float:  # noqa: ANN001
    """log p(``text`` | ``prefix``) under a causal LM: the sum of its tokens' log-probabilities (the prefix cut from
    the left to fit the model's context)."""
    head = tokenizer.encode(prefix)
    whole = tokenizer.encode(prefix + text)
    new = whole[len(head):] if whole[:len(head)] == head else tokenizer.encode(text)
    if not new:
        return 0.0
    ids = (head + new)[-int(model.config.max_seq_len):]
    if len(ids) <= len(new):  # no room for any of the prefix: score the span's tail after its own first token
        new = ids[1:]
    device = next(model.parameters()).device
    logits = model(torch.tensor([ids], device=device)).float()  # (1, T, V)
    logp = torch.log_softmax(logits[0, -len(new) - 1:-1], dim=-1)  # (n, V): the predictions of the new tokens
    return float(logp.gather(1, torch.tensor(new, device=device)[:, None]).sum())


def model_fact_check(model, tokenizer, answer: str, with_passages: str, without_passages: str,  # noqa: ANN001
                     passages: list[tuple[str, str]], question: str = "",
                     threshold: float = SUPPORT_THRESHOLD) -> FactCheck:
    """Model-scored support: each span supported when log p(span | ``with_passages`` + the answer before it) -
    log p(span | ``without_passages`` + the answer before it) > 0 (the prompts end where the answer starts)."""
    lexical = fact_check(answer, passages, question, threshold)
    for span in lexical.spans:
        before = answer[:span.start]
        gain = continuation_logprob(model, tokenizer, with_passages + before, answer[span.start:span.end]) - \
            continuation_logprob(model, tokenizer, without_passages + before, answer[span.start:span.end])
        span.supported, span.support = gain > 0, round(gain, 4)
    lexical.method = "model"
    return lexical
