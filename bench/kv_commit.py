"""Committing a verified tree's accepted tokens in the KV cache: `model.KVCache.commit` (every layer's K/V
in one buffer: one gather and one copy) against the previous commit (a gather and a copy per layer's K and V
buffer), in one script on the same cache.

The default model's shapes (30 layers, 3 KV heads, head dim 64), a float32 cache (what bfloat16 rollout
copies keep on this CPU) and a bfloat16 one, 256 committed positions per sequence; after a tree of N
tokens, the root and K - 1 accepted nodes at random positions of it are kept. Median of 3 x 200 calls.

    .venv/bin/python bench/kv_commit.py --out bench/results/kv_commit
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparkrl.model import KVCache, ModelArgs

from timing import interleaved_us


def per_layer_commit(cache: KVCache, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
    """The previous `KVCache.commit`: the kept tokens moved in each layer's K and V buffer in turn."""
    base = cache.lengths[:, None]
    src = cache.rows(base + keep)
    dst = cache.rows(base + torch.arange(keep.shape[1], device=keep.device))
    for buf in (*cache.k, *cache.v):
        flat = buf.view(-1, buf.shape[-1])
        flat.index_copy_(0, dst, flat.index_select(0, src))
    cache.lengths = cache.lengths + n_keep
    cache.pending = 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/kv_commit")
    args = ap.parse_args()
    torch.manual_seed(0)
    margs = ModelArgs("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for B, N, K in ((1, 5, 2), (1, 17, 4), (8, 5, 2), (8, 17, 4), (64, 5, 2)):
            cache = KVCache.empty(margs, B, 256 + N + 8, "cpu", dtype)
            cache.kv.normal_()
            keep = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(N - 1)[:K - 1].sort().values + 1])
                                for _ in range(B)])  # (B, K) the root, then accepted nodes in order
            n_keep = torch.full((B,), K)

            def run(commit):
                def call():
                    cache.lengths = torch.full((B,), 256)
                    cache.pending = N
                    commit(cache, keep, n_keep)
                return call

            us = interleaved_us({"per layer": run(per_layer_commit), "one buffer": run(KVCache.commit)}, 3, 200)
            rows.append({"dtype": str(dtype).split(".")[1], "sequences": B, "tree_tokens": N, "kept": K, **us,
                         "speedup": us["per layer"] / us["one buffer"]})
            print(f"{rows[-1]['dtype']:>8} B={B:<3} tree {N:<3} kept {K}: per layer {us['per layer']:7.1f} us, one buffer "
                  f"{us['one buffer']:7.1f} us, {rows[-1]['speedup']:.2f}x", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_commit.json").write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                                    "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
