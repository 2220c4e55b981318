"""Greedy generation speed: tokenloom vs Hugging Face (GPT2LMHeadModel, LlamaForCausalLM) with identical weights.

The HF model is built from the tokenloom one with ``tokenloom.interop.to_hf`` (HF's default
attention, sdpa), so both compute the same function and the generated tokens should agree.
Each run is timed after one untimed run of the same length (the first pass over every sequence length
is slower). Reported per (shape, batch size): ms per generated token (wall time / new tokens, prefill
of the 16-token prompt included), the ratio HF / tokenloom (> 1: tokenloom faster) and the fraction of
generated tokens that agree. At batch 1 it also prints the memory-bandwidth
bound: every weight must be read once per step, so a step takes at least weight bytes / bandwidth,
with the bandwidth measured in the same run (best of 10 ``x.sum()`` over a 1 GiB fp32 tensor).

    tokenloom bench generate
    tokenloom bench generate --shapes tiny --batch-sizes 1 --new-tokens 64
    tokenloom bench generate --bf16 --out generate.json
    tokenloom bench generate checkpoints/shakespeare-char --batch 1 8   # a trained model's own weights

``--compile`` adds ``generate(compile=True)`` (the one-token step compiled over a static cache), fp32 and,
with ``--bf16``, bf16 weights, with the fraction of its tokens equal to eager decoding's.

``--precision int8,int4`` adds weight-only quantised variants (:mod:`tokenloom.nn.quantized`, blocks only, group 128
or the largest that fits for int4): speed, weight bytes and teacher-forced agreement with fp32.
``--draft RUN`` / ``--prompt-lookup N`` (``--num-draft-tokens K``) add speculative greedy decoding on the same
random-id prompts: speed, the drafter's acceptance and whether the tokens equal plain greedy decoding's (text prompts,
where a drafter's acceptance means something: ``benchmarks/bench_speculative.py``).

``--bf16`` adds tokenloom in bf16 (weights cast to bf16, and fp32 weights under bf16 autocast):
speed, and teacher-forced next-token agreement with fp32 on the fp32 model's own greedy
continuation (argmax of bf16 logits == argmax of fp32 logits at every generated position).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from tokenloom.benchmarks import report_load_and_save
from tokenloom.devices import DEVICE_HELP, choose_device, default_device, peak_memory, synchronize
from tokenloom.hardware import machine
from tokenloom.interop import to_hf
from tokenloom.models.gpt import GPT, GPTConfig

PROMPT_LEN = 16
SHAPES: dict[str, Callable[[], GPTConfig]] = {
    "tiny": lambda: GPTConfig(vocab_size=65, num_layers=4, num_heads=4, embed_dim=128, max_seq_len=512),
    "gpt2": lambda: GPTConfig.from_name("gpt2"),
    # a Llama-style model of GPT-2-small's size (vs transformers' LlamaForCausalLM): RoPE, RMSNorm, SwiGLU, GQA
    "llama-small": lambda: GPTConfig(vocab_size=32000, num_layers=12, num_heads=12, num_kv_heads=4, embed_dim=768,
                                     max_seq_len=1024, position="rope", norm="rmsnorm", mlp="swiglu",
                                     mlp_hidden_dim=2048, bias=False, tie_embeddings=False),
}


GenerateFn = Callable[[GPT, Tensor, int], Tensor]


def tokenloom_generate(reference_loop: bool) -> GenerateFn:
    """tokenloom's own ``generation.generate`` (or, with ``reference_loop``, this script's loop)."""
    if reference_loop:
        return reference_greedy
    try:
        from tokenloom.generation import GenerationConfig, generate
    except ImportError as err:
        sys.exit(f"tokenloom.generation is not importable ({err}); run with --reference-loop to time "
                 "the benchmark's own greedy loop instead")

    def run(model: GPT, ids: Tensor, n: int) -> Tensor:
        return generate(model, ids, GenerationConfig(max_new_tokens=n, do_sample=False), attention_mask=None)

    return run


@torch.no_grad()
def reference_greedy(model: GPT, ids: Tensor, n: int) -> Tensor:
    """A minimal cached greedy loop: (B, T) -> (B, T + n)."""
    cache = model.create_cache(ids.shape[0], ids.shape[1] + n)
    logits = model(ids, cache=cache)  # (B, T, V)
    out = [ids]
    for i in range(n):
        next_id = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        out.append(next_id)
        if i < n - 1:
            logits = model(next_id, cache=cache)
    return torch.cat(out, dim=1)


def hf_generate(hf: torch.nn.Module, ids: Tensor, n: int) -> Tensor:
    return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                       min_new_tokens=n, pad_token_id=0)


def timed(fns: list[Callable[[], Tensor]], repeats: int, device: torch.device | str = "cpu"
          ) -> list[tuple[float, Tensor]]:
    """Best wall time and output of each function; the functions take turns, so a burst of load
    from another process hits them alike. On an accelerator the clock is read after synchronising."""
    best: list[tuple[float, Tensor]] = [(float("inf"), torch.empty(0))] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            synchronize(device)
            start = time.perf_counter()
            out = fn()
            synchronize(device)
            best[k] = min(best[k], (time.perf_counter() - start, out), key=lambda pair: pair[0])
    return best


def measure_bandwidth(gib: float = 1.0, repeats: int = 10, device: torch.device | str = "cpu") -> float:
    """Read bandwidth in bytes/s: best of ``repeats`` ``x.sum()`` over ``gib`` GiB of fp32 on ``device``."""
    x = torch.ones(int(gib * 2**30) // 4, device=device)
    x.sum()
    best = min(_seconds(x.sum, x.device) for _ in range(repeats))
    return x.numel() * 4 / best


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (a tied matrix counts once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


@torch.no_grad()
def teacher_forced_agreement(ref: GPT, other: GPT, sequence: Tensor, bf16_autocast: bool) -> float:
    """Fraction of generated positions where ``other``'s argmax equals ``ref``'s (fp32) argmax."""
    inputs = sequence[:, :-1]
    want = ref(inputs)[:, PROMPT_LEN - 1:].argmax(-1)  # predictions of the generated tokens
    ctx = torch.autocast(inputs.device.type, dtype=torch.bfloat16) if bf16_autocast else contextlib.nullcontext()
    with ctx:
        got = other(inputs)[:, PROMPT_LEN - 1:].argmax(-1)
    return (got == want).float().mean().item()


def bench_batch(model: GPT, hf: torch.nn.Module, shape: str, batch: int, gen_fn: GenerateFn,
                args: argparse.Namespace) -> tuple[dict, Tensor]:
    """fp32 tokenloom vs HF at one batch size: a result row and tokenloom's (B, T + n) output."""
    n = args.new_tokens
    gen = torch.Generator().manual_seed(batch)
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT_LEN), generator=gen).to(device)
    with torch.no_grad():
        gen_fn(model, ids, n), hf_generate(hf, ids, n)  # warm-up: every shape once (oneDNN caches kernels)
        peak_memory(device, reset=True)
        (t_ours, ours), (t_hf, theirs) = timed([lambda: gen_fn(model, ids, n), lambda: hf_generate(hf, ids, n)],
                                               args.repeats, device)
    assert ours.shape == theirs.shape == (batch, PROMPT_LEN + n), (ours.shape, theirs.shape)
    agree = (ours[:, PROMPT_LEN:] == theirs[:, PROMPT_LEN:]).float().mean().item()
    row = dict(shape=shape, batch_size=batch, new_tokens=n, tokenloom_ms_per_token=1000 * t_ours / n,
               hf_ms_per_token=1000 * t_hf / n, hf_over_tokenloom=t_hf / t_ours, token_agreement=agree,
               device=str(device))
    if (peak := peak_memory(device)) is not None:
        row["peak_memory_mb"] = peak / 2**20
    print(f"  {shape} b{batch}: tokenloom {row['tokenloom_ms_per_token']:.2f} ms/tok, "
          f"HF {row['hf_ms_per_token']:.2f} ms/tok, agreement {agree:.3f}", file=sys.stderr, flush=True)
    return row, ours


