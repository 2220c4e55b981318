"""Constrained decoding (tokenloom.generation.constraints over outlines-core): greedy decoding of tiny random GPTs under
regex, choice, JSON-schema and JSON-object constraints yields text that matches them; errors are one line."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("outlines_core")

from tokenloom.data.tokenizers import Tokenizer  # noqa: E402
from tokenloom.generation.constraints import ConstraintError, build_constraint, clear_cache  # noqa: E402

from .helpers import small_model  # noqa: E402

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
# characters enough for the regexes and choices below (a char tokenizer has no EOS)
CHAR_TEXT = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 -.,:\n"
BPE_TEXT = " ".join([
    '{"name": "Alice", "age": 30}', '{"name": "Bob Smith", "age": 7}', '{"city": "Paris", "tags": ["a", "b"]}',
    "yes no maybe nope", "To be, or not to be, that is the question.", "0123456789 [1, 2, 3] true false null",
] * 20)


@pytest.fixture(scope="module")
def char_tok() -> Tokenizer:
    return Tokenizer.train_char(CHAR_TEXT)


@pytest.fixture(scope="module")
def bpe_tok() -> Tokenizer:
    """A byte-level BPE (every byte is a token, so any JSON is expressible) with an EOS token."""
    return Tokenizer.train_bpe(BPE_TEXT, 320)


def allowed(scores: torch.Tensor) -> list[int]:
    return torch.isfinite(scores[0]).nonzero().flatten().tolist()


@torch.no_grad()
def decode(model, tok: Tokenizer, constraint, prompt: str = "x", max_new: int = 150,
           bias: torch.Tensor | None = None) -> tuple[str, bool]:
    """Greedy decoding of ``model`` (its logits plus ``bias``) through ``constraint`` (a manual loop: generate() takes
    no extra processors) -> (new text, ended by EOS or by the constraint's end)."""
    ids = torch.tensor([tok.encode(prompt)])
    start = ids.shape[1]
    for _ in range(max_new):
        logits = model(ids)[:, -1]
        scores = constraint(ids, logits if bias is None else logits + bias)
        token = int(scores.argmax(-1))
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
        if token == tok.eos_id:
            return tok.decode(ids[0, start:-1].tolist()), True
        constraint.update(ids)
        if tok.eos_id is None and constraint.done:
            return tok.decode(ids[0, start:].tolist()), True
    return tok.decode(ids[0, start:].tolist()), False


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert text and "\n" not in text
    return text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_char_tokenizer(char_tok, seed):
    regex = r"[A-Z][a-z]{2,6}-[0-9]{3}( [a-z]{1,4})?"
    model = small_model(char_tok.vocab_size, seed=seed, max_seq_len=128)
    constraint = build_constraint(char_tok, char_tok.vocab_size, regex=regex, eos_id=None)
    text, ended = decode(model, char_tok, constraint, prompt="id: ")
    assert ended and re.fullmatch(regex, text), text
    assert constraint.prompt_len == 4 and constraint.generated == len(text)


@pytest.mark.parametrize("seed", [0, 1])
def test_regex_bpe_ends_with_eos(bpe_tok, seed):
    regex = r"(yes|no)( [0-9]{1,2}){1,3}"
    model = small_model(bpe_tok.vocab_size, seed=seed, max_seq_len=128)
    text, ended = decode(model, bpe_tok, build_constraint(bpe_tok, bpe_tok.vocab_size, regex=regex,
                                                          eos_id=bpe_tok.eos_id))
    assert ended and re.fullmatch(regex, text), text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choice_yields_one_of_them(bpe_tok, seed):
    choices = ["yes", "no", "nope", "maybe not"]
    model = small_model(bpe_tok.vocab_size, seed=seed, max_seq_len=128)
    constraint = build_constraint(bpe_tok, bpe_tok.vocab_size, choice=choices, eos_id=bpe_tok.eos_id)
    text, ended = decode(model, bpe_tok, constraint, prompt="Answer:")
    assert ended and text in choices


def closing_bias(tok: Tokenizer) -> torch.Tensor:
    """+3 for the tokens that close something (quotes, brackets) and EOS: a random model left alone may write strings
    or numbers without end; the constraint must refuse these tokens wherever they would break the JSON."""
    bias = torch.zeros(tok.vocab_size)
    bias[[i for i in range(tok.vocab_size) if any(c in tok.decode([i]) for c in '"}]')] + [tok.eos_id]] = 3.0
    return bias


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema(bpe_tok, seed):
    model = small_model(bpe_tok.vocab_size, seed=seed, max_seq_len=256)
    constraint = build_constraint(bpe_tok, bpe_tok.vocab_size, json_schema=SCHEMA, eos_id=bpe_tok.eos_id)
    text, ended = decode(model, bpe_tok, constraint, max_new=200, bias=closing_bias(bpe_tok))
    assert ended, text
    value = json.loads(text)
    assert list(value) == ["name", "age"]  # the schema's order
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)


