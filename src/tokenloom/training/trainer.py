"""One Trainer for every task.

The task supplies batches, the loss and the evaluation (``tasks/``); the Trainer owns the loop:
AdamW with decay/no-decay groups, a warmup + decay schedule, gradient accumulation and clipping,
bf16 autocast, periodic evaluation, atomic checkpoints, exact resume, a clean stop on Ctrl-C, a
progress bar and ``metrics.jsonl`` in the run directory.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import STATE_FILE, resolve_checkpoint, write_checkpoint
from ..errors import CheckpointError, TrainingError
from ..nn.modes import eval_mode
from .compile import CompiledForward
from .config import RunConfig
from .optim import create_optimizer
from .precision import MasterWeights, autocast
from .schedules import create_scheduler

HISTORY_DIR = "history"  # <run>/history/step-NNNNNNNN: earlier checkpoints (train.keep_checkpoints > 1)


class Trainer:
    def __init__(self, config: RunConfig, model: nn.Module, task: Any, run_dir: str | Path, *,
                 tokenizer: Any = None, model_section: dict[str, Any] | None = None,
                 show_progress: bool | None = None) -> None:
        self.config, self.model, self.task = config, model, task
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer
        self.model_section = model_section or dict(config.model)
        t = config.train
        # bf16: the optimizer updates float32 masters; the model runs in bf16 during fit()
        self.master = MasterWeights(model) if t.precision == "bf16" else None
        params = self.master.masters if self.master else model
        self.optimizer = create_optimizer(params, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas))
        self.scheduler = create_scheduler(self.optimizer, t.schedule, warmup_steps=t.warmup_steps,
                                          max_steps=t.max_steps, min_ratio=t.min_lr / t.lr)
        self.generator = torch.Generator().manual_seed(t.seed)  # the data order
        self.forward_model = CompiledForward(model, t.compile_mode) if t.compile else model  # what the loss calls
        self.step = 0
        self.show_progress = show_progress
        self.last_eval: dict[str, float] = {}
        self.best: float | None = None  # the best value of train.keep_best so far
        self.saved_step: int | None = None  # the step of <run>/checkpoint, once this run wrote or resumed it
        self.nonfinite_steps = 0  # updates skipped for a NaN/Inf loss or gradient, over the whole run
        self.nonfinite_streak = 0  # ... in a row, up to now
        self._stop_requested = False

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
        return data

    def save(self) -> Path:
        """Write the checkpoint (weights, config, tokenizer, trainer state) atomically."""

        def save_state(tmp: Path) -> None:
            torch.save({
                "step": self.step,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "generator": self.generator.get_state(),
                "torch_rng": torch.get_rng_state(),
                "numpy_rng": np.random.get_state(),
                "python_rng": random.getstate(),
                "last_eval": self.last_eval,
                "best": self.best,
                "nonfinite_steps": self.nonfinite_steps,
                "task": self.task.state_dict() if hasattr(self.task, "state_dict") else None,
            }, tmp / STATE_FILE)

        weights = self._weights()
        keep = self.config.train.keep_checkpoints
        if keep > 1 and self.checkpoint_dir.exists() and self.saved_step not in (None, self.step):
            # the current checkpoint becomes history (a rename); the oldest beyond keep - 1 go
            history = self.run_dir / HISTORY_DIR
            history.mkdir(exist_ok=True)
            target = history / f"step-{self.saved_step:08d}"
            shutil.rmtree(target, ignore_errors=True)
            os.replace(self.checkpoint_dir, target)
            for old in sorted(history.glob("step-*"))[:-(keep - 1)]:
                shutil.rmtree(old, ignore_errors=True)
        path = write_checkpoint(self.checkpoint_dir, self.model, self._config_dict(), self.tokenizer,
                                extra=save_state, state_dict=weights)
        self.saved_step = self.step
        if self.config.train.average_last:
            self._snapshot(weights)
        return path

    def _weights(self) -> dict[str, torch.Tensor] | None:
        """The weights a checkpoint holds: the float32 masters in bf16 mode, else the model's own."""
        return self.master.state_dict() if self.master else None

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
        lower = name.endswith(("_loss", "_ppl"))
        if self.best is None or (value < self.best if lower else value > self.best):
            self.best = value
            config = {**self._config_dict(), "best": {"metric": name, "value": value, "step": self.step}}
            write_checkpoint(self.run_dir / "best", self.model, config, self.tokenizer, state_dict=self._weights())

    def load_state(self, checkpoint: str | Path) -> None:
        """Restore optimizer, scheduler, RNGs and step from a checkpoint (weights are loaded by the caller)."""
        path = resolve_checkpoint(checkpoint) / STATE_FILE
        if not path.is_file():
            raise CheckpointError(f"cannot resume: {path} is missing (the checkpoint holds weights only)")
        try:
            state = torch.load(path, weights_only=False, map_location="cpu")  # our own file: RNG tuples
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.generator.set_state(state["generator"])
            torch.set_rng_state(state["torch_rng"])
            np.random.set_state(state["numpy_rng"])
            random.setstate(state["python_rng"])
            self.step = int(state["step"])
            self.saved_step = self.step
            self.last_eval = dict(state.get("last_eval", {}))
            self.best = state.get("best")
            self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
            if state.get("task") is not None and hasattr(self.task, "load_state_dict"):
                self.task.load_state_dict(state["task"])
        except (OSError, RuntimeError, KeyError, ValueError, EOFError) as err:
            raise CheckpointError(f"{path} is truncated or corrupt ({str(err).splitlines()[0]})") from None

    # -- the loop -----------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def evaluate(self) -> dict[str, float]:
        with eval_mode(self.model), autocast(self.config.train.precision), torch.no_grad():
            metrics = self.task.evaluate(self.model)
        metrics.pop("tokens", None)
        self.last_eval = metrics
        self._log({"step": self.step, **metrics})
        self._keep_best(metrics)
        return metrics

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
        """One optimizer update over ``grad_accum_steps`` micro-batches: (mean loss, tokens)."""
        t = self.config.train
        total_loss, tokens = 0.0, 0
        if hasattr(self.task, "step"):
            self.task.step = self.step
        for _ in range(t.grad_accum_steps):
            batch = self.task.get_batch(self.generator)
            with autocast(t.precision):
                loss, n = self.task.loss(self.forward_model, batch)
            (loss / t.grad_accum_steps).backward()
            if self.master is not None:
                self.master.accumulate_grads()
            total_loss += loss.item() / t.grad_accum_steps
            tokens += n
        params = self.master.masters if self.master is not None else list(self.model.parameters())
        if t.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        else:
            grads = [p.grad for p in params if p.grad is not None]
            total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
            norm = total_norm(grads) if total_norm is not None else torch.nn.utils.clip_grad_norm_(params, math.inf)
        if not (math.isfinite(total_loss) and bool(torch.isfinite(norm))):
            # a NaN/Inf loss or gradient: no update (the weights, moments and schedule stay), the batch is spent
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_steps += 1
            self.nonfinite_streak += 1
            if t.max_nonfinite and self.nonfinite_streak >= t.max_nonfinite:
                raise TrainingError(f"the loss or the gradients were NaN/Inf for {self.nonfinite_streak} updates in "
                                    f"a row at step {self.step} (train.max_nonfinite={t.max_nonfinite}); stopped. The "
                                    f"checkpoint holds the last finite weights (step {self.step}): lower train.lr, "
                                    "check the data, or train in fp32, then --resume")
            return total_loss, tokens
        self.nonfinite_streak = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.copy_to_model()
        self.step += 1
        return total_loss, tokens

    def fit(self) -> dict[str, Any]:
        """Train until ``max_steps`` (or ``max_minutes``, or Ctrl-C); returns the final metrics."""
        t = self.config.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.master is not None:
            self.master.to_low()
        self.model.train()
        start_step, start_time = self.step, time.perf_counter()
        bar = tqdm(total=t.max_steps, initial=self.step, disable=self.show_progress is False or None,
                   dynamic_ncols=True, desc="train")
        window_tokens, window_start, loss = 0, time.perf_counter(), float("nan")
        stopped_by = "max_steps"
        failure: TrainingError | None = None
        with self._graceful_interrupt():
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
                    if self._stop_requested:
                        stopped_by = "interrupt"
                        break
                    continue
                window_tokens += tokens
                bar.update(1)
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    elapsed = time.perf_counter() - window_start
                    tps = window_tokens / max(elapsed, 1e-9)
                    lr = self.scheduler.get_last_lr()[0]
                    self._log({"step": self.step, "loss": round(loss, 5), "lr": lr, "tokens_per_s": round(tps, 1),
                               "elapsed_s": round(time.perf_counter() - start_time, 2)})
                    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
                    window_tokens, window_start = 0, time.perf_counter()
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                    metrics = self.evaluate()
                    bar.write(f"step {self.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                                 if k.startswith("val_") and not k.endswith("ppl")))
                if t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < t.max_steps:
                    self.save()
                if self._stop_requested:
                    stopped_by = "interrupt"
                    break
                if t.stop_after_steps is not None and self.step - start_step >= t.stop_after_steps:
                    stopped_by = "stop_after_steps"
                    break
                if t.max_minutes is not None and time.perf_counter() - start_time > 60 * t.max_minutes:
                    stopped_by = "max_minutes"
                    break
            bar.close()
            if self.master is not None:  # evaluate, save and hand back the model in float32
                self.master.to_fp32()
            metrics = self.evaluate() if stopped_by not in ("interrupt", "non_finite") else dict(self.last_eval)
            self.save()
            if failure is not None:
                raise failure
            if self.config.train.average_last and stopped_by in ("max_steps", "max_minutes"):
                self.average_snapshots()
        elapsed = time.perf_counter() - start_time
        summary = {"step": self.step, "train_loss": loss, **metrics, "stopped_by": stopped_by,
                   "nonfinite_steps": self.nonfinite_steps,
                   "steps_this_run": self.step - start_step, "seconds": round(elapsed, 1)}
        return summary
