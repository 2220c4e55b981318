"""Depth-adaptive early exit for decoding (Elbayad et al. 2020; CALM, Schuster et al. 2022): :class:`EarlyExit`.

Shape legend: B batch, T new positions in this call, C embed_dim, V vocab_size, L num_layers.

**The definition.** After each layer l < L, every position still running reads its exit head (:class:`~tokenloom.nn.
exits.ExitHeads`): when the largest softmax probability exceeds ``threshold`` (strictly: 1.0 never exits) the
position exits, and its output logits are that head's. An exited position's hidden state is frozen; the layers
above still compute and store its keys and values from the frozen state (state copying), so later positions attend
to well-defined entries at every layer. Each position decides from its own state only, so the pass stays causal.

**One body, two bindings** (:func:`exit_layers`): the layer loop with the exit decisions is written once, over
bound callables (:class:`Binding`):

* whole sequences (teacher forcing, a prompt's prefill): the blocks as modules; at each layer
  ``x = where(exited, x, block(x))`` (the block also stores the exited positions' keys and values);
* the one-token cached decode step: the blocks as the model's plain step functions. Once every row of the step has
  exited, each layer above only projects and stores the frozen state's keys and values
  (:func:`~tokenloom.nn.exits.frozen_block`): no queries, no attention, no output projection, no MLP. That is where
  the time goes down. With several rows, a layer is skipped only once all of them have exited (a row that runs on
  needs the block anyway): early exit pays most at batch 1.

Both give the same logits (to float rounding) and the same decisions. At threshold 1.0 the logits are the full
model's, bit for bit (the same blocks; the heads are read and never taken).

Which models can exit is declared here (:func:`declare_early_exit`), never probed: a model offers its layers'
inputs (``layer_inputs``), ``blocks``, ``final_norm``, ``forward_head``, ``decode_steps`` and ``create_cache`` (GPT).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..errors import CheckpointError, GenerationError
from ..models.gpt import GPT
from ..nn.attention import Context
from ..nn.block import StepFunctions
from ..nn.exits import ExitHeads, confident, frozen_block
from ..nn.quantized import is_quantized

EXIT_HEADS_FILE = "exit_heads.safetensors"  # trained exit heads, next to a checkpoint's model.safetensors

_EARLY_EXIT: set[type] = set()  # model classes that can exit early (see the module docstring)


def declare_early_exit(cls: type) -> type:
    """Declare that ``cls`` (and its subclasses) offers what :class:`EarlyExit` runs (see the module docstring)."""
    _EARLY_EXIT.add(cls)
    return cls


declare_early_exit(GPT)


def check_early_exit(model: object) -> None:
    """A one-line :class:`GenerationError` unless ``model`` was declared to exit early."""
    if not any(base in _EARLY_EXIT for base in type(model).__mro__):
        names = ", ".join(sorted(cls.__name__ for cls in _EARLY_EXIT))
        raise GenerationError(f"early exit (exit_threshold) needs a layered decoder-only model ({names}); "
                              f"{type(model).__name__} cannot exit early")
    if getattr(model.config, "memory_len", 0):
        raise GenerationError(f"early exit does not support a Transformer-XL memory (memory_len="
                              f"{model.config.memory_len})")
    if model.config.unet_skips:  # a declared model: a GPT, whose config has the field
        raise GenerationError("early exit does not support U-net skips (unet_skips=True): a frozen position's "
                              "skips would be undefined")
    if is_quantized(model):
        raise GenerationError("early exit runs float models only; this one is weight-only quantised (use its float "
                              "checkpoint)")


class Binding(NamedTuple):
    """The callables :func:`exit_layers` runs: one binding for whole sequences, one per batch size for steps."""

    blocks: list[Callable[[Tensor, Context], Tensor]]  # (x, ctx) -> x after the layer
    frozen: list[Callable[[Tensor, Context], None]]  # (x, ctx): store the layer's keys and values of frozen x
    heads: list[Callable[[Tensor], Tensor]]  # L - 1 exit heads: x (..., C) -> logits (..., V)
    final: Callable[[Tensor], Tensor]  # the last layer's head: final norm, then the output layer


def exit_layers(x: Tensor, contexts: list[Context], binding: Binding, threshold: float) -> tuple[Tensor, Tensor]:
    """The one body of early exit: x (..., C), the blocks' input -> (logits (..., V), layers (...) long: how many
    layers each position ran, its exit layer or L)."""
    L = len(binding.blocks)
    exited = out = layers = None  # (...) bool, (..., V) the exited positions' logits, (...) long; None: none yet
    done = False  # every position exited: the layers above only store keys and values
    for index, (block, ctx) in enumerate(zip(binding.blocks, contexts, strict=True)):
        if done:
            binding.frozen[index](x, ctx)
            continue
        y = block(x, ctx)
        x = y if exited is None else torch.where(exited.unsqueeze(-1), x, y)
        if index == L - 1:
            break
        logits = binding.heads[index](x)
        sure = confident(logits, threshold)
        if exited is None:
            if not bool(sure.any()):
                continue
            exited, out, layers = sure, logits, torch.where(sure, index + 1, L)
        else:
            newly = sure & ~exited
            out = torch.where(newly.unsqueeze(-1), logits, out)
            layers = torch.where(newly, index + 1, layers)
            exited = exited | sure
        done = bool(exited.all())
    if exited is None:
        return binding.final(x), torch.full(x.shape[:-1], L, dtype=torch.long, device=x.device)
    if done:
        return out, layers
    return torch.where(exited.unsqueeze(-1), out, binding.final(x)), layers


@dataclass
class ExitTally:
    """How many layers the one-token decode steps ran: ``positions`` decoded, ``layers`` summed over them."""

    num_layers: int
    positions: int = 0
    layers: int = 0

    def add(self, layers: Tensor) -> None:
        self.positions += layers.numel()
        self.layers += int(layers.sum())

    @property
    def mean_layers(self) -> float:
        return self.layers / self.positions if self.positions else float("nan")


class ExitOutput(NamedTuple):
    logits: Tensor  # (B, T, V)
    layers: Tensor  # (B, T) long: the layers each position ran (its exit layer, or L)


class EarlyExit:
    """``model`` with early exit at ``threshold`` through ``heads`` (default: shared, the model's final norm and
    output layer at every layer): callable like the model in the decoding protocol, ``(ids (B, T), positions=,
    attention_mask=, cache=) -> (B, T, V)``, with ``create_cache`` and ``config`` the model's. ``tally`` (optional)
    adds the layers each one-token step ran. The model must be in eval mode (generate puts it there)."""

    def __init__(self, model: nn.Module, threshold: float, heads: ExitHeads | None = None,
                 tally: ExitTally | None = None) -> None:
        check_early_exit(model)
        if not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and 0 < threshold <= 1):
            raise GenerationError(f"exit threshold must be in (0, 1] (1 = never exit), got {threshold!r}")
        L = model.config.num_layers
        heads = heads if heads is not None else ExitHeads.shared(L)
        if heads.num_layers != L:
            raise GenerationError(f"exit heads for {heads.num_layers} layers do not fit a model of {L} layers")
        self.model, self.threshold, self.heads, self.tally = model, float(threshold), heads, tally
        self.config = model.config
        self._whole: Binding | None = None
        self._step: tuple[StepFunctions, Binding] | None = None  # the step functions it was bound to, and it

    def create_cache(self, *args, **kwargs):
        return self.model.create_cache(*args, **kwargs)

    def __call__(self, input_ids: Tensor, *, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                 cache=None) -> Tensor:
        return self.forward_layers(input_ids, positions=positions, attention_mask=attention_mask, cache=cache).logits

    def forward_layers(self, input_ids: Tensor, *, positions: Tensor | None = None,
                       attention_mask: Tensor | None = None, cache=None) -> ExitOutput:
        """(B, T) ids -> (B, T, V) logits under early exit and (B, T) layers run per position."""
        model = self.model
        if model.training:
            raise GenerationError("early exit runs in eval mode (model.eval())")
        B, T = input_ids.shape
        steps = model.decode_steps(cache, T) if T == 1 else None  # the exit loop binds one position per row
        x, contexts = model.layer_inputs(input_ids, positions, attention_mask, cache, False, steps)
        rows = cache.batch_size if steps is not None else None
        logits, layers = exit_layers(x, contexts, self._binding(steps, rows), self.threshold)
        if cache is not None:
            cache.advance(T)
        if steps is not None:  # (B, V), (B,): one position per row
            logits, layers = logits.view(B, 1, -1), layers.view(B, 1)
        if self.tally is not None and T == 1:
            self.tally.add(layers)
        return ExitOutput(logits, layers)

    def _binding(self, steps: StepFunctions | None, rows: int | None) -> Binding:
        """The whole-sequence binding (``steps`` None: the modules), or the one bound to ``steps`` for ``rows``
        rows (made anew when the step functions change: another cache, or stopped rows left the batch)."""
        model, heads = self.model, self.heads
        if steps is None:
            if self._whole is None:
                norms = heads.norm_functions(model.final_norm, plain=False)
                self._whole = Binding(
                    blocks=[_module_call(block) for block in model.blocks],
                    frozen=[frozen_block(block, None) for block in model.blocks],
                    heads=[_head(norm, model.forward_head) for norm in norms],
                    final=_head(model.final_norm, model.forward_head))
            return self._whole
        if self._step is None or self._step[0] is not steps:
            norms = heads.norm_functions(steps.final_norm, plain=True)
            self._step = (steps, Binding(blocks=steps.blocks,
                                         frozen=[frozen_block(block, rows) for block in model.blocks],
                                         heads=[_head(norm, steps.head) for norm in norms],
                                         final=_head(steps.final_norm, steps.head)))
        return self._step[1]


def _module_call(block: nn.Module) -> Callable[[Tensor, Context], Tensor]:
    return lambda x, ctx: block(x, ctx)[0]


def _head(norm: Callable[[Tensor], Tensor], head: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    return lambda x: head(norm(x))


@torch.inference_mode()
def early_exit_logits(model: nn.Module, input_ids: Tensor, threshold: float,
                      heads: ExitHeads | None = None) -> ExitOutput:
    """Teacher forcing under early exit: (B, T) ids -> (B, T, V) logits and (B, T) layers run, one pass without a
    cache (the model in eval mode)."""
    return EarlyExit(model, threshold, heads).forward_layers(input_ids)


# --- trained heads on disk ------------------------------------------------------------------------------------------

def save_exit_heads(heads: ExitHeads, directory: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write trained ``heads`` to ``directory/exit_heads.safetensors`` (a temporary name, then renamed)."""
    from safetensors.torch import save_file

    if heads.norms is None:
        raise ValueError("shared exit heads have no weights to save")
    path = Path(directory) / EXIT_HEADS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tensors = {name: t.detach().contiguous().cpu() for name, t in heads.state_dict().items()}
    save_file(tensors, str(tmp), metadata={"kind": "trained", "num_layers": str(heads.num_layers),
                                           **(metadata or {})})
    tmp.replace(path)
    return path


def load_exit_heads(directory: str | Path, model: nn.Module) -> ExitHeads:
    """The trained exit heads saved next to ``model``'s checkpoint in ``directory``, on the model's device and
    dtype; a one-line :class:`CheckpointError` when there are none or they do not fit the model."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / EXIT_HEADS_FILE
    if not path.is_file():
        raise CheckpointError(f"no trained exit heads in {directory} ({EXIT_HEADS_FILE}); train them with "
                              f"`tokenloom fit-exits {directory}` or use --exit-heads shared")
    check_early_exit(model)
    c = model.config
    heads = ExitHeads.trained(model.final_norm, c.num_layers, c.norm, c.embed_dim, c.norm_eps)
    try:
        with safe_open(str(path), framework="pt") as f:
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no iteration
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from None
    expected = heads.state_dict()
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
        raise CheckpointError(f"{path} holds exit heads of another shape than this model's ({c.num_layers} layers, "
                              f"embed_dim {c.embed_dim}, {c.norm})")
    heads.load_state_dict(state)
    ref = model.tok_embed.weight
    return heads.to(device=ref.device, dtype=ref.dtype).eval()
