"""The rollout step against this machine's limits: a measured roofline.

Measures the machine's ceilings (the read bandwidth of a 1 GiB tensor, a stream triad, and the best GFLOP/s of
the products the step can use: sparkrl's compiled product and torch's, at the default model's 1536x576 shape),
then times the default policy's autoregressive decode step (`decode_one_token`: the forward, the KV-cache
commit, the nucleus and the token, as a rollout runs it) at 1, 8 and 64 responses and 128- and 1,024-token
contexts, in the rollout dtype and kernels the default picks. Each step's time is split by a profile into the
products, attention, norms and RoPE, sampling and the rest (the unprofiled step time less the kernels' own
times: dispatch, small ops, Python), and set beside its floor: the weights' and the KV cache's bytes at the
read bandwidth, or the FLOPs at the ceiling, whichever is longer. Writes roofline.json and roofline.png into
--out; nothing else may run while it measures.

    .venv/bin/python bench/roofline.py --out bench/results/roofline
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from decode_child import context_ids, time_steps

from sparkrl.commands.bench import machine as recorded_machine
from sparkrl.config import DraftConfig
from sparkrl.cpu import native
from sparkrl.model.weights import load_model
from sparkrl.train.generation import RolloutPlan, build_generation

GiB = 1 << 30
PARTS = {  # profiler op name -> part of the step (every other op's time is in "rest")
    "products": ("sparkrl_native::small_linear", "sparkrl_native::pairs_linear", "sparkrl_native::int8_linear",
                 "aten::addmm", "aten::mm",
                 "aten::bmm", "mkldnn::_linear_pointwise"),
    "attention": ("sparkrl_native::attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_attention_math"),
    "norms and RoPE": ("sparkrl_native::rms_norm", "sparkrl_native::rope"),
    "sampling": ("sparkrl_native::nucleus", "aten::sort", "aten::topk", "aten::cumsum", "aten::softmax",
                 "aten::_softmax", "aten::log_softmax", "aten::_log_softmax"),
}  # fmt: skip


def best(fn, repeats: int = 7) -> float:
    """The shortest of `repeats` timings of fn() after one untimed call (seconds)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bandwidth() -> dict:
    """GB/s: a read of a 1 GiB float32 tensor (its sum), and a triad a = b + 2c over 3 x 256 MiB."""
    x = torch.rand(GiB // 4)
    read = GiB / best(x.sum) / 1e9
    del x
    n = 256 * (1 << 20) // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    triad = 3 * n * 4 / best(lambda: torch.add(b, c, alpha=2.0, out=a)) / 1e9
    return {"read_GBps": read, "triad_GBps": triad}


def products(rows=(1, 8, 64, 256, 1088), n: int = 1536, k: int = 576) -> dict:
    """GFLOP/s of y = x W^T for W (n, k), per product and row count: sparkrl's compiled product (bfloat16, on
    pairs where this CPU has AVX512-BF16; float32) and torch's F.linear in both dtypes."""
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(n, k).to(dtype)
        pairs = native.pack_pairs(w) if dtype == torch.bfloat16 else None
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            flops = 2 * m * n * k
            tag = str(dtype).removeprefix("torch.")
            if native.available():
                out[f"sparkrl {tag}, {m} rows"] = flops / best(lambda: native.linear(x, w, None, pairs)) / 1e9
            out[f"torch {tag}, {m} rows"] = flops / best(lambda: torch.nn.functional.linear(x, w)) / 1e9
    return out


def decode_steps(model, sampler, prompts, G: int, steps: int, profile: bool):
    """Decode `steps` tokens after the prompts (each copied to G responses); (seconds per step, the profile's
    kernel seconds per step by part, or None)."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    per_step, _ = time_steps(model, sampler, prompts, G, steps, around=prof)
    if prof is None:
        return per_step, None
    parts = {name: 0.0 for name in PARTS}
    for e in prof.key_averages():
        for name, ops in PARTS.items():
            if e.key in ops:
                parts[name] += e.self_cpu_time_total / 1e6 / steps
    return per_step, parts


def floor(args, params: int, weight_bytes: int, kv_elem: int, B: int, ctx: int, bw: float, ceiling: float) -> dict:
    """The step's floor: its bytes (the weights once, each row's keys and values) at the read bandwidth, or its
    FLOPs (each weight's multiply-add per row, attention's over the context) at the products' ceiling."""
    kv = args.num_layers * B * ctx * 2 * args.num_kv_heads * args.head_dim * kv_elem
    flops = 2 * params * B + 4 * args.num_layers * B * ctx * args.num_heads * args.head_dim
    return {"weight_bytes": weight_bytes, "kv_bytes": kv, "flops": flops, "bytes_s": (weight_bytes + kv) / bw,
            "flops_s": flops / ceiling, "floor_s": max((weight_bytes + kv) / bw, flops / ceiling)}  # fmt: skip


