"""The OpenAI request fields beyond sampling: logprobs / top_logprobs, echo, token-id prompts, max_tokens 0,
presence / frequency penalties, logit_bias, response_format, n as siblings, cached_tokens in usage.

Three kinds of tests: the checks (OpenAI-shaped 400s naming the field), the log-probability formatting as pure
functions (:mod:`tokenloom.serving.logprobs` over hand-filled engine requests), and the values against the model
run offline."""

import json
import math
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn) is not installed")
pytest.importorskip("httpx", reason="the serve-test extra (httpx) is not installed")

from tokenloom.generation import GenerationConfig, generate  # noqa: E402
from tokenloom.serving.engine import Request  # noqa: E402
from tokenloom.serving.logprobs import (  # noqa: E402
    UNLIKELY,
    Choice,
    chat_logprobs,
    completion_logprobs,
    token_bytes,
    token_widths,
)

SHAKES = Path(__file__).resolve().parents[2] / "checkpoints" / "shakespeare-char"


# --- an app over the bundled Shakespeare model, in this process ---------------------------------------------------

@pytest.fixture(scope="module")
def shakes():
    from tokenloom.checkpoint import load_model, load_tokenizer

    model = load_model(SHAKES)[0].eval()
    return model, load_tokenizer(SHAKES)


def _client(shakes, **settings):
    from fastapi.testclient import TestClient

    from tokenloom.serving.app import ServeConfig, create_app

    model, tokenizer = shakes
    app = create_app(model, tokenizer, ServeConfig(model_name="shakes", max_tokens=32, request_timeout=60,
                                                   **settings))
    return TestClient(app, base_url="http://127.0.0.1")  # a Host the server answers


@pytest.fixture(scope="module")
def client(shakes):
    with _client(shakes) as c:
        yield c


def post(client, body, path="/v1/completions"):
    r = client.post(path, json=body)
    return r.status_code, r.json()


def events(client, body, path="/v1/completions") -> list[dict]:
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@torch.no_grad()
def offline_logprobs(shakes, text: str) -> tuple[list[int], torch.Tensor]:
    """The ids of ``text`` and (T, V) log_softmax of the model's logits at each position (row j scores id j + 1)."""
    model, tokenizer = shakes
    ids = tokenizer.encode(text)
    return ids, torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5)


