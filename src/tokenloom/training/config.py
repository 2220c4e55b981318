"""The run recipe: ``task``, ``model``, ``data`` and ``train`` sections of a YAML file.

Example (configs/shakespeare-char.yaml)::

    task: lm
    model: {family: gpt, num_layers: 6, num_heads: 6, embed_dim: 384, max_seq_len: 256}
    data: {path: data/tinyshakespeare/input.txt, tokenizer: char}
    train: {max_steps: 2000, batch_size: 16, lr: 1.0e-3, precision: auto}
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..config import (
    ConfigProblems,
    apply_overrides,
    check,
    check_choice,
    did_you_mean,
    from_dict,
    gather,
    load_yaml,
    raise_problems,
    to_dict,
    unique_problems,
)
from ..devices import DEVICE
from ..errors import CheckpointError, ConfigError, DataError
from ..models.factory import model_config_from_dict
from ..models.registry import MODELS
from ..nn.lora import DEFAULT_TARGETS as DEFAULT_LORA_TARGETS
from ..nn.lora import check_targets as check_lora_targets
from ..packaged import resolve_recipe, where_bundled
from ..tasks import TASKS
from .clock import CLOCKS
from .distributed import BACKENDS, STRATEGIES
from .optim import OPTIMIZERS
from .schedules import SCHEDULES
from .tensorboard_log import LOG_TARGETS


@dataclass
class ScheduledSamplingConfig:
    """Scheduled sampling for encoder-decoders (Bengio et al. 2015), in the two-pass form for Transformers
    (Mihaylova & Martins 2019): a first decoder pass with the gold inputs (no gradient) predicts every
    position; each decoder input after BOS is then replaced by the model's prediction with probability
    ``1 - teacher``, and the second pass, whose loss is trained, reads the mixed inputs.

    The teacher-forcing probability at step i: ``linear`` max(min_teacher, 1 - i / k); ``exponential``
    max(min_teacher, k ** i) (k < 1); ``inverse_sigmoid`` max(min_teacher, k / (k + exp(i / k))); ``none``
    always 1 (plain teacher forcing)."""

    schedule: Literal["none", "linear", "exponential", "inverse_sigmoid"] = "none"  # how the teacher-forcing
    #   probability decays over the steps (none: plain teacher forcing)
    k: float = 1000.0  # the decay constant of the schedule (exponential: in (0, 1))
    min_teacher: float = 0.75  # never replace more than 1 - min_teacher of the inputs
    sample: bool = False  # replace with a token sampled from the prediction (default: its argmax)

    def __post_init__(self) -> None:
        check(0.0 <= self.min_teacher <= 1.0, f"train.scheduled_sampling.min_teacher must be in [0, 1], got "
                                              f"{self.min_teacher}")
        check(self.k > 0, f"train.scheduled_sampling.k must be positive, got {self.k}")
        if self.schedule == "exponential":
            check(self.k < 1, f"train.scheduled_sampling.k must be in (0, 1) for 'exponential', got {self.k}")

    def teacher_probability(self, step: int) -> float:
        import math

        if self.schedule == "linear":
            p = 1.0 - step / self.k
        elif self.schedule == "exponential":
            p = self.k ** step
        elif self.schedule == "inverse_sigmoid":
            p = self.k / (self.k + math.exp(min(step / self.k, 700.0)))
        else:
            return 1.0
        return max(self.min_teacher, min(1.0, p))


@dataclass
class LoRAConfig:
    """Low-rank adapters (``train.lora``, :mod:`tokenloom.nn.lora`): with ``rank`` > 0 the model's weights are frozen
    and only an update ``(alpha / rank) * B @ A`` of each target linear layer trains; checkpoints hold the adapter
    (adapter.safetensors + adapter.json) and name the base weights instead of copying them; loading one for
    generation, evaluation or serving gives the base with the adapter merged (docs/alignment.md)."""

    rank: int = 0  # r of each update B @ A (8 or 16 are usual); 0 = off (the whole model trains)
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input (training only)
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))  # linear layers to adapt, by
    #   qualified name: fnmatch globs (a glob without a dot also matches a name's last part: out_proj) or re:REGEX;
    #   the default: attention's projections and the MLP's layers
    quantize_base: Literal["int8", "int4"] | None = None  # QLoRA: quantise the frozen base of every adapted layer
    #   (int8 per output channel; int4 in groups of input columns) at the start of the run; the adapters train in
    #   float

    def __post_init__(self) -> None:
        check(isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank >= 0,
              f"train.lora.rank must be an integer >= 0 (0 = off), got {self.rank!r}")
        check(self.alpha > 0, f"train.lora.alpha must be positive, got {self.alpha}")
        check(0.0 <= self.dropout < 1.0, f"train.lora.dropout must be in [0, 1), got {self.dropout}")
        check_lora_targets(self.targets)
        check(self.quantize_base is None or self.rank > 0,
              f"train.lora.quantize_base={self.quantize_base} needs train.lora.rank > 0 (QLoRA trains adapters over "
              "the quantised base)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class TrainConfig:
    """The ``train:`` section of a recipe: optimisation, schedule, precision, evaluation and checkpoints (every key
    with its default: the recipe reference, docs/reference/recipes.md)."""

    max_steps: int = 2000  # optimizer updates
    batch_size: int = 16  # sequences (images) per micro-batch
    seq_len: int | None = None  # tokens per sequence; None = model.max_seq_len
    grad_accum_steps: int = 1  # micro-batches per optimizer update
    lr: float = 1e-3  # peak learning rate
    min_lr: float | None = None  # final learning rate of cosine/linear decay; None = lr / 10
    warmup_steps: int = 100  # linear warmup from 0
    schedule: str = "cosine"  # cosine | linear | constant | inverse_sqrt | wsd
    decay_fraction: float = 0.2  # wsd: the last fraction of max_steps that decays linearly to min_lr (warmup,
    #   then the peak held constant, then the decay; Hägele et al. 2024); other schedules ignore it
    optimizer: str = "adamw"  # adamw | muon: Muon (torch.optim.Muon, as the modded-nanogpt speedrun) for the Linear
    #   weights inside the model's block stack (attention and MLP projections), AdamW for the rest (embeddings, head,
    #   norms, biases); docs/experiments.md measures it
    muon_lr: float = 0.02  # muon: Muon's peak learning rate (the same schedule multiplier as lr)
    z_loss: float = 0.0  # language models: add z_loss * mean(logsumexp(logits)^2) to the loss (PaLM: 1e-4); 0 = off
    weight_decay: float = 0.1  # AdamW decoupled weight decay (matrices only)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])  # AdamW betas
    grad_clip: float | None = 1.0  # max global gradient norm; None = off
    keep_checkpoints: int = 1  # checkpoints kept: <run>/checkpoint and the previous ones in <run>/history
    max_nonfinite: int = 10  # a NaN/Inf loss or gradient skips the update; this many in a row stop the run (0: never)
    label_smoothing: float = 0.0  # 0.1 in the original Transformer
    precision: Literal["auto", "fp32", "bf16", "bf16-autocast", "fp16"] = "auto"  # bf16: bf16 model, fp32 master
    #   weights; auto: on a CPU bf16 where it has native bf16 matrix instructions (AMX, AVX512-BF16), else fp32; on
    #   a CUDA GPU bf16-autocast (fp16 with a gradient scaler before Ampere); on MPS fp32 (hardware.py); fp16: CUDA
    #   only. A checkpoint records the precision chosen (and the machine and reason in its `machine` section)
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps (auto: a CUDA GPU, else MPS, else the CPU; docs/devices.md)
    eval_every: int = 250  # steps between validation runs (0 = only at the end)
    eval_batches: int = 20  # validation batches per evaluation
    checkpoint_every: int = 500  # steps between checkpoints (0 = only at the end)
    log_every: int = 5  # steps between metric lines: metrics.jsonl, TensorBoard (log_to) and the progress line on
    #   stderr (a tqdm bar in a terminal, else one line: step, loss, lr, ms/step, tokens/s, MFU, ETA, the task's own)
    log_to: list[str] | str = field(default_factory=list)  # where the metric lines also go: [tensorboard] writes
    #   TensorBoard scalars (and text samples) to <run>/tensorboard (the tensorboard extra); [] = metrics.jsonl only
    seed: int = 1337  # model init, data order, dropout
    threads: int | None = None  # torch intra-op threads; None = torch's default
    max_minutes: float | None = None  # stop (and checkpoint) after this much training time
    schedule_clock: str = "steps"  # steps | minutes: the learning-rate schedule runs over max_steps, or over
    #   max_minutes of training time (evaluations and checkpoints left out, summed over resumes; after the warmup the
    #   position is the larger of step and max_steps x the fraction trained), so its decay ends with the time budget
    #   on any machine;
    #   minutes: the run stops at max_minutes of training time (not bit-exact on resume: the clock is the machine's)
    stop_after_steps: int | None = None  # stop after N more steps in this invocation (a --resume counts from the
    #   step it resumes at; the run records the key, so each resume runs N more); the schedule still spans max_steps
    init_from: str | None = None  # fine-tune: start from this checkpoint's weights, tokenizer and model settings
    keep_best: str | None = None  # also keep <run>/best: the checkpoint with the best value of this eval metric
    #   (e.g. val_bleu, val_acc: higher is better; val_loss / val_ppl: lower is better)
    average_last: int = 0  # at the end, average the weights of the last N checkpoints into <run>/averaged
    activation_checkpointing: bool = False  # recompute each block's activations in backward (less memory, more time)
    compile: bool | Literal["model", "step"] = False  # torch.compile (TorchInductor; falls back to eager with a
    #   one-line warning): model = the training forward (and, through AOTAutograd, its backward); step = the forward
    #   and the optimizer's step; true = everything that pays (training/compile.py: measured, see COMPILE_TRUE there)
    ema: float = 0.0  # decay of an exponential moving average of the float32 (master) weights, updated after every
    #   optimizer step: ema = d_t * ema + (1 - d_t) * w with d_t = min(ema, (1 + t) / (10 + t)), t the updates so far;
    #   evaluations and the checkpoint's model.safetensors use the average (training/ema.py); 0 = off (e.g. 0.999)
    seq_len_warmup: int = 0  # language models (task lm): over the first N updates the training windows grow from
    #   seq_len_start to seq_len (linearly, rounded down to a multiple of seq_len_start; the batch size stays, so
    #   the tokens per update grow); evaluation always reads seq_len; 0 = off
    seq_len_start: int = 64  # seq_len_warmup: the window length at step 0 (<= seq_len)
    compile_mode: str = "default"  # torch.compile mode: default | reduce-overhead | max-autotune
    strategy: str = "auto"  # several processes (torchrun): auto | single | ddp | fsdp (docs/distributed.md)
    backend: str = "auto"  # torch.distributed backend: auto | gloo | nccl (auto: nccl on CUDA, gloo on the CPU)
    scheduled_sampling: ScheduledSamplingConfig = field(default_factory=ScheduledSamplingConfig)  # translation
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # low-rank adapters: train a small update of a frozen model

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum_steps", "eval_batches", "log_every"):
            check(getattr(self, name) >= 1, f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every"):
            check(getattr(self, name) >= 0, f"train.{name} must be >= 0, got {getattr(self, name)}")
        check(self.stop_after_steps is None or self.stop_after_steps >= 1,
              f"train.stop_after_steps must be >= 1, got {self.stop_after_steps}")
        check(self.lr > 0, f"train.lr must be positive, got {self.lr}")
        check(0 <= self.seed < SEED_LIMIT, f"train.seed must be an integer in [0, 2^64), got {self.seed}")
        check(self.threads is None or self.threads >= 1,
              f"train.threads must be a positive integer or null, got {self.threads}")
        check(self.average_last >= 0, f"train.average_last must be >= 0, got {self.average_last}")
        check(not (self.average_last and self.lora.enabled), "train.average_last averages whole weights; with "
              "train.lora (adapters) it does not apply: set one of them to 0")
        check(self.seq_len is None or self.seq_len >= 1, f"train.seq_len must be >= 1, got {self.seq_len}")
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
              f"train.betas must be two numbers in [0, 1), got {self.betas}")
        check(0.0 <= self.label_smoothing < 1.0,
              f"train.label_smoothing must be in [0, 1), got {self.label_smoothing}")
        check(self.grad_clip is None or self.grad_clip > 0, f"train.grad_clip must be positive, got {self.grad_clip}")
        check(isinstance(self.keep_checkpoints, int) and not isinstance(self.keep_checkpoints, bool)
              and self.keep_checkpoints >= 1, f"train.keep_checkpoints must be an integer >= 1, got "
                                              f"{self.keep_checkpoints!r}")
        check(isinstance(self.max_nonfinite, int) and not isinstance(self.max_nonfinite, bool)
              and self.max_nonfinite >= 0,
              f"train.max_nonfinite must be an integer >= 0 (0 = never stop), got {self.max_nonfinite!r}")
        check_choice("train.schedule", self.schedule, SCHEDULES)
        check(0.0 < self.decay_fraction <= 1.0, f"train.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.schedule == "wsd":  # warmup, then the stable phase, then the decay: the three must fit max_steps
            check(self.warmup_steps + self.decay_fraction * self.max_steps <= self.max_steps,
                  f"train.schedule wsd: train.warmup_steps ({self.warmup_steps}) + train.decay_fraction "
                  f"({self.decay_fraction:g}) x train.max_steps ({self.max_steps}) = "
                  f"{self.warmup_steps + self.decay_fraction * self.max_steps:g} is more than train.max_steps; "
                  "lower warmup_steps or decay_fraction")
        check(self.schedule_clock in CLOCKS, f"train.schedule_clock must be one of {', '.join(CLOCKS)}, got "
                                             f"{self.schedule_clock!r}")
        check(self.schedule_clock != "minutes" or self.max_minutes is not None,
              "train.schedule_clock=minutes needs train.max_minutes (the time the schedule runs over)")
        check(self.optimizer in OPTIMIZERS, f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got "
                                            f"{self.optimizer!r}{did_you_mean(self.optimizer, OPTIMIZERS)}")
        check(self.muon_lr > 0, f"train.muon_lr must be positive, got {self.muon_lr}")
        check(self.z_loss >= 0, f"train.z_loss must be >= 0 (0 = off), got {self.z_loss}")
        self.log_to = check_log_to(self.log_to)
        for name, known in (("strategy", STRATEGIES), ("backend", BACKENDS)):
            value = getattr(self, name)
            check(value in known, f"train.{name} must be one of {', '.join(known)}, got {value!r}"
                                  f"{did_you_mean(value, known)}")
        check(isinstance(self.device, str) and DEVICE.match(self.device.strip().lower()) is not None,
              f"train.device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        check(isinstance(self.ema, (int, float)) and not isinstance(self.ema, bool) and 0.0 <= self.ema < 1.0,
              f"train.ema must be a decay in [0, 1) (0 = off), got {self.ema!r}")
        check(isinstance(self.seq_len_warmup, int) and not isinstance(self.seq_len_warmup, bool)
              and self.seq_len_warmup >= 0, f"train.seq_len_warmup must be an integer >= 0 (0 = off), got "
                                            f"{self.seq_len_warmup!r}")
        check(self.seq_len_start >= 1, f"train.seq_len_start must be >= 1, got {self.seq_len_start}")
        check(self.compile in (True, False, "model", "step"),
              f"train.compile must be true, false, model or step, got {self.compile!r}")
        check(self.compile_mode in ("default", "reduce-overhead", "max-autotune"),
              f"train.compile_mode must be default, reduce-overhead or max-autotune, got {self.compile_mode!r}")
        if self.min_lr is None:
            self.min_lr = self.lr / 10
        check(0 <= self.min_lr <= self.lr, f"train.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")


def check_seq_len_warmup(train: TrainConfig, task: str, task_cls: Any, model: dict[str, Any],
                         data: dict[str, Any]) -> None:
    """``train.seq_len_warmup`` > 0: a task that draws windows it can shorten (lm), in random order (a stream's
    segments, which a Transformer-XL memory continues, keep one length), and ``seq_len_start`` <= the training
    length (``train.seq_len``, else ``model.max_seq_len``); one line naming the field and the value otherwise."""
    n = train.seq_len_warmup
    check(task_cls.takes_seq_len_warmup, f"train.seq_len_warmup={n} applies to language-model training (task lm), "
                                         f"not {task!r} (set it to 0)")
    order = data.get("order", "random") if isinstance(data, dict) else "random"
    check(order != "stream", f"train.seq_len_warmup={n} draws windows at random offsets; data.order: stream keeps "
                             "one segment length (set train.seq_len_warmup to 0 or data.order to random)")
    memory = model.get("memory_len") or 0
    check(not memory, f"train.seq_len_warmup={n} does not apply to a model with a memory (model.memory_len="
                      f"{memory}): set train.seq_len_warmup to 0")
    length = train.seq_len if train.seq_len is not None else model.get("max_seq_len")
    check(not isinstance(length, int) or train.seq_len_start <= length,
          f"train.seq_len_start ({train.seq_len_start}) must be <= the training length "
          f"({'train.seq_len' if train.seq_len is not None else 'model.max_seq_len'} = {length}): lower "
          "train.seq_len_start or set train.seq_len_warmup to 0")


def check_log_to(value: list[str] | str) -> list[str]:
    """``train.log_to`` as a list of known targets (a string names one; ``none`` or empty: none), or a one-line
    error naming the field, the value and what is allowed."""
    targets = [value] if isinstance(value, str) else list(value)
    targets = [target for target in targets if target not in ("", "none")]
    for target in targets:
        check(target in LOG_TARGETS, f"train.log_to must list targets of {', '.join(LOG_TARGETS)} (or be empty), "
                                     f"got {value!r}{did_you_mean(str(target), LOG_TARGETS)}")
    return list(dict.fromkeys(targets))


SEED_LIMIT = 2 ** 64  # torch.Generator.manual_seed takes seeds in [0, 2^64) (and [-2^63, 0), which is refused here)
TOKENIZER_KEYS = ("eos_token", "chat_template", "bos_token")  # chat_template: "default" or a Jinja string;
#   bos_token: what the template writes for {{ bos_token }} (tokenloom.data.chat)


def check_tokenizer_section(section: Any, where: str = "tokenizer") -> None:
    """A run's (or a checkpoint's) ``tokenizer`` section: ``eos_token``, a token of the vocabulary or null;
    ``chat_template`` and ``bos_token`` (strings or null) for chat templates."""
    check(isinstance(section, dict), f"{where} must be a mapping (eos_token: ...), got {section!r}")
    errors: list[ConfigError] = []
    for key, value in section.items():
        if key not in TOKENIZER_KEYS:
            errors.append(ConfigError(f"unknown key {f'{where}.{key}'!r}{did_you_mean(str(key), TOKENIZER_KEYS)}; "
                                      f"allowed: {', '.join(TOKENIZER_KEYS)}"))
        elif not (value is None or isinstance(value, str)):
            errors.append(ConfigError(f"{where}.{key} must be a token (a string) or null, got {value!r}"))
    raise_problems(errors)


@dataclass
class RunConfig:
    """A whole recipe: ``task``, ``model``, ``data``, ``train`` (and, as checkpoints record them, ``tokenizer`` and
    ``machine``). Build it with :func:`load_run_config`; validated on creation (a bad key or value is a one-line
    ``ConfigError`` naming it; several are reported together)."""

    task: str = "lm"  # what is trained: lm | translation | nat_translation | image_classification
    model: dict[str, Any] = field(default_factory=dict)  # model family and its config fields
    data: dict[str, Any] = field(default_factory=dict)  # the task's data section
    train: TrainConfig = field(default_factory=TrainConfig)  # optimiser, schedule, precision, evaluation, checkpoints
    tokenizer: dict[str, Any] = field(default_factory=dict)  # recorded by checkpoints: eos_token
    machine: dict[str, Any] = field(default_factory=dict)  # recorded by checkpoints: the CPU trained on, the precision
    #   asked for and chosen, and why

    def __post_init__(self) -> None:
        """Validate the sections that are plain mappings here (model, data: their dataclasses depend on the task
        and the family), every problem of them reported together (:class:`~tokenloom.errors.ConfigProblems`)."""
        errors: list[ConfigError] = []
        known_task = gather(errors, check_choice, "task", self.task, TASKS)
        gather(errors, check_tokenizer_section, self.tokenizer)
        if known_task:
            task_cls = TASKS.get(self.task)
            # the family defaults to the task's; vocab_size (in families that have one) comes from the
            # tokenizer when unset, so a placeholder stands in for it here, as do the settings the task takes from
            # its data (an image classifier's image_size)
            model = {"family": task_cls.default_family, **self.model}
            if isinstance(model["family"], str) and model["family"] in MODELS:
                if "vocab_size" in {f.name for f in dataclasses.fields(MODELS.get(model["family"])[0])}:
                    model.setdefault("vocab_size", 1 << 20)
                stand_ins = task_cls.model_stand_ins(model, self.data)  # (null in the recipe: from the data too)
                model.update({key: value for key, value in stand_ins.items() if model.get(key) is None})
            gather(errors, model_config_from_dict, model)  # validates the section; errors name the key
            gather(errors, from_dict, task_cls.data_config_cls, self.data, prefix="data")
            gather(errors, check, self.train.scheduled_sampling.schedule == "none" or self.task == "translation",
                   f"train.scheduled_sampling applies to the translation task, not {self.task!r}")
            gather(errors, check, self.train.z_loss == 0 or task_cls.takes_z_loss,
                   f"train.z_loss applies to language-model training (task lm), not {self.task!r} (set it to 0)")
            if self.train.seq_len_warmup:
                gather(errors, check_seq_len_warmup, self.train, self.task, task_cls, model, self.data)
        if errors:
            raise ConfigProblems(errors)  # (also one alone: from_dict then reports it as it is)

    @property
    def data_config(self) -> Any:
        return from_dict(TASKS.get(self.task).data_config_cls, self.data, prefix="data")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def load_run_config(path: str | Path | dict, overrides: list[str] | None = None) -> RunConfig:
    """A recipe file, the name of a packaged recipe (``shakespeare-char``; an existing file wins) or a dict, plus
    ``key.sub=value`` overrides -> a validated :class:`RunConfig`."""
    source = resolve_recipe(path) if not isinstance(path, dict) else None
    data = load_yaml(source) if source is not None else copy.deepcopy(path)
    apply_overrides(data, overrides)
    errors: list[ConfigError] = []
    if not isinstance(data.get("model", {}), dict):
        errors.append(ConfigError("model must be a mapping of model fields"))
        data["model"] = {}
    try:
        config = from_dict(RunConfig, data)
    except ConfigError as err:  # every problem of the recipe in one error, headed with the file's name
        errors.append(err)
    sections = list(data)  # the problems in the order of the recipe's sections
    errors = sorted(unique_problems(errors), key=lambda err: (
        sections.index(section) if (section := _section_of(str(err))) in sections else len(sections)))
    raise_problems(errors, str(source) if source is not None else "the recipe")
    return config


def _section_of(message: str) -> str:
    """The recipe section a problem is in: ``"train.lr must ..."``, ``"unknown key 'train.lr'"`` -> ``"train"``."""
    match = re.match(r"(?:unknown key ')?(\w+)", message)
    return match.group(1) if match else ""


def check_bundled_paths(config: RunConfig) -> None:
    """Before a fresh run writes anything: a path of its data section or ``train.init_from`` into the repository's
    ``data/`` or ``checkpoints/`` that is missing here (a packaged recipe run outside the repository) is a one-line
    error naming the key, where those folders are and the ``--set`` that points at them."""
    values: dict[str, Any] = {f"data.{key}": value for key, value in dataclasses.asdict(config.data_config).items()}
    values["train.init_from"] = config.train.init_from
    for key, value in values.items():
        hint = where_bundled(value, key) if isinstance(value, str) and value else ""
        if hint:
            kind = CheckpointError if Path(value).parts[0] == "checkpoints" else DataError
            raise kind(f"{key}: {value} not found{hint}")
