"""``tokenloom fit-exits CHECKPOINT``: train the exit heads of depth-adaptive early exit
(:mod:`tokenloom.training.exits`) and write them next to the checkpoint's weights (``exit_heads.safetensors``), where
``tokenloom generate --exit-threshold P`` finds them."""

from __future__ import annotations

import argparse
import sys
import time

from ..checkpoint import load_model, load_tokenizer, read_config, resolve_checkpoint
from ..errors import ConfigError
from .loading import command_device


def fit_exits(args: argparse.Namespace) -> int:
    import numpy as np

    from ..data.text import read_text
    from ..generation.early_exit import check_early_exit, save_exit_heads
    from ..nn.exits import ExitHeads
    from ..training.exits import random_windows, train_exit_heads

    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")
    ckpt = resolve_checkpoint(args.checkpoint)
    model, _ = load_model(ckpt)
    check_early_exit(model)
    c = model.config
    if args.seq_len > c.max_seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len of {c.max_seq_len}")
    data = read_config(ckpt).get("data") or {}
    path = args.data or data.get("path")
    if not path:
        raise ConfigError(f"{ckpt}/config.yaml names no data.path: give --data FILE")
    ids = np.asarray(load_tokenizer(ckpt).encode_array(read_text(path)), dtype=np.int64)
    train_ids = ids[:int(len(ids) * (1.0 - float(data.get("val_fraction", 0.1))))]
    if len(train_ids) < args.seq_len + 2:
        raise ConfigError(f"{path} holds {len(train_ids)} training tokens, too few for windows of {args.seq_len}")
    model = model.float().to(command_device(args.device).device)
    heads = ExitHeads.trained(model.final_norm, c.num_layers, c.norm, c.embed_dim, c.norm_eps)
    started = time.perf_counter()

    def log(step: int, loss: float) -> None:
        if step % 10 == 0 or step == args.steps:
            print(f"step {step}/{args.steps}: exit-head loss {loss:.4f} ({time.perf_counter() - started:.0f} s)",
                  file=sys.stderr, flush=True)

    losses = train_exit_heads(model, heads, random_windows(train_ids, args.batch_size, args.seq_len, args.seed),
                              args.steps, lr=args.lr, log=log)
    out = save_exit_heads(heads.cpu(), ckpt, {"steps": str(args.steps), "loss": f"{losses[-1]:.4f}",
                                              "data": str(path)})
    print(f"wrote {out} ({c.num_layers - 1} exit heads; last loss {losses[-1]:.4f}): "
          f"tokenloom generate {args.checkpoint} --exit-threshold 0.9")
    return 0