def same(a, b) -> bool:
    """Equal JSON values, numbers to 1e-5."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and close(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# --- the checks ---------------------------------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "ROMEO:"}]


@pytest.mark.parametrize("path, body, param, code, says", [
    (COMPLETIONS, {"prompt": "A", "logprobs": 21}, "logprobs", "invalid_value", "[0, 20], got 21"),
    (COMPLETIONS, {"prompt": "A", "logprobs": -1}, "logprobs", "invalid_value", "got -1"),
    (COMPLETIONS, {"prompt": "A", "logprobs": True}, "logprobs", "invalid_type", "boolean"),
    (COMPLETIONS, {"prompt": "A", "echo": "yes"}, "echo", "invalid_type", "echo"),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "invalid_value", "needs 'logprobs': true"),
    (CHAT, {"messages": MESSAGES, "logprobs": False, "top_logprobs": 0}, "top_logprobs", "invalid_value",
     "needs 'logprobs': true"),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value", "got 21"),
    (CHAT, {"messages": MESSAGES, "logprobs": 3}, "logprobs", "invalid_type", "bool"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": {"65": 1}}, "logit_bias", "invalid_value", "token id 65"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"100000": 1}}, "logit_bias", "invalid_value", "token id 100000"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": {"abc": 1}}, "logit_bias", "invalid_value", "'abc'"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": {"9" * 5000: 1}}, "logit_bias", "invalid_value",
     "token id 99999999999999999999..., outside"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": {"-1": 1}}, "logit_bias", "invalid_value", "'-1'"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": {"07": 1}}, "logit_bias", "invalid_value", "'07'"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": {"3": 100.5}}, "logit_bias", "invalid_value", "100.5 for token 3"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": {"3": -101}}, "logit_bias", "invalid_value", "-101 for token 3"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": {"3": "up"}}, "logit_bias", "invalid_value", "token 3"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": {"3": True}}, "logit_bias", "invalid_value", "token 3"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value",
     "at most 300"),
    (COMPLETIONS, {"prompt": "A", "logit_bias": [1]}, "logit_bias", "invalid_type", "logit_bias"),
    (COMPLETIONS, {"prompt": "A", "presence_penalty": 2.5}, "presence_penalty", "invalid_value", "got 2.5"),
    (CHAT, {"messages": MESSAGES, "frequency_penalty": -2.01}, "frequency_penalty", "invalid_value", "got -2.01"),
    (COMPLETIONS, {"prompt": "A", "frequency_penalty": "x"}, "frequency_penalty", "invalid_type", "frequency"),
    (COMPLETIONS, {"prompt": [1, 65]}, "prompt", "invalid_value", "token id 65, outside the vocabulary [0, 65)"),
    (COMPLETIONS, {"prompt": [[1], [2, -1]]}, "prompt", "invalid_value", "token id -1"),
    (COMPLETIONS, {"prompt": [10 ** 100]}, "prompt", "invalid_value", "token id 10000000000000000000..., outside"),
    (COMPLETIONS, {"prompt": [[1], []]}, "prompt", "invalid_type", "token ids"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt", "invalid_type", "token ids"),
    (COMPLETIONS, {"prompt": [1.5]}, "prompt", "invalid_type", "token ids"),
    (COMPLETIONS, {"prompt": [True]}, "prompt", "invalid_type", "token ids"),
    (COMPLETIONS, {"prompt": []}, "prompt", "invalid_type", "empty"),
    (COMPLETIONS, {"prompt": [1] * 256}, "prompt", "context_length_exceeded", "256 tokens"),
    (COMPLETIONS, {"prompt": "A", "max_tokens": 0}, "max_tokens", "invalid_value", "needs 'echo': true"),
    (COMPLETIONS, {"prompt": "A", "max_tokens": 0, "echo": False}, "max_tokens", "invalid_value", "echo"),
    (COMPLETIONS, {"prompt": "A", "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value", "echo"),
    (COMPLETIONS, {"prompt": "A", "max_tokens": -1, "echo": True}, "max_tokens", "invalid_value", "[0, 32]"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "invalid_value", "[1, 32]"),
    (COMPLETIONS, {"prompt": "A", "response_format": {"type": "json_object"}}, "response_format",
     "invalid_value", "cannot express"),  # the character vocabulary has no braces or quotes
    (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format",
     "invalid_value", "json_schema"),
    (CHAT, {"messages": MESSAGES, "response_format": {"type": "regex", "regex": "[a-"}}, "response_format",
     "invalid_value", "does not compile"),
    (CHAT, {"messages": MESSAGES, "response_format": {"type": "regex", "regex": "a" * 513}}, "response_format",
     "invalid_value", "1-512"),
    (COMPLETIONS, {"prompt": "A", "response_format": {"type": "choice", "choice": []}}, "response_format",
     "invalid_value", "choice"),
    (CHAT, {"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format", "invalid_value", "xml"),
    (CHAT, {"messages": MESSAGES, "response_format": "text"}, "response_format", "invalid_type", "dict"),
])
def test_bad_fields_get_an_openai_400_naming_the_field(client, path, body, param, code, says):
    status, reply = post(client, body, path)
    assert status == 400, reply
    error = reply["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert says in error["message"] and "\n" not in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "A", "logprobs": 0, "max_tokens": 2}),
    (COMPLETIONS, {"prompt": "A", "logprobs": 20, "max_tokens": 2, "echo": True}),
    (COMPLETIONS, {"prompt": [0, 64], "max_tokens": 2, "logit_bias": {"0": -100, "64": 100.0}}),
    (COMPLETIONS, {"prompt": [[5, 6], [7]], "max_tokens": 1, "presence_penalty": -2, "frequency_penalty": 2}),
    (COMPLETIONS, {"prompt": "A", "max_tokens": 0, "echo": True}),
    (COMPLETIONS, {"prompt": "A", "max_completion_tokens": 0, "echo": True, "logprobs": None}),
    (COMPLETIONS, {"prompt": "A", "max_tokens": 2, "response_format": {"type": "text"}, "logit_bias": {}}),
    (CHAT, {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 20}),
    (CHAT, {"messages": MESSAGES, "max_tokens": 2, "logprobs": False, "top_logprobs": None}),
])
def test_the_limits_are_accepted(client, path, body):
    status, reply = post(client, body, path)
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_the_schema_states_the_new_fields(client):
    import re

    paths = client.get("/openapi.json").json()["paths"]
    body = paths[COMPLETIONS]["post"]["requestBody"]["content"]["application/json"]["schema"]
    props = body["properties"]
    assert props["logprobs"]["maximum"] == 20 and props["max_tokens"]["minimum"] == 0
    assert {"echo", "presence_penalty", "frequency_penalty", "logit_bias", "response_format"} <= set(props)
    ids = props["prompt"]["anyOf"][2]
    assert ids["items"]["maximum"] == 64 and ids["maxItems"] == 255
    key = re.compile(props["logit_bias"]["propertyNames"]["pattern"])
    assert [k for k in ("0", "9", "64", "65", "010", "-1", "1e2") if key.match(k)] == ["0", "9", "64"]
    assert props["logit_bias"]["maxProperties"] == 300
    chat = paths[CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["top_logprobs"]["maximum"] == 20
    assert chat["properties"]["echo"]["enum"] == [False, None]  # chat has no echo: only "not used" is accepted
    assert chat["allOf"][0]["then"]["properties"]["logprobs"] == {"const": True}


def test_integers_below_matches_exactly_the_ids():
    import re

    from tokenloom.serving.schema import integers_below

    for n in (1, 2, 10, 11, 65, 100, 101, 1000, 32000, 50257):
        pattern = re.compile(integers_below(n))
        assert [i for i in range(2 * n + 20) if pattern.match(str(i))] == list(range(n)), n
        assert not any(pattern.match(s) for s in ("", "00", "01", "-0", "+1", " 1", "1.0"))


# --- the formatting, as pure functions ----------------------------------------------------------------------------

class Pieces:
    """A tokenizer whose tokens are fixed strings (several characters each)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.vocab_size = len(pieces)

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


