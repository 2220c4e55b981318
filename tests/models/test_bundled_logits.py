"""The bundled checkpoints compute what they computed before the refactor (issue 24: the refactor of attention,
blocks, KV caches and decode paths changes no behaviour).

``tests/fixtures/bundled_logits.safetensors`` pins, for fixed inputs stored in it, what checkpoints/shakespeare-char
(GPT) and checkpoints/multi30k-de-en (encoder-decoder) compute in float32 on one thread: the full-forward logits of
a padded batch, the logits and tokens of a cached greedy decode (prefill, then one token a step; GPT also
left-padded), the tokens of ``generate`` (GPT, greedy) and of ``beam_search`` (translation, 5 beams, with their
scores), and the teacher-forced logits of the translation model. The list, with shapes, is the docstring of
``tests/fixtures/make_bundled_logits.py``; this test recomputes each quantity with the current code through that
script's ``compute`` and compares: token ids exactly, floats within the tolerances below.

The fixture was written at commit 33bd098e1f6a10549dcc31241feb22e7abeec181 (before the refactor; torch 2.13.0, AVX512
kernels) by ``python tests/fixtures/make_bundled_logits.py`` (its metadata records the commit). Regenerate it only
for a deliberate change of behaviour, and say so in the commit. ``python scripts/compare_bundled_logits.py`` prints
each quantity's difference and whether it is bitwise equal.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

GENERATOR = Path(__file__).resolve().parents[1] / "fixtures" / "make_bundled_logits.py"

# Largest absolute differences measured against the fixture (written with the AVX512 kernels, one thread) at the
# fixture's commit, under the other kernel settings of `make test-kernels`:
#                        ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2     ATEN_CPU_CAPABILITY=default
#                        MKL_ENABLE_INSTRUCTIONS=AVX2                         OMP_NUM_THREADS=1
#   logits (any)         6.7e-6 (gpt.forward)                                 6.7e-6 (gpt.forward)
#   mt.beam.log_probs    9.1e-6                                               8.6e-6
#   mt.beam.scores       6.9e-7                                               6.6e-7
# and at most 8.6e-6 on logits under the other settings tried (each variable alone; ATEN_CPU_CAPABILITY=default
# with ONEDNN_MAX_CPU_ISA=SSE41 and MKL_ENABLE_INSTRUCTIONS=SSE4_2; two threads); bitwise equal with the same
# kernels (|logits| reach 15: these are a few float32 ulps). The tolerances are 3.5 to 4.5 times those. Adding 1e-3
# to one weight moves the logits by 5.6e-5 to 1.5e-3 (one element of the GPT's position embedding or first MLP
# output projection; of the translation encoder's first or second qkv projection): each such change fails here.
LOGITS_ATOL = 3e-5
ATOL = {"mt.beam.log_probs": 4e-5, "mt.beam.scores": 3e-6}


def _generator():
    """tests/fixtures/make_bundled_logits.py as a module (tests/fixtures is no package)."""
    spec = importlib.util.spec_from_file_location("make_bundled_logits", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fixture_and_now() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the fixture's outputs, the same quantities computed now from the fixture's inputs), on one thread as
    the fixture was written (the suite's autouse fixture sets two threads for each test afterwards)."""
    gen = _generator()
    stored = load_file(str(gen.FIXTURE))
    inputs = {k: v for k, v in stored.items() if k.startswith("input.")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        now = gen.compute(inputs)
    finally:
        torch.set_num_threads(threads)
    return {k: v for k, v in stored.items() if k not in inputs}, now


def test_the_same_quantities_with_the_same_shapes(fixture_and_now):
    expected, now = fixture_and_now
    assert sorted(now) == sorted(expected)
    for name, want in expected.items():
        assert (now[name].shape, now[name].dtype) == (want.shape, want.dtype), name


def test_token_ids_are_equal(fixture_and_now):
    expected, now = fixture_and_now
    ids = [name for name, t in expected.items() if not t.is_floating_point()]
    assert len(ids) == 7
    differ = [name for name in ids if not torch.equal(now[name], expected[name])]
    assert not differ, f"token ids differ from the fixture: {differ}"


def test_logits_and_scores_are_within_tolerance(fixture_and_now):
    expected, now = fixture_and_now
    floats = [name for name, t in expected.items() if t.is_floating_point()]
    assert len(floats) == 9
    report = {name: ((now[name] - expected[name]).abs().max().item(), ATOL.get(name, LOGITS_ATOL)) for name in floats}
    beyond = {name: f"{diff:.2e} > {atol:.1e}" for name, (diff, atol) in report.items()
              if not diff <= atol}  # NaN too
    assert not beyond, f"differ from the fixture beyond the tolerance (max |diff| > atol): {beyond}"
