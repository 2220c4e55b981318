"""The preference-alignment corners of the CLI: ``tokenloom generate CKPT --prompt TEXT --best-of N --reward-model
RM`` (best-of-n sampling, :mod:`tokenloom.generation.best_of_n`, with a reward model trained by the ``reward`` task)
and ``tokenloom evaluate`` of a ``dpo`` or ``reward`` checkpoint. Importing this module imports no torch
(``main.py`` builds its parsers from it)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError
from .progress import print_result


def add_best_of_options(p: argparse.ArgumentParser) -> None:
    """``generate``'s best-of-n options."""
    p.add_argument("--best-of", type=int, default=None, metavar="N",
                   help="sample N completions (one batch, --temperature/--top-k/--top-p/--seed apply), score each "
                        "with --reward-model and print the best (the scores go to stderr); with --chat the reply")
    p.add_argument("--reward-model", default=None, metavar="CKPT",
                   help="with --best-of: a reward model checkpoint (`tokenloom train` with task: reward)")


def best_of_requested(args: argparse.Namespace) -> bool:
    """``generate`` runs best-of-n: --best-of or --reward-model given (alone: its one-line error)."""
    return getattr(args, "best_of", None) is not None or getattr(args, "reward_model", None) is not None


def generate_best_of(args: argparse.Namespace, unescape: Callable[[str], str]) -> int:
    """Load the model and the reward model, sample ``--best-of`` completions, print the best. ``unescape`` reads the
    backslash escapes of ``--stop`` and ``--chat`` as ``generate`` does (``commands.unescape``)."""
    if args.best_of is None or args.reward_model is None:
        raise ConfigError("--best-of N and --reward-model CKPT go together (N samples, scored by the reward model)")
    if args.best_of < 1:
        raise ConfigError(f"--best-of must be >= 1, got {args.best_of}")
    if args.greedy or args.temperature <= 0 or args.beam > 1 or args.num_samples != 1:
        raise ConfigError("--best-of samples its candidates: leave out --greedy, --beam and --num-samples and keep "
                          "--temperature > 0")
    if args.compile or args.exit_threshold is not None or args.draft is not None or args.prompt_lookup:
        raise ConfigError("--best-of decodes plainly: leave out --compile, --exit-threshold, --draft and "
                          "--prompt-lookup")
    from ..checkpoint import load_tokenizer
    from ..devices import device_of
    from ..generation import GenerationConfig
    from ..generation.best_of_n import best_of_n
    from ..models.registry import decoding_of
    from ..tasks.reward import load_scorer
    from .loading import load_inference_model
    from .vision import refuse_image_checkpoint

    refuse_image_checkpoint(args.checkpoint, "generate", "`tokenloom classify`")
    model, _ = load_inference_model(args.checkpoint, args.precision, args.device)
    if decoding_of(model) != "causal_lm":
        raise ConfigError("--best-of needs a causal language model (a translation model: use `tokenloom translate`)")
    tokenizer = load_tokenizer(args.checkpoint)
    scorer = load_scorer(args.reward_model, device=device_of(model))
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                              stop_strings=[unescape(text) for text in args.stop], eos_token_id=tokenizer.eos_id,
                              seed=args.seed)
    if args.chat is not None:  # the reply to one user turn, through the checkpoint's chat template
        from ..data.chat import template_for_tokenizer
        from ..generation.chat import chat_config, chat_prompt_ids

        template = template_for_tokenizer(tokenizer, setting="tokenizer.chat_template")
        message = unescape(args.chat)
        ids = chat_prompt_ids(template, tokenizer, [{"role": "user", "content": message}], model.config.max_seq_len)
        result = best_of_n(model, tokenizer, ids, args.best_of, chat_config(template, config),
                           batch_reward=scorer, prompt_text=message)
        print(result.text)
    else:
        result = best_of_n(model, tokenizer, args.prompt, args.best_of, config, batch_reward=scorer)
        print(args.prompt + result.text)
    scores = ", ".join(f"{s:.3f}" for s in result.scores)
    print(f"best of {args.best_of}: sample {result.index + 1} (reward {result.scores[result.index]:.3f}; "
          f"all: {scores})", file=sys.stderr)
    return 0


def evaluate_preference(args: argparse.Namespace, ckpt: Path, config: dict) -> int:
    """``evaluate`` of a ``dpo`` checkpoint (its preference metrics against the reference its config names) or a
    ``reward`` one (pairwise loss and accuracy) on its data section's split; ``--data FILE``: that pair file as the
    validation split."""
    if args.metrics or args.source or args.reference or args.stride is not None:
        raise ConfigError(f"a {config['task']} checkpoint reports its preference metrics: leave out --metrics, "
                          "--source, --reference and --stride")
    import torch

    from ..checkpoint import load_tokenizer
    from ..config import from_dict
    from .loading import load_inference_model

    model, _ = load_inference_model(ckpt, args.precision, args.device)
    tokenizer = load_tokenizer(ckpt)
    section = dict(config.get("data") or {})
    if args.data:
        section["val_path"] = args.data
    train = config.get("train") or {}
    max_length = section.get("max_length") or train.get("seq_len") or model.config.max_seq_len
    batch_size = args.batch_size or 16
    if config["task"] == "dpo":
        from ..tasks.preference import PreferenceDataConfig, PreferenceTask

        data = from_dict(PreferenceDataConfig, section, prefix="data")
        task = PreferenceTask.for_checkpoint(data, tokenizer, train.get("init_from"), batch_size=batch_size,
                                             max_length=max_length)
    else:
        from ..tasks.reward import RewardDataConfig, RewardTask

        data = from_dict(RewardDataConfig, section, prefix="data")
        task = RewardTask.for_checkpoint(data, tokenizer, batch_size=batch_size, max_length=max_length)
    start = time.perf_counter()
    with torch.no_grad():
        metrics = task.evaluate(model, max_batches=args.batches, split=args.split)
    result = {"checkpoint": str(ckpt), "data": args.data or data.val_path or data.path, "split": args.split,
              **metrics, "seconds": round(time.perf_counter() - start, 2)}
    print_result(result, args.json, width=18)
    return 0
