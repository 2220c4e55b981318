"""Tokenizers: character-level and byte-level BPE, both stored as a standard ``tokenizer.json``.

A :class:`Tokenizer` wraps a Hugging Face ``tokenizers.Tokenizer`` (``.backend``), so the saved file
loads in any tool that reads ``tokenizer.json``. Two kinds exist, and the kind is recovered from the
file's ``model.type`` after loading (no extra field):

* ``char`` -- ``WordLevel`` model over single characters, a pre-tokenizer that isolates every
  character and a ``Fuse`` decoder. Ids follow the sorted character set, like nanoGPT's
  ``shakespeare_char`` (Tiny Shakespeare: 65 ids, ``'\\n'`` = 0, ``' '`` = 1). No special tokens.
* ``bpe`` -- byte-level BPE (``ByteLevel`` pre-tokenizer without a prefix space, ``ByteLevel``
  decoder) trained locally; encodes any text and decodes it back exactly. ``eos_id`` is the id of
  ``<|endoftext|>``. Imported BPE tokenizers (GPT-2's, Llama's with byte fallback) are this kind too.
* ``subword`` -- any other ``tokenizer.json`` model (``Unigram``, ``WordPiece``, a word-level
  ``WordLevel``), as imported with a Hugging Face model.

The end-of-text token is ``<|endoftext|>`` unless another is named (``eos_token``, e.g. ``</s>`` for
an imported Llama; the checkpoint's ``config.yaml`` records it under ``tokenizer.eos_token``).

Translation (encoder-decoder) tokenizers follow fairseq's conventions: ``<pad>`` = 0, ``<s>`` = 1 (bos),
``</s>`` = 2 (eos), ``<unk>`` = 3. :func:`train_joint_bpe` trains one byte-level BPE over source and
target text together with those ids; load its file with ``Tokenizer.from_file(path, eos_token="</s>")``
(``pad_id`` / ``bos_id`` are found by name, ``eos_id`` follows ``eos_token``).

``TOKENIZERS`` maps the kind to a builder ``(text, vocab_size) -> Tokenizer``; use
:func:`create_tokenizer`::

    tok = create_tokenizer("char", text)
    tok.save(ckpt_dir / "tokenizer.json")
    assert Tokenizer.from_file(ckpt_dir).encode("hi") == tok.encode("hi")
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import CheckpointError, ConfigError, DataError, TokenizerError, VocabularyError
from ..registry import Registry

TokenizerBuilder = Callable[[str, "int | None"], "Tokenizer"]
TOKENIZERS: Registry[TokenizerBuilder] = Registry("tokenizer")

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
TRANSLATION_EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
TRANSLATION_SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, TRANSLATION_EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2, 3
_MODEL_KINDS = {"WordLevel": "char", "BPE": "bpe", "Unigram": "subword", "WordPiece": "subword"}
_CHUNK_CHARS = 4096  # target piece length when encoding long texts in parallel
_BATCH_CHUNKS = 512  # pieces per ``encode_batch`` call (bounds memory)
_MAX_NAMED = 10  # characters / ids named in an error message


def _named(items: Iterable[object], total: int) -> str:
    """``'a', 'b', ... and 3 more`` for error messages."""
    shown = [repr(x) if isinstance(x, str) else str(x) for x in items][:_MAX_NAMED]
    more = f" and {total - len(shown)} more" if total > len(shown) else ""
    return ", ".join(shown) + more


def _is_safe_neighbour(ch: str) -> bool:
    """True for a printable, non-space character (never Unicode ``White_Space``)."""
    return ch.isprintable() and not ch.isspace()


def split_for_encoding(text: str, chunk_chars: int = _CHUNK_CHARS) -> Iterator[str]:
    """Cut ``text`` into pieces of about ``chunk_chars`` whose encodings concatenate to the whole's.

    Cuts fall only right after a ``'\\n'`` that sits between two printable non-space characters:
    the byte-level pre-tokenizer always isolates such a newline as its own pre-token, whatever
    follows, and BPE never merges across pre-tokens, so encoding the pieces separately gives the
    same ids as encoding ``text`` in one call.
    """
    n, start = len(text), 0
    while start < n:
        cut, pos = n, start + chunk_chars
        while pos < n - 1:
            j = text.find("\n", pos, n - 1)
            if j < 0:
                break
            if j > start and _is_safe_neighbour(text[j - 1]) and _is_safe_neighbour(text[j + 1]):
                cut = j + 1
                break
            pos = j + 1
        yield text[start:cut]
        start = cut


@contextlib.contextmanager
def _library_errors() -> Iterator[None]:
    """The tokenizers library's own failures (a bare ``Exception``, e.g. a word-level vocabulary without ``[UNK]``
    meeting an unknown word) as a one-line :class:`TokenizerError`."""
    try:
        yield
    except Exception as err:
        if type(err) is not Exception:
            raise
        detail = (str(err).strip().splitlines() or ["unknown error"])[0][:200]
        raise TokenizerError(f"the tokenizer cannot encode this text: {detail}") from None


class Tokenizer:
    """Text <-> token ids over a Hugging Face tokenizer (``.backend``); ``kind`` is ``char``, ``bpe`` or
    ``subword``. ``eos_token`` names the end-of-text token (default ``<|endoftext|>`` when it exists)."""

    def __init__(self, backend: HFTokenizer, kind: str | None = None, eos_token: str | None = None) -> None:
        self.backend = backend
        model_type = json.loads(backend.to_str())["model"]["type"]
        inferred = _MODEL_KINDS.get(model_type)
        if inferred == "char" and any(len(tok) != 1 for tok in backend.get_vocab(with_added_tokens=False)):
            inferred = "subword"  # a word-level vocabulary (imported)
        if inferred is None:
            raise CheckpointError(f"unsupported tokenizer model {model_type!r}; expected one of "
                                  f"{', '.join(_MODEL_KINDS)}")
        if kind is not None and kind != inferred:
            raise ValueError(f"kind {kind!r} does not match the tokenizer's {model_type} model")
        self._kind = inferred
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        if eos_token is not None and backend.token_to_id(eos_token) is None:
            raise CheckpointError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary")
        self._eos_token = eos_token if eos_token is not None else \
            (EOS_TOKEN if inferred != "char" and backend.token_to_id(EOS_TOKEN) is not None else None)
        self._eos_id = None if self._eos_token is None else backend.token_to_id(self._eos_token)
        self._stoi: dict[str, int] = {}
        if inferred == "char":
            self._stoi = backend.get_vocab(with_added_tokens=False)
        self.chat_template: str | None = None  # the chat template a checkpoint records (tokenizer.chat_template:
        #   "default" or a Jinja string; :mod:`tokenloom.data.chat`), None where it records none
        self.bos_token: str | None = None  # the text a Jinja chat template writes for {{ bos_token }}, or None
        self.origin: str | None = None  # the checkpoint it was loaded from (named by encoding errors), or None

    # ---- building -------------------------------------------------------------------------------

    @classmethod
    def train_char(cls, text: str) -> Tokenizer:
        """Character-level tokenizer; ids are the sorted characters of ``text``."""
        if not text:
            raise DataError("cannot build a character vocabulary from empty text")
        vocab = {ch: i for i, ch in enumerate(sorted(set(text)))}
        backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # <unk> is not in vocab
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = decoders.Fuse()
        return cls(backend, "char")

    @classmethod
    def train_bpe(cls, text: str, vocab_size: int,
                  special_tokens: tuple[str, ...] | list[str] = (EOS_TOKEN,)) -> Tokenizer:
        """Byte-level BPE with at most ``vocab_size`` ids (256 bytes + specials + merges)."""
        minimum = 256 + len(special_tokens)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
            raise ConfigError(f"vocab_size: {vocab_size!r} is too small for a byte-level BPE tokenizer; "
                              f"need at least {minimum} (256 bytes + {len(special_tokens)} special tokens)")
        if not text:
            raise DataError("cannot train a BPE tokenizer on empty text")
        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        backend.train_from_iterator(split_for_encoding(text), trainer=trainer)
        return cls(backend, "bpe")

    @classmethod
    def train_joint_bpe(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """Byte-level BPE (``train_bpe``'s settings) over source and target text together, for translation.

        ``texts`` are sentences (or whole newline-separated files) of both languages. The special tokens
        ``<pad>``, ``<s>``, ``</s>``, ``<unk>`` get ids 0..3 and ``eos_token`` is ``</s>``. Byte-level
        BPE never needs ``<unk>``; it is reserved so the ids match fairseq's dictionaries.
        """
        text = "\n".join(texts)
        tok = cls.train_bpe(text, vocab_size, special_tokens=TRANSLATION_SPECIAL_TOKENS)
        return tok.with_eos(TRANSLATION_EOS_TOKEN)

    # ---- files ----------------------------------------------------------------------------------

    def with_eos(self, eos_token: str | None) -> Tokenizer:
        """The same tokenizer with another end-of-text token."""
        other = type(self)(self.backend, self._kind, eos_token)
        other.chat_template, other.bos_token = self.chat_template, self.bos_token
        return other

    @classmethod
    def from_file(cls, path: str | Path, eos_token: str | None = None) -> Tokenizer:
        """Load a ``tokenizer.json`` (or ``<dir>/tokenizer.json`` when ``path`` is a directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"tokenizer file not found: {path}")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception with a serde message
            detail = (str(err).strip().splitlines() or ["unreadable"])[0][:200]
            raise CheckpointError(f"corrupt tokenizer file {path}: {detail}") from None
        try:
            return cls(backend, eos_token=eos_token)
        except CheckpointError as err:
            raise CheckpointError(f"{path}: {err}") from None
        except (KeyError, ValueError) as err:
            raise CheckpointError(f"corrupt tokenizer file {path}: {err}") from None

    def save(self, path: str | Path) -> Path:
        """Write ``tokenizer.json`` atomically (``path`` a file, or a directory to write it in)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            self.backend.save(str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    # ---- properties -----------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """``"char"``, ``"bpe"`` or ``"subword"``."""
        return self._kind

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included; ids are ``0 .. vocab_size - 1``."""
        return self._vocab_size

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-text token, or None (char tokenizers have none)."""
        return self._eos_id

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` (a special token such as ``<pad>``, or any vocabulary entry), or None."""
        return self.backend.token_to_id(token)

    @property
    def pad_id(self) -> int | None:
        """Id of ``<pad>``, or None when the vocabulary lacks it."""
        return self.backend.token_to_id(PAD_TOKEN)

    @property
    def bos_id(self) -> int | None:
        """Id of ``<s>`` (beginning of sequence), or None when the vocabulary lacks it."""
        return self.backend.token_to_id(BOS_TOKEN)

    @property
    def fingerprint(self) -> str:
        """sha256 of the serialized tokenizer; equal fingerprints encode identically."""
        return hashlib.sha256(self.backend.to_str().encode("utf-8")).hexdigest()

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"

    # ---- encoding -------------------------------------------------------------------------------

    def _oov_error(self, text: str) -> VocabularyError:
        unknown = [ch for ch in dict.fromkeys(text) if ch not in self._stoi]
        whose = f"the tokenizer of {self.origin}" if self.origin else "the tokenizer"
        return VocabularyError(f"text contains characters outside the vocabulary: "
                               f"{_named(unknown, len(unknown))} "
                               f"({whose} knows {len(self._stoi)} characters)")

    def first_unencodable(self, texts: Sequence[str]) -> int | None:
        """The index of the first of ``texts`` this tokenizer cannot encode, or None when all encode (what a reader
        calls after an encoding error, to name the line that caused it)."""
        for i, text in enumerate(texts):
            try:
                self.encode(text)
            except TokenizerError:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a char tokenizer rejects unknown characters with TokenizerError."""
        if self._kind == "char":
            stoi = self._stoi
            try:
                return [stoi[ch] for ch in text]
            except KeyError:
                raise self._oov_error(text) from None
        with _library_errors():
            return self.backend.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text, equal to ``[self.encode(t) for t in texts]`` (one ``encode_batch`` call for
        a BPE / subword tokenizer, which uses all cores)."""
        if self._kind == "char":
            return [self.encode(t) for t in texts]
        with _library_errors():
            return [e.ids for e in self.backend.encode_batch(list(texts))]

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of a long ``text`` as a uint32 array, equal to ``encode(text)`` but faster.

        char: a numpy lookup table over code points. bpe: ``encode_batch`` over pieces cut where
        the byte-level pre-tokenizer splits anyway (see :func:`split_for_encoding`).
        """
        if self._kind == "char":
            codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            table = np.full(max(map(ord, self._stoi)) + 1, -1, dtype=np.int64)
            for ch, idx in self._stoi.items():
                table[ord(ch)] = idx
            inside = codes < len(table)
            ids = np.full(len(codes), -1, dtype=np.int64)
            ids[inside] = table[codes[inside]]
            if (ids < 0).any():
                raise self._oov_error(text)
            return ids.astype(np.uint32)
        with _library_errors():
            if not self._chunkable():
                return np.asarray(self.backend.encode(text).ids, dtype=np.uint32)
            parts: list[np.ndarray] = []
            batch: list[str] = []
            for piece in split_for_encoding(text):
                batch.append(piece)
                if len(batch) == _BATCH_CHUNKS:
                    parts.extend(np.asarray(e.ids, dtype=np.uint32) for e in self.backend.encode_batch(batch))
                    batch = []
            if batch:
                parts.extend(np.asarray(e.ids, dtype=np.uint32) for e in self.backend.encode_batch(batch))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)

    def _chunkable(self) -> bool:
        """True when pieces from :func:`split_for_encoding` encode like the whole text."""
        spec = json.loads(self.backend.to_str())
        pre = spec.get("pre_tokenizer") or {}
        return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel"
                and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
                and not any("\n" in t["content"] for t in spec.get("added_tokens", [])))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; ids outside ``[0, vocab_size)`` raise TokenizerError naming them."""
        ids = [int(i) for i in ids]
        bad = [i for i in dict.fromkeys(ids) if not 0 <= i < self._vocab_size]
        if bad:
            raise TokenizerError(f"ids outside the vocabulary [0, {self._vocab_size}): "
                                 f"{_named(bad, len(bad))}")
        return self.backend.decode(ids, skip_special_tokens=False)


@TOKENIZERS.register("char")
def _build_char(text: str, vocab_size: int | None = None) -> Tokenizer:
    """Character-level; ``vocab_size`` is ignored (it is the number of distinct characters)."""
    return Tokenizer.train_char(text)


@TOKENIZERS.register("bpe")
def _build_bpe(text: str, vocab_size: int | None = None) -> Tokenizer:
    """Byte-level BPE; needs ``vocab_size``."""
    if vocab_size is None:
        raise ConfigError("vocab_size: a bpe tokenizer needs a vocab_size (for example 4096)")
    return Tokenizer.train_bpe(text, vocab_size)


def train_joint_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Joint source+target byte-level BPE for translation; see :meth:`Tokenizer.train_joint_bpe`."""
    return Tokenizer.train_joint_bpe(texts, vocab_size)


def create_tokenizer(kind: str, text: str, vocab_size: int | None = None) -> Tokenizer:
    """Train a tokenizer of ``kind`` (a ``TOKENIZERS`` name) on ``text``."""
    return TOKENIZERS.get(kind)(text, vocab_size)
