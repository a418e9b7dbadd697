"""bfloat16 products of the default model's shapes, one at a time: oneDNN's prepacked product (`kernels.pack`,
what a bfloat16 copy runs where packing pays) against the compiled product on the CPU's bfloat16 dot products
(`sparkrl.native`, weights repacked into pairs; AVX512-BF16 only). Interleaved, medians of 5 runs of many
calls each: the weights stay in cache between calls, unlike in a forward, so read the ratios, and the
forwards (bench/decode_ops.py, bench/rollout_dtypes.py) for what a model gains.

    .venv/bin/python bench/bf16_products.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sparkrl import native
from sparkrl.kernels import Linear, pack

SHAPES = {"q/k/v fused": (576, 960), "o_proj": (576, 576), "gate/up fused": (576, 3072), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}  # (in, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,17,32,136")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not native.bf16_dot():
        raise SystemExit("this CPU has no bfloat16 dot products (AVX512-BF16), or the compiled kernels cannot be built")
    torch.manual_seed(0)
    results = []
    with torch.no_grad():
        for name, (n_in, n_out) in SHAPES.items():
            lin = pack(Linear(n_in, n_out, bias=False).bfloat16().requires_grad_(False))
            pairs = native.pack_pairs(lin.weight)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, n_in).bfloat16()
                calls = max(10, 20000 // max(1, n_out // 64) // rows)
                systems = {"onednn": lambda: lin(x), "pairs": lambda: native.linear(x, lin.weight, None, pairs=pairs)}
                t = {k: [] for k in systems}
                for rep in range(5):
                    for k in (list(systems) if rep % 2 == 0 else list(systems)[::-1]):
                        start = time.perf_counter()
                        for _ in range(calls):
                            systems[k]()
                        t[k].append((time.perf_counter() - start) / calls * 1e6)
                us = {k: statistics.median(v) for k, v in t.items()}
                results.append({"product": name, "in": n_in, "out": n_out, "rows": rows, "us": us,
                                "speedup": us["onednn"] / us["pairs"]})
                print(f"{name:14s} {rows:4d} rows: oneDNN {us['onednn']:8.1f} us, pairs {us['pairs']:8.1f} us, "
                      f"{us['onednn'] / us['pairs']:.2f}x", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bf16_products.json").write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
