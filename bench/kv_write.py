"""Writing new K/V into the cache: `scatter_` along the position dimension against `index_copy_` on
the buffer viewed as rows (what `model.KVCache.write` does), per dtype and batch shape, in one script.

The shapes are the default model's (3 KV heads, head dim 64); cache capacity 160 or 2,300 positions
(a 128- or a 2,048-token response after its prompt); T new tokens per sequence at random positions
(1: a decode step, 17: a 16-node tree). Median of 3 x 50 calls.

    .venv/bin/python bench/kv_write.py --out bench/results
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch


def timed(fn, calls: int = 50, repeats: int = 3) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.manual_seed(0)
    H, D = 3, 64
    rows = []
    for dtype, cap in itertools.product((torch.float32, torch.bfloat16), (160, 2300)):
        for B, T in ((1, 1), (1, 17), (8, 1), (8, 17), (64, 1), (64, 17)):
            buf = torch.zeros(B, H, cap, D, dtype=dtype)
            slots = torch.randint(0, cap - T, (B, 1)) + torch.arange(T)  # (B, T)
            k = torch.randn(B, T, H, D, dtype=dtype).transpose(1, 2)  # (B, H, T, D), a view as in the model
            idx = slots[:, None, :, None].expand(B, H, T, D)
            flat_rows = ((torch.arange(B * H).view(B, H, 1) * cap) + slots[:, None, :]).flatten()
            flat = buf.view(-1, D)
            scatter = timed(lambda: buf.scatter_(2, idx, k))
            copy = timed(lambda: flat.index_copy_(0, flat_rows, k.reshape(-1, D)))
            rows.append(
                {
                    "dtype": str(dtype).split(".")[1],
                    "capacity": cap,
                    "sequences": B,
                    "tokens": T,
                    "scatter_us": scatter * 1e6,
                    "index_copy_us": copy * 1e6,
                    "ratio": scatter / copy,
                }
            )
            print(
                f"{rows[-1]['dtype']:>8} cap={cap:<5} B={B:<3} T={T:<3} scatter_ {scatter * 1e6:8.1f} us   index_copy_ "
                f"{copy * 1e6:6.1f} us   {scatter / copy:6.1f}x",
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_write.json").write_text(
        json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
