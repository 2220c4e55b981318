"""Translation: an encoder-decoder trained on line-aligned sentence pairs.

Batches are built by token count from length buckets (fairseq's ``--max-tokens``), the loss is
label-smoothed cross-entropy over the target tokens (padding ignored), and evaluation reports the
validation loss and, by decoding the validation sources, sacreBLEU.

Data layout (the bundled Multi30k)::

    data/multi30k/{train,val,test2016}.{de,en}     # data.dir, data.source_lang, data.target_lang

:func:`translate` turns sentences into translations with any model that has ``decoder_for`` (greedy or
beam search), batching sentences of similar length.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..config import check
from ..data.parallel import ParallelBatch, ParallelDataset, read_parallel
from ..data.tokenizers import TRANSLATION_EOS_TOKEN, Tokenizer
from ..devices import device_of, to_device
from ..errors import ConfigError, DataError, GenerationError
from ..models.factory import create_model, model_config_from_dict
from ..models.nat_kinds import decoding_options
from ..models.registry import MODELS, decoding_of, ponders
from .losses import cross_entropy
from .registry import TASKS, Sharded

DEFAULT_BEAM = 5  # translate()'s beam, and the CLI's (translate, evaluate, distill): the README's BLEU is beam 5
TRANSLATION_FORMATS = ("text", "hf")
TEACHER_FORCED = ("encoder_decoder", "semi_autoregressive")  # the decoding kinds this task trains: model(source,
#   target_in) gives the logits of target_out


@dataclass
class TranslationDataConfig:
    dir: str = "data/multi30k"  # folder holding <split>.<lang> files; with format hf, each split as a local
    #   <split>.parquet | .jsonl | .json | .csv | .arrow file or save_to_disk folder, or a save_to_disk DatasetDict
    source_lang: str = "de"  # the source files' suffix: <split>.de
    target_lang: str = "en"  # the target files' suffix: <split>.en
    train: str = "train"  # split names (file stems)
    valid: str = "val"  # the validation split (val_loss, val_bleu)
    test: list[str] = field(default_factory=lambda: ["test2016"])  # test splits (tokenloom evaluate --split)
    vocab_size: int = 8000  # joint source/target byte-level BPE
    max_source_len: int = 128  # positions (tokens + EOS); longer training pairs are dropped
    max_target_len: int = 128  # positions (BOS + tokens / tokens + EOS)
    max_tokens: int = 4096  # tokens per batch: batch size x padded length, source or target
    empty_lines: str = "error"  # error | skip
    bleu: bool = True  # decode the validation sources at each evaluation and report val_bleu
    bleu_beam: int = 1  # beam size of that decoding (1 = greedy)
    bleu_sentences: int | None = None  # decode only the first N validation sentences (None = all)
    format: str = "text"  # text: line-aligned <split>.<lang> files | hf: tables read with Hugging Face datasets
    #   (nothing is downloaded), their pairs written as such files under the run's data folder
    source_field: str = "source"  # format hf: the column of source sentences
    target_field: str = "target"  # format hf: the column of target sentences
    translation_field: str = "translation"  # format hf, without source_field/target_field columns: a column of
    #   {language: sentence} mappings (Hugging Face's wmt layout), read at source_lang and target_lang

    def __post_init__(self) -> None:
        check(self.format in TRANSLATION_FORMATS,
              f"data.format must be one of {', '.join(TRANSLATION_FORMATS)}, got {self.format!r}")
        for name in ("source_field", "target_field", "translation_field"):
            value = getattr(self, name)
            check(isinstance(value, str) and bool(value), f"data.{name} must name a column, got {value!r}")
        check(self.vocab_size >= 260, f"data.vocab_size must be at least 260, got {self.vocab_size}")
        check(self.max_tokens >= 16, f"data.max_tokens must be at least 16, got {self.max_tokens}")
        check(self.empty_lines in ("error", "skip"), f"data.empty_lines must be 'error' or 'skip', got "
                                                       f"{self.empty_lines!r}")
        check(self.bleu_beam >= 1, f"data.bleu_beam must be >= 1, got {self.bleu_beam}")
        check(self.source_lang != self.target_lang, f"data.source_lang and data.target_lang are both "
                                                    f"{self.source_lang!r}")

    def files(self, split: str) -> tuple[Path, Path]:
        root = Path(self.dir)
        return root / f"{split}.{self.source_lang}", root / f"{split}.{self.target_lang}"

    def aligned_files(self, split: str, work_dir: Path) -> tuple[Path, Path]:
        """The (source, target) files of ``split``: :meth:`files`, or with ``format: hf`` the split's pairs
        (:func:`~tokenloom.data.hf_datasets.read_pairs`) written as line-aligned ``work_dir/hf/<split>.<lang>`` files
        (a line break inside a sentence made a space), which the text format's readers and caches then take."""
        if self.format != "hf":
            return self.files(split)
        from ..data.hf_datasets import one_line, read_pairs, split_table, write_text

        setting = "data.train" if split == self.train else "data.valid" if split == self.valid else "data.test"
        pairs = read_pairs(split_table(self.dir, split, setting), source_field=self.source_field,
                           target_field=self.target_field, translation_field=self.translation_field,
                           source_lang=self.source_lang, target_lang=self.target_lang)
        folder = Path(work_dir) / "hf"
        return tuple(write_text(folder / f"{split}.{lang}", "".join(one_line(pair[side]) + "\n" for pair in pairs))
                     for side, lang in enumerate((self.source_lang, self.target_lang)))

    def read_pairs(self, split: str) -> list[tuple[str, str]]:
        """The (source, target) sentences of ``split`` in either format (empty ones as ``empty_lines`` says)."""
        if self.format != "hf":
            return read_parallel(*self.files(split), empty_lines=self.empty_lines)
        with tempfile.TemporaryDirectory(prefix="tokenloom-hf-") as tmp:
            return read_parallel(*self.aligned_files(split, Path(tmp)), empty_lines=self.empty_lines)

    @property
    def splits(self) -> list[str]:
        return list(dict.fromkeys([self.train, self.valid, *self.test]))


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """pad/bos/eos ids of a translation tokenizer (``<pad>``, ``<s>``, ``</s>``); a one-line error when one
    is missing."""
    ids = {"pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id,
           "eos_id": tokenizer.token_to_id(TRANSLATION_EOS_TOKEN)}
    if None in ids.values():
        raise ConfigError("a translation tokenizer needs <pad>, <s> and </s> tokens; this one lacks "
                          + ", ".join(name for name, value in ids.items() if value is None))
    return ids


