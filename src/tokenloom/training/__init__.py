"""Training: one Trainer for every task, schedules, optimizers, checkpoints."""

from .config import RunConfig, TrainConfig, load_run_config
from .optim import create_optimizer, param_groups
from .precision import PRECISIONS, MasterWeights, autocast
from .schedules import SCHEDULES, create_scheduler
from .setup import setup_run
from .trainer import Trainer

__all__ = ["PRECISIONS", "MasterWeights", "SCHEDULES", "RunConfig", "TrainConfig", "Trainer", "autocast",
           "create_optimizer", "create_scheduler", "load_run_config", "param_groups", "setup_run"]
