"""Conversations (JSONL) and chat templates: messages -> text -> token ids with a mask of the response tokens.

A conversation file holds one JSON object per line, either ``{"messages": [{"role": "system" | "user" |
"assistant", "content": "..."}, ...]}`` (at least one assistant turn) or ``{"prompt": "...", "response": "..."}``
(a user turn and an assistant turn). :func:`read_conversations` reads it; a bad line is a one-line
:class:`~tokenloom.errors.DataError` naming ``path:line``.

Templates (:class:`ChatTemplate`, chosen with :func:`chat_template_for`):

* ``default`` -- plain characters, so a character tokenizer trained on ordinary text can express it::

      System: {content}\\n
      User: {content}\\n
      Assistant: {content}{end}

  ``{end}`` is the tokenizer's end-of-text token when it has one (``eos_id`` not None: byte-level BPE,
  imported tokenizers), else the text ``"\\n\\n"`` (character tokenizers). A generation prompt ends in
  ``"Assistant: "``; generation stops at the end marker (the eos id, or the stop string ``"\\n\\n"``; a reply
  that itself holds a blank line is cut there).
* a Jinja string -- a Hugging Face ``chat_template`` (an imported checkpoint's ``tokenizer_config.json``),
  rendered as ``transformers`` does: :class:`jinja2.sandbox.ImmutableSandboxedEnvironment` with ``trim_blocks``,
  ``lstrip_blocks``, ``raise_exception`` and ``tojson``, over ``messages``, ``add_generation_prompt``,
  ``bos_token`` and ``eos_token``. The assistant turns' characters are found by rendering the conversation's
  prefixes (what turn ``i`` adds after the generation prompt of turns ``< i``) and mapped to tokens by their
  offsets; generation stops at the eos id and at the text the template writes after a reply (``<|im_end|>``).

The trained tokens of a conversation are every assistant turn's content and its end marker; the headers
(``"Assistant: "``, ``<|im_start|>assistant\\n``) and every other turn are context only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DataError, TokenizerError
from .jsonl import read_jsonl
from .tokenizers import Tokenizer

ROLES = ("system", "user", "assistant")
DEFAULT_HEADERS = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}
DEFAULT_END_TEXT = "\n\n"  # the default template's end of a reply for a tokenizer without an eos token
TEMPLATE_NAMES = ("auto", "default")  # besides a Jinja string
Message = dict[str, str]


@dataclass
class Conversation:
    """One line of a conversation file: its messages (``role``, ``content``) and where it came from."""

    messages: list[Message]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]
    where: str = ""  # "path:line", for error messages


def check_messages(messages: Any, where: str = "messages") -> list[Message]:
    """``messages`` as a list of ``{"role", "content"}`` dicts with known roles, string contents and at least one
    assistant turn; a one-line :class:`DataError` naming ``where`` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects, "
                        f"got {_short(messages)}")
    out: list[Message] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: messages[{i}] must be an object with \"role\" and \"content\", "
                            f"got {_short(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: messages[{i}] has role {_short(role)}; allowed: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: messages[{i}] ({role}) needs a string \"content\", got {_short(content)}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: the conversation has no assistant turn (nothing to learn)")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_conversation(obj: Any, where: str) -> Conversation:
    """A conversation from one decoded JSONL object (``messages``, or ``prompt`` + ``response``)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with \"messages\" (or \"prompt\" and \"response\"), "
                        f"got {_short(obj)}")
    if "messages" in obj:
        return Conversation(check_messages(obj["messages"], where), where)
    if "prompt" in obj or "response" in obj:
        prompt, response = obj.get("prompt"), obj.get("response")
        for key, value in (("prompt", prompt), ("response", response)):
            if not isinstance(value, str):
                raise DataError(f"{where}: \"{key}\" must be a string, got {_short(value)}")
        return Conversation([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], where)
    raise DataError(f"{where}: the line has no \"messages\" (nor \"prompt\" and \"response\"); keys: "
                    f"{', '.join(map(str, obj)) or 'none'}")


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of a JSONL file (blank lines skipped); a one-line :class:`DataError` naming
    ``path:line`` for a bad line, and naming ``path`` for a missing or empty file."""
    conversations = [parse_conversation(obj, where) for where, obj in read_jsonl(path, "conversation")]
    if not conversations:
        raise DataError(f"{path}: no conversations (the file is empty)")
    return conversations


