"""Conversation files and chat templates: the one-line errors of bad lines, the default template's text and its mask
of response tokens (equal to a hand-built one), Jinja templates rendered as transformers renders them, and templates
a tokenizer cannot apply."""

from __future__ import annotations

import json

import pytest

from tokenloom.data.chat import (
    DefaultChatTemplate,
    JinjaChatTemplate,
    chat_template_for,
    default_jinja,
    read_conversations,
    template_for_tokenizer,
)
from tokenloom.data.tokenizers import Tokenizer
from tokenloom.errors import ConfigError, DataError, TokenizerError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3"},
                {"role": "assistant", "content": "5"}, {"role": "user", "content": "Reverse: ab"},
                {"role": "assistant", "content": "ba"}]


def _char() -> Tokenizer:
    return Tokenizer.train_char("System: User: Assistant: \nBe brief.Add 2 and 3 5 Reverse: ab ba")


def _bpe(*specials: str) -> Tokenizer:
    text = "hello world system user assistant Be brief Add 2 and 3 Reverse ab ba\n" * 30
    return Tokenizer.train_bpe(text, 300, special_tokens=("<|endoftext|>", *specials))


# ---- reading ------------------------------------------------------------------------------------------------

def test_both_line_formats_are_read(tmp_path):
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"prompt": "hi", "response": "yo"}), "", json.dumps({"messages": CONVERSATION})]
    path.write_text("\n".join(lines) + "\n")
    convs = read_conversations(path)
    assert convs[0].messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert convs[1].messages == CONVERSATION
    assert convs[0].where == f"{path}:1" and convs[1].where == f"{path}:3"  # the blank line is skipped


@pytest.mark.parametrize("line, problem", [
    ('{"text": "no messages"}', 'no "messages"'),
    ('{"messages": [', "not valid JSON"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
    ('{"messages": [{"role": "user", "content": 3}]}', 'string "content"'),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    ('{"messages": []}', "non-empty list"),
    ('{"prompt": "x", "response": null}', '"response" must be a string'),
    ('["a list"]', "expected a JSON object"),
])
def test_a_bad_line_is_one_line_naming_path_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + line + "\n")
    with pytest.raises(DataError) as err:
        read_conversations(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}:2: ") and problem in text


def test_an_empty_or_missing_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no conversations"):
        read_conversations(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="not found"):
        read_conversations(tmp_path / "missing.jsonl")


# ---- the default template -------------------------------------------------------------------------------------

def test_the_default_template_text_and_its_response_mask():
    tok = _char()
    chat = chat_template_for(tok, None)
    assert isinstance(chat, DefaultChatTemplate) and chat.recorded == "default"
    text = "System: Be brief.\nUser: Add 2 and 3\nAssistant: 5\n\nUser: Reverse: ab\nAssistant: ba\n\n"
    assert chat.render(CONVERSATION) == text
    ids, trained = chat.encode(tok, CONVERSATION)
    assert ids == tok.encode(text)  # a char tokenizer: piecewise == whole
    # hand-built: the characters of each reply and its "\n\n" end, nothing else
    expected = [False] * len(text)
    for reply in ("Assistant: 5\n\n", "Assistant: ba\n\n"):
        start = text.index(reply) + len("Assistant: ")
        expected[start:start + len(reply) - len("Assistant: ")] = [True] * (len(reply) - len("Assistant: "))
    assert trained == expected
    assert tok.decode(chat.encode_prompt(tok, CONVERSATION[:2])) == "System: Be brief.\nUser: Add 2 and 3\nAssistant: "
    assert chat.stop_strings == ["\n\n"] and chat.stop_token_id is None
    assert chat.reply("ba\n\nUser: more") == "ba"


def test_the_default_template_ends_replies_with_the_eos_token():
    tok = _bpe()
    chat = chat_template_for(tok, None, "default")
    ids, trained = chat.encode(tok, CONVERSATION[:3])
    assert ids[-1] == tok.eos_id and trained[-1] and chat.stop_strings == [] and chat.stop_token_id == tok.eos_id
    assert tok.decode([i for i, t in zip(ids, trained, strict=True) if t]) == "5<|endoftext|>"
    assert chat.render(CONVERSATION[:3]).endswith("Assistant: 5<|endoftext|>")


