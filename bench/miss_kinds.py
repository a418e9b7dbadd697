"""Where the draft misses are, and which of them SPARK removes (issue 16).

Reads the round logs of two GRPO runs that drew the same prompts in the same order (e.g. the
eagle3 and eagle3+spark runs of one `sparkrl bench`), sorts every drafted position by the kind of
token the policy committed there, and reports per kind and training stage: the share of drafted
positions, the miss rate of each run, and the relative change of the second run's miss rate, with a
95% bootstrap interval over prompt groups (the same prompt group of both runs resampled together).

Kinds (of the decoded token, in this order): number in the prompt (its digits occur in a number of
the prompt), other number, formatting (no letter or digit: spaces, newlines, punctuation, operators,
LaTeX), word of the prompt (its lower-cased letters form a word of the prompt), capitalised word
(names, sentence starts), other word (reasoning words, units, ...).

    .venv/bin/python bench/miss_kinds.py --logs runs/b16_stress/gsm8k/eagle3/round_log.jsonl,runs/b16_stress/gsm8k/eagle3_spark/round_log.jsonl \
        --labels eagle3,eagle3+spark --stages 3 --out bench/results/miss_kinds_eagle3.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch

from sparkrl.analysis import interval95, read_round_log, resample_weights
from sparkrl.rollout import HIT, MISS
from sparkrl.weights import resolve_model_path

KINDS = ["number in the prompt", "other number", "formatting", "word of the prompt", "capitalised word", "other word"]


def kind(piece: str, prompt_numbers: set[str], prompt_words: set[str]) -> str:
    s = piece.strip()
    if s.isdigit():
        return KINDS[0] if any(s in n for n in prompt_numbers) else KINDS[1]
    letters = re.sub(r"[^A-Za-z]", "", s)
    if not letters:
        return KINDS[2] if not any(c.isdigit() for c in s) else KINDS[1]
    if letters.lower() in prompt_words:
        return KINDS[3]
    return KINDS[4] if s[0].isupper() else KINDS[5]


def counts(records: list[dict], tok, n_stages: int) -> list[torch.Tensor]:
    """Per stage: (prompt groups, kinds, 2) drafted positions and misses."""
    steps = sorted({r.get("step", i) for i, r in enumerate(records)})
    stage_of = {s: i * n_stages // len(steps) for i, s in enumerate(steps)}
    units = defaultdict(lambda: torch.zeros(len(KINDS), 2, dtype=torch.float64))
    piece = {}
    for i, rec in enumerate(records):
        st = stage_of[rec.get("step", i)]
        for p, ids in enumerate(rec["prompt_ids"]):
            text = tok.decode(ids)
            numbers, words = set(re.findall(r"\d+", text)), {w.lower() for w in re.findall(r"[A-Za-z]+", text)}
            for resp in rec["responses"][p * rec["group_size"]:(p + 1) * rec["group_size"]]:
                for v, o in zip(resp["tokens"], resp["outcome"]):
                    if o not in (HIT, MISS):
                        continue
                    if v not in piece:
                        piece[v] = tok.decode([v])
                    c = units[st, i, p][KINDS.index(kind(piece[v], numbers, words))]
                    c[0] += 1
                    c[1] += o == MISS
    return [torch.stack([c for (s, _, _), c in sorted(units.items()) if s == st]) for st in range(n_stages)]


def compare(a: torch.Tensor, b: torch.Tensor, bootstrap: int, seed: int = 0) -> list[dict]:
    """Per kind: shares, miss rates and b's relative change with bootstrap intervals (paired groups)."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    w = resample_weights(n, bootstrap, torch.Generator().manual_seed(seed))
    rate = lambda x, ww: (ww @ x[..., 1]) / (ww @ x[..., 0])  # (resamples, kinds)
    ra, rb = rate(a, torch.ones(1, n, dtype=torch.float64))[0], rate(b, torch.ones(1, n, dtype=torch.float64))[0]
    ch = rate(b, w) / rate(a, w) - 1
    q = interval95(ch)
    share = a[..., 0].sum(0) / a[..., 0].sum()
    miss_share = a[..., 1].sum(0) / a[..., 1].sum()
    return [{"kind": k, "share_of_drafted": float(share[i]), "share_of_misses": float(miss_share[i]),
             "miss_rate_a": float(ra[i]), "miss_rate_b": float(rb[i]), "change": float(rb[i] / ra[i] - 1),
             "change_ci": [float(q[0, i]), float(q[1, i])]} for i, k in enumerate(KINDS)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--logs", required=True, help="two round logs, comma-separated: baseline, then the variant")
    ap.add_argument("--labels", default="a,b")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--model", default="default", help="the policy whose tokenizer decodes the tokens")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
    la, lb = args.labels.split(",")
    ca, cb = (counts(read_round_log(p), tok, args.stages) for p in args.logs.split(","))
    res = {"logs": args.logs.split(","), "labels": [la, lb], "stages": []}
    for st, (a, b) in enumerate(zip(ca, cb)):
        rows = compare(a, b, args.bootstrap)
        res["stages"].append(rows)
        print(f"stage {st + 1}/{args.stages} ({len(a)} prompt groups)")
        print(f"  {'kind':22s} {'drafted':>8s} {'misses':>7s} {'miss ' + la:>12s} {'miss ' + lb:>12s}  change [95% CI]")
        for r in rows:
            print(f"  {r['kind']:22s} {r['share_of_drafted']:8.1%} {r['share_of_misses']:7.1%} {r['miss_rate_a']:12.3f} "
                  f"{r['miss_rate_b']:12.3f}  {r['change']:+.1%} [{r['change_ci'][0]:+.1%}, {r['change_ci'][1]:+.1%}]")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
