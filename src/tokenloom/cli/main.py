"""``tokenloom train | recipes | sweep | sweep-report | fit-scaling | generate | fit-exits | evaluate | translate |
classify | distill | bench | viz | report | serve | import | export | quantize | index | lora |
completion``.

Errors a user can cause print one line (``error: ...``) and exit with status 2; Ctrl-C exits 130. Warnings print
one line too (``warning: ...``, :func:`one_line_warnings`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from ..errors import ConfigError, TokenloomError


def _add_precision(p: argparse.ArgumentParser, default: str = "auto") -> None:
    if default == "auto":  # the commands that run a model: $TOKENLOOM_PRECISION sets the default (e.g. fp32 in tests)
        default = os.environ.get("TOKENLOOM_PRECISION") or default
        text = ("the weights' dtype; auto: on a CPU bf16 where it has native bf16 matrix instructions and the decode "
                "step measures faster with it, else fp32; on a CUDA GPU bf16 (fp16 before Ampere); on MPS fp32 (said "
                "on stderr); fp16: CUDA only; int8, int4: weight-only quantised (float32 activations; a float "
                "checkpoint is quantised as it loads, blocks only; a quantised checkpoint implies its own, auto "
                "takes it); default: $TOKENLOOM_PRECISION or auto")
    else:
        text = f"the weights' dtype (default {default})"
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16", "int8", "int4"], default=default,
                   help=text)
    _add_device(p)


def _add_device(p: argparse.ArgumentParser) -> None:
    from ..devices import DEVICE_HELP, default_device

    p.add_argument("--device", default=default_device(), help=DEVICE_HELP)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model from a YAML recipe",
                       description="Train from a recipe; the run directory holds the checkpoint and metrics.")
    p.add_argument("recipe", nargs="?", help="YAML recipe file, or the name of a packaged recipe (`tokenloom recipes` "
                                             "lists them; an existing file wins); optional with --resume: the run's "
                                             "own config is used")
    p.add_argument("--out", required=True, help="run directory (checkpoint, metrics.jsonl, token cache)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe value, e.g. --set train.max_steps=500 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue exactly from the run's last checkpoint")
    p.add_argument("--sample", type=int, default=0, metavar="N",
                   help="print N characters/tokens of generated text after training")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="train as N processes on this machine (starts them through torchrun's launcher; "
                        "docs/distributed.md); default: one per GPU on CUDA, else 1")
    p.add_argument("--strategy", choices=("single", "ddp", "fsdp"),
                   help="how several processes split the work (sets train.strategy; default ddp)")
    p.add_argument("--device", default=None,
                   help="sets train.device: auto (a CUDA GPU, else Apple MPS, else the CPU) | cpu | cuda | cuda:N | "
                        "mps")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="with --nproc: restart the processes up to K times after a failure; each restart resumes "
                        "from the newest intact checkpoint")
    p.set_defaults(func=_run("train"))
    r = sub.add_parser("recipes", help="list the packaged recipes, or print one (to copy and edit)",
                       description="The recipes shipped inside the package: `tokenloom train NAME --out DIR` trains "
                                   "one from anywhere. Their data/ and checkpoints/ paths point into the "
                                   "repository (not packaged): run from its root or --set the path.")
    r.add_argument("name", nargs="?", help="print this recipe's YAML")
    r.set_defaults(func=_run_in("recipes", "recipes"))


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint",
                       description="Generate text from a checkpoint, printing it as it is produced.")
    p.add_argument("checkpoint", help="checkpoint or run directory")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--chat", default=None, metavar="MESSAGE",
                   help="chat: send MESSAGE as a user turn through the checkpoint's chat template (the one it "
                        "recorded, e.g. an imported model's own or the sft task's; else the default) and print only "
                        "the reply, which ends at the template's end marker")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text appears (repeatable); \\n, \\t, \\r and \\\\ in it are a newline, "
                        "a tab, a carriage return and a backslash, so --stop '\\n\\n' stops at a blank line")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--beam", type=int, default=1, metavar="N",
                   help="beam search with N beams (prints the best hypothesis; with --num-samples K the K best)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="beam score = sum of log-probs / generated length ** this")
    p.add_argument("--no-repeat-ngram-size", type=int, default=0, help="beam search: never repeat an n-gram")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=None)
    _add_precision(p)
    p.add_argument("--compile", action="store_true",
                   help="one-token steps through torch.compile over a static cache (warns and runs eagerly where "
                        "it cannot; see docs/performance.md for when it pays)")
    p.add_argument("--exit-threshold", type=float, default=None, metavar="P",
                   help="depth-adaptive early exit (GPT): a token leaves the layer stack once an exit head's top "
                        "probability exceeds P, in (0, 1] (1 = never); faster steps, less accurate text")
    p.add_argument("--exit-heads", choices=("shared", "trained"), default=None,
                   help="with --exit-threshold: the exit heads, shared (the model's own final norm and output "
                        "layer) or trained (exit_heads.safetensors, from `tokenloom fit-exits`); default: trained "
                        "where the checkpoint has them, else shared")
    _add_speculative(p)
    p.add_argument("--verbose", action="store_true",
                   help="print speed figures to stderr (stdout keeps the text): load time, prompt tokens and time to "
                        "the first token, new tokens with tokens/s and ms/token of decoding, total time; with "
                        "--draft or --prompt-lookup: drafts kept, acceptance and tokens per pass of the model; with "
                        "--exit-threshold: the mean layers a token ran")
    from .index import add_rag_options

    add_rag_options(p)  # --rag INDEX and its options (cli/index.py)
    from .preference import add_best_of_options

    add_best_of_options(p)  # --best-of N --reward-model CKPT (cli/preference.py)
    p.set_defaults(func=_run("generate"))


def _add_speculative(p: argparse.ArgumentParser) -> None:
    """Speculative decoding's options (generate, translate, serve)."""
    p.add_argument("--draft", default=None, metavar="RUN",
                   help="speculative decoding with this small model (a checkpoint or run directory with the same "
                        "tokenizer) as the drafter: greedy output is unchanged, sampling keeps its distribution")
    p.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="speculative decoding with prompt lookup: propose the tokens that followed the last match "
                        "of the text's final n-gram (n <= N) earlier in the prompt or output; 0 = off")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="K",
                   help="with --draft or --prompt-lookup: tokens proposed per verification pass (default 4)")


