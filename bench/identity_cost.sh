#!/bin/bash
# Before (the parent commit: --cpu-kernels auto as measured then) against after (this commit: the
# batch-invariant kernels), `sparkrl generate` alternating processes, 3 repeats: AR at 1, 8, 64 responses and
# EAGLE3-style trees (--budget fixed) at 8; bfloat16 (DTYPE=float32 for float32), T 1, top-p 0.95, 128 tokens, one GSM8K-style prompt.
# Run from the repository root after `git worktree add /tmp/sparkrl-old 454a331~1` (OLD: that worktree; NEW: this
# tree, whose .venv runs both); each revision builds its kernels into its own torch extensions folder.
#   bash bench/identity_cost.sh | tee bench/results/avx512_bf16/identity_cost/ab.log
set -euo pipefail
OLD=${OLD:-/tmp/sparkrl-old}; NEW=${NEW:-$(pwd)}
PROMPT="Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
run() {  # run REV ARGS...: `python -m sparkrl ARGS` from REV's root, so that REV's sparkrl is the one imported
  local root=$([ "$1" = old ] && echo "$OLD" || echo "$NEW") rev=$1; shift
  (cd "$root" && TORCH_EXTENSIONS_DIR=/tmp/sparkrl_ext_$rev PYTHONPATH="$root" "$NEW/.venv/bin/python" "$@")
}
for rev in old new; do echo "$rev runs $(run $rev -c 'import sparkrl; print(sparkrl.__file__)')"; done
for rep in 1 2 3; do
  for cfg in "1" "8" "64" "8 --draft eagle3 --budget fixed"; do
    set -- $cfg; n=$1; shift
    for rev in old new; do
      run $rev -m sparkrl generate --model default --prompt "$PROMPT" --n $n --temperature 1 --top-p 0.95 \
        --max-new-tokens 128 --rollout-dtype ${DTYPE:-bfloat16} "$@" > /dev/null 2> /tmp/ab_err.txt
      echo "$rep n=$n $* $rev: $(grep -o '[0-9.]* tok/s' /tmp/ab_err.txt)"
    done
  done
done
