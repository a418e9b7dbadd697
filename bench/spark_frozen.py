"""SPARK on frozen checkpoints (paper Fig. 5): the same policy, drafter and projection, the same
prompts and per-response seeds, EAGLE3-style trees with and without SPARK, side by side.

Reports per dataset: AAL of both, SPARK's relative AAL gain, generation time per token of both
(medians over repeats, the methods alternating), and SPARK's own time as a share of the rollout.
Writes JSON, a PNG of AAL over rounds with the number of active responses (Fig. 5), and a round log
per method for `sparkrl analyze`.

    .venv/bin/python bench/spark_frozen.py --draft-checkpoint runs/draft3/drafter.pt \
        --data ../shared/data/gsm8k/train.jsonl,default --out bench/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from sparkrl.analysis import append_round_log
from sparkrl.config import DraftConfig, SamplingConfig, SparkConfig
from sparkrl.data import build_prompts, load_problems
from sparkrl.build import make_drafter
from sparkrl.rollout import response_generators
from sparkrl.speculative import generate_speculative
from sparkrl.build import make_spark
from sparkrl.weights import load_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-checkpoint", required=True)
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl,default")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--skip", type=int, default=1000, help="problems to skip (held out from draft pretraining)")
    ap.add_argument("--repeats", type=int, default=2, help="rollouts per method (different prompts each)")
    ap.add_argument("--eta", type=float, nargs="+", default=[0.01])
    ap.add_argument("--tree", default="5,4,16", help="depth,branch,nodes")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--logs", default="runs/spark_frozen", help="round logs for `sparkrl analyze`")
    args = ap.parse_args()
    depth, branch, nodes = map(int, args.tree.split(","))
    lm = load_model("default")
    sc = SamplingConfig(1.0, 0.95, args.max_new_tokens)
    base_cfg = DraftConfig(draft="eagle3", draft_checkpoint=args.draft_checkpoint, tree_depth=depth,
                           tree_branch=branch, tree_nodes=nodes, budget="fixed")
    drafter = make_drafter(base_cfg, lm.model)
    methods = {"eagle3": None}
    for eta in args.eta:
        cfg = dataclasses.replace(base_cfg, spark_config=SparkConfig(spark=True, spark_eta=eta))
        methods[f"spark(eta={eta:g})"] = make_spark(cfg, lm.model, drafter, sc.temperature)[1]
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    P, G = args.prompts, args.group
    results = []
    for data in args.data.split(","):
        ds = load_problems(data)
        n = args.repeats * P
        prompts = build_prompts(lm.tokenizer, ds.problems[args.skip:args.skip + n], 512, "skip").prompt_ids
        name = Path(data).parent.name if data.endswith(".jsonl") else data
        acc = {m: {"committed": 0, "row_rounds": 0, "tokens": 0, "s": [], "spark_s": 0.0, "trace": []}
               for m in methods}
        for rep in range(args.repeats):
            ps = prompts[rep * P:(rep + 1) * P]
            order = list(methods) if rep % 2 == 0 else list(methods)[::-1]
            for m in order:
                r = generate_speculative(lm.model, drafter, ps, sc, lm.eos_ids, response_generators(rep, P, G),
                                         base_cfg.shape(), G, spark=methods[m])
                a, st = acc[m], r.stats
                a["committed"] += st.committed
                a["row_rounds"] += st.row_rounds
                a["tokens"] += r.num_tokens
                a["s"].append(r.gen_s / r.num_tokens)
                a["spark_s"] += st.adapter.get("spark_s", 0.0)
                a["gen_s"] = a.get("gen_s", 0.0) + r.gen_s
                a["trace"].append(st.active_aal)
                append_round_log(f"{args.logs}/{name}_{m}.jsonl", r, step=rep, spark=methods[m] is not None)
                print(f"{name} rep {rep} {m}: AAL {st.aal:.3f}, {r.num_tokens} tokens, {r.gen_s:.1f}s, "
                      f"SPARK {st.adapter.get('spark_s', 0.0):.2f}s", flush=True)
        row = {"dataset": data, "prompts_per_rollout": P, "group": G, "rollouts": args.repeats, "methods": {}}
        for m, a in acc.items():
            row["methods"][m] = {"aal": a["committed"] / a["row_rounds"], "tokens": a["tokens"],
                                 "s_per_token_median": statistics.median(a["s"]), "s_per_token": a["s"],
                                 "spark_share": a["spark_s"] / a["gen_s"], "trace": a["trace"]}
        b = row["methods"]["eagle3"]
        for m, r in row["methods"].items():
            r["aal_gain"] = r["aal"] / b["aal"] - 1
            r["gen_speedup"] = b["s_per_token_median"] / r["s_per_token_median"]
        results.append(row)
        print(json.dumps({m: {k: r[k] for k in ("aal", "aal_gain", "gen_speedup", "spark_share")}
                          for m, r in row["methods"].items()}), flush=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "sampling": dataclasses.asdict(sc),
            "tree": [depth, branch, nodes], "draft_checkpoint": args.draft_checkpoint, "skip": args.skip}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "spark_frozen.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, Path(args.out) / "spark_frozen.png")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, row in zip(axes[0], results):
        ax2 = ax.twinx()
        for m, r in row["methods"].items():
            n = max(len(t) for t in r["trace"])
            aal = [statistics.mean(t[i][1] for t in r["trace"] if i < len(t)) for i in range(n)]
            w = 8  # moving average over rounds
            smooth = [statistics.mean(aal[max(0, i - w + 1):i + 1]) for i in range(n)]
            ax.plot(range(n), smooth, label=f"{m} (AAL {r['aal']:.2f})")
            if m == "eagle3":
                active = [statistics.mean(t[i][0] for t in r["trace"] if i < len(t)) for i in range(n)]
                ax2.bar(range(n), active, color="0.85", width=1.0, zorder=0)
        ax.set_zorder(ax2.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.set_title(f"{Path(row['dataset']).parent.name or row['dataset']}: AAL over rounds (frozen checkpoints)")
        ax.set_xlabel("verification round")
        ax.set_ylabel("AAL (moving average of 8 rounds)")
        ax2.set_ylabel("active responses (bars)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
