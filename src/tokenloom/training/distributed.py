"""One training run as several processes: torch.distributed, launched by ``torchrun``.

``train.strategy``:

* ``single``: one process (the default when not launched by torchrun).
* ``ddp``: DistributedDataParallel: every process holds the whole model; gradients are averaged
  (all-reduce) during backward; with ``grad_accum_steps`` > 1 the earlier micro-batches run under
  ``no_sync`` so each update communicates once.
* ``fsdp``: FullyShardedDataParallel (PyTorch's ``fully_shard``): parameters, gradients and AdamW moments
  are sharded across the processes, each block gathered for its forward and backward. bf16 runs with
  FSDP's mixed-precision policy (bf16 compute, float32 sharded weights and gradient reduction).
* ``auto``: ``ddp`` when torchrun started more than one process, else ``single``.

Data: every process draws the *global* batch's randomness (window offsets, the epoch order, augmentation)
from the same generator and keeps its own slice, so ``N`` processes x batch ``B`` see exactly the data of
one process x batch ``N*B``, and the data position in a checkpoint means the same for any number of
processes. Dropout (and NAT's masks) draw from each process's own torch generator (seeded per rank and
saved per rank in checkpoints).

Checkpoints hold full (unsharded) state dicts, written by rank 0 only, so any number of processes (or a
plain ``tokenloom generate``) can load them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

STRATEGIES = ("auto", "single", "ddp", "fsdp")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Distributed:
    """Where this process stands in the run: its rank among ``world_size`` processes and the strategy."""

    strategy: str = "single"  # resolved: single | ddp | fsdp
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.backend is not None

    # -- collectives (no-ops without a process group) -------------------------------------------------------
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if not self.active:
            return list(values)
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass anything)."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()


SINGLE = Distributed()


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun (its environment variables), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ConfigError(f"RANK={os.environ['RANK']!r} / WORLD_SIZE={os.environ['WORLD_SIZE']!r} are not "
                          "integers (set by torchrun)") from None


def resolve_strategy(strategy: str) -> str:
    world = torchrun_world()
    launched = world is not None and world[1] > 1
    if strategy == "auto":
        return "ddp" if launched else "single"
    if strategy == "single" and launched:
        raise ConfigError(f"train.strategy=single, but torchrun started {world[1]} processes (each would train "
                          "the same run into the same directory): use train.strategy=ddp or fsdp")
    return strategy


def resolve_backend(backend: str, device_type: str = "cpu") -> str:
    """The process group's backend for tensors on ``device_type``: ``auto`` -> nccl on CUDA, gloo elsewhere; nccl
    needs CUDA tensors (and a build with nccl), gloo CPU ones."""
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl":
        if device_type != "cuda":
            if not torch.cuda.is_available():
                why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
                raise ConfigError(f"train.backend=nccl needs CUDA GPUs, and {why}: use train.backend=gloo (CPU)")
            raise ConfigError(f"train.backend=nccl reduces CUDA tensors, but the training device is {device_type}: "
                              "set train.device=cuda (or --device cuda), or use train.backend=gloo")
        if not dist.is_available() or not dist.is_nccl_available():
            raise ConfigError("train.backend=nccl: this torch build has no nccl: use train.backend=gloo")
        return "nccl"
    if not dist.is_available() or not dist.is_gloo_available():
        raise ConfigError("this torch build has no gloo backend (torch.distributed is unavailable): use "
                          "train.strategy=single")
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(f"several processes on {device_type} are not supported (gloo reduces CPU tensors, nccl "
                          "CUDA ones): train.device=cpu or cuda")
    return "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(strategy: str, backend: str = "auto", timeout_minutes: float = 30.0,
          device_type: str = "cpu") -> Distributed:
    """Join (or, for a lone ``ddp`` / ``fsdp`` process, create) the process group for tensors on ``device_type``;
    returns where this process stands. Seeds nothing: the caller seeds."""
    strategy = resolve_strategy(strategy)
    if strategy == "single":
        return SINGLE
    import torch.distributed as dist

    backend = resolve_backend(backend, device_type)
    world = torchrun_world()
    if world is None:  # one process without torchrun: a group of one (FSDP/DDP code paths, e.g. in tests)
        rank, size, local = 0, 1, 0
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    else:
        rank, size, local = world
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend, store=_store(rank, size, timeout), rank=rank, world_size=size,
                                timeout=timeout)
    return Distributed(strategy=strategy, rank=rank, world_size=size, local_rank=local, backend=backend)


def _store(rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """The rendezvous store (``MASTER_ADDR:MASTER_PORT``, as torchrun's env:// would make it), its keys prefixed
    with the restart count: after an elastic restart the launcher's store still holds the previous attempt's
    keys, and gloo would otherwise connect to the dead processes' addresses."""
    import torch.distributed as dist

    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=size,
                          is_master=rank == 0 and not agent_hosts, timeout=timeout, multi_tenant=not agent_hosts)
    return dist.PrefixStore(f"tokenloom/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def stop(where: Distributed) -> None:
    if where.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def session(strategy: str, backend: str = "auto", device_type: str = "cpu") -> Iterator[Distributed]:
    """The process group for the block; destroyed on the way out, errors included."""
    where = start(strategy, backend, device_type=device_type)
    try:
        yield where
    finally:
        stop(where)


# -- wrapping the model --------------------------------------------------------------------------------------
def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one: every entry of every ``nn.ModuleList`` (the blocks of GPT, of the
    encoder and decoder, of ViT and Swin stages); the root holds the rest (embeddings, head, final norm)."""
    units = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            units.extend(child for child in module if any(True for _ in child.parameters()))
    return units


class TaskLoss(nn.Module):
    """A task's training loss as one module call, ``(loss, count) = TaskLoss(task, model)(batch)``: DDP and FSDP
    act around ``forward()`` only, and some losses call several of the model's methods (NAT: encode, length
    head, parallel decoder; scheduled sampling: two decoder passes). ``forward`` is what the loss calls (the
    model, or its compiled form)."""

    PREFIX = "model."  # the model's parameter names inside the wrapper

    def __init__(self, task: Any, model: nn.Module, forward: Any = None) -> None:
        super().__init__()
        self.model, self.task = model, task
        self.__dict__["call"] = forward if forward is not None else model  # not registered again: one name each

    def forward(self, batch: Any) -> tuple[torch.Tensor, int]:
        return self.task.loss(self.call, batch)


def fully_shard_model(root: TaskLoss, precision: str) -> TaskLoss:
    """Shard the wrapped model in place (FSDP2): each block, then the wrapper as the root (its forward gathers
    the embeddings, head and final norm for the whole loss)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if precision == "bf16" else MixedPrecisionPolicy())
    for unit in shard_units(root.model):
        fully_shard(unit, mp_policy=policy)
    fully_shard(root, mp_policy=policy)
    return root


