"""Compare the bundled checkpoints' logits and token ids with the current code (issue 24: the refactor changes no
behaviour): for each quantity of ``tests/fixtures/bundled_logits.safetensors``, the largest absolute difference
(and relative to the quantity's largest magnitude) and whether it is bitwise equal (``torch.equal``).

    python scripts/compare_bundled_logits.py [--fixture PATH]

Expect bitwise equality where the same kernels run in the same order (the fixture's CPU kernels, one thread), and
differences of a few float32 ulps where they do not (other vector kernels, a reordered sum): measured at the
fixture's commit under ATEN_CPU_CAPABILITY=avx2 or default, up to 6.7e-6 absolute on logits reaching 15 (5e-7
relative), 9.1e-6 on the beams' summed log-probabilities, 6.9e-7 on their scores. The fixture and what it holds:
``tests/fixtures/make_bundled_logits.py``; the test that checks it with tolerances: ``tests/models/
test_bundled_logits.py``. Exit status 1 when a token id differs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

GENERATOR = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "make_bundled_logits.py"


def generator():
    """tests/fixtures/make_bundled_logits.py as a module (tests/ is not an installed package)."""
    spec = importlib.util.spec_from_file_location("make_bundled_logits", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    gen = generator()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixture", type=Path, default=gen.FIXTURE, help="default: %(default)s")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    expected = load_file(str(args.fixture))
    with safe_open(str(args.fixture), "pt") as f:
        meta = f.metadata() or {}
    inputs = {k: v for k, v in expected.items() if k.startswith("input.")}
    actual = gen.compute(inputs)
    print(f"fixture: {args.fixture} (commit {meta.get('commit', '?')}, torch {meta.get('torch', '?')}, "
          f"{meta.get('cpu_capability', '?')})")
    print(f"now:     torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    ids_differ = False
    names = sorted(set(expected) - set(inputs) | set(actual))
    width = max(len(n) for n in names)
    for name in names:
        if name not in expected or name not in actual:
            print(f"{name:{width}s}  only in the {'fixture' if name in expected else 'current code'}")
            ids_differ = True
            continue
        want, got = expected[name], actual[name]
        if want.shape != got.shape or want.dtype != got.dtype:
            print(f"{name:{width}s}  {tuple(got.shape)} {got.dtype}, the fixture has {tuple(want.shape)} {want.dtype}")
            ids_differ = True
            continue
        bitwise = torch.equal(want, got)
        if want.is_floating_point():
            diff = (want - got).abs().max().item() if want.numel() else 0.0
            scale = want.abs().max().item() if want.numel() else 0.0
            relative = f"{diff / scale:.1e}" if scale else "-"
            print(f"{name:{width}s}  max |diff| {diff:.3e}  (relative {relative})  "
                  f"{'bitwise equal' if bitwise else 'not bitwise'}")
        else:
            print(f"{name:{width}s}  token ids  {'equal' if bitwise else 'DIFFER'}")
            ids_differ |= not bitwise
    return 1 if ids_differ else 0


if __name__ == "__main__":
    sys.exit(main())