@pytest.mark.parametrize("seed", [0, 1])
def test_json_object(bpe_tok, seed):
    """Any JSON object (the model's scores favour closing tokens, as for the schema)."""
    model = small_model(bpe_tok.vocab_size, seed=seed, max_seq_len=256)
    constraint = build_constraint(bpe_tok, bpe_tok.vocab_size, json_object=True, eos_id=bpe_tok.eos_id)
    text, ended = decode(model, bpe_tok, constraint, max_new=200, bias=closing_bias(bpe_tok))
    assert ended, text
    assert isinstance(json.loads(text), dict)


def test_bundled_tokenizers():
    """The bundled checkpoints' tokenizers: Shakespeare's 65 characters cannot write JSON (no '{'), only regexes over
    them; the translation model's byte-level BPE follows the tokens of a JSON text that fits the schema to EOS."""
    char = Tokenizer.from_file(CHECKPOINTS / "shakespeare-char")
    with pytest.raises(ConstraintError) as err:
        build_constraint(char, char.vocab_size, json_schema=SCHEMA, eos_id=None)
    assert "lacks" in one_line(err)
    bpe = Tokenizer.from_file(CHECKPOINTS / "multi30k-de-en", eos_token="</s>")
    V = bpe.vocab_size
    constraint = build_constraint(bpe, V, json_schema=SCHEMA, eos_id=bpe.eos_id)
    ids = [bpe.bos_id]
    for token in bpe.encode('{"name": "Juliet Capulet", "age": 13}'):
        scores = constraint(torch.tensor([ids]), torch.zeros(1, V))
        assert token in allowed(scores) and bpe.eos_id not in allowed(scores)
        ids.append(token)
    assert bpe.eos_id in allowed(constraint(torch.tensor([ids]), torch.zeros(1, V)))
    assert constraint.done
    again = build_constraint(bpe, V, json_schema=SCHEMA, eos_id=bpe.eos_id)
    again(torch.tensor([[bpe.bos_id]]), torch.zeros(1, V))  # the prompt
    with pytest.raises(ConstraintError) as err:  # "age" must come after "name"
        again(torch.tensor([[bpe.bos_id, *bpe.encode('{"age"')]]), torch.zeros(1, V))
    assert "does not follow" in one_line(err)


def test_a_complete_match_may_go_on(char_tok):
    """After "ab" the regex (ab)+ is complete and may go on with "a" (outlines-core 0.2's index alone drops that
    token: the end marker restores it); EOS-free tokenizers end where constraint.done says so."""
    V = char_tok.vocab_size
    a, b = char_tok.encode("ab")
    constraint = build_constraint(char_tok, V, regex="(ab)+", eos_id=None)
    ids = torch.tensor([char_tok.encode("::")])
    assert allowed(constraint(ids, torch.zeros(1, V))) == [a]
    ids = torch.cat([ids, torch.tensor([[a, b]])], 1)  # two tokens at once
    assert allowed(constraint(ids, torch.zeros(1, V))) == [a]
    assert constraint.is_complete and not constraint.done
    # "a(bc)?" with EOS: after "a", EOS or "b"; after "abc", EOS alone (forced)
    eos = char_tok.encode("\n")[0]
    constraint = build_constraint(char_tok, V, regex="^a(bc)?$", eos_id=eos)
    ids = torch.tensor([[eos]])
    constraint(ids, torch.zeros(1, V))
    ids = torch.tensor([[eos, a]])
    assert allowed(constraint(ids, torch.zeros(1, V))) == sorted([eos, b])
    ids = torch.tensor([[eos, *char_tok.encode("abc")]])
    assert allowed(constraint(ids, torch.zeros(1, V))) == [eos]
    assert constraint.done