def _add_fit_exits(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit-exits", help="train early-exit heads for `generate --exit-threshold`",
                       description="Train the exit heads of a GPT checkpoint for depth-adaptive early exit: a norm "
                                   "per layer in front of the model's own output layer, with the model frozen (its "
                                   "own predictions do not change), on random windows of the checkpoint's training "
                                   "text. Writes exit_heads.safetensors into the checkpoint directory.")
    p.add_argument("checkpoint", help="checkpoint or run directory (a GPT)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--lr", type=float, default=3e-2, help="AdamW learning rate (default 0.03)")
    p.add_argument("--seed", type=int, default=0, help="seed of the windows drawn (default 0)")
    p.add_argument("--data", default=None, help="text file to train on (default: the checkpoint's data.path; its "
                                                "training split, before the last data.val_fraction)")
    _add_device(p)
    p.set_defaults(func=_run_in("exits", "fit_exits"))


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    from ..tasks.translation import DEFAULT_BEAM

    p = sub.add_parser("evaluate", help="evaluate a checkpoint: loss and perplexity (lm), BLEU (translation), "
                       "accuracy and confusion matrix (image classification)")
    p.add_argument("checkpoint", help="checkpoint or run directory")
    p.add_argument("--data", default=None, help="lm: text file; image: data folder (default: the one the "
                   "checkpoint was trained on)")
    p.add_argument("--split", default="val", help="lm: train | val; translation: any split of the recipe's "
                   "data (val, test2016, ...); image: train | val | test")
    p.add_argument("--batches", type=int, default=None, help="lm, image: at most this many batches (default: the "
                   "whole split)")
    p.add_argument("--stride", type=int, default=None, metavar="N",
                   help="lm: strided (sliding-window) perplexity: windows of the model's context advancing by N "
                        "tokens, each scoring only its new tokens, so every token has at least context - N tokens "
                        "before it (default: non-overlapping windows)")
    p.add_argument("--batch-size", type=int, default=None, help="lm: sequences per batch (16); image: images per "
                   "batch (the recipe's data.eval_batch_size)")
    p.add_argument("--metrics", nargs="+", default=None, metavar="NAME",
                   help="translation: bleu chrf rouge exact_match (default: bleu chrf)")
    p.add_argument("--beam", type=int, default=None,
                   help=f"translation: beam size (1 = greedy; default {DEFAULT_BEAM})")
    _add_parallel_decoding(p, "translation: ")
    p.add_argument("--source", default=None, help="translation: a source file to evaluate instead of a split")
    p.add_argument("--reference", default=None, help="translation: its reference translations (line-aligned)")
    p.add_argument("--output", default=None, help="translation: write the hypotheses to this file; image: the "
                   "confusion-matrix PNG (default: <checkpoint>-confusion-<split>.png next to the checkpoint)")
    p.add_argument("--no-plot", action="store_true", help="image: do not draw the confusion-matrix PNG")
    _add_precision(p)
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.add_argument("--verbose", action="store_true",
                   help="lm, sft: print the load time and the evaluation pass's tokens/s and ms/token to stderr; "
                        "translation: as translate --verbose")
    p.set_defaults(func=_run("evaluate"))