WORDS = Pieces(["Hello", " world", "!", " How", " are", " you", "?", "\n"])


def request(prompt: list[int], new: list[int], entries=None, prompt_entries=None) -> Request:
    r = Request(list(prompt), GenerationConfig(), lambda event: None, logprobs=2)
    r.new_ids = list(new)
    r.token_logprobs = list(entries if entries is not None else [(t, -0.5 * (i + 1), [(t, -0.5 * (i + 1)),
                                                                                       (7, -3.0)])
                                                                 for i, t in enumerate(new)])
    r.prompt_logprobs = list(prompt_entries or [])
    return r


def test_completion_logprobs_shape_and_values():
    items = [(1, (1, -0.25, [(1, -0.25), (5, -1.5), (3, -math.inf)]), 0),
             (2, (2, -math.inf, [(6, -0.1)]), 6),
             (0, None, 7)]
    out = completion_logprobs(WORDS, items)
    assert out == {"tokens": [" world", "!", "Hello"], "token_logprobs": [-0.25, UNLIKELY, None],
                   "top_logprobs": [{" world": -0.25, " you": -1.5}, {"?": -0.1, "!": UNLIKELY}, None],
                   "text_offset": [0, 6, 7]}
    json.dumps(out, allow_nan=False)  # no infinity reaches JSON


def test_chat_logprobs_shape_and_values():
    items = [(1, (1, -0.25, [(1, -0.25), (5, -1.5), (3, -math.inf)]), 0), (0, None, 6)]
    out = chat_logprobs(WORDS, items)
    assert out == {"content": [{"token": " world", "logprob": -0.25, "bytes": list(b" world"), "top_logprobs": [
        {"token": " world", "logprob": -0.25, "bytes": list(b" world")},
        {"token": " you", "logprob": -1.5, "bytes": list(b" you")}]}]}


def test_choice_gives_each_token_once_its_text_arrives_with_offsets():
    r = request([0], [1, 2, 3])  # " world", "!", " How"
    choice = Choice(0, r, WORDS, "completions")
    empty = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    assert choice.open() is None  # no echo
    assert choice.delta(" wor") == empty  # " world" not whole yet
    piece = choice.delta("ld!")
    assert piece["tokens"] == [" world", "!"] and piece["text_offset"] == [0, 6]
    assert piece["token_logprobs"] == [-0.5, -1.0] and piece["top_logprobs"][0] == {" world": -0.5, "\n": -3.0}
    assert choice.delta(" How")["tokens"] == [" How"]
    assert choice.finish("length") == empty
    assert choice.logprobs()["text_offset"] == [0, 6, 7] and choice.text == " world! How"


def test_a_stop_string_cut_drops_the_entries_past_it():
    # new tokens " world", "!", " How", " are": the stop string "How" cut the text to " world! "
    r = request([0], [1, 2, 3, 4])
    choice = Choice(0, r, WORDS, "completions")
    choice.delta(" world")
    choice.delta("! ")
    assert choice.finish("stop") == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    out = choice.logprobs()
    assert out["tokens"] == [" world", "!"] and out["text_offset"] == [0, 6]  # " How" is cut mid-token: no entry
    assert choice.text == " world! "


