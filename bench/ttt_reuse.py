"""EAGLE-3's training-time test with each segment run once (`eagle3.unrolled(reuse=True)`, now) against
every earlier segment run again inside each segment's forward (before), interleaved in one process.

Default model in float32, the shipped EAGLE3-style drafter, `eagle3.draft_loss` (3 segments) forward
and backward on micro-batches of 8 random-token sequences (the last 80% of positions trained): 192
tokens (an online GRPO micro-batch of 64 prompt + 128 response tokens) and 448 (a pretraining batch
of policy responses). Medians of 4 after one warm-up each; the two systems alternate in order.

    .venv/bin/python bench/ttt_reuse.py --out bench/results/ttt_reuse
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

import sparkrl.drafters.eagle3 as eagle3
from sparkrl.drafters import load_drafter, shipped_path
from sparkrl.weights import load_model
from timing import seconds, speedup

UNROLLED = eagle3.unrolled
SYSTEMS = {"segments run again (before)": functools.partial(UNROLLED, reuse=False),
           "each segment once (now)": UNROLLED}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="192,448")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default="bench/results/ttt_reuse")
    args = ap.parse_args()
    policy = load_model("default").model.requires_grad_(False)
    drafter = load_drafter(str(shipped_path("eagle3")), policy.args).float().bind(policy)
    summary, times = {}, {}
    for T in map(int, args.lengths.split(",")):
        torch.manual_seed(0)
        toks = torch.randint(0, 8000, (8, T))
        with torch.no_grad():
            out = policy(toks, taps=drafter.feature_layers)
            logits = policy.logits(out.hidden)
        mask = torch.zeros(8, T, dtype=torch.bool)
        mask[:, T // 5:] = True
        case = f"draft_loss, 8 x {T} tokens"
        times[case] = {name: [] for name in SYSTEMS}
        for rep in range(args.repeats + 1):  # the first round warms up
            for name in (SYSTEMS if rep % 2 == 0 else reversed(SYSTEMS)):
                eagle3.unrolled = SYSTEMS[name]
                drafter.zero_grad()
                s = seconds(lambda: eagle3.draft_loss(drafter, toks, out.taps, out.hidden, logits, mask)[0].backward())
                if rep:
                    times[case][name].append(s)
                print(case, name, f"{s:.2f} s", flush=True)
        eagle3.unrolled = UNROLLED
        summary[case] = speedup(times[case], "segments run again (before)", "each segment once (now)")
        print(f"{case}: {summary[case]['speedup']:.2f}x", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ttt_reuse.json").write_text(json.dumps({"summary": summary, "seconds": times}, indent=2))


if __name__ == "__main__":
    main()