def _add_parallel_decoding(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument("--iterations", type=int, default=None,
                   help=f"{prefix}cmlm: mask-predict iterations (default 10)")
    p.add_argument("--length-beam", type=int, default=None,
                   help=f"{prefix}nat, cmlm: target-length candidates, the best kept (default 3)")
    p.add_argument("--rescore", default=None, metavar="CHECKPOINT",
                   help=f"{prefix}nat, cmlm: pick among the length candidates by this autoregressive model's "
                        "log-probability (same tokenizer)")


def _add_translate(sub: argparse._SubParsersAction) -> None:
    from ..tasks.translation import DEFAULT_BEAM

    p = sub.add_parser("translate", help="translate sentences with an encoder-decoder checkpoint",
                       description="Translate one sentence per line (stdin or --input) to stdout or --output.")
    p.add_argument("checkpoint", help="checkpoint or run directory of a translation model")
    p.add_argument("--input", default=None, help="source file, one sentence per line (default: stdin)")
    p.add_argument("--output", default=None, help="file for the translations (default: stdout)")
    p.add_argument("--beam", type=int, default=None, help=f"beam size (1 = greedy; default {DEFAULT_BEAM})")
    _add_parallel_decoding(p)
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="beam score = sum of log-probs / length ** this (default 1.0)")
    p.add_argument("--no-repeat-ngram-size", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=4096, help="source tokens per batch (times the beam)")
    p.add_argument("--too-long", choices=["truncate", "error"], default="truncate",
                   help="a source longer than the model's limit: truncate with a warning, or refuse")
    _add_speculative(p)  # greedy only: --beam defaults to 1 with a drafter
    _add_precision(p)
    p.add_argument("--verbose", action="store_true",
                   help="print speed figures to stderr (stdout keeps the translations): load time, sentences/s and "
                        "the decoding, source tokens, new tokens with tokens/s and ms/token, total time; with --draft "
                        "or --prompt-lookup: drafts kept, acceptance and tokens per pass of the model")
    p.set_defaults(func=_run("translate"))


def _add_classify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("classify", help="classify image files with an image classification checkpoint",
                       description="Print each image's predicted class and its top probabilities. Images are "
                                   "read as the model was trained: converted to its grayscale/RGB mode and size.")
    p.add_argument("checkpoint", help="checkpoint or run directory of an image classifier")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...)")
    p.add_argument("--top", type=int, default=3, metavar="K", help="show the K most likely classes (default 3)")
    p.add_argument("--mismatch", choices=["convert", "error"], default="convert",
                   help="an image of another size or mode: convert it with a warning (default), or refuse")
    p.add_argument("--invert", action="store_true",
                   help="invert the pixels first (dark digits on light paper for an MNIST model)")
    _add_precision(p)
    p.add_argument("--json", action="store_true", help="print the predictions as one JSON object")
    p.set_defaults(func=_run("classify"))


