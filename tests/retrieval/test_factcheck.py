"""The fact check: answers split into sentences and clauses; a span whose claim the passages hold passes and names
them, a span they do not hold is flagged; the model-scored mode is the log-likelihood gain it documents."""

from __future__ import annotations

import pytest
import torch

from tests.retrieval.conftest import DOCS, QUESTION
from tokenloom.checkpoint import load_model, load_tokenizer
from tokenloom.retrieval import fact_check, model_fact_check, split_spans
from tokenloom.retrieval.factcheck import claim, continuation_logprob, support

PASSAGES = [("people/curie.txt", DOCS["people/curie.txt"]), ("ada.txt", DOCS["ada.txt"])]


def spans(text: str) -> list[str]:
    return [text[a:b] for a, b in split_spans(text)]


def test_spans_are_sentences_and_clauses():
    assert spans("She was born in Warsaw. She won two prizes!  Then? ok") == \
        ["She was born in Warsaw.", "She won two prizes!", "Then?", "ok"]
    assert spans("born in Warsaw, and she won two prizes; later\nshe moved") == \
        ["born in Warsaw", "and she won two prizes", "later", "she moved"]
    assert spans("Paris, France") == ["Paris, France"]  # a comma alone does not open a clause
    assert spans("  ") == [] and spans("3.14 is pi.") == ["3.14 is pi."]


def test_a_supported_span_passes_and_an_unsupported_one_is_flagged():
    answer = "Marie Curie was born in Warsaw. She won the Turing award in 1950."
    check = fact_check(answer, PASSAGES, QUESTION)
    first, second = check.spans
    assert first.text == "Marie Curie was born in Warsaw." and first.supported
    assert first.passages == ["people/curie.txt"] and first.support == 1.0
    assert second.text == "She won the Turing award in 1950." and not second.supported
    assert second.passages == [] and second.support < check.threshold
    assert not check.supported and check.unsupported == [second]
    assert answer[first.start:first.end] == first.text and answer[second.start:second.end] == second.text


def test_the_question_words_are_not_the_claim():
    # "Marie Curie born" are the question's: the claim of a wrong answer is its new word alone
    assert claim("Marie Curie was born in Paris.", QUESTION) == {"paris"}
    wrong = fact_check("Marie Curie was born in Paris.", PASSAGES, QUESTION)
    assert not wrong.supported and wrong.spans[0].support == 0.0
    assert fact_check("Marie Curie was born in Paris.", PASSAGES).spans[0].support == pytest.approx(3 / 4)
    assert claim("Marie Curie", QUESTION) == {"marie", "curie"}  # only the question's words: they are kept
    assert support(set(), "anything") == 1.0


def test_threshold_decides_and_spans_without_content_pass():
    answer = "Warsaw and Vienna"  # one span: half its claim in the passage
    assert fact_check(answer, PASSAGES, QUESTION, threshold=0.5).supported
    assert not fact_check(answer, PASSAGES, QUESTION, threshold=0.7).supported
    empty = fact_check("It was.", PASSAGES, QUESTION)
    assert empty.supported and empty.spans[0].passages == []
    with pytest.raises(Exception, match="threshold must be in"):
        fact_check(answer, PASSAGES, QUESTION, threshold=0)


def test_model_scored_support_is_the_log_likelihood_gain(checkpoint):
    model, tokenizer = load_model(checkpoint)[0], load_tokenizer(checkpoint)
    prefix, text = "Question: Where?\nAnswer:", " Warsaw"
    ids = tokenizer.encode(prefix + text)
    n = len(tokenizer.encode(text))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0], -1)
    expected = sum(float(logp[t - 1, ids[t]]) for t in range(len(ids) - n, len(ids)))
    assert continuation_logprob(model, tokenizer, prefix, text) == pytest.approx(expected, abs=1e-4)
    with_passages, without = "[people/curie.txt] " + DOCS["people/curie.txt"] + "\n\n" + prefix, prefix
    answer = "Warsaw. Vienna."
    check = model_fact_check(model, tokenizer, answer, with_passages + " ", without + " ", PASSAGES, QUESTION)
    assert check.method == "model" and [s.text for s in check.spans] == ["Warsaw.", "Vienna."]
    for span in check.spans:
        gain = continuation_logprob(model, tokenizer, with_passages + " " + answer[:span.start], span.text) - \
            continuation_logprob(model, tokenizer, without + " " + answer[:span.start], span.text)
        assert span.support == pytest.approx(gain, abs=1e-3) and span.supported == (gain > 0)
    assert check.spans[0].passages == ["people/curie.txt"] and check.spans[1].passages == []  # named lexically
