"""Copy a trained run's checkpoint into a small, inference-only bundle (no optimizer state).

    python scripts/bundle_checkpoint.py runs/shakes-full checkpoints/shakespeare-char [--dtype bf16]

Weights are stored in bf16 by default (half the size; they load as float32). The bundle's
config.yaml keeps the recipe it was trained with; its checksums.json (written by write_checkpoint, the SHA-256 of
every file) is what every loader checks the files against.
"""

from __future__ import annotations

import argparse
import sys

import torch

from tokenloom.checkpoint import load_model, load_tokenizer, resolve_checkpoint, write_checkpoint
from tokenloom.errors import TokenloomError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="run or checkpoint directory")
    parser.add_argument("out", help="bundle directory to write")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args(argv)
    try:
        model, config = load_model(args.run)
        tokenizer = load_tokenizer(args.run)
    except TokenloomError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    out = write_checkpoint(args.out, model, config, tokenizer, dtype=dtype)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{resolve_checkpoint(args.run)} -> {out} ({size / 1e6:.1f} MB, weights in {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
