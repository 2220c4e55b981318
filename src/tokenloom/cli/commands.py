"""The work behind each CLI command; each returns the process exit status."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..checkpoint import load_model, load_tokenizer, read_config, resolve_checkpoint
from ..devices import device_of
from ..errors import CheckpointError, ConfigError, DataError, GenerationError, TrainingError
from ..generation.config import offset_seed
from ..models.registry import decoding_of
from .loading import load_inference_model, translation_model
from .progress import print_result, print_speed, progress


def train(args: argparse.Namespace) -> int:
    from ..devices import Accelerators, training_device
    from ..hardware import choose_precision, machine
    from ..training import load_run_config, setup_run
    from ..training.config import check_bundled_paths
    from ..training.distributed import resolve_backend, session, torchrun_world

    if args.strategy:
        args.overrides = [*args.overrides, f"train.strategy={args.strategy}"]
    if args.device:
        args.overrides = [*args.overrides, f"train.device={args.device}"]
    if args.nproc is not None and args.nproc < 1 or args.max_restarts < 0:
        raise ConfigError(f"--nproc must be >= 1 and --max-restarts >= 0, got {args.nproc} and {args.max_restarts}")
    out = Path(args.out)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart and not args.resume and (out / "checkpoint").exists():
        args.resume = True  # torchrun restarted the processes after a failure: continue the run
        if os.environ.get("RANK", "0") == "0":
            print(f"restart {restart}: resuming from the newest intact checkpoint in {out}", file=sys.stderr)
    if args.resume:
        if not args.recipe and not out.exists():
            raise ConfigError(f"--resume: no run directory at {out}")
        try:
            recorded = read_config(out)
        except CheckpointError:  # its config.yaml damaged: the recipe of the checkpoint the run resumes from
            import warnings

            from ..training.setup import newest_intact_checkpoint

            with warnings.catch_warnings():  # (setup_run says it, once, when it resumes from there)
                warnings.simplefilter("ignore")
                recorded = read_config(newest_intact_checkpoint(out))
        if "quantization" in recorded:  # a weight-only quantised checkpoint: one line, before the recipe check
            from ..checkpoint import refuse_quantized

            refuse_quantized(out, "resuming a run")
        config = load_run_config(recorded, args.overrides)
    else:
        if not args.recipe:
            raise ConfigError("a recipe is needed (or --resume to continue a run)")
        if (out / "checkpoint").exists():
            raise ConfigError(f"{out} already holds a checkpoint: add --resume to continue it, or choose "
                              f"another --out")
        config = load_run_config(args.recipe, args.overrides)
        check_bundled_paths(config)  # a packaged recipe outside the repository: where its data/ is, in one line
    if args.sample and config.task == "image_classification":
        raise ConfigError("--sample applies to language models; try `tokenloom classify RUN IMAGE` after training")
    world = torchrun_world()
    device = training_device(config.train.device, local_rank=world[2] if world is not None else None).device
    if config.train.precision == "fp16":
        choose_precision("fp16", device=device)  # CUDA only: one line before any data is prepared
    if args.nproc is None:  # --device cuda: one process per GPU
        args.nproc = Accelerators.detect().cuda if config.train.device.strip().lower() == "cuda" else 1
    if args.nproc > 1 and world is None:
        if config.train.strategy == "single":
            raise ConfigError(f"--nproc {args.nproc} with train.strategy=single: use --strategy ddp or fsdp")
        resolve_backend(config.train.backend, device.type)  # an unavailable backend: one line here, not one per process
        return _launch(args)
    t = config.train
    if t.backend != "auto" and (world is None or world[1] == 1) and t.strategy in ("auto", "single"):
        resolve_backend(t.backend, device.type)  # impossible here too (nccl on a CPU): one line
        print(f"note: train.backend={t.backend} applies to several processes (--nproc N); one process trains "
              "without a process group", file=sys.stderr)
    with session(t.strategy, t.backend, device.type) as where:
        trainer = setup_run(config, out, resume=args.resume, dist=where)
        trainable, n_params = trainer.parameter_counts
        say = (lambda text: print(text, file=sys.stderr)) if where.is_main else (lambda text: None)
        for notice in trainer.notices:  # a resume that keeps the run's learning-rate schedule
            say(notice)
        how = f", {where.world_size} processes ({where.strategy}, {where.backend})" if where.active else ""
        part = f", {trainable:,} trainable ({100 * trainable / n_params:.2f}%)" if trainable != n_params else ""
        say(f"training {config.task} model ({n_params / 1e6:.2f}M parameters{part}, {trainer.precision.precision}"
            f"{how}) "
            f"for {t.max_steps} steps from step {trainer.step} -> {out}")
        say(f"{trainer.device_choice.describe()}; {trainer.precision.describe()}; {machine().describe()}")
        try:
            summary = trainer.fit()
        except RuntimeError as err:
            if not where.active or not _lost_peer(err):
                raise
            raise TrainingError(f"process {where.rank}: lost contact with the other training processes "
                                f"({str(err).splitlines()[0][-160:]})") from None
    from ..metric_scope import scoped_name
    from ..tasks import TASKS

    # only the figures this run has (a Ctrl-C before the first step or evaluation has none to print, not nan); the
    # validation ones named by the part of the split they cover (val_loss[20 of 28 batches], val_loss[whole split])
    figures = [f"{scoped_name(name, summary)} {summary[name]:.{digits}f}"
               for name, digits in (("train_loss", 4), *TASKS.get(config.task).summary_metrics)
               if isinstance(summary.get(name), float | int) and math.isfinite(summary[name])]
    memory = f", peak {summary['peak_memory_mb']:,.0f} MB on {summary['device']}" if "peak_memory_mb" in summary else ""
    say(f"step {summary['step']}: " + "".join(f + "  " for f in figures)
        + f"({summary['stopped_by']}, {summary['seconds']:.0f}s{memory})")
    say(f"checkpoint: {trainer.checkpoint_dir}")
    if args.sample and where.is_main:
        model = (trainer.model if not where.active else load_model(trainer.checkpoint_dir)).eval()
        sample = _stream_text(model, trainer.tokenizer, "\n", _gen_config(max_new_tokens=args.sample,
                                                                           temperature=0.8, top_k=40, seed=t.seed))
        trainer.log_text("sample", sample)  # train.log_to tensorboard: the sample beside the curves
    return 0


def _lost_peer(err: RuntimeError) -> bool:
    """A collective that failed because another process died or hung (gloo's connection errors, timeouts)."""
    import torch.distributed as dist

    kinds = tuple(getattr(dist, name) for name in ("DistError", "DistBackendError", "DistNetworkError")
                  if hasattr(dist, name))
    text = str(err)
    return isinstance(err, kinds) or "gloo" in text or "Connection reset" in text or "Connection closed" in text


def _launch(args: argparse.Namespace) -> int:
    """``tokenloom train ... --nproc N``: run N copies of this command through torchrun's launcher (what
    ``torchrun --standalone --nproc-per-node N --max-restarts K -m tokenloom train ...`` does), each with
    ``N`` threads' share of the cores. Every process prints its own errors; a failure ends here in one line."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    command = ["-m", "tokenloom", "train", *([args.recipe] if args.recipe else []), "--out", str(args.out)]
    for override in args.overrides:
        command += ["--set", override]
    command += ["--resume"] * args.resume + (["--sample", str(args.sample)] if args.sample else [])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # our own lines say it
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=args.max_restarts,
                          monitor_interval=0.5)
    try:
        elastic_launch(config, sys.executable)(*command)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()  # the root cause; the launcher stopped the others
        code = failure.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
               else f"failed with exit code {code} (its message is above)")
        restarts = f" after {args.max_restarts} restart(s)" if args.max_restarts else ""
        raise TrainingError(f"training process {rank} {how}{restarts}; the newest intact checkpoint stays in "
                            f"{args.out} (continue with --resume)") from None
    return 0


def _gen_config(**kwargs):
    from ..generation import GenerationConfig

    return GenerationConfig(**kwargs)


def _continuation(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt``: decoded together, so tokenizers whose decoding depends on
    the position (SentencePiece-style ones drop a leading space at the start) print it correctly."""
    head = tokenizer.decode(prompt[-64:])
    whole = tokenizer.decode(prompt[-64:] + new)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new)