def test_echo_puts_the_prompt_first_with_a_null_first_entry():
    prompt = [0, 1, 2]  # "Hello world!"
    prompt_entries = [None, (1, -2.0, [(4, -1.0), (1, -2.0)]), (2, -0.5, [(2, -0.5), (6, -1.25)])]
    r = request(prompt, [3, 6], prompt_entries=prompt_entries)
    choice = Choice(0, r, WORDS, "completions", echo="Hello world!")
    text, piece = choice.open()
    assert text == "Hello world!"
    assert piece == {"tokens": ["Hello", " world", "!"], "token_logprobs": [None, -2.0, -0.5],
                     "top_logprobs": [None, {" are": -1.0, " world": -2.0}, {"!": -0.5, "?": -1.25}],
                     "text_offset": [0, 5, 11]}
    assert choice.open() is None  # once
    choice.delta(" How?")
    choice.finish("length")
    out = choice.logprobs()
    assert choice.text == "Hello world! How?"
    assert out["tokens"] == ["Hello", " world", "!", " How", "?"]
    assert out["text_offset"] == [0, 5, 11, 12, 16]
    assert all(choice.text.startswith(t, o) for t, o in zip(out["tokens"], out["text_offset"], strict=True))


def test_echo_without_logprobs_and_scoring_only():
    r = request([0, 1], [])
    choice = Choice(0, r, WORDS, None, echo="Hello world")
    assert choice.open() == ("Hello world", None)
    assert choice.finish("length") is None and choice.logprobs() is None and choice.text == "Hello world"


def test_an_engine_without_entries_gives_nulls_not_errors():
    r = request([0, 1], [2, 3], entries=[])  # (the engine before log-probabilities: nothing filled)
    choice = Choice(0, r, WORDS, "completions", echo="Hello world")
    choice.open()
    choice.delta("! How")
    choice.finish("length")
    out = choice.logprobs()
    assert out["token_logprobs"] == [None] * 4 and out["top_logprobs"] == [None] * 4
    chat = Choice(0, request([0], [2], entries=[]), WORDS, "chat")
    chat.delta("!")
    chat.finish("length")
    assert chat.logprobs() == {"content": []}


def test_chat_choice_streams_content_entries():
    r = request([0], [3, 4, 5])
    choice = Choice(0, r, WORDS, "chat")
    assert [e["token"] for e in choice.delta(" How are")["content"]] == [" How", " are"]
    assert [e["token"] for e in choice.delta(" you")["content"]] == [" you"]
    assert choice.finish("length") == {"content": []}
    assert [e["logprob"] for e in choice.logprobs()["content"]] == [-0.5, -1.0, -1.5]


def test_byte_level_tokens_offsets_and_bytes():
    from tokenloom.data.tokenizers import Tokenizer

    tok = Tokenizer.train_bpe("héllo wörld, café crème " * 40 + "naïve résumé — ✓ 日本語 ", 300)
    text = "café ✓ 日本語 naïve"
    ids = tok.encode(text)
    assert any(tok.decode([i]).count("\ufffd") for i in ids)  # some tokens hold part of a character
    widths = token_widths(tok, ids)
    assert sum(widths) == len(text)
    assert b"".join(bytes(token_bytes(tok, i)) for i in ids) == text.encode("utf-8")
    entries = [(t, -1.0, []) for t in ids]
    choice = Choice(0, request([ids[0]], ids, entries=entries), tok, "completions")
    sent = 0
    for cut in (3, 7, 11, len(text)):  # deltas that end inside and between tokens
        choice.delta(text[sent:cut])
        sent = cut
    choice.finish("length")
    out = choice.logprobs()
    assert len(out["tokens"]) == len(ids)
    assert out["text_offset"] == sorted(out["text_offset"]) and out["text_offset"][-1] < len(text)
    content = chat_logprobs(tok, [(t, e, 0) for t, e in zip(ids, entries, strict=True)])["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == text.encode("utf-8")


# --- behaviour through the server (the engine's sampling, no log-probabilities needed) ----------------------------

def test_logit_bias_forces_and_bans_greedy_tokens(client, shakes, offline):
    _, tokenizer = shakes
    plain = offline("ROMEO:", 8)
    status, reply = post(client, {"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0,
                                  "logit_bias": {str(tokenizer.encode("z")[0]): 100}})
    assert status == 200 and reply["choices"][0]["text"] == "z" * 8
    banned = {str(tokenizer.encode(ch)[0]): -100 for ch in set(plain)}
    status, reply = post(client, {"prompt": "ROMEO:", "max_tokens": 8, "temperature": 0, "logit_bias": banned})
    assert status == 200 and not set(reply["choices"][0]["text"]) & set(plain)


@pytest.mark.parametrize("server_settings", [{}, {"prompt_lookup": 3}])
def test_penalties_give_the_offline_greedy_output(shakes, server_settings):
    model, tokenizer = shakes
    prompt = "ROMEO:\nI will"
    config = GenerationConfig(max_new_tokens=24, do_sample=False, presence_penalty=0.6, frequency_penalty=0.9,
                              logit_bias={tokenizer.encode("e")[0]: -1.5})
    ids = torch.tensor([tokenizer.encode(prompt)])
    expected = tokenizer.decode(generate(model, ids, config)[0, ids.shape[1]:].tolist())
    plain = tokenizer.decode(generate(model, ids, GenerationConfig(max_new_tokens=24, do_sample=False))[
        0, ids.shape[1]:].tolist())
    assert expected != plain
    with _client(shakes, **server_settings) as c:  # with prompt lookup: the penalized request is not speculated
        status, reply = post(c, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "presence_penalty": 0.6,
                                 "frequency_penalty": 0.9, "logit_bias": {str(tokenizer.encode("e")[0]): -1.5}})
    assert status == 200 and reply["choices"][0]["text"] == expected


