"""The compiled RMSNorm, RoPE and cached attention (`sparkrl.native.rms_norm` / `rope` / `attention`) against
torch's ops, in the default model's decode step: the rollout copy as `--cpu-kernels auto` makes it in each
dtype (its products on whatever kernels it measured), with every norm and attention (RoPE, cached attention)
compiled or on torch's tensor ops. Interleaved within each repeat, medians; also the largest hidden-state
difference between the two, and each kernel alone per call against torch's ops (one norm of the default
model's width, one RoPE of its query heads) at 1 to 512 positions, and one layer's cached attention (SDPA)
at 1 to 32 sequences x 1 to 17 new tokens; and the compiled nucleus sampling (`native.nucleus`) against torch's
tensor ops at 1 to 64 rows, on the bfloat16 rollout copy's logits along a text it sampled itself.

    .venv/bin/python bench/decode_ops.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from sparkrl import native
from sparkrl.config import SamplingConfig
from sparkrl.model import RMSNorm, apply_rope
from sparkrl.precision import _step_seconds, rollout_copy, use_native
from sparkrl.rollout import generate
from sparkrl.sampling import sample_nucleus
from sparkrl.weights import load_model
from timing import interleaved_us


def per_call(dtype: torch.dtype, positions: int, repeats: int = 5, calls: int = 50) -> dict:
    """Microseconds per call (median of `repeats` runs of `calls` calls) of a norm and a RoPE at `positions`
    positions, torch's ops and compiled, interleaved."""
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    x = torch.randn(1, positions, 576).to(dtype)
    q = torch.randn(1, positions, 9, 64).to(dtype).transpose(1, 2)  # (B, H, T, D) as attention passes it
    cos, sin = torch.randn(1, 1, positions, 64).to(dtype), torch.randn(1, 1, positions, 64).to(dtype)
    fns = {"norm_torch": lambda: norm(x), "norm_compiled": lambda: native.rms_norm(x, norm.weight, 1e-5),
           "rope_torch": lambda: apply_rope(q, cos, sin), "rope_compiled": lambda: native.rope(q, cos, sin)}
    return interleaved_us(fns, repeats, calls)


def attention_per_call(dtype: torch.dtype, rows: int, new: int, span: int = 256, repeats: int = 5,
                       calls: int = 50) -> dict:
    """Microseconds per call of the cached attention of one layer of the default model (9 query heads over 3,
    head size 64) for `rows` sequences x `new` new tokens over `span` cached positions: torch's SDPA (with the
    transpose the layer makes) and compiled, interleaved."""
    torch.manual_seed(0)
    H, Hk, D = 9, 3, 64
    q = torch.randn(rows, new, H, D).to(dtype).transpose(1, 2)
    k, v = (torch.randn(rows, Hk, span + 64, D).to(dtype) for _ in range(2))
    mask = torch.ones(rows, 1, new, span, dtype=torch.bool)
    fns = {"torch": lambda: F.scaled_dot_product_attention(q, k[:, :, :span], v[:, :, :span], attn_mask=mask,
                                                          enable_gqa=True).transpose(1, 2).reshape(rows, new, H * D),
           "compiled": lambda: native.attention(q, k, v, mask, span, dtype)}
    return interleaved_us(fns, repeats, calls)


