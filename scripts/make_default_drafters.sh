#!/usr/bin/env bash
# Make the drafters shipped for the default model (sparkrl/drafters/shipped/, see its README.md):
# one pretrain-draft run trains the EAGLE3-style and the DFlash-style drafter on the same policy
# passes; their bf16 weights are copied into the package. Resumable: rerun with RESUME=--resume.
# Needs ../shared/data (GSM8K and MATH training files); about 1 hour on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/ship}
DATA=${DATA:-../shared/data/gsm8k/train.jsonl,../shared/data/math/train.jsonl}
.venv/bin/sparkrl pretrain-draft --model default --out "$OUT" --draft eagle3,dflash --data "$DATA" \
    --prompts 512 --max-solutions 2000 --max-new-tokens 256 --eval-sequences 64 --eval-every 100 --checkpoint-every 25 \
    --micro-batch 8 --lr 5e-4 --warmup 50 ${RESUME:-}
for kind in eagle3 dflash; do
    cp "$OUT/$kind/drafter.safetensors" "sparkrl/drafters/shipped/smollm2-135m-instruct-$kind.safetensors"
done
cp "$OUT/pretrain.png" sparkrl/drafters/shipped/pretrain.png
echo "sparkrl: shipped drafters updated from $OUT"
