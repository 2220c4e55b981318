"""Supervised fine-tuning on conversations (instruction tuning): the loss is the cross-entropy of the response tokens
only, over conversations rendered with a chat template and, by default, packed several to a row.

Data (``task: sft``): a JSONL file of ``{"messages": [...]}`` or ``{"prompt", "response"}`` lines
(:func:`~tokenloom.data.chat.read_conversations`; with ``data.format: hf`` a table's rows, read with Hugging Face
``datasets``), rendered with ``data.template`` (``auto``: the chat template the
checkpoint records -- an imported model's own -- else the default; ``default``; or a Jinja string). The checkpoint
records the template used (``tokenizer.chat_template``), so ``tokenloom generate --chat`` and the server's chat
endpoint render prompts the same way.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..config import check, check_choice
from ..data.chat import (
    ChatTemplate,
    Conversation,
    DefaultChatTemplate,
    JinjaChatTemplate,
    chat_template_for,
    read_conversations,
)
from ..data.jsonl import record_errors
from ..data.tokenizers import TOKENIZERS, Tokenizer, create_tokenizer
from ..devices import device_of
from ..errors import ConfigError, DataError
from ..models.factory import create_model
from ..models.registry import ponders, takes_documents
from .losses import cross_entropy
from .registry import TASKS, Sharded
from .sequences import IGNORE, pack_groups, packed_rows, pad_sequences
from .vocabulary import config_for_tokenizer

Example = tuple[list[int], list[bool]]  # (token ids, trained flags) of one conversation
SFT_FORMATS = ("jsonl", "hf")


@dataclass
class SFTDataConfig:
    path: str = "data/sft/example.jsonl"  # JSONL conversations: {"messages": [{role, content}, ...]} or
    #   {"prompt": ..., "response": ...} per line; with format hf a local json/jsonl, csv, parquet or arrow file or a
    #   save_to_disk folder, read with Hugging Face datasets (nothing is downloaded)
    val_path: str | None = None  # a validation JSONL; None = the last val_fraction of path's conversations
    format: str = "jsonl"  # jsonl: path and val_path are JSONL files | hf: tables whose messages_field column (else
    #   prompt_field and response_field columns) holds the conversations
    messages_field: str = "messages"  # format hf: the column of [{role, content}, ...] lists
    prompt_field: str = "prompt"  # format hf, without a messages column: the column of prompts
    response_field: str = "response"  # format hf, without a messages column: the column of responses
    val_fraction: float = 0.1  # without val_path: this fraction of the conversations (at least one) validates
    template: str = "auto"  # chat template: auto (the checkpoint's recorded one, else default) | default | a Jinja
    #   string (a Hugging Face chat_template)
    packing: bool = True  # several conversations per row of seq_len tokens, attention kept inside each one
    tokenizer: str = "char"  # training from scratch: char | bpe, trained on the rendered conversations
    vocab_size: int | None = None  # bpe only: the size of the learned vocabulary
    max_examples: int | None = None  # train on the first N conversations of path only; None = all

    def __post_init__(self) -> None:
        check(isinstance(self.path, str) and bool(self.path), f"data.path must name a JSONL file, got {self.path!r}")
        check(self.format in SFT_FORMATS, f"data.format must be one of {', '.join(SFT_FORMATS)}, got {self.format!r}")
        for name in ("messages_field", "prompt_field", "response_field"):
            value = getattr(self, name)
            check(isinstance(value, str) and bool(value), f"data.{name} must name a column, got {value!r}")
        check_choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        check(0.0 < self.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        check(isinstance(self.template, str) and bool(self.template),
              f"data.template must be 'auto', 'default' or a Jinja chat template, got {self.template!r}")
        check(isinstance(self.packing, bool), f"data.packing must be true or false, got {self.packing!r}")
        check(self.max_examples is None or (isinstance(self.max_examples, int) and self.max_examples >= 2),
              f"data.max_examples must be at least 2 (or null), got {self.max_examples!r}")
        if self.tokenizer == "bpe":
            check(self.vocab_size is not None and self.vocab_size >= 257,
                  f"data.vocab_size must be set to at least 257 for a bpe tokenizer, got {self.vocab_size}")


def render_for_tokenizer(conversations: Sequence[Conversation], template: str) -> str:
    """The text a tokenizer trained from scratch learns from: every conversation rendered with ``template``
    (``default`` / ``auto``: the default template with its text end; a Jinja string with an empty eos token)."""
    stand_in = types.SimpleNamespace(eos_token=None, eos_id=None)  # no special tokens yet
    chat: ChatTemplate = DefaultChatTemplate(stand_in) if template in ("auto", "default") else \
        JinjaChatTemplate(stand_in, template)
    return "".join(chat.render(c.messages) for c in conversations) + chat.render(
        [{"role": r, "content": ""} for r in ("system", "user", "assistant")], add_generation_prompt=True)


def encode_examples(conversations: Sequence[Conversation], template: ChatTemplate, tokenizer: Tokenizer,
                    seq_len: int) -> tuple[list[Example], int, int]:
    """(examples, truncated, dropped): each conversation's ids and trained flags, cut to ``seq_len`` tokens (the end
    goes); one left without a trained token to predict is dropped. A conversation the tokenizer cannot encode is a
    one-line :class:`TokenizerError` naming its ``path:line``."""
    examples: list[Example] = []
    truncated = dropped = 0
    for conv in conversations:
        with record_errors(conv.where):
            ids, trained = template.encode(tokenizer, conv.messages)
        if len(ids) > seq_len:
            truncated += 1
            ids, trained = ids[:seq_len], trained[:seq_len]
        if not any(trained[1:]):
            dropped += 1
            continue
        examples.append((ids, trained))
    return examples, truncated, dropped


def data_conversations(data: SFTDataConfig, path: str, setting: str = "data.path") -> list[Conversation]:
    """The conversations of ``path``: its JSONL lines, or with ``data.format: hf`` the rows of the table there
    (:func:`~tokenloom.data.hf_datasets.read_conversation_records`), each read as a JSONL line is."""
    if data.format != "hf":
        return read_conversations(path)
    from ..data.chat import parse_conversation
    from ..data.hf_datasets import read_conversation_records

    return [parse_conversation(record, where) for where, record in read_conversation_records(
        path, messages_field=data.messages_field, prompt_field=data.prompt_field,
        response_field=data.response_field, setting=setting)]


def split_conversations(data: SFTDataConfig) -> tuple[list[Conversation], list[Conversation], list[Conversation]]:
    """(all of ``data.path``'s conversations used, the training ones, the validation ones: ``data.val_path``'s, or
    the last ``val_fraction`` of the file, at least one)."""
    conversations = data_conversations(data, data.path)
    if data.max_examples is not None:
        conversations = conversations[:data.max_examples]
    if data.val_path is not None:
        return conversations, conversations, data_conversations(data, data.val_path, "data.val_path")
    if len(conversations) < 2:
        raise DataError(f"{data.path}: one conversation cannot be split into training and validation "
                        "(add lines or set data.val_path)")
    n_val = min(len(conversations) - 1, max(1, round(len(conversations) * data.val_fraction)))
    return conversations, conversations[:-n_val], conversations[-n_val:]


@TASKS.register("sft")
class SFTTask(Sharded):
    """Batches of conversations: with ``packing`` each row holds as many whole conversations as fit in ``seq_len``
    (example ids in ``documents``: attention never crosses them, positions restart with each; the first token of a
    conversation is never predicted from the one before), else one conversation per row, right-padded. Labels are
    -100 except on the response tokens (each assistant turn's content and end marker), so the loss is the mean
    cross-entropy over response tokens only. The training order is a fresh permutation each pass over the data
    (seeded by ``train.seed`` and the pass), its position (``epoch``, ``index``) saved in checkpoints: a resumed
    run continues exactly. Conversations longer than ``seq_len`` are cut to it (their end goes; a warning counts
    them), and dropped when nothing trained is left."""

    data_config_cls = SFTDataConfig
    default_family = "gpt"

    def __init__(self, train: Sequence[Example], val: Sequence[Example], *, batch_size: int, seq_len: int,
                 pad_id: int = 0, packing: bool = True, eval_batches: int | None = 20, seed: int = 0,
                 template: ChatTemplate | None = None) -> None:
        if not train:
            raise DataError("no training conversations left (every one was empty or dropped)")
        self.examples = {"train": list(train), "val": list(val)}
        self.batch_size, self.seq_len = batch_size, seq_len
        self.pad_id, self.packing = pad_id, packing
        self.eval_batches, self.seed = eval_batches, seed
        self.template = template
        self.epoch, self.index = 0, 0  # the pass over the training data and its next row
        self._rows: tuple[int, list[list[int]]] | None = None  # (epoch, rows of example indices) of the pass

    # ---- data position -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        state = state or {}
        self.epoch, self.index = int(state.get("epoch", 0)), int(state.get("index", 0))

    def _groups(self, examples: Sequence[Example], order: Sequence[int]) -> list[list[int]]:
        """Rows of example indices (into ``examples``) taken in ``order``: packed, or one per row."""
        if not self.packing:
            return [[i] for i in order]
        return [[order[j] for j in group] for group in pack_groups([len(examples[i][0]) for i in order], self.seq_len)]

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        if self._rows is None or self._rows[0] != epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            order = torch.randperm(len(self.examples["train"]), generator=g).tolist()
            self._rows = (epoch, self._groups(self.examples["train"], order))
        return self._rows[1]

    # ---- batches --------------------------------------------------------------------------------------------

    def _batch(self, examples: Sequence[Example], groups: Sequence[Sequence[int]]) -> tuple[Tensor, ...]:
        """(ids, labels, documents, positions) (B, seq_len) for packed rows, or (ids, labels) (B, T) padded."""
        if self.packing:
            p = packed_rows([e[0] for e in examples], [e[1] for e in examples], groups, self.seq_len, self.pad_id)
            return p.ids, p.labels, p.documents, p.positions
        chosen = [examples[g[0]] for g in groups]
        ids, labels, _ = pad_sequences([e[0] for e in chosen], [e[1] for e in chosen], self.pad_id)
        return ids, labels

    def get_batch(self, generator: torch.Generator) -> tuple[Tensor, ...]:
        """The next ``batch_size`` rows of the pass (distributed: this rank's slice of the global batch); a pass that
        runs out continues into the next (a fresh permutation)."""
        needed = self.batch_size * self.world_size
        chosen: list[list[int]] = []
        while len(chosen) < needed:
            rows = self._epoch_rows(self.epoch)
            take = rows[self.index:self.index + needed - len(chosen)]
            chosen += take
            self.index += len(take)
            if self.index >= len(rows):
                self.epoch, self.index = self.epoch + 1, 0
        if self.world_size > 1:
            chosen = chosen[self.local(self.batch_size)]
        return self._batch(self.examples["train"], chosen)

    def _logits(self, model: nn.Module, batch: Sequence[Tensor]) -> tuple[Tensor, Tensor | None]:
        """(logits (B, T, V), ponder (B, T) or None)."""
        extra: dict[str, Tensor] = {}
        if len(batch) == 4:
            extra = {"documents": batch[2], "positions": batch[3]}
        if ponders(model):
            logits, ponder = model.forward_ponder(batch[0], **extra)
            return logits, ponder
        return model(batch[0], **extra), None

    def loss(self, model: nn.Module, batch: Sequence[Tensor]) -> tuple[Tensor, int]:
        """(mean cross-entropy over the response tokens, number of response tokens)."""
        labels = batch[1]
        logits, ponder = self._logits(model, batch)
        loss = cross_entropy(logits, labels)
        if ponder is not None:  # adaptive computation time: the mean ponder count over the real positions
            real = batch[2] != 0 if len(batch) == 4 else torch.ones_like(labels, dtype=torch.bool)
            loss = loss + model.ponder_cost * ponder[real].mean()
        return loss, int((labels != IGNORE).sum())

    # ---- evaluation -----------------------------------------------------------------------------------------

    def eval_split_batches(self, split: str = "val") -> int:
        """How many batches :meth:`evaluate` reads from the whole of ``split`` (``max_batches=None``)."""
        rows = len(self._groups(self._split(split), range(len(self._split(split)))))
        return -(-rows // (self.batch_size * self.world_size))

    def _split(self, split: str) -> list[Example]:
        if split not in self.examples:
            raise DataError(f"unknown split {split!r}; the sft task has {', '.join(self.examples)}")
        return self.examples[split]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, max_batches: int | None = -1, split: str = "val",
                 progress: Callable[[int], object] | None = None, stride: int | None = None) -> dict[str, float]:
        """``{split}_loss`` (mean cross-entropy over the response tokens), ``{split}_ppl`` and ``tokens`` over the
        start of a split in file order: ``max_batches`` batches (-1: the task's ``eval_batches``; None: all)."""
        if stride is not None:
            raise DataError("strided evaluation applies to running text; the sft task scores whole conversations")
        max_batches = self.eval_batches if max_batches == -1 else max_batches
        examples = self._split(split)
        groups = self._groups(examples, range(len(examples)))
        rows = self.batch_size * self.world_size
        device = device_of(model)
        total, count = 0.0, 0
        for b, start in enumerate(range(0, len(groups), rows)):
            if max_batches is not None and b >= max_batches:
                break
            batch = [t.to(device) for t in self._batch(examples, groups[start:start + rows])]
            logits, _ = self._logits(model, batch)
            n = int((batch[1] != IGNORE).sum())
            if n:
                total += cross_entropy(logits, batch[1]).item() * n
                count += n
            if progress is not None:
                progress(n)
        if count == 0:
            raise DataError(f"the {split} split has no response tokens to evaluate")
        loss = total / count
        return {f"{split}_loss": loss, f"{split}_ppl": math.exp(min(loss, 50.0)), "tokens": count}

    # ---- setup ----------------------------------------------------------------------------------------------

    @classmethod
    def for_checkpoint(cls, data: SFTDataConfig, tokenizer: Tokenizer, *, batch_size: int, seq_len: int,
                       takes_packing: bool = True) -> SFTTask:
        """The task over a trained checkpoint's data (``tokenloom evaluate``): its tokenizer and recorded chat
        template (``tokenizer.chat_template``), no model built."""
        _, train_convs, val_convs = split_conversations(data)
        template = chat_template_for(tokenizer, tokenizer.chat_template, data.template, setting="data.template",
                                     bos_token=tokenizer.bos_token)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train, *_ = encode_examples(train_convs, template, tokenizer, seq_len)
            val, *_ = encode_examples(val_convs, template, tokenizer, seq_len)
        pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
        return cls(train, val, batch_size=batch_size, seq_len=seq_len, pad_id=pad_id,
                   packing=data.packing and takes_packing, eval_batches=None, template=template)

    @classmethod
    def setup(cls, data: SFTDataConfig, model_section: dict[str, Any], run_dir: Path, *, batch_size: int,
              seq_len: int | None, label_smoothing: float, eval_batches: int | None,
              tokenizer: Tokenizer | None = None,
              seed: int = 0) -> tuple[SFTTask, nn.Module, Tokenizer, dict[str, Any]]:
        """Conversations, the tokenizer (trained on the rendered conversations unless given: a fine-tuned
        checkpoint's or a resumed run's), the chat template (recorded on the tokenizer, so checkpoints keep it)
        and the model (``vocab_size`` and, if unset, ``max_seq_len`` from the data, like the lm task). Returns
        (task, model, tokenizer, resolved model section)."""
        if label_smoothing:
            raise ConfigError(f"train.label_smoothing={label_smoothing}: the sft task trains on plain cross-entropy "
                              "over the response tokens (set it to 0)")
        conversations, train_convs, val_convs = split_conversations(data)
        if tokenizer is None:
            template_source = data.template if data.template not in ("auto", "default") else "default"
            tokenizer = create_tokenizer(data.tokenizer, render_for_tokenizer(conversations, template_source),
                                         data.vocab_size)
        template = chat_template_for(tokenizer, tokenizer.chat_template, data.template, setting="data.template",
                                     bos_token=tokenizer.bos_token)
        tokenizer.chat_template = template.recorded  # checkpoints record the template used
        family, model_config, section, seq_len = config_for_tokenizer(model_section, tokenizer, seq_len)
        model = create_model(family, model_config)
        if data.packing and not takes_documents(model):
            raise ConfigError(f"data.packing: {family} models cannot keep packed conversations apart; set "
                              "data.packing: false (one conversation per row)")
        train, cut, dropped = encode_examples(train_convs, template, tokenizer, seq_len)
        val, val_cut, val_dropped = encode_examples(val_convs, template, tokenizer, seq_len)
        if cut + val_cut:
            warnings.warn(f"{cut + val_cut} conversation(s) longer than train.seq_len={seq_len} tokens were cut to it"
                          + (f"; {dropped + val_dropped} left with no response token were dropped"
                             if dropped + val_dropped else ""), stacklevel=2)
        if not val:
            raise DataError("no validation conversation has a response token within train.seq_len")
        pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
        task = cls(train, val, batch_size=batch_size, seq_len=seq_len, pad_id=pad_id, packing=data.packing,
                   eval_batches=eval_batches, seed=seed, template=template)
        return task, model, tokenizer, {"family": family, **section}
