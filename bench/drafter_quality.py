"""Held-out acceptance of drafters (issue 12): AAL and acceptance per depth of EAGLE3-style trees,
DFlash-style blocks and the policy drafting for itself (the ceiling), on problems held out of draft
pretraining (`data.held_out`, the same hash split `pretrain-draft` uses), and held-out AAL against
pretraining tokens from a run's snapshots.

Every system drafts on every round (`--budget fixed`): AAL measures the drafter, not the budget.
Temperature 1, top-p 0.95, rollout dtype bfloat16 (as the rollouts run on this CPU), same prompts and
per-response seeds for every system.

    .venv/bin/python bench/drafter_quality.py --data ../shared/data/gsm8k/train.jsonl,../shared/data/math/train.jsonl \
        --out bench/results/drafter_quality
    .venv/bin/python bench/drafter_quality.py --data ../shared/data/gsm8k/train.jsonl --snapshots runs/ship \
        --prompts 4 --group 4 --out bench/results/drafter_quality
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from sparkrl.config import DraftConfig, SamplingConfig
from sparkrl.drafters.selfdraft import SelfDrafter
from sparkrl.engine.autoregressive import response_generators
from sparkrl.engine.speculative import generate_speculative
from sparkrl.model.weights import load_model
from sparkrl.train.data import build_prompts, held_out, load_problems
from sparkrl.train.drafting import make_drafter


def held_out_prompts(lm, spec: str, fraction: float, n: int) -> list[list[int]]:
    problems = [p for p in load_problems(spec).problems if held_out(p, fraction)]
    return build_prompts(lm.tokenizer, problems[:n], 512, "skip").prompt_ids


def measure(lm, drafter, shape, prompts, group: int, sampling: SamplingConfig) -> dict:
    r = generate_speculative(
        lm.model, drafter, prompts, sampling, lm.eos_ids, response_generators(0, len(prompts), group), shape, group
    )
    return {
        "aal": r.stats.aal,
        "accept_at_depth": r.stats.accept_at_depth,
        "rounds": r.stats.rounds,
        "tokens": r.num_tokens,
        "gen_s": r.gen_s,
        "tok_per_s": r.num_tokens / r.gen_s,
    }


def systems(lm, args) -> dict:
    """name -> (drafter, proposal shape) for the drafters to compare."""
    eagle = DraftConfig(
        draft="eagle3",
        draft_checkpoint=args.eagle3,
        tree_depth=5,
        tree_branch=4,
        tree_nodes=16,
        tree_stop=0.0,
        budget="fixed",
    )  # every level of the 16-node trees: the measure of a drafter
    dflash = DraftConfig(draft="dflash", draft_checkpoint=args.dflash, block_size=args.block_size, budget="fixed")
    make = {
        "eagle3": lambda: (make_drafter(eagle, lm.model), eagle.shape()),
        "dflash": lambda: (make_drafter(dflash, lm.model), dflash.shape()),
        "self (ceiling)": lambda: (SelfDrafter(lm.model), eagle.shape()),
    }
    return {name: m() for name, m in make.items() if name.split()[0] in args.systems.split(",")}


def snapshots_curve(lm, args, sampling) -> dict:
    """Held-out AAL of every --every-th snapshot of a `pretrain-draft` run, per kind."""
    run = Path(args.snapshots)
    meta = json.loads((run / "config.json").read_text())
    prompts = held_out_prompts(lm, args.data.split(",")[0], args.holdout, args.prompts)
    steps_tokens = {}
    for line in (run / "pretrain.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("heldout"):
            steps_tokens[r["step"]] = r["tokens"]
    out = {}
    for kind in meta["config"]["draft"].split(","):
        every = sorted((run / kind / "snapshots").glob("step-*.safetensors"))
        files = every[:: args.every] + ([every[-1]] if every and (len(every) - 1) % args.every else [])
        cfg = lambda f: DraftConfig(
            draft=kind,
            draft_checkpoint=str(f),
            tree_depth=5,
            tree_branch=4,
            tree_nodes=16,
            tree_stop=0.0,
            block_size=args.block_size,
            budget="fixed",
        )
        out[kind] = []
        for f in files:
            step = int(re.search(r"step-(\d+)", f.name).group(1))
            c = cfg(f)
            m = measure(lm, make_drafter(c, lm.model), c.shape(), prompts, args.group, sampling)
            out[kind].append({"step": step, **m, "pretrain_tokens": steps_tokens.get(step)})
            print(f"{kind} step {step} ({steps_tokens.get(step, 0) / 1e6:.2f}M tokens): AAL {m['aal']:.2f}", flush=True)
    return out


def plot_curve(curve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for kind, rows in curve.items():
        ax.plot([r["pretrain_tokens"] / 1e6 for r in rows], [r["aal"] for r in rows], marker="o", label=kind)
    ax.set(
        xlabel="pretraining tokens (millions)",
        ylabel="held-out AAL (generation)",
        title="Held-out AAL against draft pretraining tokens",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl,../shared/data/math/train.jsonl")
    ap.add_argument("--eagle3", default="default", help="EAGLE3-style checkpoint (default: the shipped one)")
    ap.add_argument("--dflash", default="default", help="DFlash-style checkpoint (default: the shipped one)")
    ap.add_argument("--systems", default="eagle3,dflash,self", help="which of eagle3, dflash, self to compare")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--holdout", type=float, default=0.05, help="the held-out share pretraining used")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--snapshots", default="", help="a pretrain-draft run: held-out AAL of its snapshots instead")
    ap.add_argument("--every", type=int, default=1, help="with --snapshots: every k-th snapshot (and the last)")
    ap.add_argument("--out", default="bench/results/drafter_quality")
    args = ap.parse_args()
    torch.manual_seed(0)
    lm = load_model("default", dtype=args.dtype)
    sampling = SamplingConfig(1.0, 0.95, args.max_new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.snapshots:
        curve = snapshots_curve(lm, args, sampling)
        (out / "aal_vs_tokens.json").write_text(json.dumps(curve, indent=2))
        plot_curve(curve, out / "aal_vs_tokens.png")
        return
    result = {"meta": vars(args), "datasets": {}}
    compared = systems(lm, args)
    for spec in args.data.split(","):
        prompts = held_out_prompts(lm, spec, args.holdout, args.prompts)
        rows = {}
        for name, (drafter, shape) in compared.items():
            rows[name] = measure(lm, drafter, shape, prompts, args.group, sampling)
            print(
                f"{Path(spec).parent.name or spec} {name}: AAL {rows[name]['aal']:.2f}, acceptance per depth "
                f"{' '.join(f'{a:.2f}' for a in rows[name]['accept_at_depth'][:5])}",
                flush=True,
            )
        result["datasets"][spec] = rows
    (out / "drafter_quality.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