@TASKS.register("translation")
class TranslationTask(Sharded):
    """Token-count batches of sentence pairs; label-smoothed cross-entropy; val loss and BLEU."""

    data_config_cls = TranslationDataConfig
    default_family = "seq2seq"

    def __init__(self, dataset: ParallelDataset, data: TranslationDataConfig, tokenizer: Tokenizer, *,
                 seed: int = 0, label_smoothing: float = 0.0, eval_batches: int | None = None) -> None:
        self.dataset, self.data, self.tokenizer = dataset, data, tokenizer
        self.ids = special_ids(tokenizer)
        self.seed, self.label_smoothing, self.eval_batches = seed, label_smoothing, eval_batches
        self.epoch, self.position = 0, 0
        self._batches: list[list[int]] | None = None
        self.step = 0  # the trainer's step (scheduled sampling reads it)
        self.scheduled_sampling = None  # a ScheduledSamplingConfig, set by setup

    @classmethod
    def setup(cls, data: TranslationDataConfig, model_section: dict[str, Any], run_dir: Path, *, batch_size: int,
              seq_len: int | None, label_smoothing: float, eval_batches: int | None,
              tokenizer: Tokenizer | None = None, seed: int = 0,
              scheduled_sampling: Any = None) -> tuple[TranslationTask, nn.Module, Tokenizer, dict[str, Any]]:
        """Joint BPE (trained on the training pairs unless given), encoded splits under ``run_dir/data``,
        and the model with its vocabulary and special ids taken from the tokenizer."""
        tokenizer, dataset = cls.prepare_data(data, run_dir, tokenizer)
        ids = special_ids(tokenizer)
        vocab = model_section.get("vocab_size") or tokenizer.vocab_size
        check(vocab >= tokenizer.vocab_size,
              f"model.vocab_size={vocab} is smaller than the tokenizer's {tokenizer.vocab_size} ids")
        section = {"family": "seq2seq", **model_section, "vocab_size": vocab, **ids,
                   "max_source_len": max(model_section.get("max_source_len", 0), data.max_source_len),
                   "max_target_len": max(model_section.get("max_target_len", 0), data.max_target_len)}
        family, model_config = model_config_from_dict(section)
        model_cls = MODELS.get(family)[1]
        kind = decoding_of(model_cls)
        if kind not in TEACHER_FORCED:
            families = [name for name in MODELS.names() if decoding_of(MODELS.get(name)[1]) in TEACHER_FORCED]
            raise ConfigError(f"task 'translation' needs an autoregressive encoder-decoder model (family "
                              f"{', '.join(families)}), got {family!r}"
                              + (" (train it with task nat_translation)" if family == "nat" else ""))
        if scheduled_sampling is not None and kind != "encoder_decoder":
            raise ConfigError(f"train.scheduled_sampling feeds an autoregressive decoder its own predictions; family "
                              f"{family!r} decodes several tokens per step (set train.scheduled_sampling.schedule: "
                              "none)")
        model = create_model(family, model_config)
        task = cls(dataset, data, tokenizer, seed=seed, label_smoothing=label_smoothing, eval_batches=eval_batches)
        task.scheduled_sampling = scheduled_sampling
        return task, model, tokenizer, {"family": family, **{k: v for k, v in section.items() if k != "family"}}

    @staticmethod
    def prepare_data(data: TranslationDataConfig, run_dir: Path,
                     tokenizer: Tokenizer | None) -> tuple[Tokenizer, ParallelDataset]:
        """The tokenizer (a joint BPE trained on the training pairs unless given) and every split encoded
        under ``run_dir/data``."""
        files = {split: data.aligned_files(split, Path(run_dir) / "data") for split in data.splits}
        if tokenizer is None:
            pairs = read_parallel(*files[data.train], empty_lines=data.empty_lines)
            tokenizer = Tokenizer.train_joint_bpe([text for pair in pairs for text in pair], data.vocab_size)
        dataset = ParallelDataset.prepare(files, tokenizer,
                                          Path(run_dir) / "data", max_source_len=data.max_source_len,
                                          max_target_len=data.max_target_len, empty_lines=data.empty_lines,
                                          train_splits=(data.train,))
        return tokenizer, dataset

    # ---- training -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._batches = None

    def _epoch_batches(self) -> list[list[int]]:
        if self._batches is None:
            self._batches = self.dataset.batches(self.data.train, self.data.max_tokens, shuffle=True, seed=self.seed,
                                                 epoch=self.epoch)
            if not self._batches:
                raise DataError(f"the {self.data.train!r} split has no pairs within the length limits")
        return self._batches

    def get_batch(self, generator: torch.Generator | None = None) -> ParallelBatch:
        """The next training batch (the order is fixed by the seed and epoch, so resuming is exact).
        Distributed: each step takes ``world_size`` consecutive batches of the epoch, one per rank (an epoch's
        last batches that do not fill a step are left out)."""
        batches = self._epoch_batches()
        if self.position + self.world_size > len(batches):
            self.epoch, self.position, self._batches = self.epoch + 1, 0, None
            batches = self._epoch_batches()
            if len(batches) < self.world_size:
                raise DataError(f"the {self.data.train!r} split makes {len(batches)} batches of data.max_tokens="
                                f"{self.data.max_tokens}, fewer than the {self.world_size} processes")
        indices = batches[self.position + self.rank]
        self.position += self.world_size
        return self.dataset.collate(self.data.train, indices, **self.ids)

    def loss(self, model: nn.Module, batch: ParallelBatch) -> tuple[Tensor, int]:
        teacher = self.scheduled_sampling.teacher_probability(self.step) if self.scheduled_sampling else 1.0
        ponder = None
        if teacher < 1.0 and model.training:
            memory, ponder = model.encode_ponder(batch.source, batch.source_mask) if ponders(model) else (None, None)
            logits = self._scheduled_sampling_logits(model, batch, 1.0 - teacher, memory)
        elif ponders(model):  # adaptive computation time in the encoder: (B, T, V) logits, (B, S) ponder counts
            logits, ponder = model.forward_ponder(batch.source, batch.target_in, batch.source_mask)
        else:
            logits = model(batch.source, batch.target_in, batch.source_mask)  # (B, T, V)
        loss = cross_entropy(logits, batch.target_out, label_smoothing=self.label_smoothing,
                             ignore_index=self.ids["pad_id"])
        if ponder is not None:  # + tau * the mean ponder count N + R of the real source positions
            loss = loss + model.ponder_cost * source_mean(ponder, batch.source_mask)
        return loss, batch.num_target_tokens

    def _scheduled_sampling_logits(self, model: nn.Module, batch: ParallelBatch, replace: float,
                                   memory: Tensor | None = None) -> Tensor:
        """Two passes (see ScheduledSamplingConfig): gold inputs -> predictions -> mixed inputs -> logits, over
        ``memory`` (the sources encoded; None: encoded here)."""
        if memory is None:
            memory = model.encode(batch.source, batch.source_mask)
        with torch.no_grad():
            first = model.decode(batch.target_in, memory, batch.source_mask)  # (B, T, V)
            if self.scheduled_sampling is not None and self.scheduled_sampling.sample:
                predicted = torch.multinomial(first.float().softmax(-1).flatten(0, 1), 1).view(first.shape[:2])
            else:
                predicted = first.argmax(-1)  # position t predicts the token at t + 1
            mixed = batch.target_in.clone()
            swap = torch.rand(mixed[:, 1:].shape, device=mixed.device) < replace
            swap &= batch.target_mask[:, 1:].bool()  # never the padding
            mixed[:, 1:] = torch.where(swap, predicted[:, :-1], mixed[:, 1:])
        return model.decode(mixed, memory, batch.source_mask)

    # ---- evaluation ---------------------------------------------------------------------------

    def eval_split_batches(self, split: str | None = None) -> int:
        """How many batches :meth:`evaluate` reads from the whole of ``split`` (default: the validation split)."""
        return len(self.dataset.batches(split or self.data.valid, self.data.max_tokens, shuffle=False))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, max_batches: int | None = -1, split: str | None = None) -> dict[str, float]:
        """``{split}_loss`` (no label smoothing), ``{split}_ppl``, ``{split}_ece`` (expected calibration error of
        the next-token predictions under teacher forcing, percent), for a model that ponders ``{split}_ponder`` (the
        mean ponder count of the real source positions) and, with ``data.bleu``, ``{split}_bleu``."""
        from ..evaluation import expected_calibration_error

        split = split or self.data.valid
        name = "val" if split == self.data.valid else split
        max_batches = self.eval_batches if max_batches == -1 else max_batches
        total, count = 0.0, 0
        confidences, corrects = [], []
        device = device_of(model)
        pondering, ponder_total, source_tokens = ponders(model), 0.0, 0
        for i, indices in enumerate(self.dataset.batches(split, self.data.max_tokens, shuffle=False)):
            if max_batches is not None and i >= max_batches:
                break
            batch = to_device(self.dataset.collate(split, indices, **self.ids), device)
            if pondering:  # (the loss stays the plain cross-entropy; the mean ponder count is reported)
                logits, ponder = model.forward_ponder(batch.source, batch.target_in, batch.source_mask)
                ponder_total += float(ponder.sum())  # (0 at padding)
                source_tokens += int(batch.source_mask.sum())
            else:
                logits = model(batch.source, batch.target_in, batch.source_mask)
            n = batch.num_target_tokens
            total += cross_entropy(logits, batch.target_out, ignore_index=self.ids["pad_id"]).item() * n
            count += n
            real = batch.target_out != self.ids["pad_id"]
            confidence, predicted = logits[real].float().softmax(-1).max(-1)
            confidences.append(confidence)
            corrects.append(predicted == batch.target_out[real])
        if count == 0:
            raise DataError(f"the {split!r} split is empty: nothing to evaluate")
        loss = total / count
        metrics = {f"{name}_loss": loss, f"{name}_ppl": math.exp(min(loss, 50.0)),
                   f"{name}_ece": expected_calibration_error(torch.cat(confidences), torch.cat(corrects)),
                   "tokens": count}
        if pondering:  # the mean ponder count N + R per real source position
            metrics[f"{name}_ponder"] = ponder_total / max(source_tokens, 1)
        if self.data.bleu:
            from ..evaluation import compute_metrics

            sources = self.dataset.sentences(split, "source")
            references = self.dataset.sentences(split, "target")
            if self.data.bleu_sentences is not None:
                sources, references = sources[:self.data.bleu_sentences], references[:self.data.bleu_sentences]
            hypotheses = translate(model, self.tokenizer, sources, beam=self.data.bleu_beam,
                                   max_tokens=self.data.max_tokens)
            metrics[f"{name}_bleu"] = compute_metrics(["bleu"], hypotheses, references).scores["bleu"]
        return metrics


