#!/bin/bash
# Speed of two revisions side by side: `sparkrl generate` from each root in alternating processes (so drift
# hits both alike), REPEATS rounds of: AR at 1 and 8 responses, EAGLE3-style drafting with the budget at 1 and 8
# responses; default kernels and rollout dtype, T 1, top-p 0.95, 128 tokens, one GSM8K-style prompt. Prints each
# run's tokens/s and, per case, the median of B/A over the repeats. Run it alone (no tests or other jobs).
#   git worktree add /tmp/sparkrl-before REV
#   bash scripts/same_speed.sh /tmp/sparkrl-before .
set -euo pipefail
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); REPEATS=${REPEATS:-3}
PY=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
PROMPT="Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
LOG=$(mktemp)
run() {  # run ROOT ARGS...: `python -m sparkrl generate ARGS` from ROOT (its sparkrl is the one imported); tok/s
  local root=$1; shift
  (cd "$root" && PYTHONPATH="$root" "$PY" -m sparkrl generate --model default --prompt "$PROMPT" --temperature 1 \
    --top-p 0.95 --max-new-tokens 128 "$@" 2>&1 >/dev/null | grep -o '[0-9.]* tok/s' | cut -d' ' -f1)
}
for rep in $(seq "$REPEATS"); do
  for cfg in "--n 1" "--n 8" "--n 1 --draft eagle3" "--n 8 --draft eagle3"; do
    a=$(run "$A" $cfg); b=$(run "$B" $cfg)
    echo "$rep [$cfg] A $a tok/s, B $b tok/s, B/A $(echo "$b / $a" | bc -l | cut -c1-5)" | tee -a "$LOG"
  done
done
echo "median B/A per case over $REPEATS repeats:"
for cfg in "--n 1" "--n 8" "--n 1 --draft eagle3" "--n 8 --draft eagle3"; do
  grep -F "[$cfg]" "$LOG" | sed 's/.*B\/A //' | sort -n | awk -v c="$cfg" '{v[NR]=$1} END {print "  [" c "] " v[int((NR+1)/2)]}'
done
rm -f "$LOG"