def _add_distill(sub: argparse._SubParsersAction) -> None:
    from ..tasks.translation import DEFAULT_BEAM

    p = sub.add_parser("distill", help="sequence-level knowledge distillation: a teacher's translations as a corpus",
                       description="Translate a split's sources with an autoregressive teacher and write them, "
                                   "line-aligned with the translations, as a data folder (other splits copied) "
                                   "that a recipe's data.dir can point at.")
    p.add_argument("checkpoint", help="the teacher: a translation checkpoint or run directory")
    p.add_argument("--split", default="train", help="split of the teacher's data to translate (default train)")
    p.add_argument("--beam", type=int, default=DEFAULT_BEAM, help=f"the teacher's beam size (default {DEFAULT_BEAM})")
    p.add_argument("--out", required=True, help="data folder to write (a new or empty one, e.g. under runs/; never "
                                                "the teacher's own data folder)")
    p.add_argument("--max-tokens", type=int, default=4096, help="source tokens per batch (times the beam)")
    p.add_argument("--chunk", type=int, default=1000, help="sentences sorted by length and batched together at a "
                                                           "time")
    p.add_argument("--limit", type=int, default=None, help="only the first N pairs (a quick look)")
    _add_precision(p)
    p.add_argument("--force", action="store_true", help="write into an --out that already holds files, replacing "
                                                        "those distill writes (the split's two files, the copied "
                                                        "splits, README.md)")
    p.set_defaults(func=_run_in("translation", "distill"))


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure speed (and quality) side by side")
    bench = p.add_subparsers(dest="bench", metavar="WHAT", required=True)
    t = bench.add_parser("translate", help="AR greedy / beam 5 and NAT / CMLM / CTC decodings in one table",
                         description="BLEU and chrF on a split, latency per sentence at batch 1, throughput at "
                                     "batch --batch and speedup relative to AR beam 5, all measured in this run.")
    t.add_argument("runs", nargs="+", help="translation checkpoints or run directories (AR and NAT)")
    t.add_argument("--split", default="test2016")
    t.add_argument("--batch", type=int, default=64, help="sentences per batch for the throughput (default 64)")
    t.add_argument("--latency-sentences", type=int, default=200,
                   help="sentences translated one at a time for the batch-1 latency (default 200)")
    t.add_argument("--limit", type=int, default=None, help="only the first N sentences of the split")
    _add_precision(t, default="fp32")
    t.add_argument("--out", default=None, help="folder for translate-bench.md / .csv / .png")
    t.set_defaults(func=_run_in("translation", "bench_translate"))
    a = bench.add_parser("attention", help="time and peak memory of the attention backends over sequence lengths",
                         description="Forward time, extra peak memory and (linear-time backends) error against "
                                     "exact softmax attention, per backend and length, each in a fresh process; "
                                     "window: sliding-window attention block-wise (checked against its dense "
                                     "mask).")
    a.add_argument("--lengths", nargs="+", default=["512", "2048", "8192", "16384"],
                   help="sequence lengths, space- or comma-separated, k = 1024 (e.g. 1k,4k,16k,64k; default 512 "
                        "2048 8192 16384)")
    a.add_argument("--backends", nargs="+", default=["sdpa", "math", "performer", "linformer", "window"],
                   help="attention backends to measure, space- or comma-separated (default: sdpa math performer "
                        "linformer window); window = sliding-window attention (--window) block-wise with sdpa")
    a.add_argument("--mode", choices=["causal", "bidirectional", "both"], default="both",
                   help="causal masks, none, or both (linformer: bidirectional only)")
    a.add_argument("--batch", type=int, default=1)
    a.add_argument("--heads", type=int, default=8)
    a.add_argument("--head-dim", type=int, default=64)
    a.add_argument("--repeats", type=int, default=3, help="timed calls after one warm-up; the fastest is kept")
    a.add_argument("--math-max-length", type=int, default=8192,
                   help="skip the explicit softmax above this length (its scores grow with the square)")
    a.add_argument("--sdpa-max-length", type=int, default=16384,
                   help="skip full sdpa above this length (its time grows with the square: 64k causal takes ~16x "
                        "16k's; default 16384)")
    a.add_argument("--window", type=int, default=512,
                   help="the window backend's window size W (causal: a query sees itself and the W - 1 before it; "
                        "bidirectional: W//2 either side; default 512)")
    a.add_argument("--error-max-length", type=int, default=4096,
                   help="measure the approximation error up to this length (it needs the exact output too)")
    a.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a.add_argument("--out", default=None, help="folder for attention-bench.md and attention-bench.png")
    a.set_defaults(func=_run_in("bench", "bench_attention"))
    for name, what in (("train", "training throughput: tokenloom GPT vs HF GPT2LMHeadModel, fp32 / bf16"),
                       ("generate", "greedy generation speed vs HF on the same weights, bandwidth bound, bf16")):
        b = bench.add_parser(name, help=what, add_help=False,
                             description=f"{what}; every option is the benchmark's own: tokenloom bench {name} --help")
        b.set_defaults(func=_passthrough(f"..benchmarks.{name}"), passthrough=True)
    r = bench.add_parser("roofline", help="the machine's limits: matmul peak (fp32, bf16), memory bandwidth",
                         description="Matrix-product peak in float32 and bfloat16 and memory bandwidth, measured now.")
    r.add_argument("--size", type=int, default=2048, help="matrix side for the peak (default 2048)")
    r.add_argument("--gib", type=float, default=1.0, help="GiB streamed for the bandwidth (default 1)")
    r.add_argument("--threads", type=int, default=None)
    r.set_defaults(func=_run_in("bench", "bench_roofline"))


