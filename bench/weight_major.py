"""Weight-major products (`kernels.weight_major_linear`) and prepacked weights against `F.linear`, in one
script: the default model's whole decode step (every linear layer one way or the other; weights come
from memory, as in a rollout) and its LM head alone, per row count; then multi-token forwards (verify
trees, a prefill) with weight-major products forced past `kernels.WEIGHT_MAJOR_ROWS`, to show where
they stop paying. Four systems: plain `F.linear`; weight-major split into one block of output rows per
thread, each layer its own product (the form before fusing); the same with q/k/v and gate/up as one
product each (`kernels.linears`); prepacked oneDNN weights, with weight-major products up to
`kernels.PACKED_WEIGHT_MAJOR_ROWS` rows (in float32 the default where packing pays); in float32, the
same with products of up to `native.MAX_ROWS` rows on the compiled kernel (`sparkrl.native`, the
default where it pays). Interleaved, medians; also the largest logit difference against plain.

    .venv/bin/python bench/weight_major.py --dtype float32 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from sparkrl import kernels, native
from sparkrl.kernels import pack, packable
from sparkrl.precision import _step_seconds, use_native, use_weight_major
from sparkrl.weights import load_model
from timing import repeated

SYSTEMS = {"plain": (False, False, False, False), "split": (True, False, False, False),
           "split_fused": (True, True, False, False), "packed": (True, True, True, False),
           "native": (True, True, True, True)}  # (weight-major, fused, packed, compiled few-row product)


def use(policy, name: str) -> None:
    on, kernels.FUSE_LINEARS, packed, fast = SYSTEMS[name]
    use_native(use_weight_major(pack(policy, packed), on), fast)


def speedups(r: dict, key: str) -> str:
    return ", ".join(f"{n} {r[f'{key}_{n}']:.2f}x" for n in SYSTEMS if n != "plain")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--forwards", default="8x17,16x17,64x3,1x512",
                    help="ROWSxTOKENS cached forwards (beside a 160-token context), weight-major forced at any size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    policy = load_model("default", dtype=args.dtype, with_tokenizer=False).model
    if not packable(policy.lm_head.weight.dtype, "cpu"):
        SYSTEMS.pop("packed")
        SYSTEMS["native"] = (True, True, False, True)
    if args.dtype != "float32" or not native.available():
        SYSTEMS.pop("native")
    W = policy.lm_head.weight.detach()
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        toks = torch.randint(0, policy.args.vocab_size, (4, 9), generator=g)
        use(policy, "plain")
        ref = policy.logits(policy(toks).hidden)
        diff = {}
        for name in SYSTEMS:
            use(policy, name)
            diff[name] = float((policy.logits(policy(toks).hidden) - ref).abs().max())
        for M in map(int, args.rows.split(",")):
            step = {n: [] for n in SYSTEMS}
            head = {n: [] for n in SYSTEMS}
            x = torch.randn(M, W.shape[1], generator=g).to(W.dtype)
            for _ in range(args.repeats):  # interleaved: drift hits all alike
                for name in SYSTEMS:
                    use(policy, name)
                    step[name] += _step_seconds(policy, rows=M, reps=4)
                    head[name] += repeated(lambda: policy.lm_head(x), 5)
            med = {k: {n: statistics.median(v) * 1e3 for n, v in d.items()}
                   for k, d in (("step", step), ("head", head))}
            rows.append({"rows": M, "step_ms": med["step"], "head_ms": med["head"],
                         **{f"{k}_speedup_{n}": med[k]["plain"] / med[k][n] for k in ("step", "head")
                            for n in SYSTEMS if n != "plain"}})
            r = rows[-1]
            print(f"{M:3d} rows: decode step plain {r['step_ms']['plain']:6.1f} ms, {speedups(r, 'step_speedup')}; "
                  f"LM head plain {r['head_ms']['plain']:5.1f} ms, {speedups(r, 'head_speedup')}", flush=True)
        kernels.WEIGHT_MAJOR_ROWS = 1 << 30  # forced, to measure past the cap
        forwards = []
        for spec in args.forwards.split(","):
            B, T = map(int, spec.split("x"))
            t = {n: [] for n in SYSTEMS}
            for _ in range(args.repeats):
                for name in t:
                    use(policy, name)
                    t[name] += _step_seconds(policy, rows=B, context=160, reps=3, tokens=T, head=False)
            med = {n: statistics.median(v) * 1e3 for n, v in t.items()}
            forwards.append({"rows": B, "tokens": T, "ms": med,
                             **{f"speedup_{n}": med["plain"] / med[n] for n in SYSTEMS if n != "plain"}})
            f = forwards[-1]
            print(f"{B}x{T} forward ({B * T} rows): plain {med['plain']:.0f} ms, {speedups(f, 'speedup')}", flush=True)
    print("largest logit difference against F.linear: " + ", ".join(f"{n} {d:.1e}" for n, d in diff.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "weight_major" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    (out / f"{name}.json").write_text(json.dumps({"dtype": args.dtype, "torch": torch.__version__,
                                                  "threads": torch.get_num_threads(), "max_logit_diff": diff,
                                                  "rows": rows, "forwards": forwards}, indent=2))


if __name__ == "__main__":
    main()
