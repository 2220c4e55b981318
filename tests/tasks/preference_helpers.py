"""Tiny language-model checkpoints and preference files for the preference, reward and best-of-n tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tokenloom.checkpoint import read_config, write_checkpoint
from tokenloom.data.tokenizers import Tokenizer
from tokenloom.models.factory import model_config_to_dict
from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.training import load_run_config, setup_run

WORDS = ["cat", "dog", "sun", "moon", "tree", "fish", "bird", "rock"]
PAIRS = [{"prompt": f"say {w}", "chosen": f"{w} ok", "rejected": f"{w} bad"} for w in WORDS]
ALPHABET = "System: User: Assistant: \n" + "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?0123456789"


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def make_lm_checkpoint(directory: Path, *, seed: int = 0, embed_dim: int = 32, max_seq_len: int = 64,
                       tie_embeddings: bool = True) -> Path:
    """A random 2-layer GPT over a character vocabulary that spells the default chat template and the test data."""
    tok = Tokenizer.train_char(ALPHABET)
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=tok.vocab_size, num_layers=2, num_heads=2, embed_dim=embed_dim,
                       max_seq_len=max_seq_len, tie_embeddings=tie_embeddings)
    return write_checkpoint(directory, GPT(config), {"model": model_config_to_dict("gpt", config), "tokenizer": {}},
                            tok)


def run(task: str, data: dict[str, Any], out: Path, *, init_from: Path | None, steps: int = 30,
        resume: bool = False, **train: Any):
    """A Trainer for ``task`` on the CPU in fp32 (not yet fitted); ``resume``: the run recorded in ``out``, as
    ``tokenloom train --resume`` reads it."""
    if resume:
        return setup_run(load_run_config(read_config(out)), out, resume=True, show_progress=False)
    config = load_run_config({"task": task, "data": data, "train": {
        **({"init_from": str(init_from)} if init_from is not None else {}), "max_steps": steps, "batch_size": 4,
        "lr": 3e-3, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0, "device": "cpu", "precision": "fp32",
        **train}})
    return setup_run(config, out, resume=resume, show_progress=False)