def source_mean(values: Tensor, source_mask: Tensor | None) -> Tensor:
    """The mean of (B, S) per-source-position ``values`` over the real positions (``source_mask`` 1; None: all)."""
    if source_mask is None:
        return values.mean()
    mask = source_mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def encode_sources(model: nn.Module, tokenizer: Tokenizer, sentences: list[str], *,
                   truncate: bool = True) -> list[list[int]]:
    """Source ids (tokens + EOS) of each sentence; one longer than the model's source limit is truncated with
    a warning (``truncate``) or refused with a one-line error."""
    eos = special_ids(tokenizer)["eos_id"]
    limit = model.config.max_source_len
    encoded, truncated = [], 0
    for i, text in enumerate(sentences):
        tokens = tokenizer.encode(text)
        if len(tokens) + 1 > limit:
            if not truncate:
                raise GenerationError(f"sentence {i + 1} has {len(tokens) + 1} tokens, more than the model's "
                                      f"source limit of {limit}")
            tokens, truncated = tokens[:limit - 1], truncated + 1
        encoded.append(tokens + [eos])
    if truncated:
        import warnings

        warnings.warn(f"{truncated} source sentence(s) longer than the model's limit of {limit} tokens were "
                      f"truncated", stacklevel=3)
    return encoded


def source_batches(encoded: list[list[int]], max_tokens: int, pad_id: int, *, rows_per_sentence: int = 1,
                   device: torch.device | str = "cpu") -> Iterator[tuple[list[int], Tensor, Tensor]]:
    """Sentences sorted by length in batches of at most ``max_tokens`` padded source tokens (times
    ``rows_per_sentence``): (their indices, source ids (B, S) right-padded, mask (B, S))."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * len(encoded[order[end]]) * rows_per_sentence <= max_tokens:
            end += 1
        chunk = order[start:end]
        S = max(len(encoded[i]) for i in chunk)
        source = torch.full((len(chunk), S), pad_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), S, dtype=torch.long)
        for row, i in enumerate(chunk):
            source[row, :len(encoded[i])] = torch.tensor(encoded[i])
            mask[row, :len(encoded[i])] = 1
        yield chunk, source.to(device), mask.to(device)
        start = end


def translate(model: nn.Module, tokenizer: Tokenizer, sentences: list[str], *, beam: int | None = None,
              length_penalty: float = 1.0, max_tokens: int = 4096, max_len_a: float = 1.5, max_len_b: int = 10,
              no_repeat_ngram_size: int = 0, truncate: bool = True, iterations: int | None = None,
              length_beam: int | None = None, rescorer: nn.Module | None = None,
              progress: Callable[[int], object] | None = None, rounds: list[int] | None = None,
              speculation: Speculation | None = None, counts: TokenCounts | None = None) -> list[str]:
    """Translate ``sentences`` (in order) with an encoder-decoder: beam search with ``beam`` beams (default
    :data:`DEFAULT_BEAM`, 5, as ``tokenloom translate``; ``beam=1`` is greedy); a non-autoregressive model
    (:mod:`tokenloom.models.nat`) decodes in parallel instead, with the options its kind takes
    (``NATKind.options``: ``iterations`` for cmlm, ``length_beam`` and ``rescorer`` for nat and cmlm; defaults 10
    and 3; see :func:`tokenloom.generation.nat.nat_decode`) and no beam; a semi-autoregressive one
    (:mod:`tokenloom.models.semi_ar`) K tokens per step, greedy (beam 1, its default). The model's decoding kind
    picks the batch decoding (:data:`BATCH_DECODINGS`).

    Sentences are sorted by length and batched up to ``max_tokens`` source tokens (times the beam); each
    batch generates at most ``max_len_a * source_length + max_len_b`` tokens (capped by the model's
    target limit). A source longer than the model's limit is truncated with a warning (``truncate``) or
    refused with a one-line error. Options of the other kind of model are refused with a one-line error.
    ``progress``, when given, is called after each batch with the number of sentences it translated. ``rounds``,
    when given, gets the decoder rounds each sentence used appended (in batch order) by the decodings that count
    them: a parallel model's (:func:`tokenloom.generation.nat.nat_decode`), a semi-autoregressive one's steps.
    ``speculation`` (greedy autoregressive decoding only): speculative decoding of each batch
    (:class:`Speculation`: a draft encoder-decoder, bound to the same sources, or prompt lookup over the source and
    the output), the same translations. ``counts``, when given, gets the sentences, source and new tokens added
    (:class:`TokenCounts`).
    """
    from ..nn.modes import eval_mode

    kind = decoding_of(model)
    if kind not in BATCH_DECODINGS:
        raise ConfigError(f"translation needs an encoder-decoder model, got {type(model).__name__}")
    c = model.config
    parallel = kind == "parallel"
    if beam is None:
        beam = default_beam(model)
    parallel_options = check_decoding_options(model, beam=beam, iterations=iterations, length_beam=length_beam,
                                              rescorer=rescorer)
    if speculation is not None and (kind != "encoder_decoder" or beam != 1):
        raise ConfigError("speculative decoding (a draft model or prompt lookup) applies to greedy autoregressive "
                          f"translation (beam 1), not to {'beam search' if beam != 1 else f'{kind} decoding'}")
    ids = special_ids(tokenizer)
    encoded = encode_sources(model, tokenizer, sentences, truncate=truncate)
    results: list[str] = [""] * len(encoded)
    device = device_of(model)
    rows = parallel_options.get("length_beam", 1) if parallel else beam
    decode_batch = BATCH_DECODINGS[kind]
    with eval_mode(model):
        for chunk, source, mask in source_batches(encoded, max_tokens, ids["pad_id"], rows_per_sentence=rows,
                                                  device=device):
            new = min(c.max_target_len - 1, int(max_len_a * source.shape[1] + max_len_b))
            request = BatchRequest(new, ids, beam, length_penalty, no_repeat_ngram_size, parallel_options, rescorer,
                                   rounds, speculation)
            outputs = decode_batch(model, source, mask, request)
            for i, tokens in zip(chunk, outputs, strict=True):
                results[i] = tokenizer.decode(tokens).strip()
            if counts is not None:
                counts.add(len(chunk), sum(len(encoded[i]) for i in chunk), sum(len(t) for t in outputs))
            if progress is not None:
                progress(len(chunk))
    return results


@dataclass
class TokenCounts:
    """What :func:`translate` read and wrote, added up over the calls it is given to: ``sentences`` translated,
    ``source_tokens`` (each source's end-of-sentence token included, no padding) and ``new_tokens`` (the tokens of
    the translations, as decoded: no end-of-sentence token)."""

    sentences: int = 0
    source_tokens: int = 0
    new_tokens: int = 0

    def add(self, sentences: int, source_tokens: int, new_tokens: int) -> None:
        self.sentences += sentences
        self.source_tokens += source_tokens
        self.new_tokens += new_tokens


class BatchRequest(NamedTuple):
    """What :func:`translate` asks of one batch's decoding; each decoding kind reads the fields it takes."""

    max_new_tokens: int  # the batch's length cap (max_len_a * S + max_len_b, within the model's target limit)
    ids: dict[str, int]  # pad_id, bos_id, eos_id
    beam: int
    length_penalty: float
    no_repeat_ngram_size: int
    parallel_options: dict[str, int]  # a non-autoregressive model's options (check_decoding_options)
    rescorer: nn.Module | None
    rounds: list[int] | None  # gets the decoder rounds of each sentence appended, where the decoding counts them
    speculation: Speculation | None = None  # speculative greedy decoding (autoregressive decoding only)