def bench_bf16(model: GPT, variant: GPT, use_autocast: bool, fp32_output: Tensor, fp32_ms: float,
               gen_fn: GenerateFn, args: argparse.Namespace) -> dict:
    """tokenloom in bf16 on fp32's prompt: speed and teacher-forced agreement with fp32."""
    n = args.new_tokens
    ids = fp32_output[:, :PROMPT_LEN]
    ctx = torch.autocast(ids.device.type, dtype=torch.bfloat16) if use_autocast else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        gen_fn(variant, ids, n)  # warm-up
        [(seconds, _)] = timed([lambda: gen_fn(variant, ids, n)], args.repeats, ids.device)
    ms = 1000 * seconds / n
    return dict(ms_per_token=ms, speedup_vs_fp32=fp32_ms / ms,
                teacher_forced_agreement=teacher_forced_agreement(model, variant, fp32_output, use_autocast))


def bench_compiled(variant: GPT, eager_output: Tensor, fp32_ms: float, args: argparse.Namespace) -> dict:
    """``generate(compile=True)`` on the eager run's prompt (compiled in the untimed warm-up): speed, and the
    fraction of its tokens equal to eager decoding's with the same weights (``eager_output``)."""
    from tokenloom.generation import GenerationConfig, generate

    n = args.new_tokens
    ids = eager_output[:, :PROMPT_LEN]
    config = GenerationConfig(max_new_tokens=n, do_sample=False, compile=True)
    with torch.no_grad():
        generate(variant, ids, config)  # warm-up: compiles the step
        [(seconds, out)] = timed([lambda: generate(variant, ids, config)], args.repeats, ids.device)
    ms = 1000 * seconds / n
    agree = (out[:, PROMPT_LEN:] == eager_output[:, PROMPT_LEN:]).float().mean().item()
    return dict(ms_per_token=ms, speedup_vs_fp32=fp32_ms / ms, token_agreement_with_eager=agree)


