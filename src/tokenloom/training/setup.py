"""From a validated recipe to a ready :class:`Trainer` (fresh or resumed)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import load_tokenizer, load_weights, resolve_checkpoint
from ..tasks import TASKS
from .config import RunConfig
from .trainer import Trainer


def setup_run(config: RunConfig, run_dir: str | Path, *, resume: bool = False,
              show_progress: bool | None = None) -> Trainer:
    """Tokenizer, data, model and Trainer for ``config`` in ``run_dir``. With ``resume`` the weights,
    tokenizer, optimizer, schedule, RNG states and step come from ``run_dir``'s checkpoint, so the run
    continues exactly where it stopped."""
    run_dir = Path(run_dir)
    t = config.train
    tokenizer = None
    checkpoint = None
    if resume:
        checkpoint = resolve_checkpoint(run_dir)
        tokenizer = load_tokenizer(checkpoint)
    if t.threads:
        torch.set_num_threads(t.threads)
    torch.manual_seed(t.seed)
    task, model, tokenizer, section = TASKS.get(config.task).setup(
        config.data_config, config.model, run_dir, batch_size=t.batch_size, seq_len=t.seq_len,
        label_smoothing=t.label_smoothing, eval_batches=t.eval_batches, tokenizer=tokenizer)
    if checkpoint is not None:
        load_weights(model, checkpoint)  # before the Trainer takes float32 masters of the weights
    trainer = Trainer(config, model, task, run_dir, tokenizer=tokenizer, model_section=section,
                      show_progress=show_progress)
    if checkpoint is not None:
        trainer.load_state(checkpoint)
    return trainer