class Speculation(NamedTuple):
    """Speculative decoding of :func:`translate`'s greedy batches (:mod:`tokenloom.generation.speculative`): a
    ``draft`` encoder-decoder of the same vocabulary (bound to each batch's sources as the model is) or prompt lookup
    of n-grams up to ``prompt_lookup`` over each sentence's source and output; ``tally`` adds up the passes."""

    draft: nn.Module | None = None
    prompt_lookup: int = 0
    num_draft_tokens: int = 4
    tally: object | None = None  # a tokenloom.generation.DraftTally


def _autoregressive_batch(model: nn.Module, source: Tensor, mask: Tensor, request: BatchRequest) -> list[list[int]]:
    """Greedy or beam search over (B, S) sources -> each sentence's tokens (no BOS, EOS, padding); its rounds: the
    decoder passes a sentence needs alone (its tokens and the EOS)."""
    from ..generation import GenerationConfig, generate

    ids = request.ids
    config = GenerationConfig(max_new_tokens=request.max_new_tokens, do_sample=False, num_beams=request.beam,
                              length_penalty=request.length_penalty,
                              no_repeat_ngram_size=request.no_repeat_ngram_size, eos_token_id=ids["eos_id"],
                              pad_token_id=ids["pad_id"])
    bos = torch.full((source.shape[0], 1), ids["bos_id"], dtype=torch.long, device=source.device)
    extra = {}
    spec = request.speculation
    if spec is not None:  # the drafter sees this batch's sources: a draft decoder bound to them, or their ids
        from ..generation import PromptLookup

        config = replace(config, num_draft_tokens=spec.num_draft_tokens)
        draft = spec.draft.decoder_for(source, mask) if spec.draft is not None else \
            PromptLookup(spec.prompt_lookup, context=source, context_mask=mask)
        extra = {"draft": draft, "draft_tally": spec.tally}
    out = generate(model.decoder_for(source, mask), bos, config, **extra)
    outputs = []
    for row in out[:, 1:].tolist():
        tokens = row[:row.index(ids["eos_id"])] if ids["eos_id"] in row else row
        outputs.append([t for t in tokens if t != ids["pad_id"]])
    if request.rounds is not None:  # one decoder pass per token, the EOS included (alone at batch 1)
        request.rounds.extend(min(len(tokens) + 1, request.max_new_tokens) for tokens in outputs)
    return outputs


