"""Per call: the 8-bit product (`native.int8_linear`: activations quantized per row as they come in, exact int32
sums) against the compiled bfloat16 and float32 products (`native.linear`) at the default policy's shapes, 1, 8 and
64 rows, 2 threads, the weights cold (a rotating set larger than the last-level cache, as a decode step reads them).
The first measurement for issue 59 (int8 rollouts): whether 8-bit products pay on this CPU before they are wired into
a rollout. Writes int8_products.json into --out; nothing else may run while it measures.

    .venv/bin/python bench/int8_products.py --out bench/results/int8_products
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from sparkrl.commands.bench import machine
from sparkrl.cpu import native

SHAPES = {"q/k/v": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
COLD_BYTES = 256 << 20  # each kind's rotating weights: past the last-level cache


def per_call(f, n: int, repeats: int) -> float:
    """Seconds per call of f(i), the best of `repeats` runs of n calls after n // 4 untimed ones."""
    for i in range(max(1, n // 4)):
        f(i)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n):
            f(i)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/int8_products")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    assert native.available(), "the compiled kernels are not available here"
    torch.manual_seed(0)
    rows = []
    for name, (N, K) in SHAPES.items():
        copies = max(2, COLD_BYTES // (N * K * 2))
        w32 = [torch.randn(N, K) * 0.05 for _ in range(copies)]
        kinds = {"bfloat16": [w.bfloat16() for w in w32], "int8": [native.quantize_rows(w) for w in w32]}
        kinds["float32"] = w32[: max(2, copies // 2)]
        for M in map(int, a.rows.split(",")):
            n = max(20, 2000 // M) if N < 10000 else max(5, 100 // M)
            x = torch.randn(M, K)
            calls = {
                "float32": lambda i: native.linear(x, kinds["float32"][i % len(kinds["float32"])]),
                "bfloat16": lambda i, xb=x.bfloat16(): native.linear(xb, kinds["bfloat16"][i % copies]),
                "int8": lambda i, xb=x.bfloat16(): native.int8_linear(xb, *kinds["int8"][i % copies]),
            }
            us = {k: per_call(f, n, a.repeats) * 1e6 for k, f in calls.items()}
            row = {"product": name, "shape": [N, K], "rows": M, "us": us,
                   "int8_over_bfloat16": us["bfloat16"] / us["int8"],
                   "int8_over_float32": us["float32"] / us["int8"]}  # fmt: skip
            rows.append(row)
            print(f"{name:8s} {N}x{K}, {M:3d} rows: " + ", ".join(f"{k} {v:8.1f} us" for k, v in us.items())
                  + f"; int8 {row['int8_over_bfloat16']:.2f}x bfloat16, {row['int8_over_float32']:.2f}x float32",
                  flush=True)  # fmt: skip
    per_step = {}
    for M in map(int, a.rows.split(",")):  # one decode step's layer products (30 layers) and the head, summed
        sel = [r for r in rows if r["rows"] == M]
        total = {k: sum(r["us"][k] * (1 if r["product"] == "head" else 30) for r in sel) for k in ("bfloat16", "int8")}
        per_step[M] = {
            "ms": {k: v / 1e3 for k, v in total.items()},
            "int8_over_bfloat16": total["bfloat16"] / total["int8"],
        }
        print(f"a decode step's products at {M} rows: bfloat16 {total['bfloat16'] / 1e3:.1f} ms, int8 "
              f"{total['int8'] / 1e3:.1f} ms: {per_step[M]['int8_over_bfloat16']:.2f}x")  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": "python bench/int8_products.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
              "machine": machine() | {"load_after": os.getloadavg()},
              "rows": rows, "decode_step": per_step}  # fmt: skip
    (out / "int8_products.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
