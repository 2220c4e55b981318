"""Language modelling: next-token prediction on contiguous windows of a text corpus."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..config import check, check_choice
from ..data.text import TextDataset, read_text
from ..data.tokenizers import TOKENIZERS, Tokenizer, create_tokenizer
from ..devices import device_of
from ..errors import ConfigError, DataError
from ..models.factory import create_model
from ..models.registry import ponders
from .losses import cross_entropy, z_loss
from .registry import TASKS, Sharded
from .vocabulary import config_for_tokenizer

DATA_ORDERS = ("random", "stream")
LM_FORMATS = ("text", "hf")


@dataclass
class LMDataConfig:
    path: str = "data/tinyshakespeare/input.txt"  # a UTF-8 text file; with format hf a local json/jsonl, csv,
    #   parquet, txt or arrow file or a save_to_disk folder, read with Hugging Face datasets (nothing is downloaded)
    format: str = "text"  # text: path is the corpus itself | hf: path is a table whose text_field column holds the
    #   documents, joined one after another with a newline
    text_field: str = "text"  # format hf: the column that holds the text
    tokenizer: str = "char"  # char | bpe
    vocab_size: int | None = None  # bpe only: the size of the learned vocabulary
    val_fraction: float = 0.1  # the last fraction of the tokens is the validation split
    order: str = "random"  # random: windows at random offsets | stream: each batch row a contiguous stream,
    #   consecutive batches continuing it (Transformer-XL's memory, model.memory_len, needs it)

    def __post_init__(self) -> None:
        check_choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        check(self.format in LM_FORMATS, f"data.format must be one of {', '.join(LM_FORMATS)}, got {self.format!r}")
        check(isinstance(self.text_field, str) and bool(self.text_field),
              f"data.text_field must name a column, got {self.text_field!r}")
        check(self.order in DATA_ORDERS, f"data.order must be one of {', '.join(DATA_ORDERS)}, got {self.order!r}")
        check(0.0 < self.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.tokenizer == "bpe":
            check(self.vocab_size is not None and self.vocab_size >= 257,
                  f"data.vocab_size must be set to at least 257 for a bpe tokenizer, got {self.vocab_size}")


def text_file(data: LMDataConfig, work_dir: Path) -> Path:
    """The text file the task reads: ``data.path``, or with ``data.format: hf`` the ``data.text_field`` column of
    the table at ``data.path`` written to ``work_dir/hf/text.txt`` (one document after another, each ending with a
    newline), so tokenising and the memmap cache (reused while the text is the same) are the text format's."""
    if data.format != "hf":
        return Path(data.path)
    from ..data.hf_datasets import read_texts, write_text

    text = "".join(document + "\n" for document in read_texts(data.path, data.text_field))
    return write_text(Path(work_dir) / "hf" / "text.txt", text)


