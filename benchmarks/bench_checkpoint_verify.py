"""What checking ``checksums.json`` costs when a checkpoint loads: ``load_model`` of a ~500 MB GPT checkpoint with
its checksums (verified: the weights' SHA-256 computed in a thread while the model is built and loaded) and without
(the same files, ``checksums.json`` moved aside), interleaved, ``--repeats`` times each; the medians and their ratio.

``--cold`` also drops the checkpoint's files from the page cache before each load (``posix_fadvise DONTNEED``: the
first load after a copy or a download), where the disk, not the hash, sets the pace. SHA-256 alone on the machine's
cores (``hashlib``, a single stream) is printed for reference: on a warm page cache a load runs near memory-copy
speed, faster than SHA-256 can hash, so the hash sets the verified load's time there. Each load hashes as a fresh
process's first load would; "a later process" is a load after one that verified the same unchanged file (its stat
recorded in the cache directory: not hashed again).

    python benchmarks/bench_checkpoint_verify.py                        # 1024 dims, 24 layers, stored bf16 (~620 MB)
    python benchmarks/bench_checkpoint_verify.py --layers 10 --dtype fp32 --repeats 7 --cold
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path


def _drop_from_cache(directory: Path) -> None:
    for f in directory.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="how the weights are stored")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="also time loads from a cold page cache")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    args = parser.parse_args()

    import torch

    from tokenloom.checkpoint import CHECKSUM_FILE, WEIGHTS_FILE, load_model, write_checkpoint
    from tokenloom.checksums import forget_verified
    from tokenloom.models.factory import create_model, model_config_from_dict

    root = Path(args.dir or tempfile.mkdtemp(prefix="tokenloom-bench-verify-"))
    ckpt = root / f"gpt-{args.dim}x{args.layers}-{args.dtype}"
    section = {"family": "gpt", "num_layers": args.layers, "num_heads": args.dim // 64, "embed_dim": args.dim,
               "max_seq_len": 1024, "vocab_size": args.vocab, "tie_embeddings": True, "bias": False}
    if not (ckpt / CHECKSUM_FILE).is_file():
        family, config = model_config_from_dict(section)
        write_checkpoint(ckpt, create_model(family, config), {"task": "lm", "model": section},
                         dtype=torch.bfloat16 if args.dtype == "bf16" else None)
    weights = ckpt / WEIGHTS_FILE
    size = weights.stat().st_size
    aside = root / f"{ckpt.name}.{CHECKSUM_FILE}"

    def load(verify: bool | str, cold: bool) -> float:
        if verify != "remembered":
            forget_verified()  # a first load: the weights hashed, not remembered from the last run
        else:  # a later process: what the last verified load recorded in the cache directory, not this process's
            from tokenloom import checksums
            checksums._VERIFIED.clear()
            checksums._loaded = False
            load(True, False)  # (recorded)
            checksums._VERIFIED.clear()
            checksums._loaded = False
        if not verify:
            os.replace(ckpt / CHECKSUM_FILE, aside)
        try:
            if cold:
                _drop_from_cache(ckpt)
            start = time.perf_counter()
            model, _ = load_model(ckpt)
            seconds = time.perf_counter() - start
            del model
            return seconds
        finally:
            if not verify:
                os.replace(aside, ckpt / CHECKSUM_FILE)

    data = weights.read_bytes()
    start = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    sha = time.perf_counter() - start
    del data
    print(f"{weights}: {size / 1e6:.0f} MB ({args.dtype}); SHA-256 alone {sha:.3f} s ({size / sha / 1e9:.2f} GB/s); "
          f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    load(True, False)  # warm-up: imports, allocator, page cache
    for cold in (False, True) if args.cold else (False,):
        times: dict[bool | str, list[float]] = {True: [], False: [], "remembered": []}
        for i in range(args.repeats):
            order = (True, False, "remembered") if i % 2 == 0 else ("remembered", False, True)
            for verify in order:  # interleaved, order alternating
                times[verify].append(load(verify, cold))
        plain, checked, later = (statistics.median(times[k]) for k in (False, True, "remembered"))
        print(f"{'cold' if cold else 'warm'} page cache: load_model without checksums {plain:.3f} s "
              f"(runs {', '.join(f'{t:.3f}' for t in times[False])}), verified {checked:.3f} s "
              f"(runs {', '.join(f'{t:.3f}' for t in times[True])}): ratio {checked / plain:.3f} "
              f"(+{checked - plain:.3f} s); a later process, the file unchanged since a verified load: "
              f"{later:.3f} s, ratio {later / plain:.3f}")


if __name__ == "__main__":
    main()
