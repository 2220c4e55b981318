"""The paged engine against itself with a feature off, in one run, in process (no HTTP): prefix caching on and off
for clients sharing a system prompt, and the paged cache against the slot layout (one context-long block per
request) for mixed-length requests in the same KV memory.

* ``prefix``: ``--clients`` requests (64) at once, each a ``--system``-token system prompt (512) shared by all and a
  question of 16-32 tokens of its own, ``--max-tokens`` (16) greedy tokens each. Time to first token (from
  submission) p50 / p99 and tokens per second, prefix caching on vs off; the texts must be identical.
* ``mixed``: ``--requests`` (48) prompts of 16-1024 tokens (log-uniform), 32 greedy tokens each, in a KV budget of
  ``--budget-contexts`` (8) full contexts: the slot layout (``block_size`` = the context, no prefix caching) can
  run 8 at once; the paged cache (blocks of 16) as many as the blocks allow. The most requests running at once, the
  wall time, and the texts, which must be identical.

The model is a random 6-layer, 384-wide GPT (rotary positions, a 2,048-token context, the bundled character
vocabulary of 65): speed and memory do not depend on the weights, and equal outputs between two configurations are
as telling with random weights. ``--threads`` torch threads (default: all). Exit status 1 when texts differ.

* ``attention``: one layer's decode-step attention over paged blocks, the blocks gathered into one batch (what
  ``tokenloom.nn.paged`` does) against block-wise attention and against dense rows read in place (the slot layout).

    python benchmarks/bench_paged.py                      # both scenarios
    python benchmarks/bench_paged.py --scenario prefix --clients 32 --json paged.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from tokenloom import GenerationConfig
from tokenloom.benchmarks import report_load_and_save
from tokenloom.hardware import machine
from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.serving import Engine, Request


class Chars:
    """Token i is the i-th printable character; no EOS (every request runs to its max_tokens)."""

    eos_id = None
    vocab_size = 65

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(33 + i) for i in ids)


def model_for_bench(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=65, num_layers=6, num_heads=6, embed_dim=384, max_seq_len=2048, position="rope",
                       dropout=0.0)
    return GPT(config).eval()


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit every prompt at once; wait -> texts, TTFTs (s), wall time (s), tokens."""
    done, lock = threading.Event(), threading.Lock()
    finished: dict[int, float] = {}
    texts: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
    requests = []

    def sink(i: int):
        def emit(event):
            kind, value = event
            if kind == "delta":
                texts[i].append(value)
                return
            if kind == "error":
                raise SystemExit(f"request {i} failed: {value}")
            with lock:
                finished[i] = time.monotonic()
                if len(finished) == len(prompts):
                    done.set()
        return emit

    began = time.monotonic()
    for i, ids in enumerate(prompts):
        request = Request(ids, GenerationConfig(max_new_tokens=max_tokens, do_sample=False), sink(i))
        requests.append(request)
        engine.submit(request)
    if not done.wait(3600):
        raise SystemExit("the requests did not finish within an hour")
    wall = max(finished.values()) - began
    ttft = [r.first_token_at - r.submitted for r in requests]
    tokens = sum(len(r.new_ids) for r in requests)
    return {"texts": ["".join(texts[i]) for i in range(len(prompts))], "ttft": ttft, "wall": wall, "tokens": tokens,
            "cached_tokens": sum(r.cached_tokens for r in requests)}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def prefix_scenario(model: GPT, args: argparse.Namespace) -> tuple[dict, bool]:
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, 65, (args.system,), generator=gen).tolist()
    prompts = [system + torch.randint(0, 65, (int(torch.randint(16, 33, (1,), generator=gen)),),
                                      generator=gen).tolist() for _ in range(args.clients)]
    rows = {}
    for caching in (False, True):
        engine = Engine(model, Chars(), max_batch=args.clients, max_queue=args.clients, prefix_caching=caching,
                        prefill_tokens=args.prefill_tokens).start()
        try:
            run(engine, prompts[:2], 2)  # warm-up (and, with caching, the system prompt's blocks cached)
            out = run(engine, prompts, args.max_tokens)
            out["stats"] = engine.cache_stats()
        finally:
            engine.stop()
        rows["on" if caching else "off"] = out
    same = rows["on"]["texts"] == rows["off"]["texts"]
    summary = {}
    for name, out in rows.items():
        summary[name] = {"ttft_p50_ms": 1000 * statistics.median(out["ttft"]),
                         "ttft_p99_ms": 1000 * pct(out["ttft"], 99),
                         "tokens_per_s": out["tokens"] / out["wall"], "wall_s": out["wall"],
                         "cached_prompt_tokens": out["cached_tokens"]}
    off, on = summary["off"], summary["on"]
    print(f"\nprefix: {args.clients} clients, a {args.system}-token system prompt + 16-32 token questions, "
          f"{args.max_tokens} tokens each")
    print(f"{'prefix caching':<16}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'tokens/s':>10}{'wall s':>8}{'cached':>9}")
    for name, row in summary.items():
        print(f"{name:<16}{row['ttft_p50_ms']:>13.1f}{row['ttft_p99_ms']:>13.1f}{row['tokens_per_s']:>10.1f}"
              f"{row['wall_s']:>8.2f}{row['cached_prompt_tokens']:>9}")
    print(f"on / off: TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x lower, throughput "
          f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x higher; texts identical: {same}")
    summary["ttft_p50_ratio"] = off["ttft_p50_ms"] / on["ttft_p50_ms"]
    summary["throughput_ratio"] = on["tokens_per_s"] / off["tokens_per_s"]
    summary["identical"] = same
    return summary, same


def mixed_scenario(model: GPT, args: argparse.Namespace) -> tuple[dict, bool]:
    gen = torch.Generator().manual_seed(2)
    context = model.config.max_seq_len
    lengths = [int(math.exp(math.log(16) + float(torch.rand(1, generator=gen)) * (math.log(1024) - math.log(16))))
               for _ in range(args.requests)]
    prompts = [torch.randint(0, 65, (n,), generator=gen).tolist() for n in lengths]
    positions = args.budget_contexts * context  # the KV memory: positions of every layer's keys and values
    layouts = {"slots": dict(block_size=context, kv_blocks=args.budget_contexts, prefix_caching=False),
               "paged": dict(block_size=16, kv_blocks=positions // 16, prefix_caching=False)}
    rows = {}
    for name, options in layouts.items():
        engine = Engine(model, Chars(), max_batch=args.requests, max_queue=args.requests,
                        prefill_tokens=args.prefill_tokens, **options).start()
        try:
            out = run(engine, prompts, 32)
            out["peak"], out["preemptions"] = engine.peak_active, engine.preemptions
        finally:
            engine.stop()
        rows[name] = out
    same = rows["slots"]["texts"] == rows["paged"]["texts"]
    print(f"\nmixed: {args.requests} prompts of 16-1024 tokens (mean {statistics.mean(lengths):.0f}), 32 tokens each, "
          f"a KV budget of {positions} positions ({args.budget_contexts} contexts of {context})")
    print(f"{'layout':<8}{'most running':>13}{'preemptions':>12}{'wall s':>8}{'tokens/s':>10}{'TTFT p50 ms':>13}")
    summary = {}
    for name, out in rows.items():
        summary[name] = {"most_running": out["peak"], "preemptions": out["preemptions"], "wall_s": out["wall"],
                         "tokens_per_s": out["tokens"] / out["wall"],
                         "ttft_p50_ms": 1000 * statistics.median(out["ttft"])}
        row = summary[name]
        print(f"{name:<8}{row['most_running']:>13}{row['preemptions']:>12}{row['wall_s']:>8.2f}"
              f"{row['tokens_per_s']:>10.1f}{row['ttft_p50_ms']:>13.1f}")
    ratio = summary["paged"]["most_running"] / summary["slots"]["most_running"]
    print(f"paged / slots: {ratio:.2f}x the requests running at once, "
          f"{summary['slots']['wall_s'] / summary['paged']['wall_s']:.2f}x the speed; texts identical: {same}")
    summary["concurrency_ratio"], summary["identical"] = ratio, same
    return summary, same


def _best_ms(fn, n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def _attention_case(G: int, nb: int, H: int = 6, D: int = 64, bs: int = 16) -> dict:
    """G rows of nb blocks: the three ways' best times (ms) and whether they agree."""
    import torch.nn.functional as F

    S = nb * bs - 5
    gen = torch.Generator().manual_seed(G)
    pool = torch.randn(H, G * nb + 8, bs, D, generator=gen)  # head-major, as the cache keeps it
    blocks_first = pool.transpose(0, 1).contiguous()  # block-major, for the block-wise variant
    flat = torch.randperm(G * nb + 8, generator=gen)[:G * nb]
    q = torch.randn(G, H, 1, D, generator=gen)
    mask = torch.zeros(G, 1, 1, S)
    head_major = [torch.empty(H, G * nb, bs, D) for _ in range(2)]
    block_major = [torch.empty(G * nb, H, bs, D) for _ in range(2)]
    dense = pool.index_select(1, flat).view(H, G, nb * bs, D).transpose(0, 1).contiguous()

    def gathered() -> torch.Tensor:  # keys and values gathered (the same pool stands for both)
        for buffer in head_major:
            torch.index_select(pool, 1, flat, out=buffer)
        k = head_major[0].view(H, G, nb * bs, D)[:, :, :S]
        v = head_major[1].view(H, G, nb * bs, D)[:, :, :S]
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask.transpose(0, 1)).transpose(0, 1)

    def blockwise() -> torch.Tensor:
        for buffer in block_major:
            torch.index_select(blocks_first, 0, flat, out=buffer)
        k, v = (b.view(G, nb, H, bs, D) for b in block_major)
        s = torch.matmul(q.unsqueeze(1), k.transpose(-1, -2))  # (G, nb, H, 1, bs)
        s = s.permute(0, 2, 3, 1, 4).reshape(G, H, 1, nb * bs)[..., :S] / math.sqrt(D) + mask
        p = F.pad(s.softmax(-1), (0, nb * bs - S)).view(G, H, 1, nb, bs).permute(0, 3, 1, 2, 4)
        return torch.matmul(p, v).sum(1)

    def in_place() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, dense[:, :, :S], dense[:, :, :S], attn_mask=mask)

    reference = in_place()
    agree = all(torch.allclose(f(), reference, atol=1e-5) for f in (gathered, blockwise))
    return {"gathered_ms": _best_ms(gathered), "blockwise_ms": _best_ms(blockwise), "dense_ms": _best_ms(in_place),
            "agree": agree}


def attention_scenario(args: argparse.Namespace) -> tuple[dict, bool]:
    """One decode step's attention of one layer (6 heads of 64, blocks of 16, a query per row) three ways: the rows'
    blocks gathered into one batch then the fused kernel (what tokenloom.nn.paged does), block-wise (the blocks
    gathered block-major, scores per block by batched products, one softmax over them), and the slot layout's
    dense rows read in place (no gather: the floor). All three must agree."""
    rows, ok = {}, True
    print("\nattention: one layer's decode step over paged blocks (6 heads x 64, blocks of 16), ms")
    print(f"{'rows x blocks':<15}{'gathered':>10}{'block-wise':>12}{'dense':>8}")
    for G, nb in ((16, 10), (64, 35)):
        row = rows[f"{G}x{nb}"] = _attention_case(G, nb)
        ok &= row["agree"]
        print(f"{f'{G} x {nb}':<15}{row['gathered_ms']:>10.2f}{row['blockwise_ms']:>12.2f}{row['dense_ms']:>8.2f}"
              + ("" if row["agree"] else "  DIFFER"))
    return rows, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["prefix", "mixed", "attention", "all"], default="all")
    parser.add_argument("--clients", type=int, default=64, help="prefix: requests sharing the system prompt (64)")
    parser.add_argument("--system", type=int, default=512, help="prefix: system prompt tokens (512)")
    parser.add_argument("--max-tokens", type=int, default=16, help="prefix: tokens per request (16)")
    parser.add_argument("--requests", type=int, default=48, help="mixed: requests (48)")
    parser.add_argument("--budget-contexts", type=int, default=8, help="mixed: the KV budget in full contexts (8)")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="the engine's token budget per step (512)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    m = machine()
    print(f"{m.cpu}, {m.threads} threads, torch {torch.__version__}, fp32")
    model = model_for_bench()
    results: dict = {"machine": m.cpu, "threads": m.threads}
    ok = True
    if args.scenario in ("prefix", "all"):
        results["prefix"], same = prefix_scenario(model, args)
        ok &= same
    if args.scenario in ("mixed", "all"):
        results["mixed"], same = mixed_scenario(model, args)
        ok &= same
    if args.scenario in ("attention", "all"):
        results["attention"], same = attention_scenario(args)
        ok &= same
    report_load_and_save(results, load, m.threads, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