def _add_viz(sub: argparse._SubParsersAction) -> None:
    viz = sub.add_parser("viz", help="attention maps, causal-mask check and head diagnostics, training curves, "
                                     "ponder maps",
                         description="Look inside a model: attention maps (any backend), checks, curves.")
    kinds = viz.add_subparsers(dest="viz_command", metavar="WHAT", required=True)
    a = kinds.add_parser("attention", help="attention maps as a PNG: heads grid, cross-attention alignment, "
                                           "ViT rollout",
                         description="Capture the attention of a GPT (--text), a translation model (--source; "
                                     "--cross for the alignment) or a ViT (--image; --rollout) and plot it.")
    a.add_argument("checkpoint", help="checkpoint or run directory")
    a.add_argument("--text", help="GPT: the text to look at")
    a.add_argument("--source", help="translation: the source sentence")
    a.add_argument("--target", help="translation: the target (default: the model's greedy translation)")
    a.add_argument("--cross", action="store_true", help="translation: cross-attention alignment (mean of heads)")
    a.add_argument("--kind", choices=["encoder", "decoder", "cross"], default=None,
                   help="translation: which attention (default: encoder; --cross = cross)")
    a.add_argument("--image", help="ViT: an image file")
    a.add_argument("--invert", action="store_true", help="ViT: invert the image (dark digits on light paper)")
    a.add_argument("--rollout", action="store_true", help="ViT: attention rollout over all layers on the image")
    a.add_argument("--layers", type=int, nargs="+", default=None, help="layer indices (default: all; cross: last)")
    a.add_argument("--heads", type=int, nargs="+", default=None, help="head indices (default: all)")
    a.add_argument("--too-long", choices=["error", "truncate"], default="error",
                   help="text longer than the model's context: refuse (default) or keep the start")
    a.add_argument("--out", default="attention.png", help="PNG to write (default attention.png)")
    a.set_defaults(func=_run_in("viz", "attention"))
    _add_device(a)
    c = kinds.add_parser("check", help="causal-mask check and head diagnostics (table, JSON, PNG)",
                         description="Check that no query attends to a later position (every causal layer, with "
                                     "padding) and print per-head entropy and previous/first/diagonal mass with "
                                     "flags for near-uniform and collapsed heads. Exit status 1 when the causal "
                                     "check fails.")
    c.add_argument("checkpoint", help="checkpoint or run directory")
    c.add_argument("--text", help="GPT: text to run (default: a few lines of Shakespeare)")
    c.add_argument("--source", help="translation: a source sentence")
    c.add_argument("--image", help="ViT: an image file")
    c.add_argument("--too-long", choices=["error", "truncate"], default="truncate")
    c.add_argument("--out", default=None, help="folder for head-diagnostics.json and head-entropy-*.png")
    _add_device(c)
    c.set_defaults(func=_run_in("viz", "check"))
    v = kinds.add_parser("curves", help="loss / learning rate / throughput of runs on shared axes (PNG)",
                         description="Training curves of one or more run directories (their metrics.jsonl).")
    v.add_argument("runs", nargs="+", help="run directories")
    v.add_argument("--out", default="curves.png", help="PNG to write (default curves.png)")
    v.set_defaults(func=_run_in("viz", "curves"))
    n = kinds.add_parser("ponder", help="a text coloured by each token's ponder count (ACT), PNG or HTML; class table",
                         description="Run a pondering language model (adaptive computation time, family universal) "
                                     "over a text and draw each character coloured by its ponder count N + R (PNG "
                                     "or HTML, by the extension of --out); print the mean ponder per character "
                                     "class (space, punctuation, letter, digit, line start, newline, other) and its "
                                     "ratio to the letters'.")
    n.add_argument("checkpoint", help="checkpoint or run directory")
    n.add_argument("--text", help="the text to look at")
    n.add_argument("--text-file", help="a UTF-8 file holding the text to look at")
    n.add_argument("--out", required=True, help="FILE.png or FILE.html to write")
    n.add_argument("--json", default=None, help="also write the class summary and every token's ponder here")
    n.add_argument("--too-long", choices=["chunk", "truncate", "error"], default="chunk",
                   help="text longer than the model's context: run it in overlapping windows (default), keep the "
                        "start, or refuse")
    n.add_argument("--width", type=int, default=100, help="PNG: wrap lines longer than this many characters")
    _add_device(n)
    n.set_defaults(func=_run_in("viz", "ponder"))


