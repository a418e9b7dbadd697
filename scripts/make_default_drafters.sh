#!/usr/bin/env bash
# Make the drafters shipped for the default model (sparkrl/drafters/shipped/, see its README.md).
# The EAGLE3-style drafter: a run in sparkrl's earlier fused layout on the policy's own responses only,
# continued for two epochs on 3,000 more of them (another seed), then for two epochs on 2,000 more (a third
# seed); then carried into EAGLE-3's layout (what vLLM loads) and continued for three epochs on 3,000 more (a
# fourth seed). FUSED=FILE starts from a fused-layout drafter instead of the first three runs, e.g. the earlier
# shipped one: `git show 0ace070:sparkrl/drafters/shipped/smollm2-135m-instruct-eagle3.safetensors > FILE`.
# The DFlash-style drafter: a run on GSM8K solutions and policy responses (which also trains an EAGLE3-style
# drafter on the same passes, not shipped), continued for two epochs on the second EAGLE3 run's corpus, then for one
# on the third's with 64 training blocks per sequence (both reuse those runs' corpus and stored policy
# passes); their bf16 weights are copied into the package (the DFlash-style drafter's online training
# setting reset to 8 blocks per sequence). Resumable: rerun it (each stage continues from its state.pt, and a
# stage's corpus files are reused). Needs ../shared/data (GSM8K and MATH training files); about 10.5 hours on a
# 2-core CPU. ONLY=eagle3 makes (and copies) the EAGLE3-style drafter alone (about 10 hours; with FUSED, 4).
set -euo pipefail
cd "$(dirname "$0")/.."
EAGLE=${EAGLE:-runs/policy_only}
CONT=${CONT:-runs/cont2}
CONT3=${CONT3:-runs/cont3}
SHIP=${SHIP:-runs/ship}
DFL2=${DFL2:-runs/dfl2}
DFL3=${DFL3:-runs/dfl3}
DFLV=${DFLV:-runs/dflash_layout}
DATA=${DATA:-../shared/data/gsm8k/train.jsonl,../shared/data/math/train.jsonl}
resume() { [ -f "$1/state.pt" ] && echo --resume || true; }  # continue a stage that has started
LAYOUT=${LAYOUT:-runs/eagle3_layout}
if [ -n "${FUSED:-}" ] && [ "${ONLY:-}" != eagle3 ]; then
    echo "FUSED=$FUSED skips the runs the DFlash-style drafter reuses; pass ONLY=eagle3 with it" >&2
    exit 2
fi
COMMON="--model default --data $DATA --max-new-tokens 256 --eval-sequences 64 --eval-every 100 --checkpoint-every 25 --micro-batch 8 --lr 5e-4 --warmup 50"
if [ -z "${FUSED:-}" ]; then
.venv/bin/sparkrl pretrain-draft $COMMON --out "$EAGLE" --draft eagle3 --draft-layout fused --prompts 3000 --no-solutions $(resume "$EAGLE")
.venv/bin/sparkrl pretrain-draft --model default --data $DATA --max-new-tokens 256 --eval-sequences 64 --eval-every 125 \
    --checkpoint-every 25 --micro-batch 8 --out "$CONT" --draft eagle3 --init "$EAGLE/eagle3/drafter.safetensors" \
    --seed 1 --prompts 3000 --no-solutions --lr 3e-4 --warmup 25 --epochs 2 $(resume "$CONT")
.venv/bin/sparkrl pretrain-draft --model default --data $DATA --max-new-tokens 256 --eval-sequences 64 --eval-every 125 \
    --checkpoint-every 25 --micro-batch 8 --out "$CONT3" --draft eagle3 --init "$CONT/eagle3/drafter.safetensors" \
    --seed 2 --prompts 2000 --no-solutions --lr 3e-4 --warmup 25 --epochs 2 $(resume "$CONT3")
cp "$EAGLE/pretrain.png" sparkrl/drafters/shipped/pretrain-eagle3.png
cp "$CONT/pretrain.png" sparkrl/drafters/shipped/pretrain-eagle3-continued.png
cp "$CONT3/pretrain.png" sparkrl/drafters/shipped/pretrain-eagle3-continued2.png
fi
# carried into EAGLE-3's layout (`drafters.eagle3.relayout`) and continued
.venv/bin/sparkrl pretrain-draft --model default --data $DATA --max-new-tokens 256 --eval-sequences 64 --eval-every 125 \
    --checkpoint-every 25 --micro-batch 8 --out "$LAYOUT" --draft eagle3 --init "${FUSED:-$CONT3/eagle3/drafter.safetensors}" \
    --draft-layout eagle3 --seed 3 --prompts 3000 --no-solutions --lr 3e-4 --warmup 25 --epochs 3 $(resume "$LAYOUT")
