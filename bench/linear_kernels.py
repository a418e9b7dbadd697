"""One linear layer, plain `F.linear` against the prepacked oneDNN weight of `kernels.Linear`, per dtype,
weight shape (the default model's projections and LM head) and row count, in one script.

Weights stay in cache between calls here (a decode step streams them from memory), so these are the
kernels' own costs, larger than what a whole step gains (bench/sampler_vs_hf.py measures that).
Median of 3 x 50 calls; also the largest difference between the two results.

    .venv/bin/python bench/linear_kernels.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kv_write import timed  # bench/kv_write.py, beside this script
from sparkrl.kernels import Linear, pack, packable

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))  # (in, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,17,64,136")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            for n_in, n_out in SHAPES:
                layer = Linear(n_in, n_out, bias=False).to(dtype)
                packed = pack(Linear(n_in, n_out, bias=False).to(dtype), True)
                packed.weight.copy_(layer.weight)
                if not packed.packed and packable(torch.bfloat16, "cpu"):  # float32: force the path to time it
                    packed.packed = True
                for M in map(int, args.rows.split(",")):
                    if n_out > 10_000 and M > 17:
                        continue  # the LM head runs on the few visited nodes
                    x = torch.randn(M, n_in).to(dtype)
                    plain_s = timed(lambda: F.linear(x, layer.weight))
                    packed_s = timed(lambda: packed(x))
                    diff = float((packed(x).float() - F.linear(x, layer.weight).float()).abs().max())
                    rows.append({"dtype": str(dtype).removeprefix("torch."), "in": n_in, "out": n_out, "rows": M,
                                 "plain_us": plain_s * 1e6, "packed_us": packed_s * 1e6, "speedup": plain_s / packed_s,
                                 "max_abs_diff": diff})
                    r = rows[-1]
                    print(f"{r['dtype']:>8} {n_in}x{n_out:<6} M={M:<4} plain {r['plain_us']:8.1f} us  packed "
                          f"{r['packed_us']:8.1f} us  {r['speedup']:5.2f}x  max diff {diff:.1e}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear_kernels.json").write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