def _stream_text(model, tokenizer, prompt: str, config, speed=None, **decoding) -> str:  # noqa: ANN001
    """Print ``prompt`` and its continuation as the tokens arrive; returns the continuation.

    Past the context: a model with an ``attention_window`` (a rolling cache) or a Transformer-XL ``memory_len``
    whose positions extrapolate decodes on in one run. Any other model generates in chunks when the prompt
    plus ``max_new_tokens`` exceeds its context; once the context is full, the last half of it becomes the
    prompt of the next chunk (its cache is rebuilt), so earlier text falls out of view. A stop string that
    straddles two chunks is not seen. ``decoding`` goes to :func:`~tokenloom.generation.stream` (``exit_heads``,
    ``exit_tally``). ``speed`` (a :class:`~tokenloom.speed.Speed`, its counts at 0) gets this run added: the prompt's
    tokens, the time to the first new token, the new tokens and the time from the first prompt token in to the last
    new token out (the chunks' prefills after the first count as decoding time).
    """
    from dataclasses import replace

    from ..generation import stream

    ids = tokenizer.encode(prompt)
    if not ids:
        raise GenerationError("the prompt is empty after tokenization")
    context = model.config.max_seq_len
    # a sliding-window model (rolling cache) or a Transformer-XL one (memory) whose positions extrapolate decodes
    # past its context in one run: no chunks
    unbounded = getattr(model.config, "max_positions", context) is None
    if len(ids) >= context and not unbounded:
        raise GenerationError(f"prompt of {len(ids)} tokens leaves no room in the model's context of {context}")
    sys.stdout.write(prompt)
    sys.stdout.flush()
    new: list[int] = []
    shown = ""
    remaining, window, chunk = config.max_new_tokens, ids, 0
    start, first = time.perf_counter(), None
    while remaining > 0:
        steps = remaining if unbounded else min(remaining, context - len(window))
        seed = offset_seed(config.seed, chunk)
        produced = 0
        for token in stream(model, torch.tensor([window], device=device_of(model)),
                            replace(config, max_new_tokens=steps, seed=seed),
                            tokenizer=tokenizer, **decoding):
            new.append(int(token[0]))
            if first is None:
                first = time.perf_counter()
            produced += 1
            text = _continuation(tokenizer, ids, new)
            if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
                continue
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
        remaining -= produced
        if produced < steps:  # EOS or a stop string ended it
            break
        window = (ids + new)[-(context // 2):]
        chunk += 1
    if speed is not None:
        end = time.perf_counter()
        speed.prompt_tokens += len(ids)
        speed.prompts += first is not None
        speed.first_token_seconds += (first if first is not None else end) - start
        speed.new_tokens += len(new)
        speed.seconds += end - start
    text = _continuation(tokenizer, ids, new)
    sys.stdout.write(text[len(shown):] + "\n")
    sys.stdout.flush()
    return text


def generate(args: argparse.Namespace) -> int:
    from .index import generate_rag, rag_requested

    if rag_requested(args):  # --rag INDEX (or a RAG flag without it: its one-line error): cli/index.py
        return generate_rag(args, unescape)
    from .preference import best_of_requested, generate_best_of

    if best_of_requested(args):  # --best-of N --reward-model CKPT (or one without the other): cli/preference.py
        return generate_best_of(args, unescape)
    if args.num_samples < 1:
        raise ConfigError(f"--num-samples must be >= 1, got {args.num_samples}")
    from .vision import refuse_image_checkpoint

    refuse_image_checkpoint(args.checkpoint, "generate", "`tokenloom classify`")
    loading = time.perf_counter()  # --verbose: the load time, printed apart from the work's figures
    model, _ = load_inference_model(args.checkpoint, args.precision, args.device)
    tokenizer = load_tokenizer(args.checkpoint)
    if getattr(model, "decoder_for", None) is not None:
        raise ConfigError("this is a translation model: use `tokenloom translate`")
    if args.chat is not None:
        return _generate_chat(args, model, tokenizer)
    if args.beam > 1:
        if args.compile:
            raise ConfigError(f"--compile applies to greedy decoding and sampling; beam search (--beam {args.beam}) "
                              "runs eagerly")
        _early_exit(args, model)  # beam search refuses early exit in one line (its config)
        if args.draft is not None or args.prompt_lookup:
            raise ConfigError(f"--draft and --prompt-lookup apply to greedy decoding and sampling; beam search "
                              f"(--beam {args.beam}) verifies no drafts")
        return _generate_beam(args, model, tokenizer, loading)
    if args.beam < 1:
        raise ConfigError(f"--beam must be >= 1, got {args.beam}")
    decoding, kind = _early_exit(args, model)
    decoding.update(_speculative(args, model, tokenizer))
    speed = None
    if args.verbose:  # the samples' figures added up (the load time: model, tokenizer, drafter, exit heads)
        from ..speed import Speed

        speed = Speed(seconds=0.0, new_tokens=0, prompt_tokens=0, first_token_seconds=0.0, prompts=0,
                      load_seconds=time.perf_counter() - loading)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        seed = offset_seed(args.seed, i)
        config = _gen_config(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             do_sample=not args.greedy and args.temperature > 0, top_k=args.top_k,
                             top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                             stop_strings=[unescape(text) for text in args.stop], eos_token_id=tokenizer.eos_id,
                             seed=seed, compile=args.compile, exit_threshold=args.exit_threshold,
                             prompt_lookup=args.prompt_lookup, num_draft_tokens=args.num_draft_tokens)
        _stream_text(model, tokenizer, args.prompt, config, speed=speed, **decoding)
    tally = decoding.get("exit_tally")
    if args.verbose and tally is not None:
        print(f"early exit at {args.exit_threshold:g} ({kind} heads): {tally.mean_layers:.2f} of "
              f"{tally.num_layers} layers per token on average over {tally.positions} tokens", file=sys.stderr)
    if speed is not None:
        print_speed(_with_drafts(speed, decoding.get("draft_tally"), args))
    return 0


def _generate_chat(args: argparse.Namespace, model, tokenizer) -> int:
    """``--chat MESSAGE``: the reply to one user turn, rendered with the checkpoint's chat template; greedy or
    sampled (``--num-samples`` replies), stopping at the template's end marker and at ``--stop`` texts."""
    from ..data.chat import template_for_tokenizer
    from ..generation.chat import generate_reply

    if args.beam > 1 or args.compile or args.exit_threshold is not None or args.draft or args.prompt_lookup:
        raise ConfigError("--chat decodes greedily or by sampling: leave out --beam, --compile, --exit-threshold, "
                          "--draft and --prompt-lookup")
    template = template_for_tokenizer(tokenizer, setting="tokenizer.chat_template")
    messages = [{"role": "user", "content": unescape(args.chat)}]
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        config = _gen_config(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             do_sample=not args.greedy and args.temperature > 0, top_k=args.top_k, top_p=args.top_p,
                             repetition_penalty=args.repetition_penalty,
                             stop_strings=[unescape(text) for text in args.stop], seed=offset_seed(args.seed, i))
        print(generate_reply(model, tokenizer, template, messages, config))
    return 0


def _speculative(args: argparse.Namespace, model, tokenizer) -> dict:
    """``--draft`` / ``--prompt-lookup`` / ``--num-draft-tokens``: the speculative arguments of ``stream``
    (``draft``: the draft model, loaded like the model and checked to share its tokenizer; ``draft_tally``), {}
    without speculative decoding. Bad values and conflicts fail in one line before anything else loads."""
    if args.draft is None and not args.prompt_lookup:
        if args.num_draft_tokens != 4:
            raise ConfigError("--num-draft-tokens applies to speculative decoding: give --draft or --prompt-lookup")
        return {}
    if args.draft is not None and args.prompt_lookup:
        raise ConfigError("--draft and --prompt-lookup are two drafters: give one")
    _gen_config(num_draft_tokens=args.num_draft_tokens, prompt_lookup=args.prompt_lookup)  # their one-line errors
    from ..generation import DraftTally

    found = {"draft_tally": DraftTally()}
    if args.draft is not None:
        from ..generation import check_draft_tokenizer
        from ..models.registry import decoding_of

        draft, _ = load_inference_model(args.draft, args.precision, args.device)
        if decoding_of(draft) != decoding_of(model):
            raise ConfigError(f"--draft {args.draft} decodes as {decoding_of(draft)!r} and the model as "
                              f"{decoding_of(model)!r}: the drafter must be the same kind of model")
        check_draft_tokenizer(tokenizer, load_tokenizer(args.draft))
        found["draft"] = draft
    return found


def _drafter(args: argparse.Namespace) -> str:
    """``draft model RUN, k = 4`` / ``prompt lookup (n <= 3), k = 4``."""
    drafter = f"draft model {args.draft}" if args.draft is not None else f"prompt lookup (n <= {args.prompt_lookup})"
    return f"{drafter}, k = {args.num_draft_tokens}"


def speculative_summary(tally, args: argparse.Namespace) -> str:
    """The line of a speculative run: acceptance, drafts kept and tokens per pass of the model (the ``speculative``
    figure of :func:`tokenloom.speed.speed_parts`, in a line of its own)."""
    from ..speed import draft_text

    return (f"speculative decoding with {_drafter(args)}: "
            + draft_text(tally.drafted, tally.accepted, tally.rounds, tally.rows, tally.emitted))


def _with_drafts(speed, tally, args: argparse.Namespace):  # noqa: ANN001, ANN202 - a Speed and a DraftTally
    """``speed`` with a speculative run's figures from its :class:`~tokenloom.generation.DraftTally` (unchanged
    without one)."""
    if tally is not None:
        speed.drafted, speed.accepted, speed.passes = tally.drafted, tally.accepted, tally.rounds
        speed.rows, speed.emitted, speed.drafter = tally.rows, tally.emitted, _drafter(args)
    return speed


def _early_exit(args: argparse.Namespace, model) -> tuple[dict, str | None]:
    """``--exit-threshold`` / ``--exit-heads``: the early-exit arguments of ``stream`` (``exit_heads``: trained ones
    loaded from the checkpoint; ``exit_tally``) and the heads' kind; ({}, None) without early exit."""
    if args.exit_threshold is None:
        if args.exit_heads is not None:
            raise ConfigError(f"--exit-heads {args.exit_heads} applies to early exit: give --exit-threshold too")
        return {}, None
    from ..generation.early_exit import EXIT_HEADS_FILE, ExitTally, check_early_exit, load_exit_heads

    # a bad value, or beam search / --compile with early exit: the config's one-line error, before anything loads
    _gen_config(exit_threshold=args.exit_threshold, compile=args.compile, num_beams=max(args.beam, 1),
                do_sample=args.beam <= 1)
    check_early_exit(model)
    ckpt = resolve_checkpoint(args.checkpoint)
    kind = args.exit_heads or ("trained" if (ckpt / EXIT_HEADS_FILE).is_file() else "shared")
    heads = load_exit_heads(ckpt, model) if kind == "trained" else None
    return {"exit_heads": heads, "exit_tally": ExitTally(model.config.num_layers)}, kind


def _generate_beam(args: argparse.Namespace, model, tokenizer, loading: float) -> int:
    """Beam search: the ``--num-samples`` best hypotheses with their scores (no streaming: the best is
    known only at the end; no sliding window: prompt + new tokens must fit the context). ``--verbose``: the speed
    figures, the new tokens those of the best hypothesis (``loading``: when the model began to load)."""
    from ..generation import beam_search

    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise GenerationError("the prompt is empty after tokenization")
    context = model.config.max_seq_len
    new = min(args.max_new_tokens, context - len(ids))
    if new < 1:
        raise GenerationError(f"prompt of {len(ids)} tokens leaves no room in the model's context of {context}")
    config = _gen_config(max_new_tokens=new, do_sample=False, num_beams=args.beam,
                         exit_threshold=args.exit_threshold,
                         num_return_sequences=min(args.num_samples, args.beam), length_penalty=args.length_penalty,
                         no_repeat_ngram_size=args.no_repeat_ngram_size, eos_token_id=tokenizer.eos_id)
    loaded = time.perf_counter()
    with torch.inference_mode():
        out = beam_search(model, torch.tensor([ids], device=device_of(model)), config, tokenizer=tokenizer)
    seconds = time.perf_counter() - loaded
    for k in range(out.sequences.shape[1]):
        if out.sequences.shape[1] > 1:
            print(f"--- hypothesis {k + 1} (score {float(out.scores[0, k]):.4f}) ---")
        tokens = out.sequences[0, k, len(ids):len(ids) + int(out.lengths[0, k])].tolist()
        print(args.prompt + _continuation(tokenizer, ids, tokens))
    if args.verbose:
        from ..speed import Speed

        print_speed(Speed(seconds, new_tokens=int(out.lengths[0, 0]), prompt_tokens=len(ids),
                          decoding=f"beam {args.beam}", load_seconds=loaded - loading))
    return 0


def evaluate(args: argparse.Namespace) -> int:
    from ..data.text import TextDataset
    from ..tasks import LMTask

    for name in ("batch_size", "batches", "stride"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    ckpt = resolve_checkpoint(args.checkpoint)
    config = read_config(ckpt)
    if config.get("task") == "image_classification":
        from .vision import evaluate_image

        _no_speed_figures(args, config)
        return evaluate_image(args, ckpt, config)
    if config.get("task", "lm") in ("translation", "nat_translation") or \
            (config.get("model") or {}).get("family") in ("seq2seq", "nat"):
        return _evaluate_translation(args, ckpt, config)
    if args.split not in ("train", "val"):
        raise ConfigError(f"--split for a language model is 'train' or 'val', got {args.split!r}")
    if config.get("task") == "sft" and not args.data:  # the loss on the response tokens of its conversations
        return _evaluate_sft(args, ckpt, config)
    if config.get("task") in ("dpo", "reward"):  # preference metrics on its pairs (cli/preference.py)
        from .preference import evaluate_preference

        _no_speed_figures(args, config)
        return evaluate_preference(args, ckpt, config)
    if args.metrics or args.source or args.reference:
        raise ConfigError("--metrics, --source and --reference apply to translation models; a language model "
                          "reports loss and perplexity")
    loading = time.perf_counter()
    model, _ = load_inference_model(ckpt, args.precision, args.device)
    tokenizer = load_tokenizer(ckpt)
    load_seconds = time.perf_counter() - loading
    data = config.get("data") or {}
    if not args.data and not data.get("path"):
        raise ConfigError(f"{ckpt} records no training data (an imported checkpoint?): pass --data FILE")
    path = Path(args.data or data["path"])
    seq_len = (config.get("train") or {}).get("seq_len") or model.config.max_seq_len
    if args.stride is not None and args.stride > seq_len:
        raise ConfigError(f"--stride must be at most the model's window of {seq_len} tokens, got {args.stride}")
    with tempfile.TemporaryDirectory(prefix="tokenloom-eval-") as tmp:
        text = path
        if not args.data and data.get("format") == "hf":  # the recorded table's text column, as training read it
            from ..config import from_dict
            from ..tasks.lm import LMDataConfig, text_file

            text = text_file(from_dict(LMDataConfig, data, prefix="data"), Path(tmp))
        dataset = TextDataset.prepare(text, tokenizer, tmp, val_fraction=data.get("val_fraction", 0.1))
        memory_len = getattr(model.config, "memory_len", 0)  # Transformer-XL: over streams, with its memory
        rows = args.batch_size or 16
        if memory_len and not args.batch_size:  # as many streams (of at least one segment) as the split holds
            rows = max(1, min(rows, (dataset.num_tokens(args.split) - 1) // seq_len))
        task = LMTask(dataset, batch_size=rows, seq_len=seq_len, memory_len=memory_len,
                      order="stream" if memory_len else "random")
        targets = dataset.num_tokens(args.split) - 1
        windows = targets // seq_len  # the split's whole windows of seq_len tokens
        if memory_len:  # segments x streams
            windows = task.eval_split_batches(args.split) * task.batch_size
        if args.batches is not None:
            windows = min(windows, args.batches * task.batch_size)
        expected = (targets if args.stride is not None and args.batches is None else windows * seq_len) or None
        start = time.perf_counter()
        with progress("evaluate", expected if windows > 0 else None, "evaluated", "token") as done:
            metrics = task.evaluate(model, max_batches=args.batches, split=args.split, progress=done,
                                    stride=args.stride)
        seconds = time.perf_counter() - start
    tokens = metrics.pop("tokens", None)
    result = {"checkpoint": str(ckpt), "data": str(path), "split": args.split,
              **({"window": seq_len, "stride": args.stride} if args.stride is not None else {}), **metrics,
              "seconds": round(seconds, 2)}
    if tokens:
        result["tokens"] = tokens
        result["tokens_per_s"] = round(tokens / seconds, 1)
    print_result(result, args.json)
    if args.verbose:
        from ..speed import Speed

        print_speed(Speed(seconds, scored_tokens=tokens or 0, load_seconds=load_seconds))
    return 0


def _no_speed_figures(args: argparse.Namespace, config: dict) -> None:
    """``evaluate --verbose`` of a checkpoint whose evaluation has no speed figures: a note, not silence."""
    if args.verbose:
        print(f"note: --verbose prints speed figures for language and translation models; a {config['task']} "
              "checkpoint's evaluation reports its seconds with its metrics", file=sys.stderr)


def _evaluate_sft(args: argparse.Namespace, ckpt: Path, config: dict) -> int:
    """``evaluate`` of an sft checkpoint: the mean cross-entropy over the response tokens of its conversations."""
    from ..config import from_dict
    from ..models.registry import takes_documents
    from ..tasks.sft import SFTDataConfig, SFTTask

    if args.metrics or args.source or args.reference or args.stride is not None:
        raise ConfigError("an sft checkpoint reports loss and perplexity over the response tokens: leave out "
                          "--metrics, --source, --reference and --stride")
    loading = time.perf_counter()
    model, _ = load_inference_model(ckpt, args.precision, args.device)
    load_seconds = time.perf_counter() - loading
    data = from_dict(SFTDataConfig, config.get("data") or {}, prefix="data")
    seq_len = (config.get("train") or {}).get("seq_len") or model.config.max_seq_len
    task = SFTTask.for_checkpoint(data, load_tokenizer(ckpt), batch_size=args.batch_size or 16, seq_len=seq_len,
                                  takes_packing=takes_documents(model))
    start = time.perf_counter()
    with torch.no_grad():
        metrics = task.evaluate(model, max_batches=args.batches, split=args.split)
    seconds = time.perf_counter() - start
    result = {"checkpoint": str(ckpt), "data": data.path, "split": args.split, **metrics, "seconds": round(seconds, 2)}
    print_result(result, args.json)
    if args.verbose:
        from ..speed import Speed

        print_speed(Speed(seconds, scored_tokens=int(metrics.get("tokens", 0)), load_seconds=load_seconds))
    return 0


def _dtype(name: str | None):
    return None if name is None else getattr(torch, name)


def import_(args: argparse.Namespace) -> int:
    from ..interop import import_hf

    out = import_hf(args.source, args.out, dtype=_dtype(args.dtype), force=args.force)
    m = read_config(out)["model"]
    layers = m.get("num_layers", m.get("depths") or f"{m.get('encoder_layers')}+{m.get('decoder_layers')}")
    size = f"vocab {m['vocab_size']}" if "vocab_size" in m else f"{m.get('num_classes')} classes"
    print(f"imported {args.source} -> {out} ({m.get('family')}, {layers} layers, embed_dim {m.get('embed_dim')}, "
          f"{size}{', with tokenizer' if (out / 'tokenizer.json').is_file() else ', no tokenizer.json'})")
    return 0


def export(args: argparse.Namespace) -> int:
    from ..interop import export_hf

    out = export_hf(args.checkpoint, args.out, dtype=_dtype(args.dtype), force=args.force)
    config = json.loads((out / "config.json").read_text())
    print(f"exported {resolve_checkpoint(args.checkpoint)} -> {out} ({config['architectures'][0]}, "
          f"{config['torch_dtype']})")
    return 0


def quantize(args: argparse.Namespace) -> int:
    from ..checkpoint import quantize_checkpoint
    from ..nn.quantized import QuantizationConfig

    config = QuantizationConfig(bits=args.bits, group_size=args.group_size, head=args.head, embedding=args.embedding)
    out, before, after = quantize_checkpoint(args.checkpoint, args.out, config, force=args.force)
    print(f"quantized {resolve_checkpoint(args.checkpoint)} -> {out} ({config.describe()})")
    print(f"model.safetensors {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB ({before / after:.1f}x smaller)")
    return 0


def _decode_text(raw: bytes, where: str) -> str:
    """``raw`` as UTF-8; a one-line :class:`DataError` naming ``where`` and the first bad byte otherwise."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise DataError(f"{where} is not UTF-8 text (line {line}, byte {column}: 0x{raw[err.start]:02x}); "
                        "save it as UTF-8") from None


def _read_lines(path: str | None) -> list[str]:
    """The lines of a UTF-8 text file, or of standard input when ``path`` is None."""
    if path is None:
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream without bytes underneath (an embedding program's, a test's)
            return [line.rstrip("\n") for line in sys.stdin]
        text = _decode_text(stream.read(), "standard input").replace("\r\n", "\n")
        return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n") if text else []
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"input file not found: {file}")
    try:
        raw = file.read_bytes()
    except OSError as err:
        raise DataError(f"cannot read {file}: {err.strerror or err}") from None
    return _decode_text(raw, str(file)).splitlines()


def _output_file(path: str | None) -> Path | None:
    """``--output``, checked before any work is done: a missing folder is created (as every ``--out`` of the CLI
    does), and a path that cannot be written is a one-line error now, not after the translations are made."""
    if path is None:
        return None
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"--output {out} is a directory; name a file")
    folder = next((p for p in out.parents if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise ConfigError(f"cannot write --output {out}: {folder} is a file, not a folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = _temporary(out)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write --output {out}: {err.strerror or err}") from None
    return out


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """``text`` with the backslash escapes a shell passes through literally read as characters: ``\\n``, ``\\t``,
    ``\\r`` and ``\\\\`` (``--stop '\\n\\n'`` is a blank line). Any other backslash stays as it is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _temporary(out: Path) -> Path:
    return out.with_name(f".{out.name}.{os.getpid()}.tmp")


def _write_output(out: Path, text: str) -> None:
    """Write ``text`` to ``out`` whole or not at all (a temporary file, then a rename)."""
    tmp = _temporary(out)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConfigError(f"cannot write --output {out}: {err.strerror or err}") from None


def decoding_options(args: argparse.Namespace, model, tokenizer, precision: str = "fp32") -> dict:
    """translate()'s keyword arguments from --beam / --iterations / --length-beam / --rescore; options of the
    other kind of model are one-line errors."""
    from ..tasks.translation import check_decoding_options, default_beam

    beam = getattr(args, "beam", None)
    if beam is not None and beam < 1:
        raise ConfigError(f"--beam must be >= 1, got {beam}")
    options = dict(iterations=getattr(args, "iterations", None), length_beam=getattr(args, "length_beam", None))
    rescore = getattr(args, "rescore", None)
    if rescore is not None:
        device = getattr(args, "device", "auto")
        _, options["rescorer"], rescore_tokenizer = translation_model(rescore, precision, device)
        if rescore_tokenizer.fingerprint != tokenizer.fingerprint or decoding_of(options["rescorer"]) == "parallel":
            raise ConfigError(f"--rescore {rescore}: needs the autoregressive model whose tokenizer this model was "
                              "trained with (data.tokenizer_from)")
    speculation = _translation_speculation(args, model, tokenizer, precision)
    if speculation is not None:
        beam = 1 if beam is None else beam  # speculative decoding is greedy: the default beam becomes 1
    parallel = decoding_of(model) == "parallel"
    if not parallel:
        options["beam"] = default_beam(model) if beam is None else beam
    elif beam is not None:
        options["beam"] = beam  # refused below
    options.update(check_decoding_options(model, **options))  # the defaults of parallel decoding filled in
    options["speculation"] = speculation
    return {k: v for k, v in options.items() if v is not None}


def _translation_speculation(args: argparse.Namespace, model, tokenizer, precision: str):
    """translate()'s :class:`~tokenloom.tasks.translation.Speculation` from ``--draft`` / ``--prompt-lookup`` /
    ``--num-draft-tokens`` (None without them; commands without those options have none)."""
    if getattr(args, "draft", None) is None and not getattr(args, "prompt_lookup", 0):
        if getattr(args, "num_draft_tokens", 4) != 4:
            raise ConfigError("--num-draft-tokens applies to speculative decoding: give --draft or --prompt-lookup")
        return None
    if args.draft is not None and args.prompt_lookup:
        raise ConfigError("--draft and --prompt-lookup are two drafters: give one")
    from ..generation import DraftTally
    from ..tasks.translation import Speculation

    _gen_config(num_draft_tokens=args.num_draft_tokens, prompt_lookup=args.prompt_lookup)  # their one-line errors
    draft = None
    if args.draft is not None:
        _, draft, draft_tokenizer = translation_model(args.draft, precision, getattr(args, "device", "auto"))
        if decoding_of(draft) != decoding_of(model) or draft_tokenizer.fingerprint != tokenizer.fingerprint:
            raise ConfigError(f"--draft {args.draft}: needs an autoregressive encoder-decoder with this model's "
                              "tokenizer (speculative decoding compares token ids)")
    return Speculation(draft, args.prompt_lookup, args.num_draft_tokens, DraftTally())


def describe_decoding(options: dict) -> str:
    """"beam 5", "greedy", "10 iterations, length beam 3", ... for logs and tables."""
    if "beam" in options:
        return "greedy" if options["beam"] == 1 else f"beam {options['beam']}"
    parts = []
    if "iterations" in options:
        parts.append(f"{options['iterations']} iteration{'s' if options['iterations'] != 1 else ''}")
    if "length_beam" in options:
        parts.append(f"length beam {options['length_beam']}")
    if "rescorer" in options:
        parts.append("AR rescoring")
    return ", ".join(parts) or "one pass"


def translate(args: argparse.Namespace) -> int:
    from ..tasks.translation import TokenCounts
    from ..tasks.translation import translate as run

    output = _output_file(args.output)
    loading = time.perf_counter()  # --verbose: the load time (model, drafter, rescorer), apart from the work's
    _, model, tokenizer = translation_model(args.checkpoint, args.precision, args.device)
    options = decoding_options(args, model, tokenizer, args.precision)
    loaded = time.perf_counter()
    lines = _read_lines(args.input)
    keep = [i for i, line in enumerate(lines) if line.strip()]
    out = [""] * len(lines)  # an empty input line gives an empty output line
    counts = TokenCounts()
    with torch.inference_mode(), progress("translate", len(keep), "translated", "sentence") as done:
        start = time.perf_counter()
        for i, text in zip(keep, run(model, tokenizer, [lines[i] for i in keep], **options,
                                     length_penalty=args.length_penalty, max_tokens=args.max_tokens,
                                     no_repeat_ngram_size=args.no_repeat_ngram_size,
                                     truncate=args.too_long == "truncate", progress=done, counts=counts),
                            strict=True):
            out[i] = text
        seconds = time.perf_counter() - start
    tally = options["speculation"].tally if "speculation" in options else None
    if args.verbose:
        print_speed(_with_drafts(translation_speed(counts, seconds, options, loaded - loading), tally, args))
    elif tally is not None:
        print(speculative_summary(tally, args), file=sys.stderr)
    text = "".join(line + "\n" for line in out)
    if output is not None:
        _write_output(output, text)
        print(f"wrote {len(out)} line(s) ({len(keep)} translated, {len(out) - len(keep)} empty) to {output}",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def translation_speed(counts, seconds: float, options: dict, load_seconds: float):  # noqa: ANN001, ANN201
    """The :class:`~tokenloom.speed.Speed` of translating (``counts``: a
    :class:`~tokenloom.tasks.translation.TokenCounts`) in ``seconds`` with ``options`` (translate()'s)."""
    from ..speed import Speed

    return Speed(seconds, new_tokens=counts.new_tokens, prompt_tokens=counts.source_tokens, prompt_name="sources",
                 sentences=counts.sentences, decoding=describe_decoding(options), load_seconds=load_seconds)


def _evaluate_translation(args: argparse.Namespace, ckpt: Path, config: dict) -> int:
    from ..evaluation import METRICS, compute_metrics, format_metrics
    from ..tasks.translation import TranslationDataConfig
    from ..tasks.translation import translate as run

    if (args.source is None) != (args.reference is None):
        raise ConfigError("--source and --reference go together")
    metrics = args.metrics or ["bleu", "chrf"]
    for name in metrics:  # an unknown metric name fails here, before any decoding
        METRICS.get(name)
    output = _output_file(args.output)
    loading = time.perf_counter()
    _, model, tokenizer = translation_model(ckpt, args.precision, args.device)
    options = decoding_options(args, model, tokenizer, args.precision)
    load_seconds = time.perf_counter() - loading
    if args.source is not None:
        sources, references, what = _read_lines(args.source), _read_lines(args.reference), args.source
        if len(sources) != len(references):
            raise ConfigError(f"--source has {len(sources)} lines but --reference has {len(references)}")
    else:
        from ..config import from_dict
        from ..tasks.nat import NATDataConfig

        data_cls = NATDataConfig if config.get("task") == "nat_translation" else TranslationDataConfig
        data = from_dict(data_cls, config.get("data") or {}, prefix="data")
        pairs = data.read_pairs(args.split)  # (its files, or with data.format hf its table)
        sources, references = [p[0] for p in pairs], [p[1] for p in pairs]
        what = f"{args.split} ({data.source_lang}->{data.target_lang}, {len(pairs)} sentences)"
    from ..tasks.translation import TokenCounts

    counts = TokenCounts()
    start = time.perf_counter()
    with torch.inference_mode(), progress("evaluate", len(sources), "translated", "sentence") as done:
        hypotheses = run(model, tokenizer, sources, **options, progress=done, counts=counts)
    seconds = time.perf_counter() - start
    if args.verbose:
        tally = options["speculation"].tally if "speculation" in options else None
        print_speed(_with_drafts(translation_speed(counts, seconds, options, load_seconds), tally, args))
    if output is not None:
        _write_output(output, "".join(h + "\n" for h in hypotheses))
    result = compute_metrics(metrics, hypotheses, references)
    if args.json:
        print(json.dumps({"checkpoint": str(ckpt), "data": what, "decoding": describe_decoding(options),
                          **{k: v for k, v in options.items() if k != "rescorer"}, **result.scores,
                          "signatures": result.signatures, "seconds": round(seconds, 2)}))
    else:
        print(f"{ckpt}: {what}, {describe_decoding(options)}, {seconds:.1f} s")
        print(format_metrics(result))
    return 0


def classify(args: argparse.Namespace) -> int:
    from .vision import classify as run

    return run(args)


def sweep(args: argparse.Namespace) -> int:
    from ..experiments.sweep import load_sweep, run_sweep
    from ..training import load_run_config
    from ..training.config import check_bundled_paths

    if args.parallel < 1:
        raise ConfigError(f"--parallel must be >= 1, got {args.parallel}")
    overrides = [*args.overrides, *([f"train.device={args.device}"] if args.device else [])]
    plan = load_sweep(args.sweep, overrides)
    print(f"sweep {plan.name}: {len(plan.points)} runs of {plan.recipe} -> {args.out}", file=sys.stderr)
    if args.dry_run:
        for point in plan.points:
            print(f"{point.name}: {' '.join(point.all_overrides(plan.shared))}")
        return 0
    for point in plan.points:  # the recipe's data/ outside the repository: one line before the first run
        check_bundled_paths(load_run_config(plan.recipe, point.all_overrides(plan.shared)))
    results = run_sweep(plan, args.out, parallel=args.parallel, log=lambda line: print(line, file=sys.stderr))
    bad = [r for r in results if r.get("status") != "done"]
    print(f"{len(results) - len(bad)} done, {len(bad)} not ({', '.join(sorted({r['status'] for r in bad}))}): "
          f"{Path(args.out) / 'results.md'}" if bad else f"{len(results)} done: {Path(args.out) / 'results.md'}",
          file=sys.stderr)
    return 0


def sweep_report(args: argparse.Namespace) -> int:
    from ..experiments.report import sweep_report as report

    for path in report(args.out, args.metric, args.collapsed_above):
        print(path)
    return 0


def fit_scaling(args: argparse.Namespace) -> int:
    from ..experiments.report import fit_scaling as fit

    result = fit(args.out, args.metric, n_boot=args.bootstrap)
    for name in ("N", "C"):
        print(result["fits"][name]["summary"])
    return 0