def _add_experiments(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="train a grid of recipe variants (each a run directory); resumable",
                       description="Expand a sweep file (recipe, set, grid, runs, seeds, evaluate; see sweeps/) and "
                                   "train every point not finished yet; results.csv / results.md collect them.")
    p.add_argument("sweep", help="sweep YAML file")
    p.add_argument("--out", required=True, help="sweep directory (one run directory per point)")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="train N points at a time (default 1)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="add to the sweep's shared settings, e.g. --set train.max_steps=500 for a quicker version "
                        "(repeatable; use a fresh --out: finished runs are not rerun)")
    p.add_argument("--dry-run", action="store_true", help="list the points and stop")
    p.add_argument("--device", default=None, help="sets train.device of every point: auto | cpu | cuda | cuda:N | mps")
    p.set_defaults(func=_run("sweep"))
    r = sub.add_parser("sweep-report", help="tables (Markdown, CSV) and curves of a sweep directory",
                       description="results.csv, results.md (every run; per swept key: mean / std / min of the "
                                   "metric over seeds, the divergence and collapse counts; one row per combination "
                                   "of the swept keys) and curves.png.")
    r.add_argument("out", help="sweep directory")
    r.add_argument("--metric", default=None, help="metric of the grouped tables (default: the sweep file's "
                                                  "report.metric, else val_loss)")
    r.add_argument("--collapsed-above", type=float, default=None, metavar="X",
                   help="count finished runs whose final metric stays above X as collapsed (default: the sweep "
                        "file's report.collapsed_above)")
    r.set_defaults(func=_run("sweep_report"))
    f = sub.add_parser("fit-scaling", help="fit L(N) = a*N^-alpha + c and L(C) over a sweep, with bootstrap "
                                           "intervals",
                       description="Power-law fits of the final metric against non-embedding parameters N and "
                                   "compute C = 6ND over a sweep's runs: scaling.json, scaling.md, scaling-*.png.")
    f.add_argument("out", help="sweep directory")
    f.add_argument("--metric", default="val_loss")
    f.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default 1000)")
    f.set_defaults(func=_run("fit_scaling"))


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="one self-contained report.html of a run (config, curves, samples, "
                                      "metrics, attention)",
                       description="Write one HTML file with every image inlined (readable offline): the run's "
                                   "config, training curves, final metrics, samples and attention maps.")
    p.add_argument("run", help="run directory (or checkpoint)")
    p.add_argument("--out", default=None, help="HTML file (default: RUN/report.html)")
    p.add_argument("--text", default=None, help="GPT: prompt for the samples and the attention maps")
    p.add_argument("--source", default=None, help="translation: source sentence for the alignment")
    p.add_argument("--image", default=None, help="ViT: an image for the attention rollout")
    p.add_argument("--seed", type=int, default=0)
    _add_device(p)
    p.set_defaults(func=_run_in("report", "report"))


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching and a playground",
                       description="Serve a checkpoint over HTTP: /v1/completions, /v1/chat/completions (language "
                                   "models), /v1/translations (translation models), /v1/models, /health, /metrics, "
                                   "and a playground page at /. Binds to 127.0.0.1 unless --host says otherwise.")
    p.add_argument("checkpoint", help="checkpoint or run directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /metrics "
                   "(or set TOKENLOOM_API_KEY); compared as UTF-8 bytes")
    p.add_argument("--allowed-hosts", action="append", default=[], metavar="HOST[,HOST...]",
                   help="Host header names answered besides the defaults, against DNS rebinding (repeatable or "
                        "comma-separated; '.example.com' also allows its subdomains; '*' allows any). Always "
                        "answered: localhost, *.localhost, loopback addresses, the --host address; with --host "
                        "0.0.0.0 or :: any IP address too (a rebinding page uses a name), so clients that reach "
                        "the server by a DNS name need it listed. Other Hosts get 400 on every route")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages of ORIGIN (scheme://host[:port], or '*') call the API from the browser "
                        "(repeatable); default: CORS off, no page of another origin may read an answer")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--block-size", type=int, default=16, help="positions per block of the paged KV cache "
                   "(default 16; the model's context: one slot per request)")
    p.add_argument("--kv-blocks", type=int, default=None, help="blocks in the paged KV cache: its memory budget "
                   "(default: as many positions as --max-batch full contexts)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse the cached blocks of prompts' common prefixes")
    p.add_argument("--prefill-tokens", type=int, default=512, help="tokens a step runs at most: the running "
                   "requests' next tokens and chunks of prompts being prefilled (default 512)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting before 429 (default 64)")
    p.add_argument("--max-tokens", type=int, default=1024, help="the largest max_tokens a request may ask")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (default 1 MiB)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request ends (504)")
    p.add_argument("--grammar-seconds", type=float, default=10.0, help="seconds a response_format grammar may "
                   "take to compile (in a worker process, killed at the limit; the request gets 400; default 10)")
    p.add_argument("--grammar-memory-mb", type=int, default=1024, help="memory a response_format grammar's compile "
                   "may use, in MB (its worker is capped; past it the request gets 400; default 1024)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, help="seconds an idle connection stays open, "
                   "before its first request and between requests (default 5)")
    p.add_argument("--timeout-read", type=float, default=30.0, help="seconds a request has to arrive whole (headers "
                   "and body) once its first byte has come; slower ones get 408 (default 30)")
    p.add_argument("--limit-concurrency", type=int, default=256, help="running requests beyond which a request "
                   "gets 503 (default 256)")
    p.add_argument("--limit-connections", type=int, default=None, help="open connections beyond which a new one "
                   "sheds the idle ones (no request begun), longest idle first; when none is idle its request gets "
                   "503, and past twice the cap it is closed on arrival (default 2 x --limit-concurrency + 16, at "
                   "most what the file-descriptor limit leaves: serve raises its soft limit to the hard one)")
    p.add_argument("--backlog", type=int, default=2048, help="connections the kernel queues before the server "
                   "accepts them (listen backlog; the kernel caps it at net.core.somaxconn; default 2048)")
    p.add_argument("--max-header-bytes", type=int, default=65536, help="request line plus headers; larger get 431 "
                   "(default 64 KiB)")
    p.add_argument("--model-name", default=None, help="the model id in the API (default: the run's name)")
    _add_speculative(p)  # a request opts out with "speculative": false
    from .index import add_serve_rag_options

    add_serve_rag_options(p)  # --rag INDEX: POST /v1/rag (cli/index.py)
    _add_precision(p)
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--verbose", action="store_true",
                   help="log a line per completion on stderr: prompt tokens and time to the first token, new tokens "
                        "with tokens/s and ms/token after the first, drafts kept and acceptance, total time (the "
                        "numbers /metrics adds to its histograms)")
    p.set_defaults(func=_run_in("serve", "serve"))