def nucleus_per_call(model, rows: list[int], repeats: int, positions: int = 256) -> list[dict]:
    """Microseconds of sampling one call of `rows` rows (`sampling.sample_nucleus`, T 1, top-p 0.95) on torch's
    tensor ops and on the compiled nucleus, interleaved: every call of a run samples the next `rows` of the
    policy's logits along `positions` tokens of a text it sampled itself (so each run covers the whole text at
    every row count; this model's nucleus is often hundreds to thousands of tokens wide at T 1). Medians of
    `repeats` runs."""
    ops = model.compiled_ops
    use_native(model, model.lm_head.native, False)  # the text sampled on torch's ops whatever the kernel does
    own = generate(model, [[0]], SamplingConfig(1.0, 0.95, positions), (), [torch.Generator().manual_seed(0)])
    use_native(model, model.lm_head.native, ops)
    with torch.no_grad():
        logits = model.logits(model(torch.tensor([[0] + own.tokens[0][:positions - 1]])).hidden[0])  # (positions, V)
    u = torch.rand(positions, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    widths = (sample_nucleus(logits, 1.0, 0.95, u)[0] > 0).sum(-1).float()
    out = []
    for n in rows:
        chunks = [(logits[i:i + n], u[i:i + n]) for i in range(0, positions - n + 1, n)]
        fns = {way: (lambda c=compiled: [sample_nucleus(lg, 1.0, 0.95, uu, c) for lg, uu in chunks])
               for way, compiled in (("torch", False), ("compiled", True))}
        us = {k: v / len(chunks) for k, v in interleaved_us(fns, repeats, 1).items()}
        out.append({"rows": n, "us": us, "nucleus_width_median": float(widths.median()),
                    "nucleus_width_quartiles": [float(widths.quantile(q)) for q in (0.25, 0.75)]})
        print(f"nucleus sampling, {n:3d} rows per call: torch's ops {us['torch']:.0f} -> compiled {us['compiled']:.0f} us "
              f"({us['torch'] / us['compiled']:.2f}x); nucleus width median {float(widths.median()):.0f}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,8,32,1x17,8x17", help="forwards timed: ROWS or ROWSxNEW_TOKENS")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--positions", default="1,8,17,32,64,136,256,512", help="positions of the per-call timings")
    ap.add_argument("--attention", default="1x1,8x1,32x1,1x2,1x4,1x8,1x17,8x4",
                    help="cached attention per call: ROWSxNEW_TOKENS")
    ap.add_argument("--nucleus", default="1,8,64", help="nucleus sampling per call: rows")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit("the compiled kernels cannot be built here")
    policy = load_model("default", with_tokenizer=False).model
    results = []
    for name in args.dtypes.split(","):
        model = rollout_copy(policy, getattr(torch, name), "auto").model
        tokens = torch.randint(0, policy.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            hidden = {}
            for on in (False, True):
                use_native(model, model.lm_head.native, on)  # the ops only, not the products
                hidden[on] = model(tokens).hidden.float()
        diff = float((hidden[True] - hidden[False]).abs().max())
        for size in filter(None, args.rows.split(",")):
            rows, tokens = map(int, (size + "x1").split("x")[:2])
            t = {False: [], True: []}
            for _ in range(args.repeats):  # interleaved: drift hits both alike
                for on in (False, True):
                    use_native(model, model.lm_head.native, on)  # the ops only, not the products
                    t[on] += _step_seconds(model, rows=rows, context=192, reps=5, tokens=tokens)
            ms = {on: statistics.median(v) * 1e3 for on, v in t.items()}
            results.append({"dtype": name, "rows": rows, "tokens": tokens, "torch_ms": ms[False],
                            "compiled_ms": ms[True], "speedup": ms[False] / ms[True],
                            "products_compiled": model.lm_head.native, "max_hidden_diff": diff})
            print(f"{name} {rows:3d} rows x {tokens:2d} tokens: torch ops {ms[False]:.1f} ms, compiled {ms[True]:.1f} ms, "
                  f"{ms[False] / ms[True]:.3f}x (largest hidden-state difference {diff:.2e})", flush=True)
    calls = []
    for name in args.dtypes.split(","):
        for n in map(int, filter(None, args.positions.split(","))):
            us = per_call(getattr(torch, name), n)
            calls.append({"dtype": name, "positions": n, "us": us})
            print(f"{name} {n:4d} positions, per call: norm {us['norm_torch']:.1f} -> {us['norm_compiled']:.1f} us "
                  f"({us['norm_torch'] / us['norm_compiled']:.2f}x), RoPE {us['rope_torch']:.1f} -> "
                  f"{us['rope_compiled']:.1f} us ({us['rope_torch'] / us['rope_compiled']:.2f}x)", flush=True)
    attn = []
    for name in args.dtypes.split(","):
        for size in filter(None, args.attention.split(",")):
            rows, new = map(int, size.split("x"))
            us = attention_per_call(getattr(torch, name), rows, new)
            attn.append({"dtype": name, "rows": rows, "new_tokens": new, "us": us})
            print(f"{name} attention {rows:2d} rows x {new:2d} new tokens over 256 cached: SDPA {us['torch']:.1f} -> "
                  f"{us['compiled']:.1f} us ({us['torch'] / us['compiled']:.2f}x)", flush=True)
    nuc = nucleus_per_call(rollout_copy(policy, torch.bfloat16, "auto").model,
                           [int(n) for n in args.nucleus.split(",") if n], args.repeats) if args.nucleus else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_ops.json").write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                                     "results": results, "per_call": calls,
                                                     "attention_per_call": attn, "nucleus_per_call": nuc}, indent=2))


if __name__ == "__main__":
    main()
