"""``TASKS``: what a batch is, the loss and the metrics, by task name (``lm``, ...)."""

from __future__ import annotations

from typing import Any

from ..registry import Registry

TASKS: Registry[type] = Registry("task")


class Sharded:
    """A task whose training batches split across the processes of a distributed run: every process draws the
    global batch (``world_size`` x ``batch_size``, with the same generator) and keeps slice ``rank``; so N
    processes see exactly the data one process with an N times larger batch would, and a saved data position
    means the same for any number of processes."""

    rank, world_size = 0, 1
    needs_reference = False  # setup() takes reference=: train.init_from (or None), the checkpoint whose weights stay
    #   frozen as the reference (preference alignment, policy optimisation), on resume too
    fresh_weights: tuple[str, ...] = ()  # name prefixes of weights train.init_from may lack (a task's new head, e.g. a
    #   reward model's score_head): they start from their initial values
    summary_metrics: tuple[tuple[str, int], ...] = (("val_loss", 4), ("val_acc", 2))  # (metric, digits) that
    #   `tokenloom train`'s last line shows after train_loss, those the run has (GRPO: reward, satisfied, KL)
    count_unit: str = "tok"  # what loss()'s count counts, as the progress line names its rate (tok/s, img/s, pairs/s)
    counts_model_tokens: bool = False  # the count is every token the model ran forward and backward over (plain
    #   language modelling): the progress line estimates the MFU from it (tokenloom.training.progress)
    takes_z_loss: bool = False  # setup() takes z_loss=: train.z_loss, the weight of a z-loss term in its training loss
    takes_seq_len_warmup: bool = False  # setup() takes seq_len_warmup= and seq_len_start=: train.seq_len_warmup, its
    #   training windows grow over the first updates (the step it reads from its `step`, which the Trainer sets)

    @classmethod
    def model_stand_ins(cls, model: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        """Values for the model settings this task takes from its data (an image classifier's image size, channels
        and classes) where the recipe's ``model`` section leaves them out, standing in for the data's until it is
        read: recipe validation checks the rest of the section with them. (Every task derives from this class.)"""
        return {}

    def shard(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def train_metrics(self) -> dict[str, float]:
        """The task's own training metrics since the last call, averaged (the Trainer adds them to each
        ``metrics.jsonl`` line of a training step); none by default."""
        return {}

    def local(self, per_rank: int) -> slice:
        """This rank's rows of a global batch of ``world_size * per_rank``."""
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)
