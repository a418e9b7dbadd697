"""The acceptance walk of a verified tree (`verify.accept_tree`): this tree's version against another
git revision's, side by side in one process, on the trees the engine really verifies.

Default model (`--dtype`, bfloat16 by default; kernels as `--cpu-kernels auto` picks), the shipped EAGLE3-style drafter,
held-out GSM8K prompts, 16-node trees (depth 5, branch 4), T 1, top-p 0.95. For each row count the
engine runs a few rounds (so the trees and caches are mid-rollout), then the same tree, policy
hidden states and uniforms go through both walks in turn (LM head included, as the engine calls it),
20 times each; medians. Walks from before the one-draw walk (which take max_children and a uniform
per (level, child) test) get uniforms in that layout; the two then commit tokens with the same
distribution, not the same tokens.

    .venv/bin/python bench/accept_walk.py --against 06ba004 --out bench/results
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import time
import types
from pathlib import Path

import torch

from sparkrl import verify
from sparkrl.build import make_drafter
from sparkrl.config import DraftConfig, SamplingConfig
from sparkrl.data import build_prompts, held_out, load_problems
from sparkrl.kernels import pack
from sparkrl.precision import use_packed, use_weight_major, weight_major_pays
from sparkrl.rollout import response_generators
from sparkrl.speculative import NoAdaptation, Speculation
from sparkrl.weights import load_model


def module_at(rev: str, path: str = "sparkrl/verify.py") -> types.ModuleType:
    """`path` as it was at git revision `rev`, loaded as a module."""
    src = subprocess.check_output(["git", "show", f"{rev}:{path}"], text=True)
    mod = types.ModuleType(f"verify_{rev}")
    exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="git revision whose accept_tree to compare with")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    walks = {"this tree": verify.accept_tree, args.against: module_at(args.against).accept_tree}
    per_child = {k: "max_children" in inspect.signature(w).parameters for k, w in walks.items()}
    dcfg = DraftConfig(draft="eagle3", draft_checkpoint="default", tree_depth=5, tree_branch=4, tree_nodes=16,
                       budget="fixed")
    lm = load_model("default", dtype=args.dtype)
    policy = pack(lm.model, use_packed("auto", getattr(torch, args.dtype), lm.model))
    use_weight_major(policy, weight_major_pays(policy))
    drafter = pack(make_drafter(dcfg, policy), policy.lm_head.packed)
    drafter = use_weight_major(drafter, policy.lm_head.weight_major).bind(policy)
    shape, sc = dcfg.shape(), SamplingConfig(1.0, 0.95, 256)
    problems = [p for p in load_problems(args.data).problems if held_out(p, 0.05)]
    prompts = build_prompts(lm.tokenizer, problems[:64], 512, "skip").prompt_ids
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for B in map(int, args.rows.split(",")):
            eng = Speculation(policy, drafter, sc, shape, response_generators(0, B, 1), NoAdaptation())
            eng.start(prompts[:B], 1, ())
            for _ in range(8):  # mid-rollout trees and caches
                eng.speculative_round(shape.nodes)
            u = torch.rand(B, (shape.depth + 1) * (shape.max_children + 1), generator=g, dtype=torch.float64)
            prop = drafter.propose(eng.dcache, eng.state, shape, shape.nodes, 1.0, None)
            tree = prop.tree
            eng.dcache.commit(n_keep=torch.zeros(B, dtype=torch.long))
            out = policy(tree.tokens, eng.pcache, tree_mask=tree.ancestor_mask(), depth=tree.depth, taps=eng.taps)
            eng.pcache.commit(n_keep=torch.zeros(B, dtype=torch.long))
            r = torch.arange(B)
            # walks since the row-compacting one call head(rows, nodes); older ones head(nodes) for every row
            head = lambda a, b=None: policy.logits(out.hidden[r, a] if b is None else out.hidden[a, b])
            layouts = {k: (u, shape.depth, shape.max_children) if per_child[k] else (u[:, :shape.depth + 1], shape.depth)
                       for k in walks}
            times = {k: [] for k in walks}
            levels = {}
            for i in range(args.calls + 1):
                for name in (list(walks) if i % 2 else list(walks)[::-1]):
                    t = time.perf_counter()
                    acc = walks[name](tree, head, 1.0, 0.95, *layouts[name])
                    if i:  # the first call of each warms up
                        times[name].append(time.perf_counter() - t)
                    levels[name] = float(acc.n_accepted.double().mean()) + 1
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            ratio = med[args.against] / med["this tree"]
            rows.append({"rows": B, "ms": med, "levels_walked": levels, "speedup": ratio, "times_s": times})
            print(f"{B:3d} rows: this tree {med['this tree']:6.2f} ms, {args.against} {med[args.against]:6.2f} ms "
                  f"({ratio:.2f}x), levels walked per row {levels['this tree']:.2f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "accept_walk.json" if args.dtype == "bfloat16" else f"accept_walk_{args.dtype}.json"
    (out / name).write_text(json.dumps({"against": args.against, "dtype": args.dtype, "torch": torch.__version__,
                                                      "threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