def test_a_char_tokenizer_missing_a_template_character_is_one_line():
    tok = Tokenizer.train_char("abc \n:")  # no 'U', 's', 'e', 'r', ...
    with pytest.raises(TokenizerError) as err:
        chat_template_for(tok, None)
    text = str(err.value)
    assert "\n" not in text and text.startswith("data.template (default): ") and "'U'" in text
    with pytest.raises(TokenizerError, match=r"^data.template \(jinja\).*'<'"):
        chat_template_for(_char(), None, CHATML)


def test_bad_template_settings_are_one_line():
    with pytest.raises(ConfigError, match="data.template must be 'auto', 'default' or a Jinja"):
        chat_template_for(_char(), None, "chatml")
    with pytest.raises(ConfigError, match="not a valid Jinja chat template"):
        chat_template_for(_bpe(), None, "{% for m in messages %}")
    failing = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(TokenizerError, match="System role not supported"):
        chat_template_for(_bpe(), None, failing)
    no_reply = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(TokenizerError, match="no text for the assistant turns"):
        chat_template_for(_bpe(), None, no_reply)


def test_auto_takes_the_recorded_template_and_the_default_written_as_jinja_is_the_same():
    bpe = _bpe("<|im_start|>", "<|im_end|>")
    assert isinstance(chat_template_for(bpe, CHATML, "auto"), JinjaChatTemplate)
    assert isinstance(chat_template_for(bpe, CHATML, "default"), DefaultChatTemplate)
    assert isinstance(chat_template_for(bpe, "default", "auto"), DefaultChatTemplate)
    assert chat_template_for(bpe, None, CHATML).recorded == CHATML
    tok = _char()
    tok.chat_template = default_jinja(False)
    jinja = template_for_tokenizer(tok)
    default = chat_template_for(tok, None, "default")
    assert isinstance(jinja, JinjaChatTemplate)
    assert jinja.render(CONVERSATION, True) == default.render(CONVERSATION, True)
    assert jinja.encode(tok, CONVERSATION) == default.encode(tok, CONVERSATION)
    assert jinja.stop_strings == ["\n\n"]


# ---- Jinja templates ------------------------------------------------------------------------------------------

def test_chatml_renders_as_transformers_does_and_masks_the_replies():
    tok = _bpe("<|im_start|>", "<|im_end|>")
    chat = chat_template_for(tok, CHATML)
    text = chat.render(CONVERSATION)
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # a hand-written expectation instead
        expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 2 and 3<|im_end|>\n"
                    "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\nReverse: ab<|im_end|>\n"
                    "<|im_start|>assistant\nba<|im_end|>\n")
        assert text == expected
    else:
        hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token="<|endoftext|>")
        hf.chat_template = CHATML
        assert text == hf.apply_chat_template(CONVERSATION, tokenize=False)
        prompt = chat.render(CONVERSATION[:4], add_generation_prompt=True)
        assert prompt == hf.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True)
        hf_ids = hf.apply_chat_template(CONVERSATION[:4], tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
        assert chat.encode_prompt(tok, CONVERSATION[:4]) == list(hf_ids)
    ids, trained = chat.encode(tok, CONVERSATION)
    replies = tok.decode([i for i, t in zip(ids, trained, strict=True) if t])
    assert replies == "5<|im_end|>\nba<|im_end|>\n"  # each reply with the end the template writes after it
    assert chat.stop_strings == ["<|im_end|>"] and chat.reply("ba<|im_end|>\n<|im_start|>") == "ba"


def test_templates_see_bos_and_eos_tokens():
    tok = _bpe("<s>")
    source = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
              "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
    chat = chat_template_for(tok, source, bos_token="<s>")
    assert chat.render(CONVERSATION[1:3]) == "<s>Add 2 and 35<|endoftext|>"
    ids, trained = chat.encode(tok, CONVERSATION[1:3])
    assert ids[0] == tok.token_to_id("<s>") and ids[-1] == tok.eos_id
    assert tok.decode([i for i, t in zip(ids, trained, strict=True) if t]) == "5<|endoftext|>"
    assert chat.stop_strings == []  # the eos id ends a reply
