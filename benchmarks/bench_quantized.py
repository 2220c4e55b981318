"""Weight-only quantisation: batch-1 greedy decoding speed of a checkpoint in float32, int8 and int4, each quantised
layer through each kernel that runs here, measured in one run (the variants take turns), and the bytes of the
weights.

    python benchmarks/bench_quantized.py                                   # checkpoints/shakespeare-char
    python benchmarks/bench_quantized.py CKPT --tokens 200 --repeats 5 --threads 1

Prints ms/token (median and best over the repeats) and the ratio to float32. Perplexity is
`tokenloom evaluate CKPT --precision int8` (or a checkpoint written by `tokenloom quantize`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from tokenloom import GenerationConfig, generate
from tokenloom.checkpoint import load_model
from tokenloom.hardware import machine
from tokenloom.nn.int_kernels import KERNELS
from tokenloom.nn.quantized import QuantizationConfig, QuantizedLinear, fitting_group_size, quantize_model


def variants(model: torch.nn.Module, group_size: int) -> dict[str, torch.nn.Module]:
    out = {"fp32": model}
    for bits in (8, 4):
        config = QuantizationConfig(bits=bits, group_size=fitting_group_size(model, group_size))
        quantized = quantize_model(copy.deepcopy(model), config)
        layers = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
        for kernel in KERNELS[bits]:
            if not all(kernel.runs(m.weights, torch.float32) for m in layers):
                print(f"int{bits} {kernel.name}: does not run here for every layer, skipped")
                continue
            variant = copy.deepcopy(quantized)
            for m in variant.modules():
                if isinstance(m, QuantizedLinear):
                    m.use_kernels(kernel.name, kernel.name)
            out[f"int{bits} {kernel.name}"] = variant
    return out


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the quantised layers' buffers or the float blocks' linear weights, bytes of every tensor)."""
    state = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in state.values()}.values())
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if layers:
        part = sum(t.numel() * t.element_size() for m in layers for t in m.buffers())
    else:
        part = sum(m.weight.numel() * m.weight.element_size() for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name.startswith("blocks."))
    return part, total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", default="checkpoints/shakespeare-char")
    p.add_argument("--tokens", type=int, default=200, help="new tokens per run")
    p.add_argument("--repeats", type=int, default=5, help="runs per variant, taking turns")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine().describe())
    model, _ = load_model(args.checkpoint)
    runs = variants(model, args.group_size)
    prompt = torch.tensor([[0]])
    config = GenerationConfig(max_new_tokens=args.tokens, do_sample=False)
    times: dict[str, list[float]] = {name: [] for name in runs}
    texts = {}
    with torch.inference_mode():
        for name, variant in runs.items():  # warm-up
            texts[name] = generate(variant, prompt, GenerationConfig(max_new_tokens=args.tokens, do_sample=False))
        for _ in range(args.repeats):
            for name, variant in runs.items():
                start = time.perf_counter()
                generate(variant, prompt, config)
                times[name].append((time.perf_counter() - start) / args.tokens * 1e3)
    base = statistics.median(times["fp32"])
    print(f"{'variant':36} {'ms/token':>9} {'best':>7} {'vs fp32':>8} {'layers MB':>10} {'all MB':>7}  same text")
    for name, values in times.items():
        part, total = weight_bytes(runs[name])
        same = torch.equal(texts[name], texts["fp32"])
        print(f"{name:36} {statistics.median(values):9.3f} {min(values):7.3f} {statistics.median(values) / base:7.2f}x "
              f"{part / 1e6:10.2f} {total / 1e6:7.2f}  {same}")


if __name__ == "__main__":
    main()