def test_token_id_prompts_equal_their_text(client, shakes, offline):
    _, tokenizer = shakes
    ids = tokenizer.encode("ROMEO:")
    status, reply = post(client, {"prompt": [ids, tokenizer.encode("JULIET:\nO")], "max_tokens": 6,
                                  "temperature": 0})
    assert status == 200
    assert [c["text"] for c in reply["choices"]] == [offline("ROMEO:", 6), offline("JULIET:\nO", 6)]
    status, reply = post(client, {"prompt": ids, "max_tokens": 4, "temperature": 0, "echo": True})
    assert reply["choices"][0]["text"] == "ROMEO:" + offline("ROMEO:", 4)
    assert reply["usage"]["prompt_tokens"] == 6


# --- values against the model run offline (the paged engine's log-probabilities) ----------------------------------

@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.7, "seed": 3, "top_k": 5,
                                                            "logit_bias": {"1": 5}, "presence_penalty": 1.0}])
def test_completion_logprobs_equal_the_offline_log_softmax(client, shakes, sampling):
    status, reply = post(client, {"prompt": "ROMEO:", "max_tokens": 12, "logprobs": 5, **sampling})
    assert status == 200
    choice = reply["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == 12
    assert lp["text_offset"] == list(range(12))
    ids, logp = offline_logprobs(shakes, "ROMEO:" + choice["text"])
    _, tokenizer = shakes
    for g, (value, top) in enumerate(zip(lp["token_logprobs"], lp["top_logprobs"], strict=True)):
        row = logp[6 + g - 1]  # the raw model's distribution: the sampling settings change none of it
        assert close(value, row[ids[6 + g]].item()), g
        values, alternatives = row.topk(5)
        expected = {tokenizer.decode([a]): v for a, v in zip(alternatives.tolist(), values.tolist(), strict=True)}
        expected.setdefault(lp["tokens"][g], row[ids[6 + g]].item())
        assert top.keys() == expected.keys() and all(close(top[k], expected[k]) for k in top), g


def test_echo_with_max_tokens_0_gives_the_teacher_forced_scores(client, shakes):
    prompt = "ROMEO:\nBut soft, what light"
    status, reply = post(client, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3})
    assert status == 200
    choice = reply["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 0 and reply["usage"]["prompt_tokens"] == len(prompt)
    assert lp["tokens"] == list(prompt) and lp["text_offset"] == list(range(len(prompt)))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ids, logp = offline_logprobs(shakes, prompt)
    for j in range(1, len(ids)):
        assert close(lp["token_logprobs"][j], logp[j - 1, ids[j]].item()), j
        values, alternatives = logp[j - 1].topk(3)
        top = lp["top_logprobs"][j]
        assert len(top) in (3, 4) and all(close(top[shakes[1].decode([a])], v)
                                          for a, v in zip(alternatives.tolist(), values.tolist(), strict=True)), j


def test_echo_with_generation_covers_prompt_then_completion(client, shakes, offline):
    _, tokenizer = shakes
    ids = tokenizer.encode("JULIET:\nO")
    status, reply = post(client, {"prompt": ids, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 0})
    assert status == 200
    choice = reply["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "JULIET:\nO" + offline("JULIET:\nO", 6)
    assert "".join(lp["tokens"]) == choice["text"] and lp["text_offset"] == list(range(len(choice["text"])))
    all_ids, logp = offline_logprobs(shakes, choice["text"])
    assert lp["token_logprobs"][0] is None
    assert all(close(lp["token_logprobs"][j], logp[j - 1, all_ids[j]].item()) for j in range(1, len(all_ids)))


def test_chat_logprobs_equal_the_offline_log_softmax(client, shakes):
    status, reply = post(client, {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True,
                                  "top_logprobs": 3}, CHAT)
    assert status == 200
    choice = reply["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"] and len(content) == 8
    ids, logp = offline_logprobs(shakes, "ROMEO:\n" + choice["message"]["content"])
    for g, entry in enumerate(content):
        row = logp[7 + g - 1]
        assert close(entry["logprob"], row[ids[7 + g]].item()) and entry["bytes"] == list(entry["token"].encode())
        values, alternatives = row.topk(3)
        assert [t["token"] for t in entry["top_logprobs"]] == [shakes[1].decode([a]) for a in alternatives.tolist()]
        assert all(close(t["logprob"], v) for t, v in zip(entry["top_logprobs"], values.tolist(), strict=True))


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "ROMEO:", "max_tokens": 20, "temperature": 0, "logprobs": 2, "echo": True}),
    (COMPLETIONS, {"prompt": "ROMEO:", "max_tokens": 20, "temperature": 0, "logprobs": 1, "stop": ["the"]}),
    (CHAT, {"messages": MESSAGES, "max_tokens": 20, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
])
def test_streamed_logprobs_add_up_to_the_reply(client, path, body):
    status, reply = post(client, body, path)
    assert status == 200
    chunks = events(client, body, path)
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    whole = reply["choices"][0]["logprobs"]
    if path == CHAT:
        assert same([e for p in pieces for e in p["content"]], whole["content"])
        return
    for key in whole:
        assert same([x for p in pieces for x in p[key]], whole[key]), key
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == reply["choices"][0]["text"] and "".join(whole["tokens"]) == text  # the stop cut: no extra entry