cp "$LAYOUT/eagle3/drafter.safetensors" sparkrl/drafters/shipped/smollm2-135m-instruct-eagle3.safetensors
cp "$LAYOUT/pretrain.png" sparkrl/drafters/shipped/pretrain-eagle3-layout.png
if [ "${ONLY:-}" = eagle3 ]; then
    echo "sparkrl: shipped EAGLE3-style drafter updated from $LAYOUT (carried from ${FUSED:-$CONT3, continued from $CONT, from $EAGLE})"
    exit 0
fi
.venv/bin/sparkrl pretrain-draft $COMMON --out "$SHIP" --draft eagle3,dflash --prompts 512 --max-solutions 2000 $(resume "$SHIP")
# the DFlash-style drafter continued on the corpora (and stored policy passes) of $CONT and $CONT3
mkdir -p "$DFL2" "$DFL3"
for d in corpus features; do
    ln -sfn "$(realpath "$CONT")/$d" "$DFL2/$d"
    ln -sfn "$(realpath "$CONT3")/$d" "$DFL3/$d"
done
.venv/bin/sparkrl pretrain-draft --model default --data $DATA --max-new-tokens 256 --eval-sequences 64 --eval-every 125 \
    --checkpoint-every 25 --micro-batch 8 --out "$DFL2" --draft dflash --init "$SHIP/dflash/drafter.safetensors" \
    --seed 1 --prompts 3000 --no-solutions --lr 3e-4 --warmup 25 --epochs 2 $(resume "$DFL2")
.venv/bin/sparkrl pretrain-draft --model default --data $DATA --max-new-tokens 256 --eval-sequences 64 --eval-every 125 \
    --checkpoint-every 25 --micro-batch 8 --out "$DFL3" --draft dflash --init "$DFL2/dflash/drafter.safetensors" \
    --seed 2 --prompts 2000 --no-solutions --lr 3e-4 --warmup 25 --epochs 1 --anchors 64 $(resume "$DFL3")
# online GRPO training goes on with a drafter's own blocks per sequence: the shipped one trains with 8, as a fresh one
.venv/bin/python - "$DFL3/dflash/drafter.safetensors" "$DFL3/dflash/drafter-anchors8.safetensors" <<'PY'
import sys
from sparkrl.drafters.base import read_checkpoint, read_description, save_safetensors
ck = read_checkpoint(sys.argv[1])
ck["settings"]["anchors"] = 8
save_safetensors(ck, __import__("pathlib").Path(sys.argv[2]), fingerprint=read_description(sys.argv[1])["fingerprint"])
PY
# carried into DFlash's layout (`drafters.dflash.relayout`, what vLLM's dflash method runs) and continued on a corpus
# of its own (the stacked-layout file the project shipped before is $DFL3's with 8 blocks per sequence, as below)
.venv/bin/sparkrl pretrain-draft --model default --data $DATA --max-new-tokens 256 --eval-sequences 64 --eval-every 75 \
    --checkpoint-every 25 --micro-batch 8 --out "$DFLV" --draft dflash --init "$DFL3/dflash/drafter-anchors8.safetensors" \
    --draft-layout dflash --prompts 1200 --no-solutions --lr 3e-4 --warmup 25 --epochs 3 $(resume "$DFLV")
cp "$DFLV/dflash/drafter.safetensors" sparkrl/drafters/shipped/smollm2-135m-instruct-dflash.safetensors
cp "$SHIP/pretrain.png" sparkrl/drafters/shipped/pretrain.png
cp "$DFL2/pretrain.png" sparkrl/drafters/shipped/pretrain-dflash-continued.png
cp "$DFL3/pretrain.png" sparkrl/drafters/shipped/pretrain-dflash-continued2.png
cp "$DFLV/pretrain.png" sparkrl/drafters/shipped/pretrain-dflash-layout.png
echo "sparkrl: shipped drafters updated from $LAYOUT (eagle3, carried from $CONT3, from $CONT, from $EAGLE) and $DFLV (dflash," \
     "carried from $DFL3, from $DFL2, from $SHIP)"
