"""A decoder layer in one compiled call against the same layer run module by module, side by side in one process.

Times the default policy's autoregressive decode step (`decode_one_token`, as a rollout runs it; the same step
`bench/roofline.py` splits) with `CpuDecoderLayer`'s one call per layer (`native.decode_layer`, the default) and
with the layer's modules calling the same kernels one by one (`accelerate.FUSE_LAYERS = False`, what the default
ran before), at 1, 8 and 64 responses and 128- and 1,024-token contexts. The two alternate, setting by setting,
`--rounds` times; each figure is the median of its rounds, each ratio the median of the rounds' ratios. Both give
the same tokens (checked here on every round: the same uniforms must give the same token ids). Writes
fused_layers.json and fused_layers.png into --out; nothing else may run while it measures.

    .venv/bin/python bench/fused_layers.py --out bench/results/fused_layers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_child import context_ids, time_steps  # noqa: E402
from roofline import machine  # noqa: E402

from sparkrl.config import DraftConfig  # noqa: E402
from sparkrl.cpu import accelerate  # noqa: E402
from sparkrl.model.weights import load_model  # noqa: E402
from sparkrl.train.generation import RolloutPlan, build_generation  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/fused_layers")
    ap.add_argument("--responses", default="1,8,64")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per setting and round")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the two per setting")
    a = ap.parse_args()
    info = machine()
    lm, dc = load_model("default"), DraftConfig(draft="none")
    gen = build_generation(RolloutPlan.settle(lm.model, "auto", "auto", dc), dc, lm.model, 1.0, trains=False)
    model, sampler = gen.policy.model, gen.policy.sampler
    rows = []
    with torch.no_grad():
        for ctx in map(int, a.contexts.split(",")):
            for B in map(int, a.responses.split(",")):
                P = max(1, B // 8)
                prompts = context_ids(lm.tokenizer, P, ctx)
                times = {"one call": [], "modules": []}
                for _ in range(a.rounds):
                    toks = {}
                    for name, on in (("one call", True), ("modules", False)):
                        accelerate.FUSE_LAYERS = on
                        t, toks[name] = time_steps(model, sampler, prompts, B // P, a.steps)
                        times[name].append(t)
                    assert toks["one call"] == toks["modules"], "the two paths gave other tokens"
                accelerate.FUSE_LAYERS = True
                ratios = [m / o for o, m in zip(times["one call"], times["modules"])]
                med = {k: statistics.median(v) for k, v in times.items()}
                row = {"responses": B, "context": ctx, "step_ms": {k: v * 1e3 for k, v in med.items()},
                       "tok_per_s": {k: B / v for k, v in med.items()},
                       "speedup": statistics.median(ratios), "speedup_rounds": ratios}  # fmt: skip
                rows.append(row)
                print(f"{B:3d} x {ctx:5d}: one call {row['step_ms']['one call']:7.2f} ms, modules "
                      f"{row['step_ms']['modules']:7.2f} ms: {row['speedup']:.2f}x "
                      f"(rounds {min(ratios):.2f}-{max(ratios):.2f})", flush=True)  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info["load_after"] = os.getloadavg()
    info["dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    result = {"command": "python bench/fused_layers.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
              "machine": info, "rows": rows}  # fmt: skip
    (out / "fused_layers.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "fused_layers.png")
    print(f"wrote {out / 'fused_layers.json'} and fused_layers.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['responses']} x {r['context']}" for r in rows]
    x = range(len(rows))
    for i, name in enumerate(("modules", "one call")):
        ax.bar([j + 0.4 * i for j in x], [r["tok_per_s"][name] for r in rows], 0.4, label=name)
    for j, r in enumerate(rows):
        ax.text(j + 0.4, r["tok_per_s"]["one call"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([j + 0.2 for j in x], labels, fontsize=8)
    ax.set_xlabel("responses x context tokens")
    ax.set_ylabel("tokens/s (decode step)")
    ax.set_yscale("log")
    ax.set_title("A decoder layer in one compiled call against its modules")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
