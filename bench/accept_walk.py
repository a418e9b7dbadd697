"""The acceptance walk of a verified tree (`verify.accept_tree`) with its LM head computed level by level
(each level's walking rows) against `verify.PathLogits` (the drafter's best-ranked nodes below each asked
node in the same call, within --path-rows rows), and optionally against another git revision's walk (per-level
head), side by side in one process, on the trees the engine really verifies.

Default model (`--dtype`, bfloat16 by default) as sparkrl's rollout copy makes it (`--cpu-kernels auto`),
the shipped EAGLE3-style drafter, held-out GSM8K prompts, 16-node trees (depth 5, branch 4), T 1, top-p
0.95. For each row count the engine runs a few rounds (so the trees and caches are mid-rollout), then the
same tree, policy hidden states and uniforms go through every system in turn (LM head included, as the
engine calls it), --calls times each over --trees trees; medians per tree, summed over trees. Also the LM
head calls per walk. Walks from before the one-draw walk (which take max_children and a uniform per
(level, child) test) get uniforms in that layout; the two then commit tokens with the same distribution,
not the same tokens.

    .venv/bin/python bench/accept_walk.py --out bench/results
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import statistics
import subprocess
import time
import types
from pathlib import Path

import torch

from sparkrl import verify
from sparkrl.build import make_drafting
from sparkrl.config import DraftConfig, SamplingConfig
from sparkrl.data import build_prompts, held_out, load_problems
from sparkrl.precision import rollout_copy
from sparkrl.rollout import response_generators
from sparkrl.speculative import PATH_ROWS, NoAdaptation, Speculation
from sparkrl.weights import load_model


def module_at(rev: str, path: str = "sparkrl/verify.py") -> types.ModuleType:
    """`path` as it was at git revision `rev`, loaded as a module."""
    src = subprocess.check_output(["git", "show", f"{rev}:{path}"], text=True)
    mod = types.ModuleType(f"verify_{rev}")
    exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)
    return mod


class Counted:
    """A function that counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default=None, help="also this git revision's accept_tree, with its PathLogits "
                    "where it has one (else a per-level head)")
    ap.add_argument("--size", default="16,5", help="the trees' nodes,depth (the engine drafts its best nodes)")
    ap.add_argument("--path-rows", type=int, default=PATH_ROWS, help="verify.PathLogits' row limit")
    ap.add_argument("--rows", default="1,2,8,64")
    ap.add_argument("--trees", type=int, default=6, help="trees per row count (one engine round apart)")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    level, path = "per-level head", f"best-ranked nodes below ({args.path_rows} rows)"
    walks = {level: verify.accept_tree, path: verify.accept_tree}
    lazy = {path: verify.PathLogits}  # the walks that take a PathLogits of their own revision
    if args.against:
        old = module_at(args.against)
        walks[args.against] = old.accept_tree
        if hasattr(old, "PathLogits"):
            lazy[args.against] = old.PathLogits
    nodes, depth = map(int, args.size.split(","))
    per_child = {k: "max_children" in inspect.signature(w).parameters for k, w in walks.items()}
    dcfg = DraftConfig(draft="eagle3", draft_checkpoint="default", tree_depth=5, tree_branch=4, tree_nodes=16,
                       tree_stop=0.0, budget="fixed")  # every level, as the walks were measured
    lm = load_model("default", dtype=args.dtype)
    policy = rollout_copy(lm.model, getattr(torch, args.dtype), "auto").model
    drafter = make_drafting(dcfg, policy, policy, 1.0).rollout.model.bind(policy)
    shape, sc = dcfg.shape(), SamplingConfig(1.0, 0.95, 256)
    drafted = dataclasses.replace(shape, depth=depth)
    problems = [p for p in load_problems(args.data).problems if held_out(p, 0.05)]
    prompts = build_prompts(lm.tokenizer, problems[:64], 512, "skip").prompt_ids
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for B in map(int, args.rows.split(",")):
            eng = Speculation(policy, drafter, sc, shape, response_generators(0, B, 1), NoAdaptation())
            eng.start(prompts[:B], 1, ())
            for _ in range(4):  # mid-rollout trees and caches
                eng.speculative_round(nodes, depth)
            total = {k: 0.0 for k in walks}
            heads = {k: 0 for k in walks}
            levels = []
            for _ in range(args.trees):
                u = torch.rand(B, (shape.depth + 1) * (shape.max_children + 1), generator=g, dtype=torch.float64)
                prop = drafter.propose(eng.dcache, eng.state, drafted, nodes, 1.0, None)
                tree = prop.tree
                eng.dcache.commit(n_keep=torch.zeros(B, dtype=torch.long))
                out = policy(tree.tokens, eng.pcache, tree_mask=tree.ancestor_mask(), depth=tree.depth, taps=eng.taps)
                eng.pcache.commit(n_keep=torch.zeros(B, dtype=torch.long))
                r = torch.arange(B)
                # walks since the row-compacting one call head(rows, nodes); older ones head(nodes) for every row
                plain = lambda a, b=None: policy.logits(out.hidden[r, a] if b is None else out.hidden[a, b])
                layouts = {k: (u, depth, shape.max_children) if per_child[k] else (u[:, :depth + 1], depth) for k in walks}
                times, calls = {k: [] for k in walks}, {}
                for i in range(args.calls + 1):
                    for name in (list(walks) if i % 2 else list(walks)[::-1]):
                        counted = Counted(policy.logits if name in lazy else plain)
                        h = lazy[name](counted, out.hidden, tree, args.path_rows) if name in lazy else counted
                        t = time.perf_counter()
                        acc = walks[name](tree, h, 1.0, 0.95, *layouts[name])
                        if i:  # the first call of each warms up
                            times[name].append(time.perf_counter() - t)
                        calls[name] = counted.calls
                levels.append(float(acc.n_accepted.double().mean()) + 1)
                for k in walks:
                    total[k] += statistics.median(times[k]) * 1e3
                    heads[k] += calls[k]
                eng.speculative_round(nodes, depth)  # the next tree from one round further
            ratio = total[level] / total[path]
            rows.append({"rows": B, "ms_per_walk": {k: v / args.trees for k, v in total.items()},
                         "head_calls_per_walk": {k: v / args.trees for k, v in heads.items()},
                         "levels_walked": statistics.mean(levels), "speedup": ratio})
            print(f"{B:3d} rows: " + "; ".join(f"{k} {total[k] / args.trees:.2f} ms, {heads[k] / args.trees:.2f} head calls"
                                              for k in walks) + f"; levels walked per row {statistics.mean(levels):.2f}",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "accept_walk" + ("" if args.dtype == "bfloat16" else f"_{args.dtype}") + \
        ("" if args.size == "16,5" else f"_{nodes}_{depth}") + ".json"
    (out / name).write_text(json.dumps({"against": args.against, "size": [nodes, depth], "dtype": args.dtype,
                                        "path_rows": args.path_rows,
                                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                                        "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
