"""Round costs of the rollout methods at the paper's model sizes, for a GPU (and a CPU smoke run).

No network and at most 64 MiB of files reach a lent GPU machine, so real checkpoints cannot: this script builds
the architectures with RANDOM weights (sizes in `SIZES`) and times what does not depend on the weights, with the
engine's own rounds (`speculative.time_rounds`, the budget's cost-model timing: drafting, the drafter's
catch-up, the verification forward, the acceptance walk, the commits, every host sync the engine makes):
  * an autoregressive step (AR),
  * an EAGLE3-style tree round (depth 5, 16 nodes), sampled EAGLE3-style chains of 3, 4 and 5 tokens, and a
    DFlash-style block round (16 tokens),
  * SPARK's per-round work (the correction of every drafted context and the feedback update) at a store of the
    size a late rollout holds (`spark_seconds`).
With random weights no draft is accepted, so each round's cost is that of a round accepting nothing; the
predicted generation speedup uses the acceptance length (AAL) measured on the CPU with the default policy and
its shipped drafters (`bench/cpu_aal.py`): speedup = AAL x t(AR step) / t(round) (+ SPARK's time and AAL for the
+spark rows), assuming that AAL carries over to these sizes.

    python bench/gpu_costs.py --out $OUT/gpu_costs.json                      # Qwen2.5 1.5B/3B/7B, 8/32/64 rows
    python bench/gpu_costs.py --smoke --out /tmp/gpu_costs.json              # tiny shape on the CPU (CI)
Writes the JSON and a PNG beside it (round costs relative to the AR step; predicted speedups).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from sparkrl.config import TreeShape
from sparkrl.drafters.dflash import DFlashDrafter
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.engine.spark import Spark, init_projection
from sparkrl.engine.speculative import own_text, time_rounds
from sparkrl.model.transformer import ModelArgs, Transformer

SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab (the Hugging Face configs of these models)
    "tiny": (64, 128, 2, 4, 2, 512),
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064),
}
METHODS = {  # name -> (drafter kind, what it proposes); the names of bench/cpu_aal.py's AALs
    "tree": ("eagle3", TreeShape(5, 4, 16)),
    "chain3": ("eagle3", TreeShape.chain(3)),
    "chain4": ("eagle3", TreeShape.chain(4)),
    "chain5": ("eagle3", TreeShape.chain(5)),
    "block": ("dflash", TreeShape.block(15)),
}
CPU_AAL = Path(__file__).parent / "results" / "avx512_bf16" / "cpu_aal.json"


def make(name: str, device, dtype) -> Transformer:
    d, ff, L, H, Hkv, V = SIZES[name]
    args = ModelArgs("qwen2", V, d, ff, L, H, Hkv, d // H, qkv_bias=True, rope_theta=1e6)
    with torch.device(device):
        m = Transformer(args)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return m.to(dtype).eval().requires_grad_(False)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def spark_seconds(policy: Transformer, B: int, reps: int) -> float:
    """One round of SPARK's work for B responses in groups of 8: five levels of corrections (a depth-5 tree's
    root and expansions) and the feedback update of 4 contexts per response, with 2,000 tracked rows per group
    (what a group's store held late in a 160-token rollout here)."""
    device, d, V = policy.lm_head.weight.device, policy.args.hidden_size, policy.args.vocab_size
    groups = max(B // 8, 1)
    spark = Spark(init_projection(policy.lm_head.weight.float(), 8), V)
    spark.begin(groups, max(B // groups, 1))
    g = torch.Generator(device=device).manual_seed(0)
    keys = (
        torch.arange(groups, device=device)[:, None] * V
        + torch.randint(0, V, (groups, 2000), device=device, generator=g)
    ).flatten()
    spark.store.add(keys, torch.randn(keys.numel(), 8, device=device, generator=g) * 0.01)
    n = 4 * B
    fb = (
        torch.arange(n, device=device) % B,
        torch.randn(n, d, device=device, generator=g),
        torch.randn(n, V, device=device, generator=g),
        torch.softmax(torch.randn(n, V, device=device, generator=g) * 3, -1),
        torch.ones(n, device=device),
    )
    z, h = torch.randn(B, 4, V, device=device, generator=g), torch.randn(B, 4, d, device=device, generator=g)
    active = torch.arange(B, device=device)
    times = []
    for _ in range(reps + 1):
        sync(device)
        t = time.perf_counter()
        spark.select(active)
        for _ in range(5):
            spark.correct(z, h)
        spark.feedback(*fb)
        spark._pending = []  # the store keeps its size across repeats
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def measure(name: str, batches: list[int], context: int, device, dtype, reps: int) -> list[dict]:
    """Median seconds of each method's round (and the AR step, timed beside every method) per row count."""
    policy = make(name, device, dtype)
    drafters = {"eagle3": Eagle3Drafter(policy.args), "dflash": DFlashDrafter(policy.args, block_size=16)}
    rows = {B: {"model": name, "rows": B, "context": context, "seconds": {}} for B in batches}
    text = own_text(policy, context)  # one text for every method's rounds
    for method, (kind, shape) in METHODS.items():
        drafter = drafters[kind].to(device=device, dtype=dtype).requires_grad_(False)
        size = (shape.nodes, shape.depth)
        got = time_rounds(policy, drafter, shape, batches, [(0, 0), size], context, reps, text=text).rounds
        for i, B in enumerate(batches):
            s = rows[B]["seconds"]
            s.setdefault("ar_step", []).extend(t for t, _ in got[(0, 0)][i])
            s[method] = statistics.median(t for t, _ in got[size][i])
        sync(device)
    for B, r in rows.items():
        r["seconds"]["ar_step"] = statistics.median(r["seconds"]["ar_step"])
        r["seconds"]["spark"] = spark_seconds(policy, B, reps)
        print(json.dumps(r), flush=True)
    return list(rows.values())


def predict(rows: list[dict], aal: dict) -> None:
    """Each row's predicted generation speedup per method (and +spark) from the CPU's AALs."""
    for r in rows:
        s, out = r["seconds"], {}
        for method in METHODS:
            for spark in (False, True):
                key = method + ("+spark" if spark else "")
                if key in aal:
                    out[key] = aal[key] * s["ar_step"] / (s[method] + (s["spark"] if spark else 0.0))
        r["predicted_gen_speedup"] = out
        r["relative_to_ar"] = {k: v / s["ar_step"] for k, v in s.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['model']}\n{r['rows']} rows" for r in rows]
    keys = [*METHODS, "spark"]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)) * 2, 4.5))
    width = 0.8 / len(keys)
    for j, k in enumerate(keys):
        axes[0].bar([i + j * width for i in range(len(rows))], [r["relative_to_ar"][k] for r in rows], width, label=k)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_ylabel("round cost / AR step")
    axes[0].set_title(f"round costs, {result['meta']['device']} ({result['meta']['dtype']}, random weights)")
    pred = sorted({k for r in rows for k in r["predicted_gen_speedup"]})
    width = 0.8 / max(len(pred), 1)
    for j, k in enumerate(pred):
        axes[1].bar(
            [i + j * width for i in range(len(rows))],
            [r["predicted_gen_speedup"].get(k, 0) for r in rows],
            width,
            label=k,
        )
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_ylabel("predicted Gen. speedup over AR")
    axes[1].set_title("at the AAL measured on the CPU (bench/cpu_aal.py)")
    for ax in axes:
        ax.set_xticks([i + 0.4 for i in range(len(rows))], labels, fontsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b")
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache (prompt + response so far)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds of each method per row count")
    ap.add_argument("--aal", default=str(CPU_AAL), help="bench/cpu_aal.py's JSON: the AAL of each method on the CPU")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape at 2 rows, 2 repeats, 64 tokens of context")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.batches, args.reps, args.context = "tiny", "2", 2, 64
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    aal = json.loads(Path(args.aal).read_text())["aal"] if Path(args.aal).exists() else {}
    rows = []
    t0 = time.perf_counter()
    for name in args.sizes.split(","):
        rows += measure(name, [int(b) for b in args.batches.split(",")], args.context, device, dtype, args.reps)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    predict(rows, aal)
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "weights": "random (timing only)",
        "aal": aal,
        "aal_source": args.aal,
        "command": " ".join(sys.argv),
        "wall_s": time.perf_counter() - t0,
    }
    result = {"meta": meta, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"gpu_costs: {out}, {out.with_suffix('.png')} ({meta['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
