"""The playground page's chat and structured-output modes in headless Chromium, against a live ``tokenloom serve``
of the bundled character model: a conversation answered turn by turn (and reset), a regex and a choice list that
the output keeps to, and a grammar the server refuses shown with its message. The completion mode is tested in
test_server.py (and with a non-ASCII key in test_browser_safety.py)."""

import re
from urllib.parse import urlencode

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn) is not installed")
pytest.importorskip("httpx", reason="the serve-test extra (httpx, openai) is not installed")

from tests.browser import chromium, run_page  # noqa: E402
from tests.serving.live import SHAKES, LiveServer  # noqa: E402 - after the extras are known to be there

KEY = "playground-key"


@pytest.fixture(scope="module")
def server():
    chromium()  # skip before starting a server when there is no browser
    # a generous compile limit: on a loaded machine the refusal must not turn into a timeout
    s = LiveServer(SHAKES, "--api-key", KEY, "--max-tokens", "100", "--grammar-seconds", "120")
    yield s
    s.stop()


def page(server, **params) -> str:
    return f"{server.url}/?{urlencode({'autorun': '1', **params}, doseq=True)}#api_key={KEY}"


def test_the_page_stays_self_contained_and_renders_text_as_text():
    from tokenloom.serving.playground import PLAYGROUND_HTML

    assert not [m for m in PLAYGROUND_HTML.split('"') if m.startswith(("http:", "https:", "//"))]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "<script src"):
        assert sink not in PLAYGROUND_HTML, sink


def test_chat_answers_each_turn_and_resets(server, offline):
    system = "KING HENRY:"
    url = page(server, mode="chat", system=system, message=["ROMEO:", "JULIET:"], max_tokens=20, temperature=0)
    (state, turns, status, error, reset), console = run_page(url, [
        "document.body.dataset.state",
        "[...document.querySelectorAll('#conversation .msg')].map((m) => [m.classList[1], "
        "m.querySelector('.content').textContent])",
        "$('status').textContent", "$('chat_error').textContent",
        "($('reset').click(), [$('conversation').children.length, document.activeElement.id])"])
    assert state == "done", (turns, error, console)
    assert [role for role, _ in turns] == ["user", "assistant", "user", "assistant"]
    assert [turns[0][1], turns[2][1]] == ["ROMEO:", "JULIET:"]
    # no chat template in this checkpoint: the server joins the contents with newlines (system prompt first)
    first = offline(f"{system}\nROMEO:\n", 20)
    assert turns[1][1] == first and first
    assert turns[3][1] == offline(f"{system}\nROMEO:\n{first}\nJULIET:\n", 20)  # the reply saw the whole conversation
    assert "chunks in" in status and error == ""
    assert reset == [0, "message"]  # the conversation is gone, the message box has the focus
    assert console == []


def test_structured_regex_output_matches_the_regex(server):
    regex = "[a-z]{3} [a-z]{3}"
    url = page(server, mode="structured", prompt="ROMEO:", format="regex", regex=regex, max_tokens=30, seed=3)
    (state, generated, output, status), console = run_page(url, [
        "document.body.dataset.state", "$('generated').textContent", "$('output').textContent",
        "$('status').textContent"])
    assert state == "done", (output, console)
    assert re.fullmatch(regex, generated), generated
    assert output == generated  # the structured mode shows the generated text alone
    assert "matches the regex" in status
    assert console == []


def test_structured_choice_output_is_one_of_the_choices(server):
    choices = ["yes", "no", "perhaps"]
    url = page(server, mode="structured", prompt="ROMEO:\nWilt thou?\nJULIET:\n", format="choice", choice=choices,
               max_tokens=10, temperature=1, seed=5)
    (state, generated, status, output), console = run_page(url, [
        "document.body.dataset.state", "$('generated').textContent", "$('status').textContent",
        "$('output').textContent"])
    assert state == "done", (output, console)
    assert generated in choices
    assert "one of the choices" in status


@pytest.mark.parametrize("fmt", ["json_object", "json_schema"])
def test_a_refused_grammar_shows_the_servers_message(server, fmt):
    url = page(server, mode="structured", format=fmt, max_tokens=20)
    (state, output, is_error, status), _ = run_page(url, [
        "document.body.dataset.state", "$('output').textContent", "$('output').classList.contains('error')",
        "$('status').textContent"])
    # the character model's vocabulary has no "{": the server answers 400 and the page shows why
    assert state == "error" and is_error and status == "error"
    assert "'response_format'" in output and "cannot express" in output, output
