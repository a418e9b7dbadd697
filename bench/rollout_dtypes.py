"""The autoregressive decode step in each --rollout-dtype, side by side: alternating processes (`decode_child.py`,
the default policy, the default kernels), at every --responses x --contexts setting, --rounds times in rotating
order. Per setting: each dtype's median step time and tokens/s, and the median over the rounds of each one's
speed over the first's. Writes rollout_dtypes.json and .png into --out; nothing else may run while it measures.

    .venv/bin/python bench/rollout_dtypes.py --dtypes bfloat16,int8 --out bench/results/rollout_dtypes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from decode_child import run_child


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,int8", help="--rollout-dtype values; ratios are over the first")
    ap.add_argument("--out", default="bench/results/rollout_dtypes")
    ap.add_argument("--responses", default="1,8,64")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per setting (after 2 untimed)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    dtypes = a.dtypes.split(",")
    settings = {"responses": [int(b) for b in a.responses.split(",")], "steps": a.steps,
                "contexts": [int(c) for c in a.contexts.split(",")]}  # fmt: skip
    results = {d: [] for d in dtypes}
    for r in range(a.rounds):
        for d in dtypes[r % len(dtypes) :] + dtypes[: r % len(dtypes)]:
            results[d].append(run_child(settings | {"dtype": d}))
            print(f"round {r + 1}/{a.rounds}: {d}", file=sys.stderr, flush=True)
    rows = []
    for key in [k for k in results[dtypes[0]][0] if "x" in k]:
        B, ctx = map(int, key.split("x"))
        ms = {d: statistics.median(x[key]["step_s"] for x in results[d]) * 1e3 for d in dtypes}
        base = results[dtypes[0]]
        ratio = {d: statistics.median(b[key]["step_s"] / x[key]["step_s"] for b, x in zip(base, results[d]))
                 for d in dtypes[1:]}  # fmt: skip
        tok_s = {d: B / v * 1e3 for d, v in ms.items()}
        rows.append({"responses": B, "context": ctx, "step_ms": ms, "tok_per_s": tok_s,
                     f"speed_over_{dtypes[0]}": ratio})  # fmt: skip
        print(f"{B:3d} x {ctx:5d}: " + ", ".join(f"{d} {v:7.2f} ms" for d, v in ms.items())
              + "; " + ", ".join(f"{d} {v:.2f}x {dtypes[0]}" for d, v in ratio.items()), flush=True)  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from sparkrl.commands.bench import machine

    result = {"command": "python bench/rollout_dtypes.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
              "machine": machine() | {"load_after": os.getloadavg()}, "rows": rows}  # fmt: skip
    (out / "rollout_dtypes.json").write_text(json.dumps(result, indent=1))
    plot(rows, dtypes, out / "rollout_dtypes.png")


def plot(rows: list[dict], dtypes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(dtypes)
    for i, d in enumerate(dtypes):
        ax.bar([j + i * width for j in range(len(rows))], [r["tok_per_s"][d] for r in rows], width, label=d)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [f"{r['responses']} x {r['context']}" for r in rows])
    ax.set_xlabel("responses x context tokens")
    ax.set_ylabel("tokens/s (decode step)")
    ax.set_yscale("log")
    ax.set_title("Autoregressive decode step by rollout dtype")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