def machine() -> dict:
    """What `sparkrl bench` records of the machine (commit, versions, threads), the processor's name and the vector
    extensions the kernels' paths depend on, and the load before the run."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    name = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")), "?")
    return recorded_machine() | {"cpu": name, "avx512_bf16": "avx512_bf16" in flags,
                                 "avx512_vnni": "avx512_vnni" in flags, "load_before": os.getloadavg()}  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    """One panel per context: each setting's step split in ms, stacked, and its floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4.2), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        mine = [r for r in rows if r["context"] == ctx]
        labels = [str(r["responses"]) for r in mine]
        bottom = [0.0] * len(mine)
        for part in [*PARTS, "rest"]:
            vals = [r["split_ms"][part] for r in mine]
            ax.bar(labels, vals, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        floors = [r["floor"]["floor_s"] * 1e3 for r in mine]
        ax.scatter(labels, floors, color="k", marker="_", s=1500, linewidths=2, label="floor", zorder=3)
        ax.set_xlabel("responses")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"{ctx}-token context")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        "default policy decode step: time split and its floor (bytes at the read bandwidth or FLOPs at the ceiling)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/roofline")
    ap.add_argument("--responses", default="1,8,64")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per setting (after 2 untimed)")
    ap.add_argument("--dtype", default="auto", help="the rollout dtype (--rollout-dtype; auto: train's pick)")
    a = ap.parse_args()
    info = machine()
    limits = bandwidth()
    gflops = products()
    ceiling = max(gflops.values()) * 1e9
    print(json.dumps(limits), f"ceiling {ceiling / 1e9:.0f} GFLOP/s", flush=True)
    lm, dc = load_model("default"), DraftConfig(draft="none")
    gen = build_generation(RolloutPlan.settle(lm.model, a.dtype, "auto", dc), dc, lm.model, 1.0, trains=False)
    model, sampler = gen.policy.model, gen.policy.sampler
    read = [p for n, p in model.named_parameters() if "embed" not in n]  # a step reads one row of the embedding
    if model.args.tie_word_embeddings:
        read.append(model.lm_head.weight)  # and all of it as the head
    params, weight_bytes = sum(p.numel() for p in read), sum(p.numel() * p.element_size() for p in read)
    kv_elem = model.new_cache(1, 1).kv.element_size()
    rows = []
    with torch.no_grad():
        for ctx in map(int, a.contexts.split(",")):
            for B in map(int, a.responses.split(",")):
                P = max(1, B // 8)
                prompts = context_ids(lm.tokenizer, P, ctx)
                wall, _ = decode_steps(model, sampler, prompts, B // P, a.steps, profile=False)
                _, parts = decode_steps(model, sampler, prompts, B // P, a.steps, profile=True)
                split = {k: v * 1e3 for k, v in parts.items()} | {"rest": (wall - sum(parts.values())) * 1e3}
                f = floor(model.args, params, weight_bytes, kv_elem, B, ctx, limits["read_GBps"] * 1e9, ceiling)
                row = {"responses": B, "context": ctx, "step_ms": wall * 1e3, "tok_per_s": B / wall,
                       "split_ms": split, "floor": f, "of_floor": f["floor_s"] / wall,
                       "floor_tok_per_s": B / f["floor_s"]}  # fmt: skip
                rows.append(row)
                shares = ", ".join(f"{k} {v / (wall * 1e3):.0%}" for k, v in split.items())
                head = f"{B:3d} x {ctx:5d}: {wall * 1e3:7.2f} ms/step, {B / wall:7.1f} tok/s"
                print(
                    f"{head}, {row['of_floor']:.0%} of its floor ({B / f['floor_s']:.0f} tok/s); {shares}", flush=True
                )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info["load_after"] = os.getloadavg()
    info["dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    info["kernels"] = gen.plan.record()
    result = {"command": "python bench/roofline.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
              "machine": info, "limits": limits | {"ceiling_GFLOPs": ceiling / 1e9}, "products_GFLOPs": gflops,
              "steps": rows}  # fmt: skip
    (out / "roofline.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "roofline.png")
    print(f"wrote {out / 'roofline.json'} and roofline.png; median share of floor "
          f"{statistics.median(r['of_floor'] for r in rows):.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
