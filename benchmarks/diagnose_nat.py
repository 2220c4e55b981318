"""Where a non-autoregressive translator loses BLEU: length prediction or token prediction.

For a checkpoint of family ``nat`` and a split with references, in one run:

* BLEU (sacrebleu, as ``tokenloom evaluate``) with the predicted lengths (length beam 1) and, for kinds with a
  length predictor (nat, cmlm), with the **oracle lengths** (each reference's token count): the gap between the
  two is what length prediction costs;
* the length predictor's exact-match rate and mean absolute error against the references;
* **token accuracy at the oracle length**: the share of reference positions whose one-pass argmax (every
  target position masked for cmlm) is the reference token, against the autoregressive teacher's teacher-forced
  next-token accuracy on the same references (``--teacher``), the ceiling a parallel decoder approaches;
* the decoder rounds each sentence used (iterations, edit rounds).

    python benchmarks/diagnose_nat.py runs/cmlm --teacher checkpoints/multi30k-de-en --split test2016 --iterations 10
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tokenloom.checkpoint import load_model, load_tokenizer, read_config
from tokenloom.generation.nat import nat_decode
from tokenloom.models.nat_kinds import NAT_KINDS
from tokenloom.models.registry import decoding_of
from tokenloom.tasks.translation import encode_sources, source_batches, special_ids


def split_files(checkpoint: Path, split: str) -> tuple[list[str], list[str]]:
    """The split's source and reference lines, from the data folder the checkpoint trained on."""
    data = read_config(checkpoint).get("data", {})
    folder = Path(data.get("dir", "data/multi30k"))
    src = (folder / f"{split}.{data['source_lang']}").read_text(encoding="utf-8").splitlines()
    ref = (folder / f"{split}.{data['target_lang']}").read_text(encoding="utf-8").splitlines()
    return src, ref


def batches(model, tokenizer, sources: list[str]):
    """(sentence indices, source ids (B, S), mask (B, S)) of ``sources``, sorted by length, 4,096 tokens a batch."""
    encoded = encode_sources(model, tokenizer, sources)
    return source_batches(encoded, 4096, special_ids(tokenizer)["pad_id"])


@torch.no_grad()
def decode_all(model, tokenizer, sources: list[str], lengths: list[int] | None, iterations: int,
               rounds: list[int]) -> tuple[list[str], list[list[int]]]:
    """Each sentence's translation and its tokens, at the predicted lengths (length beam 1) or the given ones."""
    out, out_tokens = [""] * len(sources), [[] for _ in sources]
    for chunk, source, mask in batches(model, tokenizer, sources):
        given = None if lengths is None else torch.tensor([lengths[i] for i in chunk])
        order: list[int] = []
        decoded = nat_decode(model, source, mask, iterations=iterations, length_beam=1, lengths=given, rounds=order)
        rounds.extend(order)
        for i, tokens in zip(chunk, decoded, strict=True):
            out[i], out_tokens[i] = tokenizer.decode(tokens).strip(), tokens
    return out, out_tokens


@torch.no_grad()
def oracle_token_accuracy(model, tokenizer, sources: list[str], targets: list[list[int]]) -> float:
    """Share of reference positions whose one-pass prediction at the reference length is the reference token."""
    ids = special_ids(tokenizer)
    right = total = 0
    for chunk, source, mask in batches(model, tokenizer, sources):
        lengths = torch.tensor([max(1, len(targets[i])) for i in chunk])
        memory = model.encode(source, mask)
        if model.config.kind == "cmlm":
            T = int(lengths.max())
            real = torch.arange(T)[None] < lengths[:, None]
            tokens = torch.full((len(chunk), T), model.config.mask_id).masked_fill(~real, ids["pad_id"])
            inputs, dmask = model.decoder_inputs(source, mask, tokens=tokens)
        else:
            inputs, dmask = model.decoder_inputs(source, mask, lengths)
        logits = model.decode_parallel(inputs, dmask, memory, mask).float()
        logits[..., model.config.banned_ids] = float("-inf")
        best = logits.argmax(-1)
        for row, i in enumerate(chunk):
            ref = torch.tensor(targets[i][:best.shape[1]])
            right += int((best[row, :len(ref)] == ref).sum())
            total += len(targets[i])
    return right / max(total, 1)


@torch.no_grad()
def teacher_accuracy(teacher, tokenizer, sources: list[str], targets: list[list[int]]) -> float:
    """The autoregressive teacher's teacher-forced next-token accuracy on the references (EOS included)."""
    ids = special_ids(tokenizer)
    right = total = 0
    for chunk, source, mask in batches(teacher, tokenizer, sources):
        T = max(len(targets[i]) for i in chunk) + 1
        target_in = torch.full((len(chunk), T), ids["pad_id"])
        target_out = torch.full((len(chunk), T), -1)
        for row, i in enumerate(chunk):
            tokens = targets[i][:T - 1]
            target_in[row, :len(tokens) + 1] = torch.tensor([ids["bos_id"], *tokens])
            target_out[row, :len(tokens) + 1] = torch.tensor([*tokens, ids["eos_id"]])
        best = teacher(source, target_in, mask).argmax(-1)
        keep = target_out >= 0
        right += int((best[keep] == target_out[keep]).sum())
        total += int(keep.sum())
    return right / max(total, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--teacher", help="the autoregressive teacher: its teacher-forced accuracy beside")
    parser.add_argument("--split", default="test2016")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--sentences", type=int, default=0, help="the first N sentences (0: all)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import sacrebleu

    checkpoint = Path(args.checkpoint)
    model, _ = load_model(checkpoint)
    if decoding_of(model) != "parallel":
        print(f"error: {checkpoint} is not a non-autoregressive (family nat) checkpoint", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(checkpoint)
    sources, refs = split_files(checkpoint, args.split)
    if args.sentences:
        sources, refs = sources[:args.sentences], refs[:args.sentences]
    targets = [tokenizer.encode(r) for r in refs]
    kind = NAT_KINDS.get(model.config.kind)
    result: dict[str, object] = {"checkpoint": str(checkpoint), "kind": model.config.kind, "split": args.split,
                                 "sentences": len(sources), "iterations": args.iterations}
    rounds: list[int] = []
    hyps, hyp_tokens = decode_all(model, tokenizer, sources, None, args.iterations, rounds)
    result["bleu"] = round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    result["rounds_per_sentence"] = round(sum(rounds) / len(rounds), 2)
    if kind.has_length_head:
        oracle, _ = decode_all(model, tokenizer, sources, [max(1, len(t)) for t in targets], args.iterations, [])
        result["bleu_oracle_length"] = round(sacrebleu.corpus_bleu(oracle, [refs]).score, 2)
        gaps = [len(h) - len(t) for h, t in zip(hyp_tokens, targets, strict=True)]
        result["length_exact"] = round(sum(g == 0 for g in gaps) / len(gaps), 4)
        result["length_mae"] = round(sum(abs(g) for g in gaps) / len(gaps), 3)
        result["token_accuracy_oracle_length"] = round(oracle_token_accuracy(model, tokenizer, sources, targets), 4)
    if args.teacher:
        teacher, _ = load_model(args.teacher)
        result["teacher_forced_accuracy_teacher"] = round(teacher_accuracy(teacher, tokenizer, sources, targets), 4)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            print(f"{key:32s} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