_DTYPE_CHOICES = ["float32", "bfloat16", "float16"]


def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="turn a Hugging Face model directory into a tokenloom checkpoint",
                       description="Import a local Hugging Face model directory (config.json, model.safetensors "
                                   "or pytorch_model.bin, tokenizer.json), or a hub name (gpt2, org/name) already in "
                                   "the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub; nothing is "
                                   "downloaded), as a tokenloom checkpoint. Supported: "
                                   "GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM (its sliding window too).")
    p.add_argument("format", choices=["hf"], help="source format: hf (Hugging Face transformers)")
    p.add_argument("source", help="Hugging Face model directory, or a hub name in the local Hugging Face cache")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--dtype", choices=_DTYPE_CHOICES, default=None, help="store weights in this dtype "
                   "(default: as in the source)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=_run("import_"))


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory",
                       description="Export a tokenloom checkpoint as config.json + model.safetensors (+ tokenizer "
                                   "files) that transformers' AutoModelForCausalLM loads: the GPT-2 layout for "
                                   "learned positions + LayerNorm + GELU, the Llama layout for RoPE + RMSNorm + "
                                   "SwiGLU.")
    p.add_argument("checkpoint", help="checkpoint or run directory")
    p.add_argument("--format", choices=["hf"], default="hf", help="target format (default: hf)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--dtype", choices=_DTYPE_CHOICES, default=None, help="store weights in this dtype "
                   "(default: as in the checkpoint)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=_run("export"))


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a weight-only int8 / int4 copy of a checkpoint",
                       description="Quantise a float checkpoint's weights for inference: int8 per output channel or "
                                   "int4 in groups of input columns, the linear layers of every Transformer block "
                                   "(optionally the output layer and the token embedding too). The new checkpoint "
                                   "loads anywhere a checkpoint does (generate, evaluate, translate, serve); it "
                                   "cannot be trained.")
    p.add_argument("checkpoint", help="float checkpoint or run directory")
    p.add_argument("--bits", type=int, choices=[8, 4], required=True, help="weight width")
    p.add_argument("--group-size", type=int, default=128,
                   help="int4: input columns sharing a scale and zero point (32, 64, 128 or 256)")
    p.add_argument("--head", action="store_true",
                   help="also the output layer (a head tied to the embedding gets its own quantised copy)")
    p.add_argument("--embedding", action="store_true", help="also the token embedding (int8 per row; GPT)")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=_run("quantize"))


def _add_lora(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora", help="a LoRA run's adapter: describe it, or merge it into a full checkpoint",
                       description="A LoRA run (train.lora) checkpoints its adapter (adapter.safetensors + "
                                   "adapter.json) and names its frozen base; every command loads it as the base with "
                                   "the adapter merged. docs/alignment.md")
    kinds = p.add_subparsers(dest="lora_command", metavar="ACTION", required=True)
    i = kinds.add_parser("info", help="rank, alpha, targets, trainable parameters and the base of an adapter")
    i.add_argument("checkpoint", help="LoRA checkpoint or run directory")
    i.set_defaults(func=_run_in("lora", "info"))
    m = kinds.add_parser("merge", help="write the base with the adapter merged as a standalone full checkpoint")
    m.add_argument("checkpoint", help="LoRA checkpoint or run directory")
    m.add_argument("--out", required=True, help="checkpoint directory to write")
    m.add_argument("--force", action="store_true", help="replace a non-empty --out")
    m.set_defaults(func=_run_in("lora", "merge"))