def _parallel_batch(model: nn.Module, source: Tensor, mask: Tensor, request: BatchRequest) -> list[list[int]]:
    """A non-autoregressive model's parallel decoding (:func:`tokenloom.generation.nat.nat_decode`)."""
    from ..generation.nat import nat_decode

    return nat_decode(model, source, mask, **request.parallel_options, rescorer=request.rescorer,
                      rounds=request.rounds)


def _semi_autoregressive_batch(model: nn.Module, source: Tensor, mask: Tensor,
                               request: BatchRequest) -> list[list[int]]:
    """K tokens per step, greedy (:func:`tokenloom.generation.semi_ar.semi_ar_decode`); padding ids dropped, as
    the autoregressive decoding drops them."""
    from ..generation.semi_ar import semi_ar_decode

    out = semi_ar_decode(model, source, mask, max_new_tokens=request.max_new_tokens)
    if request.rounds is not None:
        request.rounds.extend(out.steps)
    return [[t for t in tokens if t != request.ids["pad_id"]] for tokens in out.tokens]


# decoding kind (tokenloom.models.registry.DECODERS) -> how translate() decodes one batch of sources
BATCH_DECODINGS: dict[str, Callable[[nn.Module, Tensor, Tensor, BatchRequest], list[list[int]]]] = {
    "encoder_decoder": _autoregressive_batch, "parallel": _parallel_batch,
    "semi_autoregressive": _semi_autoregressive_batch}