# ---- templates ----------------------------------------------------------------------------------------------

class ChatTemplate:
    """Messages -> text (:meth:`render`) -> token ids with the trained (response) tokens marked (:meth:`encode`).

    Bound to a tokenizer's special tokens when made (:func:`chat_template_for`). ``recorded`` is what a checkpoint
    records under ``tokenizer.chat_template`` (``"default"`` or the Jinja source); ``stop_strings`` and
    ``stop_token_id`` end a generated reply; ``setting`` names the config setting in error messages."""

    name = "template"
    recorded = ""

    def __init__(self, tokenizer: Tokenizer, setting: str = "data.template") -> None:
        self.eos_token, self.eos_id = tokenizer.eos_token, tokenizer.eos_id
        self.setting = setting

    @property
    def stop_strings(self) -> list[str]:
        """Texts that end a generated reply (beside :attr:`stop_token_id`)."""
        return []

    @property
    def stop_token_id(self) -> int | None:
        """The id that ends a generated reply, or None."""
        return self.eos_id

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        raise NotImplementedError

    def encode(self, tokenizer: Tokenizer, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
        """(ids, trained): token ids of the rendered conversation and, per id, whether it belongs to an assistant
        turn's content or its end marker (the tokens a response-only loss learns)."""
        raise NotImplementedError

    def encode_prompt(self, tokenizer: Tokenizer, messages: Sequence[Message]) -> list[int]:
        """Ids of ``messages`` followed by the generation prompt (the assistant header), for generation."""
        raise NotImplementedError

    def reply(self, text: str) -> str:
        """A generated continuation cut at the first stop string or eos token text (the reply alone)."""
        stops = [*self.stop_strings, *([self.eos_token] if self.eos_token else [])]
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
        return text[:cut]

    def check(self, tokenizer: Tokenizer) -> None:
        """Refuse (one line naming :attr:`setting`) a template ``tokenizer`` cannot apply: render and encode a probe
        conversation (missing characters of a character vocabulary, template errors, no assistant span)."""
        probe = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        try:
            self.encode(tokenizer, probe)
            self.encode_prompt(tokenizer, probe[:1])
        except TokenizerError as err:
            message = _first_line(err)
            if not message.startswith(f"{self.setting}:"):  # (a template error names the setting already)
                message = f"{self.setting} ({self.name}): the tokenizer cannot apply the chat template: {message}"
            raise TokenizerError(message) from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


class DefaultChatTemplate(ChatTemplate):
    """``System: ...\\n`` / ``User: ...\\n`` / ``Assistant: ...{end}`` (see the module docstring). Each piece is
    encoded on its own (header, content, end), so the prompt's ids are always a prefix of the conversation's."""

    name = "default"
    recorded = "default"

    @property
    def end_text(self) -> str:
        """The end of a reply as text: the eos token's text, or ``"\\n\\n"``."""
        return self.eos_token if self.eos_id is not None else DEFAULT_END_TEXT

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.eos_id is not None else [DEFAULT_END_TEXT]

    def _pieces(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[tuple[str, bool, bool]]:
        """(text, trained, is_end_token) pieces of the conversation."""
        pieces: list[tuple[str, bool, bool]] = []
        for m in messages:
            pieces.append((DEFAULT_HEADERS[m["role"]], False, False))
            if m["role"] == "assistant":
                pieces += [(m["content"], True, False), (self.end_text, True, self.eos_id is not None)]
            else:
                pieces.append((m["content"] + "\n", False, False))
        if add_generation_prompt:
            pieces.append((DEFAULT_HEADERS["assistant"], False, False))
        return pieces

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        return "".join(text for text, _, _ in self._pieces(messages, add_generation_prompt))

    def _encode(self, tokenizer: Tokenizer, messages: Sequence[Message],
                add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        trained: list[bool] = []
        for text, learn, is_eos in self._pieces(messages, add_generation_prompt):
            piece = [self.eos_id] if is_eos else (tokenizer.encode(text) if text else [])
            ids += piece
            trained += [learn] * len(piece)
        return ids, trained

    def encode(self, tokenizer: Tokenizer, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
        return self._encode(tokenizer, messages, False)

    def encode_prompt(self, tokenizer: Tokenizer, messages: Sequence[Message]) -> list[int]:
        return self._encode(tokenizer, messages, True)[0]


class JinjaChatTemplate(ChatTemplate):
    """A Hugging Face ``chat_template`` (Jinja source), rendered in a sandbox as ``transformers`` renders it."""

    name = "jinja"

    def __init__(self, tokenizer: Tokenizer, source: str, setting: str = "data.template",
                 bos_token: str | None = None) -> None:
        super().__init__(tokenizer, setting)
        self.recorded = source
        self.bos_token = bos_token if bos_token is not None else ""
        self._compiled = _compile_jinja(source, setting)
        self._stops: list[str] | None = None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._compiled.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token or "")
        except TemplateError as err:
            raise TokenizerError(f"{self.setting}: the chat template fails to render: {_first_line(err)}") from None
        except Exception as err:  # anything the template's own code raises (e.g. a bad message layout)
            raise TokenizerError(f"{self.setting}: the chat template fails to render: "
                                 f"{type(err).__name__}: {_first_line(err)}") from None

    def assistant_spans(self, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, [(start, end) character span of each assistant turn]): turn ``i``'s span is what
        ``render(messages[:i + 1])`` adds to ``render(messages[:i], add_generation_prompt=True)``."""
        text = self.render(messages)
        spans: list[tuple[int, int]] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[:i + 1])
            if not upto.startswith(before):
                before = self.render(messages[:i])
            if not upto.startswith(before) or not text.startswith(upto):
                raise TokenizerError(f"{self.setting}: the chat template does not render a conversation's turns as "
                                     f"a growing prefix, so assistant turn {i} cannot be located")
            if len(upto) > len(before):
                spans.append((len(before), len(upto)))
        if not spans:
            raise TokenizerError(f"{self.setting}: the chat template renders no text for the assistant turns")
        return text, spans

    def encode(self, tokenizer: Tokenizer, messages: Sequence[Message]) -> tuple[list[int], list[bool]]:
        text, spans = self.assistant_spans(messages)
        ids, starts = _encode_with_offsets(tokenizer, text)
        trained = [any(a <= s < b for a, b in spans) for s in starts]
        return ids, trained

    def encode_prompt(self, tokenizer: Tokenizer, messages: Sequence[Message]) -> list[int]:
        return _encode_with_offsets(tokenizer, self.render(messages, add_generation_prompt=True))[0]

    @property
    def stop_strings(self) -> list[str]:
        """The text the template writes after a reply (``<|im_end|>``), stripped of whitespace; none when it writes
        only the eos token or nothing."""
        if self._stops is None:
            marker = "\x00REPLY\x00"
            convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
            try:
                text = self.render(convo)
            except TokenizerError:
                text = ""
            tail = text.split(marker, 1)[1] if marker in text else ""
            tail = tail.strip() or tail  # "<|im_end|>\n" -> "<|im_end|>"; a whitespace end ("\n\n") as it is
            if self.eos_token and tail.startswith(self.eos_token):
                tail = ""  # the eos id ends the reply
            self._stops = [tail] if tail else []
        return self._stops


def _encode_with_offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[int]]:
    """(ids, start character of each id) of ``text`` without added special tokens (BOS post-processing)."""
    if tokenizer.kind == "char":
        return tokenizer.encode(text), list(range(len(text)))
    try:
        enc = tokenizer.backend.encode(text, add_special_tokens=False)
    except Exception as err:
        raise TokenizerError(f"the tokenizer cannot encode this text: {_first_line(err)}") from None
    return list(enc.ids), [start for start, _ in enc.offsets]


def _compile_jinja(source: str, setting: str) -> Any:
    """The template compiled like ``transformers``' ``_compile_jinja_template`` (sandboxed)."""
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ConfigError(f"{setting}: a Jinja chat template needs jinja2: pip install jinja2") from err

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as err:
        raise ConfigError(f"{setting}: not a valid Jinja chat template: {_first_line(err)}") from None


def chat_template_for(tokenizer: Tokenizer, recorded: str | None, name: str = "auto", *,
                      setting: str = "data.template", bos_token: str | None = None) -> ChatTemplate:
    """The template ``name`` asks for, bound to ``tokenizer`` and checked against it: ``"auto"`` -- the checkpoint's
    ``recorded`` template (``tokenizer.chat_template``) when there is one, else the default; ``"default"``; or a
    Jinja string. A template the tokenizer cannot apply is a one-line :class:`TokenizerError` naming ``setting``."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{setting} must be 'auto', 'default' or a Jinja chat template, got {name!r}")
    source = (recorded or "default") if name == "auto" else name
    if source == "default":
        template: ChatTemplate = DefaultChatTemplate(tokenizer, setting)
    else:
        if "{" not in source:
            raise ConfigError(f"{setting} must be 'auto', 'default' or a Jinja chat template (with {{{{ ... }}}} or "
                              f"{{% ... %}}), got {_short(source)}")
        template = JinjaChatTemplate(tokenizer, source, setting, bos_token=bos_token)
    template.check(tokenizer)
    return template


def template_from_section(tokenizer: Tokenizer, section: dict[str, Any] | None, name: str = "auto", *,
                          setting: str = "data.template") -> ChatTemplate:
    """:func:`chat_template_for` with a checkpoint's ``tokenizer`` section (``chat_template``, ``bos_token``)."""
    section = section or {}
    return chat_template_for(tokenizer, section.get("chat_template"), name, setting=setting,
                             bos_token=section.get("bos_token"))


def recorded_template(section: dict[str, Any] | None) -> str | None:
    """The chat template a checkpoint's ``tokenizer`` section records, or None."""
    value = (section or {}).get("chat_template")
    return value if isinstance(value, str) and value else None


def template_for_tokenizer(tokenizer: Tokenizer, name: str = "auto", *, setting: str = "data.template") -> ChatTemplate:
    """:func:`chat_template_for` with the template a checkpoint's tokenizer carries (``tokenizer.chat_template`` and
    ``tokenizer.bos_token``, set by :func:`~tokenloom.checkpoint.load_tokenizer` from ``config.yaml``)."""
    return chat_template_for(tokenizer, tokenizer.chat_template, name, setting=setting, bos_token=tokenizer.bos_token)


def default_jinja(with_eos: bool) -> str:
    """The default template as a Hugging Face Jinja ``chat_template`` (what an export writes): the same text, the end
    of a reply ``{{ eos_token }}`` (``with_eos``) or ``"\\n\\n"``."""
    end = "eos_token" if with_eos else "'\\n\\n'"
    return ("{% for message in messages %}"
            "{% if message['role'] == 'system' %}{{ 'System: ' + message['content'] + '\\n' }}"
            "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n' }}"
            f"{{% else %}}{{{{ 'Assistant: ' + message['content'] + {end} }}}}{{% endif %}}"
            "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")


def jinja_source(recorded: str, tokenizer: Tokenizer) -> str:
    """A recorded template (``tokenizer.chat_template``) as a Jinja string: the default one written out, a Jinja one
    as it is."""
    return default_jinja(tokenizer.eos_id is not None) if recorded == "default" else recorded
