"""Our batched sampler vs transformers' `generate`, side by side in one process.

Same model (the embedded default, in --dtype: float32 or bfloat16), same prompt, temperature 1, top-p 0.95, exactly
--new-tokens tokens per response (EOS ignored on both sides, so both do the same work), batch sizes
1, 8 and 32. The two systems alternate within every repeat so machine drift hits both alike; we
report the median time of each and the ratio of generated tokens/s. sparkrl runs as it does by
default (bfloat16 on prepacked weights where they pay here, `--cpu-kernels auto`; weight-major
products where those pay here); when either is on, the same sampler on plain `F.linear` weights runs
beside it ("sparkrl-plain"); where the compiled kernels are on (`sparkrl.cpu.native`: few-row products, norms,
RoPE), the same copy with them off, on torch's kernels, runs beside it too ("sparkrl-blas").

    .venv/bin/python bench/sampler_vs_hf.py --out bench/results
    .venv/bin/python bench/sampler_vs_hf.py --dtype bfloat16 --out bench/results
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from sparkrl.config import DraftConfig, SamplingConfig
from sparkrl.cpu.accelerate import use_native
from sparkrl.engine.autoregressive import generate, response_generators
from sparkrl.engine.sampling import SAMPLER
from sparkrl.model.weights import load_model
from sparkrl.train.data import chat_prompt_ids
from sparkrl.train.generation import RolloutPlan, build_generation

PROMPT = "Tom has 3 boxes with 12 apples each and eats 5 apples. How many are left? Solve it step by step."


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=("auto", "packed", "weight-major", "plain"),
        help="sparkrl's kernels, as its --cpu-kernels",
    )
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    lm = load_model("default", dtype=args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=getattr(torch, args.dtype)).eval()
    prompt = chat_prompt_ids(lm.tokenizer, PROMPT)
    sc = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=args.new_tokens)

    plain = copy.deepcopy(lm.model)  # F.linear everywhere, attention in the model's dtype: the eager reference
    plan = RolloutPlan.settle(lm.model, "model", args.cpu_kernels, DraftConfig())
    rollout = build_generation(plan, DraftConfig(), lm.model, sc.temperature, trains=False).policy  # as sparkrl runs it
    lm.model, k = rollout.model, rollout.kernels
    packed = k.packed
    fast = packed or k.weight_major or k.float32_attention
    native_on = bool(k.compiled)  # the compiled kernels

    def ours(B, model=lm.model, compiled=True):
        sampler = SAMPLER
        if model is lm.model:  # the plain reference has no weight-major products for it to serve
            use_native(model, native_on and compiled)
            sampler = rollout.sampler if native_on and compiled else SAMPLER
        r = generate(model, [prompt], sc, (), response_generators(0, 1, B), group_size=B, sampler=sampler)
        return r.num_tokens

    def theirs(B):
        x = torch.tensor([prompt] * B)
        with torch.no_grad():
            o = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=True,
                temperature=1.0,
                top_p=0.95,
                top_k=0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=lm.tokenizer.eos_token_id,
            )
        return (o.shape[1] - x.shape[1]) * B

    systems = {"sparkrl": ours, "transformers": theirs}
    if fast:  # the same sampler on plain weights (F.linear everywhere), side by side
        systems["sparkrl-plain"] = lambda B: ours(B, plain)
    if native_on:  # the same copy on torch's kernels (BLAS products, tensor-op norms and RoPE), side by side
        systems["sparkrl-blas"] = lambda B: ours(B, compiled=False)
    ours(1), theirs(1)  # warm-up
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        times = {k: [] for k in systems}
        tokens = {}
        for rep in range(args.repeats):
            order = list(systems) if rep % 2 == 0 else list(systems)[::-1]
            for name in order:
                t = time.perf_counter()
                tokens[name] = systems[name](B)
                times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        tps = {k: tokens[k] / med[k] for k in systems}
        row = {
            "batch": B,
            "tokens": tokens,
            "median_s": med,
            "times_s": times,
            "tok_per_s": tps,
            "ratio": tps["sparkrl"] / tps["transformers"],
        }
        if fast:
            row["fast_over_plain"] = tps["sparkrl"] / tps["sparkrl-plain"]
        if native_on:
            row["native_over_blas"] = tps["sparkrl"] / tps["sparkrl-blas"]
        rows.append(row)
        print(
            f"batch {B:3d}: sparkrl {tps['sparkrl']:7.1f} tok/s, transformers {tps['transformers']:7.1f} tok/s, "
            f"ratio {row['ratio']:.2f}x"
            + (f"; fast / plain kernels {row['fast_over_plain']:.2f}x" if fast else "")
            + (f"; compiled kernels / torch's {row['native_over_blas']:.2f}x" if native_on else ""),
            flush=True,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    meta = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "prompt_tokens": len(prompt),
        "dtype": args.dtype,
        "packed_weights": packed,
        "weight_major_kernels": k.weight_major,
        "float32_attention": k.float32_attention,
        "native_kernel": native_on,
        "compiled_ops": native_on,
    }
    name = "sampler_vs_hf" + ("" if args.dtype == "float32" else f"_{args.dtype}") + ("_packed" if packed else "")
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    _plot(rows, out / f"{name}.png", args.dtype)


def _plot(rows, path, dtype):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    names = [n for n in ("sparkrl", "sparkrl-plain", "transformers") if n in rows[0]["tok_per_s"]]
    w = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([x + (i - (len(names) - 1) / 2) * w for x in xs], [r["tok_per_s"][name] for r in rows], w, label=name)
    for x, r in zip(xs, rows):
        ax.text(x, max(r["tok_per_s"].values()) * 1.02, f"{r['ratio']:.2f}x", ha="center")
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    ax.set_ylim(0, max(max(r["tok_per_s"].values()) for r in rows) * 1.15)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Autoregressive sampling, default model, CPU, {dtype}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
