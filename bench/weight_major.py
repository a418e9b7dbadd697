"""Weight-major products (`kernels.weight_major_linear`) against `F.linear`, in one script: the default
model's whole decode step (every linear layer one way or the other; weights come from memory, as in a
rollout) and its LM head alone, per row count; then multi-token forwards (verify trees, a prefill) with
weight-major products forced past `kernels.WEIGHT_MAJOR_ROWS`, to show where they stop paying.
Interleaved, medians; also the largest logit difference.

    .venv/bin/python bench/weight_major.py --dtype float32 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparkrl import kernels
from sparkrl.kernels import weight_major_linear
from sparkrl.precision import _step_seconds, use_weight_major
from sparkrl.weights import load_model


def head_seconds(f, reps: int = 5) -> list[float]:
    f()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return out


def forward_seconds(policy, B: int, T: int, context: int = 160, reps: int = 3) -> list[float]:
    """Seconds of a cached forward of T new tokens on B rows (a verify or a prefill), rolled back."""
    cache = policy.new_cache(B, context + T + 2)
    cache.lengths += context
    tok = torch.randint(0, policy.args.vocab_size, (B, T))
    out = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        policy(tok, cache)
        cache.commit(n_keep=torch.zeros(B, dtype=torch.long))
        out.append(time.perf_counter() - t)
    return out[1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rows", default="1,2,8,16,64")
    ap.add_argument("--forwards", default="8x17,16x17,64x3,1x512",
                    help="ROWSxTOKENS cached forwards (beside a 160-token context), weight-major forced at any size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    policy = load_model("default", dtype=args.dtype, with_tokenizer=False).model
    W = policy.lm_head.weight.detach()
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        toks = torch.randint(0, policy.args.vocab_size, (4, 9), generator=g)
        use_weight_major(policy, False)
        ref = policy.logits(policy(toks).hidden)
        use_weight_major(policy, True)
        diff = float((policy.logits(policy(toks).hidden) - ref).abs().max())
        for M in map(int, args.rows.split(",")):
            step = {"plain": [], "weight_major": []}
            head = {"plain": [], "weight_major": []}
            x = torch.randn(M, W.shape[1], generator=g).to(W.dtype)
            for _ in range(args.repeats):  # interleaved: drift hits both alike
                for name in step:
                    use_weight_major(policy, name == "weight_major")
                    step[name] += _step_seconds(policy, rows=M, reps=4)
                    f = (lambda: weight_major_linear(x, W)) if name == "weight_major" else (lambda: F.linear(x, W))
                    head[name] += head_seconds(f)
            med = {k: {n: statistics.median(v) * 1e3 for n, v in d.items()}
                   for k, d in (("step", step), ("head", head))}
            rows.append({"rows": M, "step_ms": med["step"], "head_ms": med["head"],
                         "step_speedup": med["step"]["plain"] / med["step"]["weight_major"],
                         "head_speedup": med["head"]["plain"] / med["head"]["weight_major"]})
            r = rows[-1]
            print(f"{M:3d} rows: decode step {r['step_ms']['plain']:6.1f} -> {r['step_ms']['weight_major']:6.1f} ms "
                  f"({r['step_speedup']:.2f}x); LM head {r['head_ms']['plain']:5.1f} -> "
                  f"{r['head_ms']['weight_major']:5.1f} ms "
                  f"({r['head_speedup']:.2f}x)", flush=True)
        kernels.WEIGHT_MAJOR_ROWS = 1 << 30  # forced, to measure past the cap
        forwards = []
        for spec in args.forwards.split(","):
            B, T = map(int, spec.split("x"))
            t = {"plain": [], "weight_major": []}
            for _ in range(args.repeats):
                for name in t:
                    use_weight_major(policy, name == "weight_major")
                    t[name] += forward_seconds(policy, B, T)
            med = {n: statistics.median(v) * 1e3 for n, v in t.items()}
            forwards.append({"rows": B, "tokens": T, "ms": med, "speedup": med["plain"] / med["weight_major"]})
            print(f"{B}x{T} forward ({B * T} rows): {med['plain']:.0f} -> {med['weight_major']:.0f} ms "
                  f"({forwards[-1]['speedup']:.2f}x)", flush=True)
    print(f"largest logit difference, weight-major against F.linear: {diff:.1e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "weight_major" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    (out / f"{name}.json").write_text(json.dumps({"dtype": args.dtype, "torch": torch.__version__,
                                                  "threads": torch.get_num_threads(), "max_logit_diff": diff,
                                                  "rows": rows, "forwards": forwards}, indent=2))


if __name__ == "__main__":
    main()