def test_a_stop_string_cut_leaves_no_entry_past_it(client, offline):
    full = offline("ROMEO:", 30)
    stop = full[12:15]
    status, reply = post(client, {"prompt": "ROMEO:", "max_tokens": 30, "temperature": 0, "logprobs": 0,
                                  "stop": [stop]})
    choice = reply["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop" and choice["text"] == full[:full.find(stop)]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]


def test_n_samples_are_siblings_that_sample_as_separate_requests(client):
    body = {"prompt": "ROMEO:", "max_tokens": 12, "temperature": 1.0, "seed": 11}
    status, together = post(client, {**body, "n": 3, "logprobs": 1})
    assert status == 200
    alone = [post(client, {**body, "seed": 11 + j, "logprobs": 1})[1]["choices"][0] for j in range(3)]
    assert [c["text"] for c in together["choices"]] == [c["text"] for c in alone]
    for c, a in zip(together["choices"], alone, strict=True):
        assert all(close(x, y) for x, y in zip(c["logprobs"]["token_logprobs"], a["logprobs"]["token_logprobs"],
                                               strict=True))
    assert together["usage"]["completion_tokens"] == 36


def test_usage_counts_the_cached_prompt_tokens(client):
    prompt = "KING HENRY:\nOnce more unto the breach, dear friends, once more;"  # 63 characters: 3 full blocks of 16
    first = post(client, {"prompt": prompt, "max_tokens": 2, "temperature": 0})[1]
    second = post(client, {"prompt": prompt, "max_tokens": 2, "temperature": 0})[1]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # the full blocks before the last token
    chunks = events(client, {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                             "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


def test_response_format_regex_and_choice_keep_the_output_in_them(client):
    pytest.importorskip("outlines_core")
    import re

    for n in (1, 3):
        status, reply = post(client, {"prompt": "ROMEO:", "max_tokens": 30, "temperature": 1.0, "seed": 5, "n": n,
                                      "response_format": {"type": "regex", "regex": "(to|be)( (or|not|to|be)){2}"}})
        assert status == 200, reply
        for choice in reply["choices"]:
            assert re.fullmatch("(to|be)( (or|not|to|be)){2}", choice["text"]) and choice["finish_reason"] == "stop"
    status, reply = post(client, {"messages": MESSAGES, "max_tokens": 30,
                                  "response_format": {"type": "choice", "choice": ["Aye", "Nay, my lord"]}}, CHAT)
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] in ("Aye", "Nay, my lord")


def test_a_prompt_larger_than_the_kv_cache_is_a_400_and_the_server_goes_on(shakes):
    with _client(shakes, block_size=4, kv_blocks=5) as small:  # 20 positions in all
        status, reply = post(small, {"prompt": "ROMEO: " * 4, "max_tokens": 2})
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        assert "KV cache holds 20 positions" in reply["error"]["message"]
        status, reply = post(small, {"prompt": "ROMEO:", "max_tokens": 8})
        assert status == 200 and reply["usage"]["completion_tokens"] == 8
        for _ in range(100):  # (the engine releases a request's blocks just after its last event)
            health = small.get("/health").json()
            if not health.get("active") and not health.get("queued"):
                break
            time.sleep(0.02)
        assert not health.get("active") and not health.get("queued"), health


def test_the_tokenizer_routes_round_trip_and_refuse_bad_ids(client, shakes):
    _, tokenizer = shakes
    info = client.get("/tokenizer_info").json()
    assert info["vocab_size"] == 65 and info["max_model_len"] == 256 and "eos_token" in info
    r = client.post("/tokenize", json={"prompt": "ROMEO:", "add_special_tokens": False}).json()
    assert r["tokens"] == tokenizer.encode("ROMEO:") and r["count"] == 6
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "ROMEO:"}
    bad = client.post("/detokenize", json={"tokens": [1, 65]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens" and "[0, 65)" in bad.text
    bad = client.post("/tokenize", json={"prompt": "\u00e9"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert client.post("/tokenize", content=b"x", headers={"Content-Type": "text/plain"}).status_code == 415


def test_the_tokenizer_routes_are_behind_the_api_key(shakes):
    with _client(shakes, api_key="sesame") as keyed:
        assert keyed.post("/tokenize", json={"prompt": "A"}).status_code == 401
        assert keyed.get("/tokenizer_info").status_code == 401
        ok = keyed.post("/tokenize", json={"prompt": "A"}, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200


def test_a_grammar_that_compiles_too_long_is_a_400_and_the_server_goes_on(shakes):
    pytest.importorskip("outlines_core")
    with _client(shakes, grammar_seconds=1.0) as c:  # (tests/serving/test_grammar_limits.py: what is left behind)
        status, reply = post(c, {"prompt": "A", "max_tokens": 4,
                                 "response_format": {"type": "regex", "regex": "(a|b|c)*a(a|b){22}"}})
        assert status == 400 and "took over 1 s to compile" in reply["error"]["message"], reply
        status, reply = post(c, {"prompt": "ROMEO:", "max_tokens": 4})
        assert status == 200


# --- OpenAI fields the server does not implement (tokenloom.serving.fields) ----------------------------------------

# a value that asks for what each unsupported field does (a new row of the table needs one here)
USED = {"best_of": 3, "suffix": "the end", "echo": True, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto", "functions": [{"name": "f", "parameters": {}}], "function_call": "auto",
        "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"], "reasoning_effort": "high",
        "verbosity": "low", "web_search_options": {}, "min_p": 0.1, "repetition_penalty": 1.2,
        "length_penalty": 0.5, "use_beam_search": True, "min_tokens": 5, "ignore_eos": True, "stop_token_ids": [3],
        "include_stop_str_in_output": True, "guided_json": {"type": "object"}, "guided_regex": "a+",
        "guided_choice": ["a"], "guided_grammar": "root ::= 'a'"}
PLAIN = {COMPLETIONS: {"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0},
         CHAT: {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}}


def _table(kind):
    from tokenloom.serving.fields import ROUTES, Unsupported, rules

    return [pytest.param(route, name, rule, id=f"{route.rsplit('/', 1)[1]}-{name}") for route in ROUTES
            for name, rule in rules(route).items()
            if (isinstance(rule, Unsupported) if kind == "unsupported" else rule == kind)]


def _text(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("route, name, rule", _table("unsupported"))
def test_a_field_that_would_change_the_result_is_a_400_naming_it(client, route, name, rule):
    status, reply = post(client, {**PLAIN[route], name: USED[name]}, route)
    assert status == 400, reply
    error = reply["error"]
    assert (error["param"], error["code"], error["type"]) == (name, "unsupported_parameter", "invalid_request_error")
    assert error["message"] == f"'{name}' is not supported by this server; {rule.hint()}"


def test_best_of_is_refused_in_the_words_a_client_can_act_on(client):
    for value in (3, 2.0, True, "1"):
        status, reply = post(client, {**PLAIN[COMPLETIONS], "best_of": value})
        assert status == 400 and reply["error"]["param"] == "best_of", reply
        assert reply["error"]["message"] == "'best_of' is not supported by this server; leave it out or set it to 1"


@pytest.mark.parametrize("route, name, rule", _table("unsupported"))
def test_the_values_that_mean_not_used_are_accepted_and_change_nothing(client, route, name, rule):
    status, plain = post(client, PLAIN[route], route)
    assert status == 200, plain
    for value in (*rule.accepted, None, *(1.0 for ok in rule.accepted if ok == 1 and ok is not True)):
        status, reply = post(client, {**PLAIN[route], name: value}, route)
        assert status == 200, (value, reply)
        assert _text(reply) == _text(plain)


@pytest.mark.parametrize("route, name, rule", [*_table("harmless"),
                                               *(pytest.param(r, "x_unknown_field", None, id=f"{r[4:]}-unknown")
                                                 for r in (COMPLETIONS, CHAT))])
def test_harmless_and_unknown_fields_are_accepted_and_change_nothing(client, route, name, rule):
    status, plain = post(client, PLAIN[route], route)
    for value in ("someone", {"k": "v"}, True):
        status, reply = post(client, {**PLAIN[route], name: value}, route)
        assert status == 200, (value, reply)
        assert _text(reply) == _text(plain)


def test_the_table_and_the_published_schema_name_the_same_fields(client):
    from tokenloom.serving.fields import ROUTES, Unsupported, rules

    paths = client.get("/openapi.json").json()["paths"]
    for route in ROUTES:
        props = paths[route]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
        table = rules(route)
        assert set(props) == set(table), set(props) ^ set(table)  # every field the route reads is in the table
        for name, rule in table.items():
            if isinstance(rule, Unsupported):
                assert props[name]["enum"] == [*rule.accepted, None] and "not supported" in props[name]["description"]


# --- translations longer than the model's source limit --------------------------------------------------------------

DE_EN = Path(__file__).resolve().parents[2] / "checkpoints" / "multi30k-de-en"
LONG = "Ein Hund rennt. " * 3000  # 48,000 characters: it was translated as one sentence, cut silently


@pytest.fixture(scope="module")
def translator():
    from fastapi.testclient import TestClient

    from tokenloom.checkpoint import load_model, load_tokenizer
    from tokenloom.serving.app import ServeConfig, create_app

    model, tokenizer = load_model(DE_EN)[0].eval(), load_tokenizer(DE_EN)
    app = create_app(model, tokenizer, ServeConfig(model_name="de-en", request_timeout=60))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c, model, tokenizer


def _words(tokenizer, n: int) -> str:
    """A German text of exactly ``n`` tokens."""
    words, text = "Ein Hund rennt über die grüne Wiese und ein Mann schaut zu .".split(), ""
    i = 0
    while len(tokenizer.encode(text)) < n:
        text = (text + " " + words[i % len(words)]).strip()
        i += 1
    assert len(tokenizer.encode(text)) == n  # (each word here is one token or more: the search may overshoot)
    return text


def test_a_translation_input_over_the_source_limit_is_a_400_naming_it(translator):
    client, model, tokenizer = translator
    limit = model.config.max_source_len
    for body, where in (({"input": LONG}, "'input' is"), ({"input": ["Ein Hund rennt.", LONG]}, "'input'[1] is")):
        r = client.post("/v1/translations", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
        assert error["message"].startswith(where) and f"source limit of {limit} tokens" in error["message"]
        assert '"truncate": true' in error["message"] and "\n" not in error["message"]
    fits, over = _words(tokenizer, limit - 1), None  # limit - 1 tokens and the end-of-sentence token: the limit
    for n in range(limit, limit + 4):  # (a word of two tokens may skip n = limit)
        try:
            over = _words(tokenizer, n)
            break
        except AssertionError:
            continue
    r = client.post("/v1/translations", json={"input": [fits]})
    assert r.status_code == 200 and r.json()["data"][0]["truncated"] is False, r.text
    r = client.post("/v1/translations", json={"input": [fits, over]})
    assert r.status_code == 400 and "'input'[1]" in r.json()["error"]["message"], r.text


def test_truncate_true_translates_the_cut_input_and_says_which(translator):
    from tokenloom.tasks.translation import translate

    client, model, tokenizer = translator
    r = client.post("/v1/translations", json={"input": ["Ein Hund rennt.", LONG], "truncate": True})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [(d["index"], d["truncated"]) for d in data] == [(0, False), (1, True)]
    assert data[0]["translation"] == "A dog runs."
    with torch.inference_mode(), pytest.warns(UserWarning, match="truncated"):
        expected = translate(model, tokenizer, [LONG], beam=1, truncate=True)[0]
    assert data[1]["translation"] == expected and expected  # the input's first tokens, translated
    schema = client.get("/openapi.json").json()["paths"]["/v1/translations"]["post"]
    body = schema["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert body["truncate"]["type"] == ["boolean", "null"] and str(model.config.max_source_len) in \
        body["input"]["description"]
