#!/usr/bin/env bash
# The GPU checks in one run (docs/devices.md), under 8 minutes on one GPU: the `gpu` tests (CPU vs CUDA logits of
# every family, a 50-step loss curve, greedy generation, exact resume; DDP over nccl when two GPUs are visible),
# then `bench train` and `bench generate` on the GPU, with their figures printed and kept under $OUT (default
# gpu-check/).
#
#     bash scripts/gpu_check.sh            # in the repository root, on a machine with a CUDA GPU
#
# It uses the machine's own CUDA build of torch when one is installed (a CPU build cannot see the GPU), and
# installs tokenloom and the test dependencies beside it (never another torch).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "no CUDA GPU visible to $PY (torch: $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none))" >&2
    exit 1
fi
"$PY" -c "import tokenloom" 2>/dev/null || "$PY" -m pip install --quiet --no-deps -e . 
"$PY" -m pip install --quiet pytest transformers safetensors tokenizers sacrebleu pyyaml tqdm 2>/dev/null || true
"$PY" - <<'PY' | tee "$OUT/gpu.txt"
import torch
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}; "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
export TOKENLOOM_DEVICE=cuda
timeout 240 "$PY" -m pytest -o addopts="" -q -m gpu tests/devices/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.txt" | tail -15
timeout 150 "$PY" -m tokenloom bench train --preset gpt-6l-384 --device cuda --timed-steps 20 --out "$OUT/train.json" \
    2>&1 | tee "$OUT/bench-train.txt" | tail -12
timeout 90 "$PY" -m tokenloom bench generate --shapes tiny,gpt2 --batch-sizes 1,8 --new-tokens 128 --device cuda \
    --bf16 --out "$OUT/generate.json" 2>&1 | tee "$OUT/bench-generate.txt" | tail -20
echo "figures: $OUT/"