def bench_quantized(model: GPT, bits: int, fp32_output: Tensor, fp32_ms: float, gen_fn: GenerateFn,
                    args: argparse.Namespace) -> dict:
    """A weight-only quantised copy of ``model`` on fp32's prompt: speed, bytes and agreement with fp32."""
    from tokenloom.nn.quantized import QuantizationConfig, fitting_group_size, quantize_model

    group = fitting_group_size(model) if bits == 4 else 128
    variant = quantize_model(copy.deepcopy(model), QuantizationConfig(bits=bits, group_size=group)).eval()
    n, ids = args.new_tokens, fp32_output[:, :PROMPT_LEN]
    with torch.no_grad():
        gen_fn(variant, ids, n)  # warm-up
        [(seconds, _)] = timed([lambda: gen_fn(variant, ids, n)], args.repeats, ids.device)
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in (*variant.parameters(), *variant.buffers())}
    ms = 1000 * seconds / n
    return dict(ms_per_token=ms, speedup_vs_fp32=fp32_ms / ms, weight_bytes=sum(tensors.values()),
                teacher_forced_agreement=teacher_forced_agreement(model, variant, fp32_output, False))


def bench_speculative(model: GPT, draft: GPT | None, ids: Tensor, fp32_output: Tensor, fp32_ms: float,
                      args: argparse.Namespace) -> dict:
    """Speculative greedy decoding of ``ids`` with the draft model or prompt lookup: speed, acceptance, and the
    fraction of tokens equal to plain greedy decoding's (``fp32_output``; 1.0 expected)."""
    from tokenloom.generation import DraftTally, GenerationConfig, generate

    n = args.new_tokens
    config = GenerationConfig(max_new_tokens=n, do_sample=False, num_draft_tokens=args.num_draft_tokens,
                              prompt_lookup=args.prompt_lookup)
    tally = DraftTally()
    with torch.no_grad():
        generate(model, ids, config, draft=draft)  # warm-up
        [(seconds, out)] = timed([lambda: generate(model, ids, config, draft=draft, draft_tally=tally)],
                                 args.repeats, ids.device)
    ms = 1000 * seconds / n
    same = (out[:, ids.shape[1]:] == fp32_output[:, ids.shape[1]:]).float().mean().item()
    return dict(ms_per_token=ms, speedup_vs_fp32=fp32_ms / ms, acceptance=tally.acceptance_rate,
                tokens_per_pass=tally.tokens_per_pass, token_agreement=same)


