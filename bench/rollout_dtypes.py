"""The default model's cached forwards in each rollout precision, side by side: float32 on the kernels
`--cpu-kernels auto` gives it, bfloat16 attending in bfloat16, and bfloat16 attending in float32 on a
float32 KV cache (`Attention.attn_dtype`, the default where it pays), and bfloat16 on the compiled
product (`sparkrl.native`: the weights widened as they stream; where it can be built). Decode steps (one new token) at
several row counts and verify-sized forwards (T new tokens, LM head on the last), beside a 192-token
context; systems interleaved within each repeat, medians. Reports each forward's time, its ratio to
float32, and the verify cost ratio (T-token forward / 1-token step) per precision and row count.
Writes rollout_dtypes.json and .png.

    .venv/bin/python bench/rollout_dtypes.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from sparkrl import native
from sparkrl.precision import RolloutCopy, _step_seconds, use_packed
from sparkrl.weights import load_model

SYSTEMS = {"float32": (torch.float32, False, None), "bf16": (torch.bfloat16, False, False),
           "bf16, fp32 attention": (torch.bfloat16, True, False),
           "bf16, compiled product": (torch.bfloat16, None, True)}  # (dtype, float32 attention, compiled product;
# None: measured, as under --cpu-kernels auto)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,64", help="rows of the decode steps and (with --tokens) the forwards")
    ap.add_argument("--tokens", default="1,2,5,9,17", help="new tokens per row (1: a decode step)")
    ap.add_argument("--verify-rows", default="1,8", help="row counts the multi-token forwards run at")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    policy = load_model("default", with_tokenizer=False).model
    if not native.available():
        SYSTEMS.pop("bf16, compiled product")
    models = {name: RolloutCopy(policy, dt, separate=True, packed=use_packed("auto", dt, policy), attention32=attn,
                                native=fast, ops=fast).model
              for name, (dt, attn, fast) in SYSTEMS.items()}  # as `precision.rollout_copy`, with the kernels chosen
    kernels = {name: {"packed": m.lm_head.packed, "weight_major": m.lm_head.weight_major, "native": m.lm_head.native,
                      "compiled_ops": m.model.norm.native,
                      "float32_attention": m.model.attn_dtype is not None} for name, m in models.items()}
    print("kernels:", kernels, flush=True)
    sizes = [(r, 1) for r in map(int, args.rows.split(","))]
    sizes += [(r, t) for r in map(int, args.verify_rows.split(",")) for t in map(int, args.tokens.split(",")) if t > 1]
    results = []
    for rows, tokens in sizes:
        t = {n: [] for n in models}
        for _ in range(args.repeats):  # interleaved: drift hits all alike
            for name, m in models.items():
                t[name] += _step_seconds(m, rows=rows, context=192, reps=4, tokens=tokens)
        ms = {n: statistics.median(v) * 1e3 for n, v in t.items()}
        results.append({"rows": rows, "tokens": tokens, "ms": ms, "vs_float32": {n: ms["float32"] / v for n, v in ms.items()}})
        print(f"{rows:3d} rows x {tokens:2d} tokens: " + ", ".join(f"{n} {v:.1f} ms ({ms['float32'] / v:.2f}x)"
                                                              for n, v in ms.items()), flush=True)
    step = {(r["rows"], n): r["ms"][n] for r in results if r["tokens"] == 1 for n in models}
    for r in results:
        if (r["rows"], "float32") in step:
            r["per_step"] = {n: r["ms"][n] / step[(r["rows"], n)] for n in models}  # T-token / 1-token
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout_dtypes.json").write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                                         "kernels": kernels, "forwards": results}, indent=2))
    plot(results, list(models), out / "rollout_dtypes.png")


def plot(results: list[dict], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [r for r in results if r["tokens"] == 1]
    for n in names:
        a.plot([r["rows"] for r in steps], [r["ms"][n] for r in steps], "o-", label=n)
    a.set(xscale="log", xlabel="rows (one new token each)", ylabel="ms per decode step", title="decode step")
    a.legend()
    for rows in sorted({r["rows"] for r in results if r["tokens"] > 1}):
        pts = [r for r in results if r["rows"] == rows and "per_step" in r]
        for n in names:
            b.plot([r["tokens"] for r in pts], [r["per_step"][n] for r in pts], "o-", label=f"{n}, {rows} rows")
    b.set(xlabel="new tokens per row (T)", ylabel="T-token forward / 1-token step", title="verify cost")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