def _run(name: str) -> Callable[[argparse.Namespace], int]:
    def call(args: argparse.Namespace) -> int:
        from . import commands  # heavy imports (torch) only once a command runs

        return getattr(commands, name)(args)

    return call


def _passthrough(module: str) -> Callable[[argparse.Namespace], int]:
    """A command whose arguments all go to ``module.main(argv)`` (a benchmark with its own parser); needs the
    ``parity`` extra (transformers), named in one line when it is missing."""
    def call(args: argparse.Namespace) -> int:
        import importlib

        try:
            benchmark = importlib.import_module(module, __package__)
        except ImportError as err:
            raise ConfigError(f"this benchmark needs {err.name or 'an optional package'}: "
                              "pip install 'tokenloom[parity]'") from None
        benchmark.main(args.rest)
        return 0

    return call


def _run_in(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    def call(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(f".{module}", __package__), name)(args)

    return call


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenloom", description="The Transformer family on an ordinary machine.")
    parser.add_argument("--version", action="version", version="tokenloom 0.1.0")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_train(sub)
    _add_experiments(sub)
    _add_generate(sub)
    _add_fit_exits(sub)
    _add_evaluate(sub)
    _add_translate(sub)
    _add_classify(sub)
    _add_distill(sub)
    _add_bench(sub)
    _add_viz(sub)
    _add_report(sub)
    _add_serve(sub)
    _add_import(sub)
    _add_export(sub)
    _add_quantize(sub)
    _add_lora(sub)
    from .index import add_index

    add_index(sub)  # tokenloom index DOCS --out INDEX (cli/index.py)
    _add_completion(sub)
    _show_defaults(parser)
    return parser


def _add_completion(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("completion", help="print the shell's tab-completion script (bash, zsh, tcsh)",
                       description='Print the tab completion of every command, flag and choice for a shell, e.g. '
                                   'in ~/.bashrc:\n\n  eval "$(tokenloom completion bash)"\n\nor written once to '
                                   'a file the shell reads at start (quicker).')
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"], help="the shell the script is for")
    p.set_defaults(func=_run_in("completion", "completion"))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks, and a line wider than the terminal wraps (at its own indent); each
    option's default appended to its help where it has one worth showing (not None, False or empty) and the help
    does not already say it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        lines = []
        for line in text.splitlines():
            if len(indent + line) <= width:
                lines.append(indent + line)
                continue
            lead = line[:len(line) - len(line.lstrip())]
            lines.append(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent + lead,
                                       break_long_words=False, break_on_hyphens=False))
        return "\n".join(lines) + ("\n" if text.endswith("\n") else "")

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text.lower() or action.default in (None, False, [], "") \
                or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)" if text else text


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """``--help`` of every (sub)command shows the defaults (:class:`_HelpFormatter`)."""
    parser.formatter_class = _HelpFormatter
    for action in parser._actions:
        if action.help is None and action.option_strings:  # argparse prints nothing for an option without help
            action.help = ""
        if action.help == "" and action.default not in (None, False, [], "", argparse.SUPPRESS):
            action.help = "(default: %(default)s)"
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001 - warnings' signature
    return f"warning: {' '.join(str(message).split())}\n"


class _OneLineLog(logging.Formatter):
    """A log record as ``warning: ...`` (``error: ...``) on one line, like the CLI's own messages."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {' '.join(record.getMessage().split())}"


def one_line_warnings() -> None:
    """Every warning as one ``warning: ...`` line on stderr, without the file and source line: Python warnings
    (torch's and matplotlib's included) and the records of loggers that have no handler of their own (matplotlib's
    font notes, ...), which Python's last-resort handler prints. Called first in :func:`main`; importing this
    module imports no torch, so warnings that libraries raise as they are imported get the format too."""
    import warnings

    warnings.formatwarning = _one_line_warning
    if logging.lastResort is not None:
        logging.lastResort.setFormatter(_OneLineLog())


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser ``args`` were parsed by: ``tokenloom bench train`` -> the ``bench train`` parser."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[name]


def main(argv: list[str] | None = None) -> int:
    one_line_warnings()  # before build_parser imports torch
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.rest = rest
    elif rest:  # the command's own usage, not the top level's
        _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args) or 0
    except TokenloomError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