def models(args: argparse.Namespace) -> list[tuple[str, Callable[[], GPT]]]:
    """(name, build) per model to measure: the GPT checkpoints or run directories given, else ``--shapes``
    with random weights."""
    if not args.runs:
        return [(shape, lambda shape=shape: GPT(SHAPES[shape]())) for shape in args.shapes.split(",")]
    from tokenloom.checkpoint import load_model, read_config, resolve_checkpoint
    from tokenloom.errors import ConfigError

    out = []
    for run in args.runs:
        checkpoint = resolve_checkpoint(run)
        family = (read_config(checkpoint).get("model") or {}).get("family", "gpt")
        if family != "gpt":
            raise ConfigError(f"{checkpoint} holds a {family!r} model; bench generate measures GPT models")
        out.append((str(run), lambda checkpoint=checkpoint: load_model(checkpoint)[0]))
    return out


def bench(args: argparse.Namespace) -> dict:
    gen_fn = tokenloom_generate(args.reference_loop)
    rows, bf16_rows, compiled_rows, extra_rows = [], [], [], []
    draft = None
    if args.draft is not None:
        from tokenloom.checkpoint import load_model

        draft = load_model(args.draft)[0].eval().to(choose_device(args.device).device)
    device = choose_device(args.device).device
    bandwidth = measure_bandwidth(device=device)
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s ({device})", file=sys.stderr)
    for shape, make in models(args):
        torch.manual_seed(args.seed)
        model = make().eval()
        hf = to_hf(model).eval().to(device)
        model = model.to(device)
        room = model.config.max_seq_len - PROMPT_LEN
        if args.new_tokens > room:
            print(f"  {shape}: {room} new tokens (its context is {model.config.max_seq_len})", file=sys.stderr)
        model_args = copy.copy(args)
        model_args.new_tokens = min(args.new_tokens, room)
        variants = {}
        if args.bf16:
            variants["bf16 weights"] = (copy.deepcopy(model).to(torch.bfloat16), False)
            variants["bf16 autocast"] = (model, True)
        for batch in args.batch or [int(b) for b in args.batch_sizes.split(",")]:
            row, ours = bench_batch(model, hf, shape, batch, gen_fn, model_args)
            if batch == 1:
                bound = weight_bytes(model) / bandwidth
                row.update(weight_bytes=weight_bytes(model), bandwidth_bound_ms=1000 * bound,
                           tokenloom_over_bound=row["tokenloom_ms_per_token"] / (1000 * bound))
            rows.append(row)
            for bits in args.quantized:
                r = dict(shape=shape, batch_size=batch, variant=f"int{bits}",
                         **bench_quantized(model, bits, ours, row["tokenloom_ms_per_token"], gen_fn, model_args))
                extra_rows.append(r)
                print(f"  {shape} b{batch} int{bits}: {r['ms_per_token']:.2f} ms/tok, "
                      f"{r['weight_bytes'] / 1e6:.1f} MB, agreement {r['teacher_forced_agreement']:.4f}",
                      file=sys.stderr, flush=True)
            if draft is not None or args.prompt_lookup:
                label = "draft model" if draft is not None else f"prompt lookup {args.prompt_lookup}"
                r = dict(shape=shape, batch_size=batch, variant=f"{label}, k={args.num_draft_tokens}",
                         **bench_speculative(model, draft, ours[:, :PROMPT_LEN], ours, row["tokenloom_ms_per_token"],
                                             model_args))
                extra_rows.append(r)
                print(f"  {shape} b{batch} {r['variant']}: {r['ms_per_token']:.2f} ms/tok, acceptance "
                      f"{r['acceptance']:.2f}, same tokens {r['token_agreement']:.4f}", file=sys.stderr, flush=True)
            for label, (variant, use_autocast) in variants.items():
                r = dict(shape=shape, batch_size=batch, variant=label,
                         **bench_bf16(model, variant, use_autocast, ours, row["tokenloom_ms_per_token"],
                                      gen_fn, model_args))
                bf16_rows.append(r)
                print(f"  {shape} b{batch} {label}: {r['ms_per_token']:.2f} ms/tok, "
                      f"agreement {r['teacher_forced_agreement']:.4f}", file=sys.stderr, flush=True)
            if args.compile:
                eager = {"fp32 compiled": (model, ours)}
                if "bf16 weights" in variants:
                    bf16 = variants["bf16 weights"][0]
                    with torch.no_grad():
                        eager["bf16 compiled"] = (bf16, gen_fn(bf16, ours[:, :PROMPT_LEN], model_args.new_tokens))
                for label, (variant, eager_out) in eager.items():
                    r = dict(shape=shape, batch_size=batch, variant=label,
                             **bench_compiled(variant, eager_out, row["tokenloom_ms_per_token"], model_args))
                    compiled_rows.append(r)
                    print(f"  {shape} b{batch} {label}: {r['ms_per_token']:.2f} ms/tok, tokens equal to eager "
                          f"{r['token_agreement_with_eager']:.4f}", file=sys.stderr, flush=True)
        del model, hf, variants
    return dict(bandwidth_bytes_per_s=bandwidth, generate=rows, bf16=bf16_rows, compiled=compiled_rows,
                quantized_and_speculative=extra_rows)