def _strip(name: str) -> str:
    return name[len(TaskLoss.PREFIX):] if name.startswith(TaskLoss.PREFIX) else name


def _rename_optimizer_state(state: dict[str, Any], rename: Any) -> dict[str, Any]:
    return {"state": {rename(k): v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [rename(n) for n in g["params"]]} for g in state["param_groups"]]}


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """Every parameter gathered as a plain tensor for the block (evaluation and decoding, which call parts of
    the model directly), sharded again after."""
    modules = fsdp_modules(model)
    for m in modules:
        m.set_reshard_after_forward(False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True)


def full_state(root: TaskLoss, optimizer: torch.optim.Optimizer | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The sharded model's full state dict (and the optimizer's, keyed by parameter name), gathered on every
    rank, on the CPU, named as the plain model names them. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    weights = {_strip(k): v.detach().cpu() for k, v in get_model_state_dict(root, options=options).items()}
    first: dict[int, str] = {}
    for name, param in root.model.named_parameters(remove_duplicate=False):  # tied weights: one tensor
        if id(param) in first and name in weights:
            weights[name] = weights[first[id(param)]]
        first.setdefault(id(param), name)
    optim = None
    if optimizer is not None:
        optim = _rename_optimizer_state(get_optimizer_state_dict(root, optimizer, options=options), _strip)
    return weights, optim


def load_sharded_optimizer(root: TaskLoss, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a full, name-keyed optimizer state into the sharded optimizer (every rank holds the full state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = _rename_optimizer_state(state, lambda name: TaskLoss.PREFIX + name)
    set_optimizer_state_dict(root, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))
