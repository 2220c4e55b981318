"""On a real CUDA GPU (marked ``gpu``; skipped without CUDA): the same model gives the CPU's logits within the
dtype's tolerance for every registered family, 50 training steps follow the CPU's loss curve, greedy generation
gives the same tokens, resume is exact on the GPU, and DDP over nccl on two GPUs trains like one process with the
global batch. ``scripts/gpu_check.sh`` runs these with the GPU benchmarks."""

from __future__ import annotations

import json

import pytest
import torch

from tests.registry.helpers import build, collect_presets, outputs, source_batch
from tests.training.test_trainer import recipe, run
from tokenloom.generation import GenerationConfig, generate
from tokenloom.models.registry import MODELS, decoding_of

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda", 0)
PRESETS = collect_presets()


@pytest.fixture(autouse=True)
def exact_matmuls():
    """float32 matmuls without TF32 on both sides (the comparison is of the code, not of the GPU's fast modes)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.parametrize("family, name, preset", PRESETS, ids=[f"{f}:{n}" for f, n, _ in PRESETS])
def test_cuda_logits_match_the_cpu(family, name, preset):
    cpu = build(family, preset).eval()
    gpu = build(family, preset).eval().to(CUDA)
    with torch.no_grad():
        for got, want in zip(outputs(family, gpu, device=CUDA), outputs(family, cpu), strict=True):
            assert got.device.type == "cuda"
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


DECODING = [(f, n, p) for f, n, p in PRESETS if decoding_of(MODELS.get(f)[1]) in ("causal_lm", "encoder_decoder")]


@pytest.mark.parametrize("family, name, preset", DECODING, ids=[f"{f}:{n}" for f, n, _ in DECODING])
def test_greedy_generation_is_the_same_on_cuda(family, name, preset):
    cpu = build(family, preset).eval()
    gpu = build(family, preset).eval().to(CUDA)
    gen = torch.Generator().manual_seed(3)
    config = GenerationConfig(max_new_tokens=8, do_sample=False)
    if decoding_of(cpu) == "causal_lm":
        ids = torch.randint(0, cpu.config.vocab_size, (3, 5), generator=gen)
        want, got = generate(cpu, ids, config), generate(gpu, ids.to(CUDA), config)
    else:
        src, mask = source_batch(cpu.config, gen)
        bos = torch.full((src.shape[0], 1), cpu.config.bos_id)
        want = generate(cpu.decoder_for(src, mask), bos, config)
        got = generate(gpu.decoder_for(src.to(CUDA), mask.to(CUDA)), bos.to(CUDA), config)
    assert torch.equal(got.cpu(), want)


def _losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_fifty_training_steps_follow_the_cpu_curve(tmp_path):
    cfg = recipe(tmp_path, max_steps=50, eval_every=25, checkpoint_every=0, log_every=5)
    cfg["model"]["dropout"] = 0.0
    run(cfg, tmp_path / "cpu", overrides=["train.device=cpu"])
    run(cfg, tmp_path / "gpu", overrides=["train.device=cuda"])
    cpu, gpu = _losses(tmp_path / "cpu"), _losses(tmp_path / "gpu")
    assert len(cpu) == len(gpu) == 10
    for a, b in zip(cpu, gpu, strict=True):
        assert b == pytest.approx(a, abs=2e-2)


def test_resume_is_exact_on_cuda(tmp_path):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        cfg = recipe(tmp_path, device="cuda")
        full, _ = run(cfg, tmp_path / "full")
        run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=4"])
        resumed, _ = run(cfg, tmp_path / "split", resume=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert next(resumed.model.parameters()).device.type == "cuda"
    for name, value in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=0, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_ddp_over_nccl_trains_like_one_process_with_the_global_batch(tmp_path):
    from tokenloom.cli.main import main

    cfg = recipe(tmp_path, max_steps=6, batch_size=4, checkpoint_every=0)
    cfg["model"]["dropout"] = 0.0
    path = tmp_path / "recipe.json"  # JSON is YAML
    path.write_text(json.dumps(cfg))
    assert main(["train", str(path), "--out", str(tmp_path / "two"), "--device", "cuda", "--nproc", "2"]) == 0
    assert main(["train", str(path), "--out", str(tmp_path / "one"), "--device", "cuda:0",
                 "--set", "train.batch_size=8"]) == 0
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    for a, b in zip(one, two, strict=True):
        assert b == pytest.approx(a, abs=1e-3)
