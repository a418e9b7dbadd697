"""Speculative rollouts (EAGLE3-style trees or DFlash-style blocks) vs our autoregressive sampler.

Same policy (the embedded default), same prompts (GSM8K questions in the GRPO prompt format; with
--heldout, only those held out of draft pretraining), same per-response seeds, temperature 1, top-p
0.95. Batches of 1, 8 and 64 responses (1 prompt x 1, 1 prompt x 8, 8 prompts x 8). After one untimed
rollout of each (a process's first rollouts run cold), three systems alternate within each repeat
(autoregressive, the drafter's full proposal every round, and with the budget); tokens/s over all repeats
(responses end at their EOS, so systems and repeats generate different counts), and the rollouts' seconds
against AR's (`time_ratio`: a batch lasts as long as its longest response, so with several responses
tokens/s also counts how long the shorter ones happened to run); settings with fewer than --min-responses
responses run several prompt sets in turn. Optionally (--grpo-step) one GRPO step each way, to split its
time into generation, draft training and policy training.

    .venv/bin/python bench/spec_vs_ar.py --draft eagle3 --draft-checkpoint default --heldout 0.05 \
        --data ../shared/data/gsm8k/train.jsonl --dtype bfloat16 --out bench/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch
from default_rollouts import default_rollouts

from sparkrl.commands.bench import machine
from sparkrl.config import DraftConfig, RunConfig, SamplingConfig, build
from sparkrl.engine.autoregressive import generate, response_generators
from sparkrl.engine.budget import AR, Budget, CostModel
from sparkrl.engine.records import RoundStats
from sparkrl.engine.speculative import generate_speculative
from sparkrl.train.generation import RolloutPlan, build_generation


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="eagle3", help="eagle3, dflash or self-int8, or several, comma-separated: "
                    "each drafter side by side (the first one's also-* systems and --grpo-step)")  # fmt: skip
    ap.add_argument("--draft-checkpoint", default="default", help="default: the drafter shipped for the default model")
    ap.add_argument("--block-size", type=int, default=16, help="dflash: the block size")
    ap.add_argument(
        "--heldout",
        type=float,
        default=0.0,
        help="use only problems held out of draft pretraining (the share it held out, e.g. 0.05)",
    )
    ap.add_argument("--data", default="default")
    ap.add_argument("--batches", default="1x1,1x8,8x8", help="PROMPTSxGROUP per setting")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--min-responses",
        type=int,
        default=4,
        help="settings with fewer responses run several prompt sets one after another, to reach this",
    )
    ap.add_argument(
        "--fixed-upto",
        type=int,
        default=1 << 30,
        help="run the full-proposal-every-round system only up to this many responses",
    )
    ap.add_argument("--tree", default="5,4,16", help="depth,branch,nodes")
    ap.add_argument("--draft-mode", default="tree", choices=("tree", "chain"), help="as sparkrl's --draft-mode")
    ap.add_argument("--tree-stop", type=float, default=DraftConfig.tree_stop, help="as sparkrl's --tree-stop")
    ap.add_argument(
        "--also-stop",
        type=float,
        default=None,
        help="also the full proposal every round with this --tree-stop, interleaved with the others",
    )
    ap.add_argument("--skip", type=int, default=0, help="problems to skip (e.g. those used for pretraining)")
    ap.add_argument("--grpo-step", action="store_true")
    ap.add_argument("--budget", default="auto", choices=("auto", "adaptive"), help="the DRAFT+budget system's budget")
    ap.add_argument(
        "--also-full-depth",
        action="store_true",
        help="also the budget choosing among full-depth trees only (each node count at depth "
        "min(depth, nodes), as before trees of every depth), interleaved with the others",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the rollout dtype of every compared system (policy and drafter)",
    )
    ap.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=("auto", "packed", "plain"),
        help="linear layers of every compared system, as sparkrl's --cpu-kernels",
    )
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    depth, branch, nodes = map(int, args.tree.split(","))
    drafts = args.draft.split(",")
    dcfg = lambda draft: DraftConfig(
        draft=draft,
        draft_checkpoint="" if draft == "self-int8" else args.draft_checkpoint,
        tree_depth=depth,
        tree_branch=branch,
        tree_nodes=nodes,
        tree_stop=args.tree_stop,
        draft_mode=args.draft_mode,
        budget=args.budget,
        block_size=args.block_size,
    )
    lm, gen, prompts = default_rollouts(dcfg(drafts[0]), args.dtype, args.data, args.heldout, args.cpu_kernels,
                                        skip=args.skip)  # fmt: skip
    sampler = gen.policy.sampler
    engines = {drafts[0]: gen.engine}
    for draft in drafts[1:]:  # the same policy copy, another drafter and its own budget
        plan = RolloutPlan.settle(lm.model, "model", args.cpu_kernels, dcfg(draft))
        engines[draft] = build_generation(plan, dcfg(draft), lm.model, 1.0, trains=False).engine
    full_depth_budget = full_depth_only(gen.engine.budget, gen.engine.shape) if args.also_full_depth else None
    sc = SamplingConfig(1.0, 0.95, args.max_new_tokens)
    speculative = lambda engine, P, G, shape=None, **kw: lambda ps: generate_speculative(
        lm.model, engine.drafter, ps, sc, lm.eos_ids, response_generators(0, P, G), shape or engine.shape, G,
        sampler=sampler, **kw
    )  # fmt: skip
    rows = []
    for spec in args.batches.split(","):
        P, G = map(int, spec.split("x"))
        sets = -(-args.min_responses // (P * G))  # prompt sets run one after another, so that few responses
        # still average over several problems (their lengths and acceptance vary)
        spec = drafts[0]
        systems = {
            "autoregressive": lambda ps: generate(
                lm.model, ps, sc, lm.eos_ids, response_generators(0, P, G), G, sampler=sampler
            )
        }
        for draft, engine in engines.items():  # the full proposal every round, and with the budget
            systems[draft] = speculative(engine, P, G)
            systems[f"{draft}+budget"] = speculative(engine, P, G, budget=engine.budget)
        also = f"{spec} (tree stop {args.also_stop})"
        if args.also_stop is not None:
            systems[also] = speculative(gen.engine, P, G, dataclasses.replace(gen.engine.shape, stop=args.also_stop))
        full_only = f"{spec}+budget (full depth only)"
        if args.also_full_depth:
            systems[full_only] = speculative(gen.engine, P, G, budget=full_depth_budget)
        if P * G > args.fixed_upto:  # the full proposal every round is known to lose there; save the time
            for draft in drafts:
                del systems[draft]
        for name in systems:  # untimed, once each: the process's first rollouts run cold (measured: the first
            # of 12 interleaved one-response AR rollouts ran 12% below the rest), and in timed order the first
            # system would pay it
            systems[name](prompts[:P])
        times, tokens, stats = ({k: [] for k in systems} for _ in range(3))
        for rep in range(args.repeats):
            for name in list(systems) if rep % 2 == 0 else list(systems)[::-1]:
                outs = [systems[name](prompts[j * P : (j + 1) * P]) for j in range(sets)]
                times[name].append(sum(o.gen_s for o in outs))
                tokens[name].append(sum(o.num_tokens for o in outs))
                stats[name] += [o.stats for o in outs]
        # rates over all repeats: responses end at their EOS, so the token counts differ between systems
        # and (with a budget, whose estimates carry over) between repeats
        tps = {k: sum(tokens[k]) / sum(times[k]) for k in systems}
        figures = {draft: per_draft(stats, draft) for draft in drafts}
        row = {
            "prompts": P,
            "group": G,
            "responses": P * G,
            "prompt_sets": sets,
            "tokens": tokens,
            "times_s": times,
            "tok_per_s": tps,
            "ratio": {k: tps[k] / tps["autoregressive"] for k in systems if k != "autoregressive"},
            # the same prompt sets as often: a rollout of several responses lasts as long as its longest
            # (often the token cap), so its tokens/s also measures how long the shorter ones happened to run
            "time_ratio": {k: sum(times["autoregressive"]) / sum(times[k]) for k in systems if k != "autoregressive"},
            **figures[spec],  # the first drafter's, as the plot and older results read them
            "rounds": figures[spec]["budget_tree_rounds"][1],
            "drafts": figures,
        }
        if full_only in stats:
            sf = RoundStats.merge(stats[full_only], concurrent=False)
            row["full_depth_only"] = {"aal": sf.aal, "tree_rounds": [sf.tree_rounds, sf.rounds], "sizes": sf.sizes}
            print(
                f"{P}x{G}: {full_only} {tps[full_only]:.1f} tok/s ({row['ratio'][full_only]:.2f}x, "
                f"{sf.tree_rounds}/{sf.rounds} drafted rounds {sf.sizes}, AAL {sf.aal:.2f})",
                flush=True,
            )
        if also in stats:
            sa = RoundStats.merge(stats[also], concurrent=False)
            row["also"] = {
                "tree_stop": args.also_stop,
                "aal": sa.aal,
                "accept_at_depth": sa.accept_at_depth,
                "split_s": {k: getattr(sa, k) for k in ("draft_s", "verify_s", "accept_s")},
            }
            print(
                f"{P}x{G}: {also} {tps[also]:.1f} tok/s ({row['ratio'][also]:.2f}x, AAL {sa.aal:.2f}), "
                f"split {row['also']['split_s']}",
                flush=True,
            )
        rows.append(row)
        for draft, f in row["drafts"].items():
            fixed = (
                f"{draft} {tps[draft]:.1f} tok/s ({row['ratio'][draft]:.2f}x, AAL {f['aal']:.2f}), " if f["aal"] else ""
            )
            b = f"{draft}+budget"
            print(
                f"{P}x{G}: AR {tps['autoregressive']:.1f} tok/s, {fixed}with budget {tps[b]:.1f} tok/s "
                f"({row['ratio'][b]:.2f}x, in time {row['time_ratio'][b]:.2f}x, "
                f"{f['budget_tree_rounds'][0]}/{f['budget_tree_rounds'][1]} drafted rounds {f['budget_sizes']}, "
                f"AAL {f['budget_aal']:.2f}), split {f['split_s']}",
                flush=True,
            )
    result = {
        "meta": {
            "draft": args.draft,
            "block_size": args.block_size,
            "tree_stop": args.tree_stop,
            "heldout": args.heldout,
            "tree": [depth, branch, nodes],
            "draft_mode": args.draft_mode,
            "max_new_tokens": args.max_new_tokens,
            "data": args.data,
            "dtype": args.dtype,
            "budget": args.budget,
            "packed_weights": gen.policy.kernels.packed,
            "float32_attention": gen.policy.kernels.float32_attention,
            "machine": machine(),
            "draft_checkpoint": args.draft_checkpoint,
            "repeats": args.repeats,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "rows": rows,
    }
    if args.grpo_step:
        result["grpo_step"] = grpo_steps(args, depth, branch, nodes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = (
        "spec_vs_ar"
        + ("" if args.draft == "eagle3" else "_" + args.draft.replace(",", "_"))
        + ("" if args.dtype == "float32" else f"_{args.dtype}")
    )
    name += "_packed" if args.cpu_kernels == "packed" else ""
    name += "_chain" if args.draft_mode == "chain" else ""
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"{name}.png")


def per_draft(stats: dict, draft: str) -> dict:
    """A drafter's figures of one setting: AAL of its full proposal (None where it did not run) and of the budget,
    the budget's drafted rounds and sizes, the round's time split and the acceptance per depth."""
    sb = RoundStats.merge(stats[f"{draft}+budget"], concurrent=False)
    st = RoundStats.merge(stats[draft], concurrent=False) if draft in stats else None
    return {
        "aal": st.aal if st else None,
        "budget_aal": sb.aal,
        "budget_tree_rounds": [sb.tree_rounds, sb.rounds],
        "budget_sizes": sb.sizes,
        "split_s": {k: getattr(st or sb, k) for k in ("draft_s", "verify_s", "accept_s")},
        "accept_at_depth": (st or sb).accept_at_depth,
    }


def full_depth_only(budget: Budget, shape) -> Budget:
    """A budget like `budget` (same timing) choosing among full-depth trees only: n nodes at depth
    min(depth, n), the candidates before trees of every depth."""
    c = budget.cost
    keep = lambda s: s == AR or s[1] == min(shape.depth, s[0])
    cost = CostModel(
        c.rows,
        {s: v for s, v in c.rounds.items() if keep(s)},
        {s: v for s, v in c.accepted.items() if keep(s)},
        c.level,
    )
    return Budget(cost, shape, adaptive=budget.adaptive)


def plot(result: dict, path: Path) -> None:
    """Generated tokens/s per system and batch, with ratios to autoregressive and the tree's AAL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = list(rows[0]["tok_per_s"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    w = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [x + (i - (len(names) - 1) / 2) * w for x in range(len(rows))]
        ys = [r["tok_per_s"].get(name, 0.0) for r in rows]
        ax.bar(xs, ys, w, label=name)
        for x, y, r in zip(xs, ys, rows):
            if name != "autoregressive" and name in r["ratio"]:
                ax.text(x, y * 1.02, f"{r['ratio'][name]:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(
        range(len(rows)), [f"{r['prompts']}x{r['group']} (AAL {r['aal'] or r['budget_aal']:.2f})" for r in rows]
    )
    ax.set_ylim(0, max(max(r["tok_per_s"].values()) for r in rows) * 1.15)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Speculative ({result['meta']['draft']}) vs autoregressive rollouts, default model, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def grpo_steps(args, depth, branch, nodes) -> dict:
    """One GRPO step (8 prompts x 8 would be slow here: 2 x 8) with and without drafting."""
    from sparkrl.train.trainer import train

    out = {}
    drafting = {
        "draft": args.draft,
        "draft_checkpoint": args.draft_checkpoint,
        "tree_depth": depth,
        "tree_branch": branch,
        "tree_nodes": nodes,
        "block_size": args.block_size,
    }
    for name, draft in (("autoregressive", {}), (args.draft, drafting)):
        with tempfile.TemporaryDirectory() as d:
            cfg = build(
                RunConfig,
                {
                    "out": d,
                    "steps": 1,
                    "data": args.data,
                    "prompts_per_step": 2,
                    "group_size": 8,
                    "max_new_tokens": args.max_new_tokens,
                    "rollout_dtype": args.dtype,
                    **draft,
                },
            )
            t = time.perf_counter()
            train(cfg)
            total = time.perf_counter() - t
            m = json.loads((Path(d) / "metrics.jsonl").read_text().splitlines()[0])
        out[name] = {
            "gen_s": m["gen_s"],
            "draft_train_s": m["draft_train_s"],
            "train_s": m["train_s"],
            "gen_tokens": m["gen_tokens"],
            "aal": m.get("aal"),
            "wall_s": total,
        }
        print(name, out[name], flush=True)
    return out


if __name__ == "__main__":
    main()