def test_scores_kept_where_allowed(char_tok):
    V = char_tok.vocab_size
    constraint = build_constraint(char_tok, V, choice=["ab", "ba"], eos_id=None)
    scores = torch.randn(1, V)
    out = constraint(torch.tensor([[0]]), scores)
    kept = allowed(out)
    assert kept == sorted(char_tok.encode("ab"))
    assert torch.equal(out[0, kept], scores[0, kept])
    wider = constraint(torch.tensor([[0]]), torch.zeros(1, V + 7))  # a model vocabulary padded past the tokenizer's
    assert allowed(wider) == kept


def test_cache_shares_the_compiled_index(bpe_tok):
    clear_cache()
    first = build_constraint(bpe_tok, bpe_tok.vocab_size, json_schema=dict(SCHEMA), eos_id=bpe_tok.eos_id)
    second = build_constraint(bpe_tok, bpe_tok.vocab_size, json_schema=dict(SCHEMA), eos_id=bpe_tok.eos_id)
    assert first._compiled is second._compiled and first is not second
    ids = torch.tensor([[1, 2]])
    V = bpe_tok.vocab_size
    first(ids, torch.zeros(1, V))
    first(torch.cat([ids, torch.tensor([bpe_tok.encode("{")])], 1), torch.zeros(1, V))
    fresh = build_constraint(bpe_tok, V, json_schema=dict(SCHEMA), eos_id=bpe_tok.eos_id)
    assert allowed(second(ids, torch.zeros(1, V))) == allowed(fresh(ids, torch.zeros(1, V)))  # its own state
    assert bpe_tok.encode("{")[0] in allowed(fresh(ids, torch.zeros(1, V)))


def test_errors_are_one_line(char_tok, bpe_tok):
    V = bpe_tok.vocab_size
    cases = [
        (dict(json_schema={"type": "foo"}), "json_schema does not compile"),
        (dict(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "does not compile"),
        (dict(regex="[a-"), "does not compile"),
        (dict(regex="(?<=a)b"), "does not compile"),
        (dict(choice=[]), "at least one"),
        (dict(choice="yes"), "list of strings"),
        (dict(regex="a", choice=["a"]), "exactly one"),
        ({}, "exactly one"),
    ]
    for kwargs, expected in cases:
        with pytest.raises(ConstraintError) as err:
            build_constraint(bpe_tok, V, eos_id=bpe_tok.eos_id, **kwargs)
        assert expected in one_line(err), kwargs
    with pytest.raises(ConstraintError) as err:
        build_constraint(char_tok, char_tok.vocab_size, json_schema=SCHEMA, eos_id=None)
    assert "cannot express" in one_line(err) and '"{"' in str(err.value)
    with pytest.raises(ConstraintError) as err:
        build_constraint(bpe_tok, V, regex="a", eos_id=V)
    assert "eos_id" in one_line(err)


def test_follow_errors(char_tok):
    V = char_tok.vocab_size
    constraint = build_constraint(char_tok, V, regex="[a-z]+", eos_id=None)
    with pytest.raises(ConstraintError) as err:  # speculative decoding's candidate rows
        constraint(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, V))
    assert "batch of 1" in one_line(err)
    constraint(torch.tensor([[0, 1]]), torch.zeros(1, V))
    with pytest.raises(ConstraintError) as err:
        constraint(torch.tensor([[0, 1, char_tok.encode("Q")[0]]]), torch.zeros(1, V))
    assert "does not follow" in one_line(err)
    done = build_constraint(char_tok, V, choice=["ok"], eos_id=None)
    done(torch.tensor([[0]]), torch.zeros(1, V))
    with pytest.raises(ConstraintError) as err:  # complete, nothing may follow and no EOS to end it
        done(torch.tensor([[0, *char_tok.encode("ok")]]), torch.zeros(1, V))
    assert "constraint.done" in one_line(err)


def test_without_the_library(monkeypatch, char_tok):
    clear_cache()
    monkeypatch.setitem(sys.modules, "outlines_core", None)
    with pytest.raises(ConstraintError) as err:
        build_constraint(char_tok, char_tok.vocab_size, regex="a", eos_id=None)
    assert "needs outlines-core" in one_line(err)
