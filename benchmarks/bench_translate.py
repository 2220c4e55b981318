"""Translation speed: tokenloom's encoder-decoder vs Hugging Face ``MarianMTModel`` with the same weights.

The checkpoint (a Marian-layout translation model: post-norm, ``sinusoidal_halves`` positions, output
bias, e.g. ``configs/multi30k-de-en.yaml``) is loaded into tokenloom and converted to a ``MarianMTModel``
with ``tokenloom.interop.to_hf``, so both compute the same function. Both translate the same sentences,
tokenized by the checkpoint's tokenizer, sorted by length and cut into the same batches, with the same
decoding settings (greedy or beam search, length penalty 1.0, no forced EOS, at most 1.5 * source + 10 new
tokens). Each side translates the whole split ``--repeat`` times, the sides alternating, and its fastest
pass counts. Reported per beam size: wall time, sentences/s, the ratio HF / tokenloom (> 1: tokenloom faster),
the fraction of identical translations, and each side's BLEU against the references.

    python benchmarks/bench_translate.py runs/de-en
    python benchmarks/bench_translate.py runs/de-en --split test2016 --beams 1,5 --batch-sentences 64
    python benchmarks/bench_translate.py runs/de-en --precision bf16       # both sides in bf16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from tokenloom.checkpoint import load_model, load_tokenizer, resolve_checkpoint
from tokenloom.config import from_dict
from tokenloom.data.parallel import read_parallel
from tokenloom.evaluation import compute_metrics
from tokenloom.generation import GenerationConfig, beam_search, generate
from tokenloom.hardware import machine
from tokenloom.interop import to_hf
from tokenloom.tasks.translation import TranslationDataConfig, special_ids


def batches(encoded: list[list[int]], size: int) -> list[list[int]]:
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    return [order[i:i + size] for i in range(0, len(order), size)]


def pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    return ids, mask


def strip(tokens: list[int], ids: dict[str, int]) -> list[int]:
    if ids["eos_id"] in tokens:
        tokens = tokens[:tokens.index(ids["eos_id"])]
    return [t for t in tokens if t not in (ids["pad_id"], ids["bos_id"])]


def run_tokenloom(model, source, mask, beam: int, new: int, ids: dict[str, int]) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=new, do_sample=False, num_beams=beam, eos_token_id=ids["eos_id"],
                              pad_token_id=ids["pad_id"])
    start = torch.full((source.shape[0], 1), ids["bos_id"])
    decoder = model.decoder_for(source, mask)
    out = beam_search(decoder, start, config).sequences[:, 0] if beam > 1 else generate(decoder, start, config)
    return [strip(row[1:], ids) for row in out.tolist()]


def run_hf(hf, source, mask, beam: int, new: int, ids: dict[str, int]) -> list[list[int]]:
    out = hf.generate(input_ids=source, attention_mask=mask, num_beams=beam, do_sample=False, max_new_tokens=new,
                      length_penalty=1.0, early_stopping=False, forced_eos_token_id=None, bad_words_ids=None,
                      decoder_start_token_id=ids["bos_id"], eos_token_id=ids["eos_id"], pad_token_id=ids["pad_id"])
    return [strip(row[1:], ids) for row in out.tolist()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--split", default="test2016")
    parser.add_argument("--beams", default="1,5")
    parser.add_argument("--batch-sentences", type=int, default=64)
    parser.add_argument("--sentences", type=int, default=None, help="only the first N sentences")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per side (alternating); the fastest "
                                                               "counts")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="both models' weights and compute (bf16: the CPU's bf16 matrix units)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--marian-random", action="store_true",
                        help="for a checkpoint Marian cannot express (e.g. pre-norm): benchmark a randomly "
                             "initialised Marian-layout model of the same shape instead of its weights")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    ckpt = resolve_checkpoint(args.checkpoint)
    model, config = load_model(ckpt)
    tokenizer = load_tokenizer(ckpt)
    if args.marian_random:
        from dataclasses import replace

        from tokenloom import EncoderDecoder

        torch.manual_seed(0)
        model = EncoderDecoder(replace(model.config, norm_placement="post", position="sinusoidal_halves",
                                       output_bias=True, num_kv_heads=None)).eval()
        print("random Marian-layout weights of the checkpoint's shape: every translation runs to the length "
              "limit", file=sys.stderr)
    ids = special_ids(tokenizer)
    hf = to_hf(model).eval()
    if args.precision == "bf16":
        model, hf = model.to(torch.bfloat16), hf.to(torch.bfloat16)
    data = from_dict(TranslationDataConfig, config.get("data") or {}, prefix="data")
    pairs = read_parallel(*data.files(args.split))[:args.sentences]
    sources, references = [p[0] for p in pairs], [p[1] for p in pairs]
    encoded = [tokenizer.encode(s)[:model.config.max_source_len - 1] + [ids["eos_id"]] for s in sources]
    chunks = batches(encoded, args.batch_sentences)
    print(f"{machine().describe()}, transformers {transformers.__version__}; "
          f"{len(sources)} sentences of {args.split}, {len(chunks)} batches", file=sys.stderr)
    load_before = os.getloadavg()[0]
    rows = []
    for beam in (int(b) for b in args.beams.split(",")):
        results: dict[str, dict] = {}
        sides = (("tokenloom", run_tokenloom, model), ("hf", run_hf, hf))
        with torch.inference_mode():
            for _, fn, net in sides:  # warm-up
                fn(net, *pad([encoded[i] for i in chunks[0]], ids["pad_id"]), beam, 8, ids)
            for _ in range(args.repeat):  # the sides alternate; each keeps its fastest pass
                for name, fn, net in sides:
                    out: list[list[int] | None] = [None] * len(encoded)
                    start = time.perf_counter()
                    for chunk in chunks:
                        source, mask = pad([encoded[i] for i in chunk], ids["pad_id"])
                        new = min(model.config.max_target_len - 1, int(1.5 * source.shape[1] + 10))
                        for i, tokens in zip(chunk, fn(net, source, mask, beam, new, ids), strict=True):
                            out[i] = tokens
                    seconds = time.perf_counter() - start
                    if name not in results or seconds < results[name]["seconds"]:
                        results[name] = dict(seconds=seconds, tokens=out)
                    print(f"  beam {beam} {name}: {seconds:.2f} s", file=sys.stderr, flush=True)
        for name in results:
            texts = [tokenizer.decode(t).strip() for t in results[name]["tokens"]]
            results[name]["bleu"] = compute_metrics(["bleu"], texts, references).scores["bleu"]
        same = sum(a == b for a, b in zip(results["tokenloom"]["tokens"], results["hf"]["tokens"], strict=True))
        rows.append(dict(beam=beam, tokenloom_s=results["tokenloom"]["seconds"], hf_s=results["hf"]["seconds"],
                         ratio=results["hf"]["seconds"] / results["tokenloom"]["seconds"],
                         identical=same / len(encoded), tokenloom_bleu=results["tokenloom"]["bleu"],
                         hf_bleu=results["hf"]["bleu"], sentences=len(encoded)))
    print(f"\n{args.split}: {len(encoded)} sentences, batches of {args.batch_sentences}, {args.precision}; "
          f"{machine().describe()}, transformers {transformers.__version__}")
    print("beam  tokenloom s  HF s   HF/tokenloom  sent/s (tokenloom)  identical  BLEU tokenloom  BLEU HF")
    for r in rows:
        print(f"{r['beam']:>4}  {r['tokenloom_s']:>11.1f}  {r['hf_s']:>5.1f}  {r['ratio']:>11.2f}x  "
              f"{r['sentences'] / r['tokenloom_s']:>18.1f}  {r['identical']:>9.3f}  {r['tokenloom_bleu']:>14.2f}  "
              f"{r['hf_bleu']:>7.2f}")
    print(f"1-min load average before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(machine=machine().as_dict(), transformers=transformers.__version__,
                           date=time.strftime("%Y-%m-%d"), rows=rows), fh, indent=2)


if __name__ == "__main__":
    main()