@TASKS.register("lm")
class LMTask(Sharded):
    """Batches are (x, y) with y = x shifted by one; the loss is the mean token cross-entropy, plus, for a model
    declared to ponder (adaptive computation time, :func:`~tokenloom.models.registry.ponders`), its
    ``ponder_cost * mean(N + R)``; evaluation reports the plain cross-entropy and ``{split}_ponder``.

    ``order="stream"`` reads the training split as ``batch_size`` (global) contiguous streams, one per batch row,
    each batch the next segment of every stream (:meth:`TextDataset.stream_batch`); each pass over the streams
    after the first starts at a random shift of less than ``seq_len`` (drawn from the data generator), so passes
    do not repeat the same segment boundaries (on Tiny Shakespeare, 920 steps of the XL recipe: val loss 1.570 with
    the shifts, 1.565 without: no measurable change at ~4 passes). The pass, segment and shift are the task's
    state, saved in checkpoints. A model with a Transformer-XL memory (``memory_len``) then carries its
    memory from batch to batch (forgotten when the streams wrap around), and evaluates over streams of the split
    with its memory. On resume the data continues exactly where it stopped but the memory starts empty (it is
    not saved: one segment without memory)."""

    data_config_cls = LMDataConfig
    default_family = "gpt"
    counts_model_tokens = True  # every (x, y) window's tokens run forward and backward: the progress line's MFU
    takes_z_loss = True  # train.z_loss: added to the training loss (loss())
    takes_seq_len_warmup = True  # train.seq_len_warmup: the training windows grow (train_seq_len())

    def __init__(self, dataset: TextDataset, *, batch_size: int, seq_len: int, label_smoothing: float = 0.0,
                 eval_batches: int | None = 20, order: str = "random", memory_len: int = 0,
                 z_loss: float = 0.0, seq_len_warmup: int = 0, seq_len_start: int = 64) -> None:
        self.dataset = dataset
        self.batch_size, self.seq_len = batch_size, seq_len
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss  # train.z_loss: the weight of the training loss's z-loss term (0: off)
        self.eval_batches = eval_batches
        if seq_len_warmup and (order == "stream" or memory_len or not 1 <= seq_len_start <= seq_len):
            raise ConfigError(f"train.seq_len_warmup={seq_len_warmup} needs data.order random, no model.memory_len and "
                              f"1 <= train.seq_len_start ({seq_len_start}) <= seq_len ({seq_len})")
        self.seq_len_warmup, self.seq_len_start = seq_len_warmup, seq_len_start
        self.step = 0  # the optimizer update about to happen (the Trainer sets it): train_seq_len(step)
        if memory_len and order != "stream":
            raise ConfigError(f"model.memory_len={memory_len} needs data.order: stream (each batch row a contiguous "
                              "stream, so the memory continues the text)")
        self.order, self.memory_len = order, memory_len
        self.epoch, self.segment, self.offset = 0, 0, 0  # stream order: the pass, its next segment, its shift
        self.memory = None  # the training memory (a SegmentMemory), made on the first batch
        self._wrapped = False

    def train_seq_len(self, step: int) -> int:
        """The training window length at ``step`` (0-based): ``seq_len`` from step ``seq_len_warmup`` on; before it
        ``s0 = seq_len_start`` grown linearly, rounded down to a multiple of s0 (never below s0):
        ``max(s0, floor((s0 + (seq_len - s0) * step / seq_len_warmup) / s0) * s0)`` (integer arithmetic). Evaluation
        always reads ``seq_len``. Depends on the step alone, so a resumed run draws the same windows."""
        n, s0 = self.seq_len_warmup, self.seq_len_start
        if not n or step >= n:
            return self.seq_len
        grown = s0 + (self.seq_len - s0) * step // n
        return min(self.seq_len, max(s0, grown // s0 * s0))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "segment": self.segment, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        state = state or {}
        self.epoch, self.segment, self.offset = (int(state.get(key, 0)) for key in ("epoch", "segment", "offset"))
        self.memory = None  # resume: the memory starts empty

    @classmethod
    def setup(cls, data: LMDataConfig, model_section: dict[str, Any], run_dir: Path, *, batch_size: int,
              seq_len: int | None, label_smoothing: float, eval_batches: int | None,
              tokenizer: Tokenizer | None = None, seed: int = 0, z_loss: float = 0.0, seq_len_warmup: int = 0,
              seq_len_start: int = 64) -> tuple[LMTask, nn.Module, Tokenizer, dict[str, Any]]:
        """Tokenizer (trained unless given), token memmaps in ``run_dir/data``, and the model with its
        ``vocab_size`` (and, if unset, ``max_seq_len``) taken from the data. Returns (task, model,
        tokenizer, resolved model section)."""
        path = text_file(data, Path(run_dir) / "data")
        if tokenizer is None:
            tokenizer = create_tokenizer(data.tokenizer, read_text(path), data.vocab_size)
        dataset = TextDataset.prepare(path, tokenizer, Path(run_dir) / "data", val_fraction=data.val_fraction)
        family, model_config, section, seq_len = config_for_tokenizer(model_section, tokenizer, seq_len)
        model = create_model(family, model_config)
        task = cls(dataset, batch_size=batch_size, seq_len=seq_len, label_smoothing=label_smoothing,
                   eval_batches=eval_batches, order=data.order, memory_len=getattr(model_config, "memory_len", 0),
                   z_loss=z_loss, seq_len_warmup=seq_len_warmup, seq_len_start=seq_len_start)
        return task, model, tokenizer, {"family": family, **section}

    def get_batch(self, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``batch_size`` random windows (of :meth:`train_seq_len` tokens at this step), or the next segment of each
        stream (distributed: this rank's slice of the global batch's rows)."""
        rows = self.batch_size * self.world_size
        if self.order == "stream":
            if self.segment >= self.dataset.streams("train", rows, self.seq_len, self.offset):
                # a new pass over the streams, shifted by a random offset so its segments are not the last pass's
                self.epoch, self.segment = self.epoch + 1, 0
                self.offset = int(torch.randint(self.seq_len, (1,), generator=generator))
            x, y = self.dataset.stream_batch("train", rows, self.seq_len, self.segment, self.offset)
            self._wrapped = self.segment == 0
            self.segment += 1
        else:
            x, y = self.dataset.get_batch("train", rows, self.train_seq_len(self.step), generator)
        if self.world_size == 1:
            return x, y
        rows = self.local(self.batch_size)
        return x[rows], y[rows]

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
        """(mean loss, number of target tokens)."""
        x, y = batch
        cache = None
        if self.memory_len:  # Transformer-XL: the memory of the previous segments of the same streams
            if self.memory is None or self.memory.batch_size != x.shape[0]:
                self.memory = model.create_cache(x.shape[0])
            if self._wrapped:
                self.memory.reset()
            cache = self.memory
        if ponders(model):  # adaptive computation time: the mean ponder count N + R, weighted by tau
            logits, ponder = model.forward_ponder(x, cache=cache)  # (B, T, V), (B, T)
            extra = model.ponder_cost * ponder.mean()
        else:
            logits, extra = model(x, cache=cache), None  # (B, T, V)
        loss = cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        if self.z_loss:
            loss = loss + self.z_loss * z_loss(logits)
        return (loss if extra is None else loss + extra), y.numel()

    def eval_split_batches(self, split: str = "val") -> int:
        """How many batches :meth:`evaluate` reads from the whole of ``split`` (``max_batches=None``)."""
        if self.memory_len:
            return self.dataset.streams(split, self.batch_size * self.world_size, self.seq_len)
        windows = max(0, self.dataset.num_tokens(split) - 1) // self.seq_len
        return -(-windows // (self.batch_size * self.world_size))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, max_batches: int | None = -1, split: str = "val",
                 progress: Callable[[int], object] | None = None, stride: int | None = None) -> dict[str, float]:
        """``{split}_loss`` (without label smoothing), ``{split}_ppl`` and ``tokens`` over the start of a
        split: ``max_batches`` windows (-1: the task's ``eval_batches``; None: the whole split); ``progress`` is
        called with each batch's number of target tokens. With ``stride`` the windows overlap, advancing by
        ``stride`` tokens and scoring only the new ones (the sliding-window perplexity of a causal LM,
        :meth:`TextDataset.iter_strided`: every token scored once, with at least ``seq_len - stride`` of context)."""
        max_batches = self.eval_batches if max_batches == -1 else max_batches
        total, count = 0.0, 0
        # batches of the global batch size: the same windows whatever the number of processes
        device = device_of(model)
        rows = self.batch_size * self.world_size
        memory = None
        if self.memory_len:  # Transformer-XL: consecutive segments of streams over the split, with the memory
            if stride is not None:
                raise DataError("strided evaluation re-reads overlapping windows; a model with a Transformer-XL "
                                "memory is evaluated over consecutive segments instead (leave out --stride)")
            memory = model.create_cache(rows)
            segments = self.dataset.streams(split, rows, self.seq_len)
            segments = segments if max_batches is None else min(segments, max(0, max_batches))
            batches = ((*self.dataset.stream_batch(split, rows, self.seq_len, j), None) for j in range(segments))
        elif stride is None:
            batches = ((x, y, None) for x, y in self.dataset.iter_batches(split, rows, self.seq_len, max_batches))
        else:
            batches = self.dataset.iter_strided(split, rows, self.seq_len, stride, max_batches)
        pondering, ponder_total = ponders(model), 0.0
        for x, y, scored in batches:
            x, y = x.to(device), y.to(device)
            if pondering:  # (the loss stays the plain cross-entropy; the mean ponder count is reported)
                logits, ponder = model.forward_ponder(x)
            else:
                logits = model(x, cache=memory) if memory is not None else model(x)
            if scored is not None:  # strided: the targets an earlier window scored are left out (ignore_index)
                y = y.masked_fill(~scored.to(device), -100)
            n = y.numel() if scored is None else int(scored.sum())
            total += cross_entropy(logits, y).item() * n
            if pondering:
                ponder_total += (ponder.sum() if scored is None else ponder[scored.to(device)].sum()).item()
            count += n
            if progress is not None:
                progress(n)
        if count == 0:
            raise DataError(f"the {split} split has fewer than {self.seq_len + 1} tokens: nothing to evaluate")
        loss = total / count
        out = {f"{split}_loss": loss, f"{split}_ppl": math.exp(min(loss, 50.0)), "tokens": count}
        if pondering:  # the mean ponder count N + R per scored token
            out[f"{split}_ponder"] = ponder_total / count
        return out
