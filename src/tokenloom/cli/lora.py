"""``tokenloom lora info CKPT`` and ``tokenloom lora merge CKPT --out DIR``: a LoRA run's checkpoint (adapter files
and the base they name, :mod:`tokenloom.nn.lora`) described, or written as a standalone full checkpoint."""

from __future__ import annotations

import argparse

from ..checkpoint import adapter_base, merge_adapter_checkpoint, read_checked_adapter, resolve_checkpoint
from ..errors import CheckpointError
from ..nn.lora import ADAPTER_WEIGHTS, is_adapter


def info(args: argparse.Namespace) -> int:
    """Rank, alpha, targets, the adapted layers, the trainable parameters and the base (found and checked, or why
    not)."""
    ckpt = resolve_checkpoint(args.checkpoint)
    if not is_adapter(ckpt):
        raise CheckpointError(f"{ckpt} holds no LoRA adapter (adapter.json): a full checkpoint")
    spec, tensors = read_checked_adapter(ckpt)  # its files checked against checksums.json
    adapters = sum(t.numel() for key, t in tensors.items() if key.endswith((".lora_A.weight", ".lora_B.weight")))
    full = [key for key in tensors if not key.endswith((".lora_A.weight", ".lora_B.weight"))]
    try:
        base = f"{adapter_base(ckpt, spec)} (SHA-256 checked)"
    except CheckpointError as err:
        base = f"NOT USABLE: {err}"
    quantized = spec.quantized_base
    shown = ", ".join(spec.modules[:4]) + (f", ... ({len(spec.modules)} layers)" if len(spec.modules) > 4 else "")
    rows = [("checkpoint", str(ckpt)), ("rank", str(spec.rank)),
            ("alpha", f"{spec.alpha:g} (scale {spec.alpha / spec.rank:g})"), ("dropout", f"{spec.dropout:g}"),
            ("targets", ", ".join(spec.targets)), ("adapted", shown),
            ("trainable", f"{adapters + sum(tensors[k].numel() for k in full):,} parameters ({adapters:,} in the "
                          f"adapters" + (f", {len(full)} tensors trained in full)" if full else ")")),
            ("base", base),
            ("quantized base", f"int{quantized['bits']}" + (f" (group {quantized['group_size']})"
                                                             if quantized["bits"] == 4 else "")
             if quantized else "no"),
            ("file", f"{ckpt / ADAPTER_WEIGHTS} ({(ckpt / ADAPTER_WEIGHTS).stat().st_size / 1e6:.2f} MB)")]
    for key, value in rows:
        print(f"{key:>14}: {value}")
    return 0


def merge(args: argparse.Namespace) -> int:
    out, spec = merge_adapter_checkpoint(args.checkpoint, args.out, force=args.force)
    print(f"merged {resolve_checkpoint(args.checkpoint)} (rank {spec.rank}, {len(spec.modules)} layers) -> {out}: "
          "a full checkpoint")
    return 0
