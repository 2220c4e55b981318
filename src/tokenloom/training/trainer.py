"""One Trainer for every task.

The task supplies batches, the loss and the evaluation (``tasks/``); the Trainer owns the loop:
AdamW with decay/no-decay groups, a warmup + decay schedule, gradient accumulation and clipping,
bf16 autocast, periodic evaluation, atomic checkpoints, exact resume, a clean stop on Ctrl-C, a
progress line (``progress.py``), ``metrics.jsonl`` in the run directory (and TensorBoard: ``tensorboard_log.py``).
Under torchrun it is one of several processes (``train.strategy`` ddp / fsdp, see ``distributed.py``): each trains
on its slice of the global batch, rank 0 logs and writes the checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..checkpoint import STATE_FILE, read_config, resolve_checkpoint, write_checkpoint
from ..devices import peak_memory, to_device, training_device
from ..errors import CheckpointError, ConfigError, TrainingError
from ..hardware import choose_precision, machine
from ..metric_scope import scope_fields, scoped_name
from ..nn.fused import weights_updated
from ..nn.lora import AdapterSpec, frozen_state_names, lora_state_dict, parameter_counts, save_adapter
from ..nn.modes import eval_mode
from . import distributed
from .clock import TrainingClock, schedule_position
from .compile import CompiledForward, CompiledStep, available_parts
from .config import RunConfig, TrainConfig
from .distributed import SINGLE, Distributed
from .ema import WeightAverage
from .optim import create_optimizer, hidden_matrices, load_named_optimizer_state, named_optimizer_state
from .precision import MasterWeights, autocast
from .progress import progress_mode, training_progress
from .schedules import ScheduleSpec, kept_schedule_notice
from .tensorboard_log import TensorBoardLog, check_tensorboard, forget_earlier_run

HISTORY_DIR = "history"  # <run>/history/step-NNNNNNNN: earlier checkpoints (train.keep_checkpoints > 1)
METRICS_FILE = "metrics.jsonl"  # <run>/metrics.jsonl: one JSON object a line, each with the step it was logged at


def _plain_numpy_state() -> tuple:
    """numpy's global RNG state with its key array as a tensor: a trainer state of tensors and plain Python values,
    which ``torch.load(weights_only=True)`` reads without allow-listing anything."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _load_state_file(path: Path) -> dict[str, Any]:
    """``trainer_state.pt`` read with ``weights_only=True``: tensors, containers and numbers only, never code. States
    written before the numpy key array became a tensor hold a numpy array: numpy's array reconstruction (data, no
    code) is allowed for those."""
    import pickle

    try:
        from numpy._core.multiarray import _reconstruct  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    safe = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]  # numpy.dtypes.UInt32DType
    try:
        with torch.serialization.safe_globals(safe):
            state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path} holds objects a trainer state never holds; it is not loaded, since loading "
                              f"could run code ({str(err).splitlines()[-1][:160]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a trainer state (a {type(state).__name__})")
    def numpy_state(value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 5 and isinstance(value[1], torch.Tensor):
            return value[0], value[1].numpy().astype(np.uint32), *value[2:]
        return value

    if "numpy_rng" in state:
        state["numpy_rng"] = numpy_state(state["numpy_rng"])
    for rng in state.get("rank_rng") or []:
        if isinstance(rng, dict) and "numpy" in rng:
            rng["numpy"] = numpy_state(rng["numpy"])
    return state


def _before_checkpoint(line: bytes, step: int) -> bool:
    """Whether a ``metrics.jsonl`` line was logged before the checkpoint of ``step`` was written: lines of earlier
    steps, and of that step except a skipped update's (an update skipped at ``step`` comes after its checkpoint).
    A torn or foreign line is not kept."""
    try:
        record = json.loads(line)
        logged = int(record["step"])
    except (ValueError, TypeError, KeyError):
        return False
    return logged < step or (logged == step and "skipped" not in record)


def _schedule_of_config(train: dict[str, Any]) -> ScheduleSpec:
    """The schedule a checkpoint's config.yaml ``train`` section builds (a key it lacks takes its default)."""
    if not isinstance(train, dict):
        raise ValueError(f"the checkpoint's train section is not a mapping: {train!r:.80}")
    default = TrainConfig()
    keys = {key: train.get(key, getattr(default, key)) for key in ("schedule", "lr", "warmup_steps", "max_steps",
                                                                      "decay_fraction")}
    keys["min_lr"] = train.get("min_lr")
    return ScheduleSpec.of(SimpleNamespace(**keys))


class Trainer:
    """One training loop for every task: AdamW, warmup and decay, clipping, accumulation, mixed precision,
    evaluation, checkpoints that resume exactly, several processes. Made by :func:`tokenloom.training.setup.setup_run`;
    :meth:`fit` trains, :meth:`evaluate` measures the validation split as the recipe's ``train.eval_batches`` asks."""

    def __init__(self, config: RunConfig, model: nn.Module, task: Any, run_dir: str | Path, *,
                 tokenizer: Any = None, model_section: dict[str, Any] | None = None,
                 show_progress: bool | None = None, dist: Distributed = SINGLE,
                 adapter: AdapterSpec | None = None) -> None:
        # train.device auto -> a CUDA GPU (cuda:LOCAL_RANK when distributed), else MPS, else the CPU
        self.device_choice = training_device(config.train.device, local_rank=dist.local_rank if dist.active else None)
        self.device = self.device_choice.device
        # train.precision auto -> the precision for this device (and CPU); the checkpoint records the choice
        # (resuming elsewhere continues in it) and its `machine` section the CPU and the reason
        self.precision = choose_precision(config.train.precision, device=self.device)
        recorded = config.machine.get("precision") or {}
        if not isinstance(recorded, dict):  # a record edited by hand (or damaged): no record
            recorded = {}
        if recorded.get("requested") == "auto" and recorded.get("chosen") == self.precision.precision:  # a resume
            self.precision = dataclasses.replace(self.precision, requested="auto",
                                                 reason=f"chosen when the run started: {recorded.get('reason')}")
        if dist.active:  # every process trains in rank 0's choice (a measured choice could differ between them)
            self.precision = dist.broadcast_object(self.precision if dist.is_main else None)
        if self.precision.precision != config.train.precision:
            config = dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                           precision=self.precision.precision))
        self.config, self.model, self.task = config, model.to(self.device), task
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer
        self.model_section = model_section or dict(config.model)
        self.dist = dist
        t = config.train
        if dist.world_size > 1:
            if not hasattr(task, "shard"):
                raise TrainingError(f"{type(task).__name__} cannot split its batches across processes")
            task.shard(dist.rank, dist.world_size)
        self.fsdp = dist.strategy == "fsdp"
        # train.lora: the model holds adapters over its frozen base; checkpoints hold the adapter and name the base
        self.adapter = adapter
        if adapter is not None and self.fsdp:
            raise TrainingError("train.lora with train.strategy fsdp is not supported (the frozen base and the "
                                "adapters would be sharded alike); use ddp")
        self.parameter_counts = parameter_counts(model)  # (trainable, total) values
        # train.compile: the forward (model) and the optimizer's step (step) through torch.compile; unavailable
        # here: one warning, eager
        self.compiled_parts = available_parts(t.compile)
        self.forward_model = CompiledForward(model, t.compile_mode, checked=True) \
            if "model" in self.compiled_parts else model  # what the loss calls
        # DDP / FSDP wrap the whole loss computation (TaskLoss), not just the model's forward
        self.wrapper = distributed.TaskLoss(task, model, self.forward_model) if dist.strategy != "single" else None
        if self.fsdp:  # sharded in place, before the optimizer sees the (now sharded) parameters
            distributed.fully_shard_model(self.wrapper, t.precision)
        # bf16: the optimizer updates float32 masters; the model runs in bf16 during fit() (FSDP: its sharded
        # float32 parameters are the masters, its mixed-precision policy computes in bf16)
        # (a LoRA run's frozen base has no masters: the float32 originals are kept and given back unrounded)
        self.master = MasterWeights(model, keep=frozen_state_names(model) if adapter is not None else ()) \
            if t.precision == "bf16" and not self.fsdp else None
        params = self.master.masters if self.master else model
        # train.optimizer muon: Muon for the Linear weights of the model's block stack (hidden_matrices), AdamW for
        # the rest
        hidden = hidden_matrices(model) if t.optimizer == "muon" else []
        if t.optimizer == "muon" and self.fsdp:
            raise ConfigError("train.optimizer=muon with train.strategy=fsdp is not supported; use train.optimizer "
                              "adamw or train.strategy ddp")
        if t.optimizer == "muon" and not hidden:
            raise ConfigError(f"train.optimizer=muon: this {type(model).__name__} model has no trainable 2-D weights "
                              "in its block stacks for Muon (optim.hidden_matrices finds none); use train.optimizer "
                              "adamw")
        if self.master is not None:
            hidden = [self.master.master_of(p) for p in hidden]
        self.optimizer = create_optimizer(params, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas),
                                          optimizer=t.optimizer, muon_lr=t.muon_lr, hidden=hidden,
                                          tensor_lr="step" in self.compiled_parts)
        self.compiled_step = CompiledStep(self.optimizer, t.compile_mode) if "step" in self.compiled_parts else None
        # train.ema: the float32 moving average of what the optimizer updates (the masters in bf16), training/ema.py
        if t.ema and self.fsdp:
            raise ConfigError(f"train.ema={t.ema} with train.strategy=fsdp is not supported (the average would be "
                              "sharded); use train.strategy ddp or set train.ema to 0")
        self.ema = WeightAverage([p for g in self.optimizer.param_groups for p in g["params"]], t.ema) \
            if t.ema else None
        self.schedule_spec = ScheduleSpec.of(t)  # a resume replaces it by the run's recorded one (load_state)
        self.scheduler = self.schedule_spec.create(self.optimizer)
        self.clock = TrainingClock()  # training time (train.schedule_clock: minutes)
        # fp16 (CUDA): losses scaled so small gradients survive float16; an overflowing step is skipped (counted with
        # the non-finite ones) and the scale lowered
        self.scaler = torch.amp.GradScaler(self.device.type) if t.precision == "fp16" else None
        self.generator = torch.Generator().manual_seed(t.seed)  # the data order (the same on every rank), on the CPU
        self.ddp: nn.Module | None = None  # DistributedDataParallel, built in fit() once the model has its dtype
        self.step = 0
        self.show_progress = show_progress
        self.last_eval: dict[str, float] = {}
        self.best: float | None = None  # the best value of train.keep_best so far
        self.saved_step: int | None = None  # the step of <run>/checkpoint, once this run wrote or resumed it
        self.tokens_seen = 0  # target tokens (or images) trained on, over the whole run (all ranks)
        self.nonfinite_steps = 0  # updates skipped for a NaN/Inf loss or gradient, over the whole run
        self.nonfinite_streak = 0  # ... in a row, up to now
        self._stop_requested = False
        self.notices: list[str] = []  # one-line notes for the user (a resume that keeps the run's schedule)
        self._scope: dict[str, int] | None = None  # how much of the validation split an evaluation reads
        self.tensorboard: TensorBoardLog | None = None  # train.log_to tensorboard: open during fit()
        if "tensorboard" in t.log_to and dist.is_main:
            check_tensorboard()  # a missing package: one line now, not after the data is prepared

    # -- checkpoints --------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoint"

    def _config_dict(self) -> dict[str, Any]:
        data = self.config.to_dict()
        data["model"] = dict(self.model_section)
        if hasattr(self.task, "checkpoint_data"):  # what the task resolved from the data (image classes, ...)
            data["data"] = {**(data.get("data") or {}), **self.task.checkpoint_data()}
        eos = getattr(self.tokenizer, "eos_token", None)
        data["tokenizer"] = {"eos_token": eos} if eos is not None else {}
        for key in ("chat_template", "bos_token"):  # the chat template (tokenloom.data.chat) goes along
            if getattr(self.tokenizer, key, None) is not None:
                data["tokenizer"][key] = getattr(self.tokenizer, key)
        data["machine"] = {**machine().as_dict(), "precision": self.precision.as_dict(),
                           "device": {"requested": self.config.train.device, "chosen": str(self.device),
                                      "reason": self.device_choice.reason}}
        return data

    def save(self) -> Path:
        """Write the checkpoint (weights, config, tokenizer, trainer state) atomically. Distributed: every rank
        takes part (full state dicts are gathered, each rank's random states collected); rank 0 writes. With
        ``train.ema`` the weights written are the average; the raw ones go into the trainer state (training/ema.py)."""
        ema = self.ema.state_dict(self._ema_names()) if self.ema is not None else None
        with self._averaged():
            return self._save(ema)

    def _ema_names(self) -> list[str]:
        names = self._param_names()
        return [names[id(p)] for p in self.ema.params]

    def _averaged(self) -> contextlib.AbstractContextManager:
        """``train.ema``: the parameters hold the average inside the block (else: nothing changes)."""
        if self.ema is None:
            return contextlib.nullcontext()
        return self.ema.swapped(self.master.copy_to_model if self.master is not None else weights_updated)

    def _save(self, ema: dict | None) -> Path:
        if self.fsdp:  # one gather for both
            weights, optimizer = distributed.full_state(self.wrapper, self.optimizer)
        else:
            weights, optimizer = self._weights(), named_optimizer_state(self.optimizer, self._param_names())
        optimizer = to_device(optimizer, "cpu")  # a checkpoint holds CPU tensors, whatever device trained it
        rng = {"torch": torch.get_rng_state(), "numpy": _plain_numpy_state(), "python": random.getstate()}
        if self.device.type == "cuda":  # dropout on the GPU draws from its own generator
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        rngs = self.dist.gather_objects(rng)

        def save_state(tmp: Path) -> None:
            torch.save({
                "step": self.step,
                "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(),
                "schedule": self.schedule_spec.as_dict(),  # what it was built from: every resume keeps it
                "generator": self.generator.get_state(),
                "torch_rng": rngs[0]["torch"],  # rank 0's (the single-process layout)
                "numpy_rng": rngs[0]["numpy"],
                "python_rng": rngs[0]["python"],
                "rank_rng": rngs,  # every rank's, in rank order
                "global_batch": self._global_batch(),
                "strategy": self.dist.strategy,
                "last_eval": self.last_eval,
                "best": self.best,
                "nonfinite_steps": self.nonfinite_steps,
                "tokens_seen": self.tokens_seen,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "task": self.task.state_dict() if hasattr(self.task, "state_dict") else None,
                "ema": ema,  # train.ema: the average and the raw weights (training/ema.py)
                "train_s": self.clock.total_s,  # training time so far, over the runs this one resumed
            }, tmp / STATE_FILE)

        if self.dist.is_main:
            with self._disk(self.checkpoint_dir):
                self._write(weights, save_state)
        self.saved_step = self.step
        self.dist.barrier()  # the checkpoint is on disk for every rank
        return self.checkpoint_dir

    def _write(self, weights: dict[str, torch.Tensor] | None, save_state: Any) -> None:
        keep = self.config.train.keep_checkpoints
        if keep > 1 and self.checkpoint_dir.exists() and self.saved_step not in (None, self.step):
            # the current checkpoint becomes history (a rename); the oldest beyond keep - 1 go
            history = self.run_dir / HISTORY_DIR
            history.mkdir(exist_ok=True)
            target = history / f"step-{self.saved_step:08d}"
            if target.exists():
                # resumed from this history entry past a damaged <run>/checkpoint: the damaged one goes aside,
                # never over the intact checkpoint of the same step
                target = self.run_dir / "checkpoint.damaged"
                shutil.rmtree(target, ignore_errors=True)
            os.replace(self.checkpoint_dir, target)
            for old in sorted(history.glob("step-*"))[:-(keep - 1)]:
                shutil.rmtree(old, ignore_errors=True)
        self._write_checkpoint(self.checkpoint_dir, self._config_dict(), weights, extra=save_state)
        if self.config.train.average_last:
            self._snapshot(weights)

    @contextlib.contextmanager
    def _disk(self, path: Path) -> Iterator[None]:
        """Writing under the run directory: a failure (read-only, full, gone) becomes a one-line
        :class:`TrainingError` naming the path and the last checkpoint, which the atomic writes leave intact."""
        try:
            yield
        except (OSError, SafetensorError) as err:
            where = getattr(err, "filename", None) or path
            why = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]
            kept = (f"the last checkpoint (step {self.saved_step}) in {self.run_dir} is intact: continue with "
                    "--resume once the directory takes files again" if self.saved_step is not None
                    else "no checkpoint was written yet")
            raise TrainingError(f"cannot write {where}: {why}; {kept}") from None

    def _weights(self) -> dict[str, torch.Tensor] | None:
        """The weights a checkpoint holds: the float32 masters in bf16 mode, else the model's own (FSDP: gathered
        from the shards, a collective every rank calls)."""
        if self.fsdp:
            return distributed.full_state(self.wrapper)[0]
        return self.master.state_dict() if self.master else None

    def _param_names(self) -> dict[int, str]:
        """id(optimizer parameter) -> the model parameter's name (bf16: the masters stand for the parameters)."""
        named = self.model.named_parameters()
        if self.master is not None:
            return {id(self.master.master_of(p)): name for name, p in named if p.requires_grad}
        return {id(p): name for name, p in named}

    def _global_batch(self) -> dict[str, int]:
        t = self.config.train
        return {"world_size": self.dist.world_size, "batch_size": t.batch_size, "grad_accum_steps": t.grad_accum_steps}

    # -- best checkpoint and weight averaging -------------------------------------------------------
    @property
    def snapshot_dir(self) -> Path:
        return self.run_dir / "snapshots"

    def _snapshot(self, weights: dict[str, torch.Tensor] | None) -> None:
        """Keep the weights of the last ``train.average_last`` checkpoints as safetensors files."""
        from ..checkpoint import state_dict_for_saving

        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        tensors = state_dict_for_saving(weights if weights is not None else self.model.state_dict())
        tmp = self.snapshot_dir / f".step-{self.step:08d}.tmp"
        save_file({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, str(tmp))
        tmp.replace(self.snapshot_dir / f"step-{self.step:08d}.safetensors")
        for old in sorted(self.snapshot_dir.glob("step-*.safetensors"))[:-self.config.train.average_last]:
            old.unlink()

    def average_snapshots(self) -> Path | None:
        """Average the kept snapshots into ``<run>/averaged`` (a checkpoint without trainer state)."""
        files = sorted(self.snapshot_dir.glob("step-*.safetensors"))[-self.config.train.average_last:]
        if len(files) < 2:
            return None
        total: dict[str, torch.Tensor] = {}
        for f in files:
            for name, tensor in load_file(str(f)).items():
                total[name] = total[name] + tensor if name in total else tensor.clone()
        averaged = {name: t / len(files) if t.is_floating_point() else t for name, t in total.items()}
        config = self._config_dict()
        config["averaged"] = [f.stem for f in files]
        return write_checkpoint(self.run_dir / "averaged", None, config, self.tokenizer, state_dict=averaged)

    def _keep_best(self, metrics: dict[str, float]) -> None:
        name = self.config.train.keep_best
        if not name or name not in metrics:
            return
        value = metrics[name]
        lower = name.endswith(("_loss", "_ppl", "_ece"))
        if self.best is None or (value < self.best if lower else value > self.best):  # the same on every rank
            self.best = value
            weights = self._weights()
            if self.dist.is_main:
                config = {**self._config_dict(), "best": {"metric": name, "value": value, "step": self.step}}
                with self._disk(self.run_dir / "best"):
                    self._write_checkpoint(self.run_dir / "best", config, weights)

    def _write_checkpoint(self, directory: Path, config: dict[str, Any], weights: dict[str, torch.Tensor] | None,
                          extra: Any = None) -> Path:
        """A checkpoint of the model (``weights``: the state to save, None for the model's own); a LoRA run's holds
        the adapter files (adapter.safetensors, adapter.json) in place of model.safetensors: its base is named."""
        if self.adapter is None:
            return write_checkpoint(directory, self.model, config, self.tokenizer, extra=extra, state_dict=weights)
        tensors = lora_state_dict(self.model, weights)

        def files(tmp: Path) -> None:
            save_adapter(tmp, tensors, self.adapter)
            if extra is not None:
                extra(tmp)

        return write_checkpoint(directory, None, config, self.tokenizer, extra=files, weights=False)

    def load_state(self, checkpoint: str | Path) -> None:
        """Restore optimizer, scheduler, RNGs and step from a checkpoint (weights are loaded by the caller)."""
        path = resolve_checkpoint(checkpoint) / STATE_FILE
        if path.is_dir():
            raise CheckpointError(f"cannot resume: {path} is a directory, not a trainer state")
        if not path.is_file():
            raise CheckpointError(f"cannot resume: {path} is missing (the checkpoint holds weights only)")
        try:
            state = _load_state_file(path)
            self._check_world(state)
            self._keep_schedule(state, path.parent)  # before the optimizer's state (a new scheduler sets its lr)
            if self.fsdp:
                optimizer = named_optimizer_state(self.optimizer, self._param_names(), state["optimizer"])
                distributed.load_sharded_optimizer(self.wrapper, self.optimizer, optimizer)
            else:
                load_named_optimizer_state(self.optimizer, state["optimizer"], self._param_names())
            self.scheduler.load_state_dict(state["scheduler"])
            self.generator.set_state(state["generator"])
            rngs = state.get("rank_rng") or [{"torch": state["torch_rng"], "numpy": state["numpy_rng"],
                                              "python": state["python_rng"]}]
            if self.dist.rank < len(rngs):
                torch.set_rng_state(rngs[self.dist.rank]["torch"])
                np.random.set_state(tuple(rngs[self.dist.rank]["numpy"]))
                random.setstate(rngs[self.dist.rank]["python"])
                if self.device.type == "cuda" and rngs[self.dist.rank].get("cuda") is not None:
                    torch.cuda.set_rng_state(rngs[self.dist.rank]["cuda"], self.device)
            else:  # a rank the checkpoint did not have (more processes than before): its own streams
                seed = (self.config.train.seed + 1_000_003 * self.dist.rank + int(state["step"])) % 2**64
                torch.manual_seed(seed), np.random.seed(seed % 2**32), random.seed(seed)
            self.step = int(state["step"])
            self.saved_step = self.step
            self.last_eval = dict(state.get("last_eval", {}))
            self.best = state.get("best")
            self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
            self.tokens_seen = int(state.get("tokens_seen", 0))  # 0 in checkpoints older than the counter
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            if state.get("task") is not None and hasattr(self.task, "load_state_dict"):
                self.task.load_state_dict(state["task"])
            self._load_ema(state.get("ema"))
            self.clock.before_s = float(state.get("train_s", 0.0))  # 0 in trainer states older than the key
        except OSError as err:
            raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
        except (RuntimeError, KeyError, ValueError, EOFError, TypeError, IndexError) as err:
            raise CheckpointError(f"{path} is truncated or corrupt ({(str(err).splitlines() or [repr(err)])[0]})") \
                from None

    def _load_ema(self, state: dict | None) -> None:
        """``train.ema``: the average and the raw weights (the model was loaded with the average) from a trainer
        state; a run that starts averaging on resume starts from its weights."""
        if self.ema is None:
            if state is not None:  # the average was on and is now off: train on from the raw weights
                with torch.no_grad():
                    names = self._param_names()
                    for p in (p for g in self.optimizer.param_groups for p in g["params"]):
                        p.copy_(state["weights"][names[id(p)]])
                if self.master is not None:
                    self.master.copy_to_model()
            return
        if state is None:
            warnings.warn("train.ema: the checkpoint resumed holds no average; it starts from the current weights",
                          stacklevel=3)
            return
        self.ema.load_state_dict(state, self._ema_names())
        if self.master is not None:
            self.master.copy_to_model()
        weights_updated()

    def _keep_schedule(self, state: dict[str, Any], checkpoint: Path) -> None:
        """A resume trains on the learning-rate schedule the run started with, whatever this resume's ``train``
        keys say: the one its trainer state records (in checkpoints older than that record, the one built from the
        checkpoint's config.yaml). A change of a key that shapes it adds a line to :attr:`notices`."""
        before = _schedule_of_config(read_config(checkpoint).get("train") or {})
        kept = ScheduleSpec.from_record(state["schedule"]) if state.get("schedule") is not None else before
        if kept == self.schedule_spec:
            return
        notice = kept_schedule_notice(kept, before, self.schedule_spec, str(self.run_dir))
        if notice is not None:
            self.notices.append(notice)
        self.schedule_spec, self.scheduler = kept, kept.create(self.optimizer)

    def _check_world(self, state: dict[str, Any]) -> None:
        """Resuming with another number of processes: the data position, schedule and step count are in updates
        of the checkpoint's global batch, so that batch must stay; the per-rank random streams (dropout) cannot
        be carried over (a warning: the run continues correctly, not bit for bit)."""
        saved = state.get("global_batch") or {"world_size": 1, "batch_size": self.config.train.batch_size,
                                               "grad_accum_steps": self.config.train.grad_accum_steps}
        now = self._global_batch()
        if saved["world_size"] == now["world_size"]:
            return
        before = saved["world_size"] * saved["batch_size"] * saved["grad_accum_steps"]
        after = now["world_size"] * now["batch_size"] * now["grad_accum_steps"]
        if before != after:
            need = before // (now["world_size"] * now["batch_size"])
            hint = (f"--set train.grad_accum_steps={need}" if need * now["world_size"] * now["batch_size"] == before
                    else f"train.batch_size x train.grad_accum_steps = {before / now['world_size']:g}")
            raise CheckpointError(
                f"cannot resume: the checkpoint was written by {saved['world_size']} process(es) x batch "
                f"{saved['batch_size']} x {saved['grad_accum_steps']} accumulation step(s) = {before} per update, "
                f"this run has {now['world_size']} x {now['batch_size']} x {now['grad_accum_steps']} = {after}; its "
                f"data position and schedule count updates of {before}: keep the global batch ({hint}) or start a new "
                "run with train.init_from")
        if self.dist.is_main:
            warnings.warn(f"resuming a {saved['world_size']}-process checkpoint with {now['world_size']} process(es): "
                          "the data continues where it stopped, but each rank's dropout stream starts anew, so the "
                          "run will not repeat an uninterrupted one bit for bit", stacklevel=3)

    # -- the loop -----------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        path = self.run_dir / METRICS_FILE
        with self._disk(path), open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.record(record)

    @contextlib.contextmanager
    def _tensorboard_log(self) -> Iterator[None]:
        """``train.log_to: [tensorboard]``: the event writer, open while :meth:`fit` runs (rank 0). A resume hides the
        events logged after its checkpoint (as :meth:`_start_metrics` drops those lines); a fresh run replaces an
        earlier run's event files."""
        if "tensorboard" not in self.config.train.log_to or not self.dist.is_main:
            yield
            return
        with self._disk(self.run_dir):
            if self.saved_step is None:
                forget_earlier_run(self.run_dir)  # (its metrics.jsonl is replaced too, with a warning)
            self.tensorboard = TensorBoardLog(self.run_dir, None if self.saved_step is None else self.saved_step + 1)
        try:
            yield
        finally:
            self.tensorboard.close()
            self.tensorboard = None

    def log_text(self, tag: str, text: str) -> None:
        """A text sample (``tokenloom train --sample``'s) at the current step, to TensorBoard when ``train.log_to``
        names it (rank 0); otherwise nothing."""
        if "tensorboard" in self.config.train.log_to and self.dist.is_main:
            log = TensorBoardLog(self.run_dir)
            log.text(tag, text, self.step)
            log.close()

    def _start_metrics(self) -> None:
        """Make ``metrics.jsonl`` this run's story up to now, before the first line is logged: a fresh run (no
        checkpoint loaded or written) starts a new file (an earlier run's, one that never reached a checkpoint, is
        replaced, with a warning); a resume keeps the lines up to the checkpoint it continues from and drops those
        of the steps it replays (logged after that checkpoint by a run that was killed), so each step is logged
        once. Rewritten atomically (a temporary file, then a rename); a torn last line is dropped."""
        if not self.dist.is_main:
            return
        path = self.run_dir / METRICS_FILE
        if not path.exists():
            return
        with self._disk(path):
            if self.saved_step is None:
                warnings.warn(f"{path} of an earlier run (without a checkpoint) is replaced by this run's",
                              stacklevel=3)
                path.unlink()
                return
            lines = path.read_bytes().splitlines(keepends=True)
            kept = [line.rstrip(b"\r\n") + b"\n" for line in lines if _before_checkpoint(line, self.saved_step)]
            if len(kept) == len(lines) and (not lines or lines[-1].endswith(b"\n")):
                return
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as fh:
                fh.writelines(kept)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)

    def evaluate(self) -> dict[str, float]:
        """The first ``train.eval_batches`` batches of the validation split, which every rank evaluates (identical
        results); rank 0 logs. The metrics carry how much of the split they cover (``eval_batches``,
        ``eval_split_batches``: :mod:`tokenloom.metric_scope`)."""
        gathered = distributed.unsharded(self.wrapper) if self.fsdp else contextlib.nullcontext()
        with self._averaged():  # train.ema: the average is evaluated (and kept as <run>/best)
            with eval_mode(self.model), autocast(self.config.train.precision, self.device.type), torch.no_grad(), \
                    gathered:
                metrics = self.task.evaluate(self.model)
            metrics.pop("tokens", None)
            metrics.update(self._eval_scope())
            self.last_eval = metrics
            self._log({"step": self.step, **metrics})
            self._keep_best(metrics)
        return metrics

    def _eval_scope(self) -> dict[str, int]:
        """The batches an evaluation reads and (tasks that count them) the validation split's, counted once."""
        if self._scope is None:
            count = getattr(self.task, "eval_split_batches", None)
            self._scope = scope_fields(self.config.train.eval_batches, count() if count is not None else None)
        return self._scope

    @contextlib.contextmanager
    def _graceful_interrupt(self) -> Iterator[None]:
        """First Ctrl-C: finish the current step, checkpoint, stop. A second one stops at once (the
        last checkpoint on disk stays intact: checkpoints are swapped in atomically)."""

        def handler(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True

        try:
            previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def train_step(self) -> tuple[float, int]:
        """One optimizer update over ``grad_accum_steps`` micro-batches: (mean loss, tokens), both over the global
        batch when distributed."""
        t = self.config.train
        total_loss, tokens = 0.0, 0
        if hasattr(self.task, "step"):
            self.task.step = self.step
        for i in range(t.grad_accum_steps):
            batch = to_device(self.task.get_batch(self.generator), self.device, non_blocking=True)  # built on the CPU
            with autocast(t.precision, self.device.type), self._gradient_sync(i == t.grad_accum_steps - 1):
                loss, n = self._loss(batch)
                weight = 1.0
                if self.dist.world_size > 1:
                    # the global batch's mean: each rank's mean weighted by its share of the tokens (images)
                    loss_sum, n_all = self.dist.all_reduce_sum([loss.item() * n, n])
                    weight = self.dist.world_size * n / n_all
                    total_loss += loss_sum / n_all / t.grad_accum_steps
                    tokens += int(n_all)
                else:
                    total_loss += loss.item() / t.grad_accum_steps
                    tokens += n
                if weight != 1.0:
                    loss = loss * weight
                loss = loss / t.grad_accum_steps
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            if self.master is not None:
                self.master.accumulate_grads()
        params = self.master.masters if self.master is not None else list(self.model.parameters())
        if self.master is not None and self.dist.world_size > 1:
            self._average_master_grads()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # true gradients for clipping and the finite check
        if t.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        else:
            grads = [p.grad for p in params if p.grad is not None]
            total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
            norm = total_norm(grads) if total_norm is not None else torch.nn.utils.clip_grad_norm_(params, math.inf)
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor
            norm = norm.full_tensor()
        if not (math.isfinite(total_loss) and bool(torch.isfinite(norm))):
            # a NaN/Inf loss or gradient: no update (the weights, moments and schedule stay), the batch is spent
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_steps += 1
            if self.scaler is not None:
                self.scaler.update()  # lowers the scale
            if self.scaler is None or not math.isfinite(total_loss):  # fp16 overflow of the gradients: no streak
                self.nonfinite_streak += 1
            if t.max_nonfinite and self.nonfinite_streak >= t.max_nonfinite:
                raise TrainingError(f"the loss or the gradients were NaN/Inf for {self.nonfinite_streak} updates in "
                                    f"a row at step {self.step} (train.max_nonfinite={t.max_nonfinite}); stopped. The "
                                    f"checkpoint holds the last finite weights (step {self.step}): lower train.lr, "
                                    "check the data, or train in fp32, then --resume")
            return total_loss, tokens
        self.nonfinite_streak = 0
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self.compiled_step is not None:  # train.compile: step
            self.compiled_step()
        else:
            self.optimizer.step()
        weights_updated()  # the fused AdamW bumps no version counter: decode steps must not reuse pre-step weights
        if self.ema is not None:
            self.ema.update()
        self._advance_schedule()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.copy_to_model()
        self.step += 1
        return total_loss, tokens

    def _advance_schedule(self) -> None:
        """One step of the learning-rate schedule; ``train.schedule_clock: minutes``: to where the training time puts
        it (:func:`~tokenloom.training.clock.schedule_position`, every rank at the ranks' mean time)."""
        t = self.config.train
        if t.schedule_clock == "minutes":
            trained = self.clock.total_s
            if self.dist.world_size > 1:
                trained = self.dist.all_reduce_sum([trained])[0] / self.dist.world_size
            position = schedule_position(self.step + 1, trained, t.max_steps, 60 * t.max_minutes, t.warmup_steps)
            self.scheduler.last_epoch = position - 1  # LambdaLR.step() moves it on by one
        self.scheduler.step()

    def _out_of_time(self, start_time: float) -> bool:
        """``train.max_minutes``: of training time (schedule_clock minutes), else of this process's wall clock."""
        t = self.config.train
        if t.max_minutes is None:
            return False
        spent = self.clock.total_s if t.schedule_clock == "minutes" else time.perf_counter() - start_time
        return spent >= 60 * t.max_minutes

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP / FSDP: communicate gradients only in the last micro-batch of an update."""
        if self.ddp is not None and not last:
            return self.ddp.no_sync()
        if self.fsdp:
            self.wrapper.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    @torch.no_grad()
    def _average_master_grads(self) -> None:
        """bf16 with master weights under DDP: the float32 master gradients, averaged in one all-reduce."""
        import torch.distributed as dist

        masters = self.master.masters
        flat = torch.cat([(m.grad if m.grad is not None else torch.zeros_like(m)).reshape(-1) for m in masters])
        dist.all_reduce(flat)
        flat /= self.dist.world_size
        for m, chunk in zip(masters, flat.split([m.numel() for m in masters]), strict=True):
            m.grad = chunk.view_as(m)

    def _wrap_for_training(self) -> None:
        """DDP: wrap the model once it holds its training dtype (fp32 / bf16-autocast; in bf16 the float32 master
        gradients are averaged instead, see :meth:`_average_master_grads`)."""
        if self.dist.strategy != "ddp" or self.ddp is not None or self.master is not None:
            return
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        # buffers (position tables, masks) are computed alike on every rank: nothing to broadcast per forward
        quiet = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                 inspect.signature(DistributedDataParallel).parameters else {"broadcast_buffers": False})
        self.ddp = DistributedDataParallel(self.wrapper, **quiet)

    def _loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        if self.ddp is not None:
            return self.ddp(batch)
        if self.fsdp:
            return self.wrapper(batch)
        return self.task.loss(self.forward_model, batch)

    def _agree(self, *flags: bool) -> list[bool]:
        """Stop decisions every rank must share (a clock, a signal): true on one rank -> true on all."""
        if not self.dist.active:
            return list(flags)
        return [v > 0 for v in self.dist.all_reduce_sum([float(f) for f in flags])]

    def fit(self) -> dict[str, Any]:
        """Train until ``max_steps`` (or ``max_minutes``, or Ctrl-C); returns the final metrics."""
        t = self.config.train
        if t.threads:
            torch.set_num_threads(t.threads)
        with self._disk(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._start_metrics()
        if self.master is not None:
            self.master.to_low()
        self._wrap_for_training()
        self.model.train()
        start_step, start_time = self.step, time.perf_counter()
        self.clock.start()
        progress = training_progress(progress_mode(self.show_progress, self.dist.is_main), t, self.task,
                                     self.model_section, self.parameter_counts[1], self.device, self.dist.world_size,
                                     start_step)
        window_tokens, window_start, window_step, loss = 0, self.clock.this_run_s, self.step, float("nan")
        stopped_by = "max_steps"
        failure: TrainingError | None = None
        with self._graceful_interrupt(), self._tensorboard_log():
            while self.step < t.max_steps:
                step_before, skipped_before = self.step, self.nonfinite_steps
                try:
                    loss, tokens = self.train_step()
                except TrainingError as err:
                    failure, stopped_by = err, "non_finite"
                    self._log({"step": self.step, "stopped": "non_finite", "nonfinite_steps": self.nonfinite_steps})
                    break
                if self.step == step_before:  # the update was skipped (non-finite)
                    if self.nonfinite_steps != skipped_before:
                        self._log({"step": self.step, "skipped": "non_finite", "loss": str(loss),
                                   "nonfinite_steps": self.nonfinite_steps})
                    if self._agree(self._stop_requested)[0]:
                        stopped_by = "interrupt"
                        break
                    continue
                window_tokens += tokens
                self.tokens_seen += tokens
                progress.advance()
                out_of_time = self._out_of_time(start_time)  # the last step of a timed run is logged too
                if self.step % t.log_every == 0 or self.step == t.max_steps or out_of_time:
                    # the window's training time only: evaluations and checkpoints are left out of its rates
                    elapsed = max(self.clock.this_run_s - window_start, 1e-9)
                    record = {"step": self.step, "loss": round(loss, 7), "lr": float(self.scheduler.get_last_lr()[0]),
                              "tokens_per_s": round(window_tokens / elapsed, 1),
                              "ms_per_step": round(1000 * elapsed / max(self.step - window_step, 1), 2),
                              "elapsed_s": round(time.perf_counter() - start_time, 2),
                              "train_s": round(self.clock.this_run_s, 2),
                              **self.task.train_metrics()}  # the task's own (GRPO: reward, kl, ...)
                    self._log(record)
                    progress.show(record)
                    window_tokens, window_start, window_step = 0, self.clock.this_run_s, self.step
                with self.clock.paused():  # evaluations and checkpoints are left out of train_s
                    if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                        metrics = self.evaluate()
                        if self.dist.is_main:
                            shown = {k: v for k, v in metrics.items() if k.startswith("val_")
                                     and not k.endswith("ppl")}
                            progress.note(f"step {self.step}: " + "  ".join(f"{scoped_name(k, metrics)} {v:.4f}"
                                                                           for k, v in shown.items()))
                    if t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < t.max_steps:
                        self.save()
                interrupted, out_of_time = self._agree(self._stop_requested, out_of_time)
                if interrupted:
                    stopped_by = "interrupt"
                    break
                if t.stop_after_steps is not None and self.step - start_step >= t.stop_after_steps:
                    stopped_by = "stop_after_steps"
                    break
                if out_of_time:
                    stopped_by = "max_minutes"
                    break
            progress.close()
            if self.master is not None:  # evaluate, save and hand back the model in float32
                self.master.to_fp32()
            metrics = self.evaluate() if stopped_by not in ("interrupt", "non_finite") else dict(self.last_eval)
            self.save()
            if failure is not None:
                raise failure
            if self.config.train.average_last and stopped_by in ("max_steps", "max_minutes") and self.dist.is_main:
                with self._disk(self.run_dir / "averaged"):
                    self.average_snapshots()
        elapsed = time.perf_counter() - start_time
        summary = {"step": self.step, "train_loss": loss, **metrics, "stopped_by": stopped_by,
                   "nonfinite_steps": self.nonfinite_steps, "tokens": self.tokens_seen,
                   "steps_this_run": self.step - start_step, "seconds": round(elapsed, 1), "device": str(self.device),
                   "trainable_parameters": self.parameter_counts[0], "parameters": self.parameter_counts[1]}
        if (peak := peak_memory(self.device)) is not None:  # CUDA: the most memory this run held
            summary["peak_memory_mb"] = round(peak / 2**20, 1)
        return summary