def print_tables(results: dict, reference_loop: bool) -> None:
    impl = "this script's reference loop" if reference_loop else "tokenloom.generation.generate"
    print(f"\ngreedy, fp32, prompt {PROMPT_LEN} tokens; tokenloom via {impl}; HF via model.generate")
    print(f"{'shape':<6} {'batch':>5} {'tokenloom ms/tok':>17} {'HF ms/tok':>10} {'HF/tokenloom':>13} "
          f"{'agreement':>10}")
    for r in results["generate"]:
        print(f"{r['shape']:<6} {r['batch_size']:>5} {r['tokenloom_ms_per_token']:>17.2f} "
              f"{r['hf_ms_per_token']:>10.2f} {r['hf_over_tokenloom']:>12.2f}x {r['token_agreement']:>10.3f}")
    bw = results["bandwidth_bytes_per_s"]
    print(f"\nmemory bandwidth: {bw / 1e9:.1f} GB/s (best of 10 x.sum() over a 1 GiB fp32 tensor)")
    for r in results["generate"]:
        if "bandwidth_bound_ms" in r:
            print(f"{r['shape']} batch 1: weights {r['weight_bytes'] / 1e6:.0f} MB -> bound "
                  f"{r['bandwidth_bound_ms']:.2f} ms/token; "
                  f"tokenloom {r['tokenloom_ms_per_token']:.2f} ms/token = "
                  f"{r['tokenloom_over_bound']:.2f}x the bound")
    if results["bf16"]:
        print("\ntokenloom bf16 (teacher-forced agreement with fp32 argmax on fp32's own greedy "
              "continuation; target >= 0.98)")
        print(f"{'shape':<6} {'batch':>5} {'variant':<14} {'ms/tok':>8} {'vs fp32':>8} {'agreement':>10}")
        for r in results["bf16"]:
            print(f"{r['shape']:<6} {r['batch_size']:>5} {r['variant']:<14} {r['ms_per_token']:>8.2f} "
                  f"{r['speedup_vs_fp32']:>7.2f}x {r['teacher_forced_agreement']:>10.4f}")
    if results.get("quantized_and_speculative"):
        print("\nweight-only quantised and speculative greedy decoding (agreement: teacher-forced with fp32 for int8 / "
              "int4, tokens equal to plain greedy for speculative decoding)")
        print(f"{'shape':<6} {'batch':>5} {'variant':<22} {'ms/tok':>8} {'vs fp32':>8} {'agreement':>10} "
              f"{'MB / acceptance':>16}")
        for r in results["quantized_and_speculative"]:
            agree = r.get("teacher_forced_agreement", r.get("token_agreement"))
            last = f"{r['weight_bytes'] / 1e6:.1f} MB" if "weight_bytes" in r else f"{r['acceptance']:.2f}"
            print(f"{r['shape']:<6} {r['batch_size']:>5} {r['variant']:<22} {r['ms_per_token']:>8.2f} "
                  f"{r['speedup_vs_fp32']:>7.2f}x {agree:>10.4f} {last:>16}")
    if results.get("compiled"):
        print("\ntokenloom generate(compile=True) (tokens equal to eager decoding with the same weights; compiled in "
              "an untimed warm-up)")
        print(f"{'shape':<6} {'batch':>5} {'variant':<14} {'ms/tok':>8} {'vs fp32':>8} {'same tokens':>12}")
        for r in results["compiled"]:
            print(f"{r['shape']:<6} {r['batch_size']:>5} {r['variant']:<14} {r['ms_per_token']:>8.2f} "
                  f"{r['speedup_vs_fp32']:>7.2f}x {r['token_agreement_with_eager']:>12.4f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenloom bench generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help="GPT checkpoints or run directories to measure on their own weights "
                        "(default: --shapes with random weights)")
    parser.add_argument("--shapes", default="tiny,gpt2", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (instead of --batch-sizes)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2,
                        help="time each run this many times (tokenloom and HF taking turns), keep the best")
    parser.add_argument("--bf16", action="store_true", help="also time tokenloom in bf16 and check agreement")
    parser.add_argument("--compile", action="store_true",
                        help="also time generate(compile=True) (fp32, and bf16 with --bf16)")
    parser.add_argument("--precision", default="", metavar="LIST",
                        help="also time weight-only quantised copies: comma-separated from int8, int4")
    parser.add_argument("--draft", default=None, metavar="RUN",
                        help="also time speculative greedy decoding with this draft model (same vocabulary)")
    parser.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                        help="also time speculative greedy decoding with prompt lookup (n-grams up to N)")
    parser.add_argument("--num-draft-tokens", type=int, default=4, metavar="K", help="draft tokens per pass")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch.set_num_threads (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference-loop", action="store_true",
                        help="time this script's minimal greedy loop, not tokenloom.generation.generate")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--device", default=default_device(), help=DEVICE_HELP)
    args = parser.parse_args(argv)
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            parser.error(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    wanted = [p for p in args.precision.split(",") if p]
    if any(p not in ("int8", "int4") for p in wanted):
        parser.error(f"--precision takes int8 and int4 (fp32 is always measured), got {args.precision!r}")
    args.quantized = [int(p[3:]) for p in wanted]
    if args.draft is not None and args.prompt_lookup:
        parser.error("--draft and --prompt-lookup are two drafters: give one")
    if args.num_draft_tokens < 1:
        parser.error(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    print(f"{machine().describe()}, transformers {transformers.__version__}; {choose_device(args.device).describe()}")
    load_before = os.getloadavg()[0]
    results = bench(args)
    print_tables(results, args.reference_loop)
    results.update(torch=torch.__version__, transformers=transformers.__version__, threads=args.threads,
                   date=time.strftime("%Y-%m-%d"), machine=machine().as_dict())
    report_load_and_save(results, load_before, args.threads, args.out)


if __name__ == "__main__":
    main()
