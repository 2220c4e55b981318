"""From a validated recipe to a ready :class:`Trainer` (fresh or resumed)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import torch

from ..checkpoint import (
    checkpoint_damage,
    load_model,
    load_tokenizer,
    load_weights,
    read_config,
    refuse_quantized,
    resolve_checkpoint,
)
from ..errors import CheckpointError, ChecksumError, ConfigError, VocabularyError
from ..models.transfer import transfer_weights, weight_map
from ..nn.lora import is_adapter
from ..tasks import TASKS
from .config import RunConfig
from .distributed import SINGLE, Distributed
from .lora import resume_lora, start_lora
from .trainer import HISTORY_DIR, Trainer


def setup_run(config: RunConfig, run_dir: str | Path, *, resume: bool = False,
              show_progress: bool | None = None, dist: Distributed = SINGLE) -> Trainer:
    """Tokenizer, data, model and Trainer for ``config`` in ``run_dir``. With ``resume`` the weights,
    tokenizer, optimizer, schedule, RNG states and step come from ``run_dir``'s checkpoint, so the run
    continues exactly where it stopped; the learning-rate schedule stays the one the run started with, whatever
    ``config.train`` says (a changed key that shapes it: a line in ``trainer.notices``). With ``train.init_from``
    (fine-tuning) a fresh run starts from another checkpoint's weights and tokenizer, its model settings
    overridden by the recipe's ``model``.
    Tasks without a tokenizer (``uses_tokenizer = False``: image classification) get None.

    Distributed (``dist``): rank 0 prepares the data (and trains the tokenizer) first; the other ranks then
    take its tokenizer and reuse the prepared files. Every rank builds the same initial weights (one seed);
    dropout streams differ per rank."""
    run_dir = Path(run_dir)
    t = config.train
    task_cls = TASKS.get(config.task)
    uses_tokenizer = getattr(task_cls, "uses_tokenizer", True)
    tokenizer = None
    checkpoint = None
    mapping = None  # train.init_from a checkpoint of another family: how its weights map (models.transfer)
    model_section = config.model
    if resume:
        checkpoint = newest_intact_checkpoint(run_dir)
        refuse_quantized(checkpoint, "resuming a run")
        tokenizer = load_tokenizer(checkpoint) if uses_tokenizer else None
    elif t.init_from:
        if not Path(t.init_from).exists():
            raise CheckpointError(f"train.init_from: checkpoint not found: {t.init_from} (train that run first, or "
                                  "--set train.init_from=CHECKPOINT)")
        checkpoint = resolve_checkpoint(t.init_from)
        refuse_quantized(checkpoint, "train.init_from (fine-tuning)")
        tokenizer = load_tokenizer(checkpoint) if uses_tokenizer else None
        teacher_section = read_config(checkpoint).get("model", {})
        family = config.model.get("family") or task_cls.default_family
        if teacher_section.get("family", family) != family:  # another family's checkpoint: its declared map
            mapping = weight_map(family, str(teacher_section.get("family")), f"train.init_from={t.init_from}")
        model_section = {**teacher_section, **config.model, **({"family": family} if mapping else {})}
    # before anything is written, prepared or allocated; a model whose sizes come from the data (an image
    # classifier's image_size, ...) once the data has fixed them
    sized_by_data = task_cls.model_stand_ins({"family": task_cls.default_family, **model_section}, config.data)
    if not sized_by_data:
        check_training_memory(config, model_section)
    check_writable(run_dir)  # before any data is prepared or a step is trained
    if t.threads:
        torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)
    if dist.active and not dist.is_main:
        tokenizer = dist.broadcast_object(None)  # waits until rank 0 has prepared the data
    extra = {"reference": t.init_from} if task_cls.needs_reference else {}  # the frozen reference's weights
    try:
        task, model, tokenizer, section = task_cls.setup(
            config.data_config, model_section, run_dir, batch_size=t.batch_size, seq_len=t.seq_len,
            label_smoothing=t.label_smoothing, eval_batches=t.eval_batches, tokenizer=tokenizer, seed=t.seed, **extra,
            **({"scheduled_sampling": t.scheduled_sampling} if t.scheduled_sampling.schedule != "none" else {}),
            **({"z_loss": t.z_loss} if t.z_loss else {}),
            **({"seq_len_warmup": t.seq_len_warmup, "seq_len_start": t.seq_len_start} if t.seq_len_warmup else {}))
    except VocabularyError as err:  # the data has characters the given tokenizer lacks: name what fixed it
        if tokenizer is None:
            raise
        fixed = "the resumed run's checkpoint fixes the tokenizer: resume on the data it trained on" if resume else (
            f"train.init_from={t.init_from} fixes the tokenizer: start from a model trained on data that has these "
            "characters")
        raise VocabularyError(f"{err}; {fixed}") from None
    if dist.active and dist.is_main:
        dist.broadcast_object(tokenizer)
    if sized_by_data:  # (every rank: each refuses alike)
        check_training_memory(config, section)
    if dist.rank:
        torch.manual_seed((t.seed + 1_000_003 * dist.rank) % 2**64)  # this rank's dropout stream (rank 0: seed's)
    if t.activation_checkpointing:
        model_config = getattr(model, "config", None)
        if not hasattr(model_config, "gradient_checkpointing"):
            raise ConfigError(f"train.activation_checkpointing: {type(model).__name__} models have no per-block "
                              "activation checkpointing (GPT and the encoder-decoder families do)")
        model_config.gradient_checkpointing = True
    adapter = None  # train.lora: the adapter's settings (a LoRA run resumed: its base and adapter are loaded here)
    transfer = None  # train.init_from another family's checkpoint: what was copied, what starts fresh
    if resume and checkpoint is not None and is_adapter(checkpoint):
        adapter = resume_lora(model, checkpoint, t.lora, task_cls.fresh_weights)
    elif mapping is not None:
        if t.lora.enabled:
            raise ConfigError(f"train.init_from={t.init_from}: a {mapping.teacher} checkpoint starts a "
                              f"{section.get('family')} model afresh; train.lora needs a checkpoint of the same family")
        teacher, _ = load_model(checkpoint)
        transfer = transfer_weights(model, teacher.state_dict(), mapping, f"train.init_from={t.init_from}")
    elif checkpoint is not None:  # before the Trainer takes float32 masters of the weights
        if resume and t.lora.enabled:
            raise CheckpointError(f"cannot resume with train.lora: {checkpoint} holds no adapter (the run trained "
                                  "the whole model); start a LoRA run with train.init_from instead")
        try:
            # fine-tuning may switch the attention backend: a performer's random features or a linformer's
            # projections, absent from a checkpoint trained with exact attention, start from their initial values
            # (and a task's new head, e.g. a reward model's score_head on a language model: task_cls.fresh_weights)
            # (not under LoRA: its checkpoints name the base weights instead of holding them, so all must be there)
            load_weights(model, checkpoint, fresh=None if resume else (
                lambda name: (".backend." in name and not t.lora.enabled) or name.startswith(task_cls.fresh_weights)))
        except CheckpointError as err:
            if resume or isinstance(err, ChecksumError):  # (a damaged file: no advice about the model section)
                raise
            raise ConfigError(f"train.init_from={t.init_from}: {err} (the recipe's model section may only change "
                              f"settings that keep the weights, e.g. dropout, attention)") from None
    if t.lora.enabled and adapter is None:  # a fresh LoRA run: base frozen (quantised), adapters put in
        adapter = start_lora(model, config, run_dir, section, tokenizer, checkpoint, task_cls.fresh_weights,
                             write=dist.is_main)
    trainer = Trainer(config, model, task, run_dir, tokenizer=tokenizer, model_section=section,
                      show_progress=show_progress, dist=dist, adapter=adapter)
    if transfer is not None:
        trainer.notices.append(f"train.init_from={t.init_from} ({mapping.teacher} -> {section.get('family')}): "
                               f"{transfer.summary()}")
    if resume:
        trainer.load_state(checkpoint)
    return trainer


VOCABULARY_STAND_IN = 256  # the vocabulary size counted before the tokenizer is known (a lower bound)


def check_training_memory(config: RunConfig, model_section: dict) -> None:
    """Refuse a run that cannot fit in this machine's memory before any data is prepared: its weights, gradients,
    optimizer moments and activations (:func:`tokenloom.models.sizes.training_parts`) against
    :func:`tokenloom.budget.memory_limit`; one line naming the setting of the largest part."""
    from ..budget import check_memory
    from ..models.factory import model_config_from_dict
    from ..models.registry import MODELS
    from ..models.sizes import training_parts

    section = {"family": TASKS.get(config.task).default_family, **model_section}
    config_cls, _ = MODELS.get(section["family"])
    if "vocab_size" in {f.name for f in dataclasses.fields(config_cls)}:
        section.setdefault("vocab_size", VOCABULARY_STAND_IN)  # from the tokenizer, later
    _, model_config = model_config_from_dict(section)
    t = config.train
    parts = training_parts(model_config, t.batch_size, t.seq_len, activation_checkpointing=t.activation_checkpointing)
    if parts:
        largest = max(parts, key=lambda p: p.bytes)
        check_memory(f"{largest.setting}: training", ((p.what, p.bytes) for p in parts))


def newest_intact_checkpoint(run_dir: Path) -> Path:
    """The checkpoint to resume from: ``<run>/checkpoint`` when its checksums hold, else (with a warning naming
    the damage) the newest intact one in ``<run>/history``; a one-line error when none is intact."""
    candidates = [run_dir / "checkpoint", run_dir / "checkpoint.old"]
    candidates += sorted((run_dir / HISTORY_DIR).glob("step-*"), reverse=True)
    candidates = [c for c in candidates if (c / "config.yaml").is_file()]
    if not candidates:
        return resolve_checkpoint(run_dir)  # its one-line error (or run_dir is a checkpoint itself)
    damaged = []
    for candidate in candidates:
        damage = checkpoint_damage(candidate)
        if damage is None:
            if damaged:
                warnings.warn(f"resuming from {candidate}: " + "; ".join(damaged), stacklevel=3)
            return candidate
        damaged.append(f"{candidate.name} is damaged ({damage})")
    raise CheckpointError(f"no intact checkpoint to resume from in {run_dir}: " + "; ".join(damaged))


def check_writable(run_dir: Path) -> None:
    """Create ``run_dir`` if needed and prove it takes files; a one-line error otherwise."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write the run directory {run_dir}: {err.strerror or err}") from None
