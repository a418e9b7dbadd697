#!/usr/bin/env bash
# First use of speculative generation on a machine: `sparkrl generate --draft eagle3` on the default model with an
# empty sparkrl cost cache (the converted model kept), and with FRESH_KERNELS=1 an empty torch extensions folder too
# (the compiled kernels built again). Prints the seconds to the first response and the whole run; run it alone.
#   bash bench/first_use.sh [OUT_LOG]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/first_use/first_use.log}
mkdir -p "$(dirname "$OUT")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/cache"
ln -s "$(.venv/bin/python -c 'from sparkrl.machine import cache_dir; print(cache_dir())')/models" "$tmp/cache/models"
[ "${FRESH_KERNELS:-0}" = 1 ] && export TORCH_EXTENSIONS_DIR="$tmp/ext"
printf 'What is 12 + 7?\nName three colors.\n' > "$tmp/prompts.txt"
start=$(date +%s.%N)
SPARKRL_CACHE="$tmp/cache" .venv/bin/sparkrl generate --model default --prompts-file "$tmp/prompts.txt" \
    --temperature 0 --max-new-tokens 96 --draft eagle3 2>&1 | stdbuf -oL tr '\r' '\n' | while IFS= read -r line; do
    now=$(date +%s.%N)
    case "$line" in
        "--- prompt 0"*) printf 'first response after %.1f s\n' "$(awk "BEGIN{print $now - $start}")" ;;
        sparkrl:*) printf '%6.1f s  %s\n' "$(awk "BEGIN{print $now - $start}")" "$line" ;;
    esac
done | tee -a "$OUT"
printf 'total %.1f s (fresh kernels: %s, %s)\n' "$(awk "BEGIN{print $(date +%s.%N) - $start}")" "${FRESH_KERNELS:-0}" \
    "$(date -u +%FT%TZ)" | tee -a "$OUT"
