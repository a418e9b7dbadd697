"""Per-round costs of the rollout methods at realistic model sizes, for a lent GPU machine.

The machine has no network and at most 64 MiB of files travel to it, so the paper's models cannot be
loaded there: this script builds them with RANDOM weights (the same architectures, sizes in
`SIZES`) and times, per verification round and batch size, what does not depend on the weights:
  * an autoregressive step (1-token policy forward + LM head + sampling),
  * a speculative round: the drafter's tree (EAGLE3-style, one layer, depth 5 x branch 4, 16 nodes),
    the 17-token tree-verification forward, the LM head on the visited nodes, and SPARK's per-round
    work (correction of every drafted context, feedback update) at a realistic number of touched rows.
It then combines them with acceptance lengths measured on real models elsewhere (`--aal` pairs, e.g.
from `sparkrl bench` on the CPU, or the paper's) into a predicted generation speedup:
    speedup = AAL * t(AR step) / t(speculative round).
That prediction assumes the measured AAL carries over to the larger model; say so when quoting it.

    python bench/gpu_costs.py --sizes qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b --batches 8,32,64 \
        --aal eagle3=1.74,eagle3+spark=1.80 --out $OUT/gpu_costs.json     # < 10 min on one H200
    python bench/gpu_costs.py --sizes tiny --batches 2 --out /tmp/gpu_costs.json   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.config import TreeShape
from sparkrl.drafters.tree import build_tree
from sparkrl.model import ModelArgs, Transformer
from sparkrl.sampling import sample
from sparkrl.spark import Spark, init_projection

SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab (Hugging Face configs of these models)
    "tiny": (64, 128, 2, 4, 2, 512),
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064),
}


def make(name: str, device, dtype) -> Transformer:
    d, ff, L, H, Hkv, V = SIZES[name]
    args = ModelArgs("qwen2", V, d, ff, L, H, Hkv, d // H, qkv_bias=name.startswith("qwen"), rope_theta=1e6)
    with torch.device(device):
        m = Transformer(args)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return m.to(dtype).eval().requires_grad_(False)


def timed(fn, device, reps: int) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


@torch.no_grad()
def measure(name: str, batches: list[int], context: int, device, dtype, reps: int) -> list[dict]:
    policy = make(name, device, dtype)
    drafter = Eagle3Drafter(policy.args).to(device=device, dtype=dtype).bind(policy)
    shape = TreeShape(5, 4, 16)
    V, d = policy.args.vocab_size, policy.args.hidden_size
    rows = []
    for B in batches:
        cap = context + 64
        pc, dc = policy.new_cache(B, cap), drafter.new_cache(B, cap)
        ctx = torch.randint(0, V, (B, context), device=device)
        policy(ctx, pc)
        pc.commit(n_keep=torch.full((B,), context, device=device))
        drafter(ctx, torch.zeros(B, context, d, device=device, dtype=dtype), dc)
        dc.commit(n_keep=torch.full((B,), context, device=device))
        u = torch.rand(B, dtype=torch.float64)  # the engine's uniforms are float64 on the CPU
        zero = torch.zeros(B, dtype=torch.long, device=device)
        root = torch.randint(0, V, (B,), device=device)

        def ar_step():
            out = policy(root[:, None], pc)
            pc.commit(n_keep=zero)  # roll back: every repeat sees the same context
            sample(policy.logits(out.hidden[:, -1]), 1.0, 0.95, u)

        step = drafter(root[:, None], torch.zeros(B, 1, d, device=device, dtype=dtype), dc)
        dc.commit(n_keep=zero)
        z, a, h = step.z[:, 0], step.a[:, 0], step.h[:, 0]
        tree = build_tree(drafter, dc, root, z, a, h, shape).tree
        dc.commit(n_keep=zero)

        def draft():
            build_tree(drafter, dc, root, z, a, h, shape)
            dc.commit(n_keep=zero)

        def verify():
            out = policy(tree.tokens, pc, tree_mask=tree.ancestor_mask(), depth=tree.depth)
            pc.commit(n_keep=zero)
            policy.logits(out.hidden[:, :3])  # the walk visits ~AAL + 1 nodes

        spark = Spark(init_projection(policy.lm_head.weight.float(), 8), drafter.vocab_ids.numel())
        spark.begin(max(B // 8, 1), min(B, 8))
        g = torch.Generator(device=device).manual_seed(0)
        m = 2000  # touched rows per group late in a rollout (measured here: ~1,500 per group at 160 tokens)
        groups = max(B // 8, 1)
        keys = (torch.arange(groups, device=device)[:, None] * spark.V
                + torch.randint(0, spark.V, (groups, m), device=device, generator=g)).flatten()
        spark.store.add(keys, torch.randn(keys.numel(), 8, device=device, generator=g) * 0.01)
        n_ctx = 4 * B  # feedback contexts per round (measured here: ~4 per response)
        fb = (torch.arange(n_ctx, device=device) % B, torch.randn(n_ctx, d, device=device, generator=g),
              torch.randn(n_ctx, spark.V, device=device, generator=g),
              torch.softmax(torch.randn(n_ctx, spark.V, device=device, generator=g) * 3, -1),
              torch.ones(n_ctx, device=device))
        active = torch.arange(B, device=device)

        def spark_round():
            spark.select(active)
            for _ in range(5):  # the root and four expansion levels of a depth-5 tree
                spark.correct(z[:, None].expand(-1, 4, -1), h[:, None].expand(-1, 4, -1))
            spark.feedback(*fb)
            spark._pending = []  # keep the store the same size across repeats

        t = {"ar_step": timed(ar_step, device, reps), "draft": timed(draft, device, reps),
             "verify": timed(verify, device, reps), "spark": timed(spark_round, device, reps)}
        t["spec_round"] = t["draft"] + t["verify"]
        t["spec_round_spark"] = t["spec_round"] + t["spark"]
        rows.append({"model": name, "batch": B, "context": context, "seconds": t,
                     "spark_share_of_round": t["spark"] / t["spec_round_spark"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b")
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache (prompt + response so far)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--aal", default="", help="method=AAL pairs measured on real models, e.g. eagle3=1.74,eagle3+spark=1.80")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    aal = {k: float(v) for k, v in (p.split("=") for p in args.aal.split(",") if p)}
    rows = []
    for name in args.sizes.split(","):
        rows += measure(name, [int(b) for b in args.batches.split(",")], args.context, device, dtype, args.reps)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        s = r["seconds"]
        r["predicted_gen_speedup"] = {m: a * s["ar_step"] / (s["spec_round_spark"] if "spark" in m else s["spec_round"])
                                      for m, a in aal.items()}
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
            "torch": torch.__version__, "weights": "random (timing only)", "aal_source": args.aal}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