def default_beam(model: nn.Module) -> int:
    """translate()'s beam when none is given: :data:`DEFAULT_BEAM` for an autoregressive model, 1 (greedy) for one
    that decodes several tokens per step (parallel, semi-autoregressive)."""
    return DEFAULT_BEAM if decoding_of(model) == "encoder_decoder" else 1


def check_decoding_options(model: nn.Module, *, beam: int = 1, iterations: int | None = None,
                           length_beam: int | None = None, rescorer: nn.Module | None = None) -> dict[str, int]:
    """One-line errors for decoding options that the model does not take; for a non-autoregressive (parallel)
    model, the options of its kind with the defaults filled in (:func:`tokenloom.models.nat_kinds.decoding_options`:
    cmlm: iterations 10; nat and cmlm: length beam 3), else {}."""
    if decoding_of(model) != "parallel":
        for name, value in (("iterations", iterations), ("length_beam", length_beam), ("rescorer", rescorer)):
            if value is not None:
                raise ConfigError(f"{name.replace('_', ' ')} is an option of non-autoregressive models; this "
                                  "model is autoregressive (use beam)")
        if beam > 1 and decoding_of(model) == "semi_autoregressive":
            raise ConfigError(f"beam {beam}: a semi-autoregressive model decodes greedily (K tokens per step); "
                              "use beam 1")
        return {}
    return decoding_options(model.config.kind, beam=beam, iterations=iterations, length_beam=length_beam,
                            rescorer=rescorer)
