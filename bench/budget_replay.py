"""The speculation budget's choices replayed on recorded rounds: what each way of sizing a one-response round
would commit, without this machine's noise.

Rollouts of one response each draft the full tree every round (16 nodes, depth 5) and record its shape, the
drafter's probability of every node's path (`Tree.prob`) and the accepted path. A tree of any size (n, d) is
the n best-ranked nodes of depth <= d of the full one, so the drafts it would have accepted in that round
follow exactly (`budget.kept_drafts`; position-keyed uniforms sample the same tokens whatever was drafted).
The rounds are then replayed, each policy picking a size per round and scored by the cost model's round
seconds (this machine's cached timing, `budget.CostModel`, at the accepted drafts; an AR round its AR step),
over all the rounds and over each quarter of them from a fresh start (how much a policy's ratio depends on
the prompts):

* every fixed size, every round;
* `budget.Budget` itself (its running estimates, margin and explorations; it sees `kept_drafts` of the full
  tree for the sizes below the chosen one, where a real round's tree gives a lower bound for some of them);
* per round from the drafter's own probabilities: the size with the most expected tokens per second, the
  expected drafts of a size being the sum of its nodes' path probabilities (known before verifying: an upper
  bound on what a per-round rule could do, as deeper sizes must be drafted to be scored).

Also the calibration: per size, the rounds in quartiles of their expected drafts, against the drafts kept; and
per size at 1 and 8 rows, the drafts a round would have to accept for 1.1x and 1.3x of AR per token.
The replay scores sizes with the cost model, not with timed rollouts: its ratios say how the policies compare,
`spec_vs_ar.py` how fast the engine runs.

    .venv/bin/python bench/budget_replay.py --data ../shared/data/gsm8k/train.jsonl --heldout 0.05 --first 40 \\
        --prompts 24 --rounds runs/budget_replay/rounds.json --out bench/results/budget_replay
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparkrl.budget import AR, Budget, kept_drafts, size_nodes, tree_sizes
from sparkrl.config import DraftConfig, SamplingConfig
from sparkrl.rollout import response_generators
from sparkrl.speculative import NoAdaptation, Speculation
from sparkrl.verify import Tree

from default_rollouts import default_rollouts


@torch.no_grad()
def record(policy, drafter, shape, prompts, max_new_tokens: int, eos_ids) -> list[dict]:
    """Every round of one-response rollouts drafting the full tree: its valid/depth/rank/prob and the path."""
    rounds = []
    for j, prompt in enumerate(prompts):
        eng = Speculation(policy, drafter.bind(policy), SamplingConfig(1.0, 0.95, max_new_tokens), shape,
                          response_generators(j, 1, 1), NoAdaptation())
        eng.start([prompt], 1, eos_ids)
        while eng.drop_finished():
            _, prop, acc = eng.speculative_round(shape.nodes, shape.depth)
            eng.batch.rounds += 1
            t = prop.tree
            rounds.append({"valid": t.valid[0].tolist(), "depth": t.depth[0].tolist(), "rank": t.rank[0].tolist(),
                           "prob": t.prob[0].tolist(), "path": acc.path[0].tolist()})
        print(f"prompt {j + 1}/{len(prompts)}: {len(rounds)} rounds", flush=True)
    return rounds


class Recorded:
    """One recorded round as the budget sees it: the tree and the accepted path; per size, the drafts it keeps
    and the drafts the drafter expected (its nodes' path probabilities summed)."""

    def __init__(self, r: dict, sizes):
        n = len(r["valid"])
        self.tree = Tree(tokens=torch.zeros(1, n, dtype=torch.long), parents=torch.zeros(1, n, dtype=torch.long),
                         valid=torch.tensor([r["valid"]]), depth=torch.tensor([r["depth"]]), rank=torch.tensor([r["rank"]]))
        self.path = torch.tensor([r["path"]])
        prob = torch.tensor(r["prob"], dtype=torch.float64)
        self.kept, self.expected = {}, {}
        for s in sizes:
            self.kept[s] = int(kept_drafts(self.tree, self.path, s))
            self.expected[s] = float(prob[size_nodes(self.tree, s)[0]].sum())


def replay(rounds: list[Recorded], cost, pick) -> dict:
    """Tokens and model seconds of the rounds with pick(round) -> size, and the sizes picked."""
    tokens = seconds = 0.0
    picked = {}
    for r in rounds:
        s = pick(r)
        a = 0 if s == AR else r.kept[s]
        tokens += 1 + a
        seconds += cost.seconds(1, s, None if s == AR else a)
        picked[f"{s[0]},{s[1]}"] = picked.get(f"{s[0]},{s[1]}", 0) + 1
    return {"tokens": tokens, "seconds": seconds, "picked": picked}


def by_budget(budget: Budget):
    class Acc:  # what `Budget.observe` reads of an `Acceptance`
        def __init__(self, path):
            self.path = path

    def pick(r: Recorded):
        s = budget.choose(1)
        if s != AR:
            budget.observe(s, r.tree, Acc(r.path))
        return s
    return pick


def by_expectation(cost, sizes):
    return lambda r: max([AR] + sizes, key=lambda s: (1 + (0 if s == AR else r.expected[s])) /
                         cost.seconds(1, s, None if s == AR else r.expected[s]))


def calibration(rounds: list[Recorded], sizes) -> dict:
    out = {}
    for s in sizes:
        pairs = sorted((r.expected[s], r.kept[s]) for r in rounds)
        q = len(pairs) // 4
        parts = [pairs[i * q:(i + 1) * q if i < 3 else len(pairs)] for i in range(4)]
        out[f"{s[0]},{s[1]}"] = [{"expected": sum(e for e, _ in p) / len(p), "kept": sum(k for _, k in p) / len(p),
                                  "rounds": len(p)} for p in parts]
    return out


def needed(cost, rounds: list[Recorded], sizes, rows=(1, 8), gains=(1.1, 1.3)) -> list[dict]:
    """Per row count and size: the round's cost at no accepted draft (in AR rounds), the drafts the recorded
    rounds kept, and the drafts a round must accept for each gain per token over AR, by the cost model (round
    seconds are linear in drafts)."""
    out = []
    for B in rows:
        ar = cost.seconds(B, AR)
        for s in sizes:
            c0 = cost.seconds(B, s, 0.0) / ar
            c1 = cost.seconds(B, s, 1.0) / ar - c0  # one more accepted draft
            out.append({"rows": B, "size": f"{s[0]},{s[1]}", "depth": s[1], "round_vs_ar": c0,
                        "kept": sum(r.kept[s] for r in rounds) / len(rounds),
                        "for": {f"{g}x": (g * c0 - 1) / (1 - g * c1) for g in gains}})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--heldout", type=float, default=0.05, help="only problems held out of draft pretraining")
    ap.add_argument("--first", type=int, default=40,
                    help="skip this many of those problems (the rollout benches report on the first ones)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--momentum", default="0.9", help="the budget's running-average momentum(s) to replay, a,b,...")
    ap.add_argument("--rounds", default=None,
                    help="a JSON file of recorded rounds: replayed if it exists, else recorded there")
    ap.add_argument("--out", default="bench/results/budget_replay")
    args = ap.parse_args()
    dcfg = DraftConfig(draft="eagle3", draft_checkpoint="default", budget="auto")
    lm, d, prompts = default_rollouts(dcfg, args.dtype, args.data, args.heldout, count=args.prompts, skip=args.first)
    shape, cost = dcfg.shape(), d.budget.cost
    saved = Path(args.rounds) if args.rounds else None
    if saved is not None and saved.exists():
        raw = json.loads(saved.read_text())
    else:
        raw = record(lm.model, d.rollout.model, shape, prompts, args.max_new_tokens, lm.eos_ids)
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(raw))
    sizes = tree_sizes(shape)
    rounds = [Recorded(r, sizes) for r in raw]
    pickers = {f"fixed {s[0]},{s[1]}": lambda s=s: (lambda r: s) for s in sizes}  # name -> a fresh pick
    for m in map(float, args.momentum.split(",")):
        pickers[f"budget (momentum {m})"] = lambda m=m: by_budget(Budget(cost, shape, momentum=m))
    pickers["per round, by the drafter's probabilities"] = lambda: by_expectation(cost, sizes)
    quarters = [rounds[i * len(rounds) // 4:(i + 1) * len(rounds) // 4] for i in range(4)]
    parts = [rounds] + quarters
    ar_rates = [len(part) / replay(part, cost, lambda r: AR)["seconds"] for part in parts]  # tokens per model second
    systems = {}
    for name, make in pickers.items():  # over all rounds, and over each quarter from a fresh start
        runs = [replay(part, cost, make()) for part in parts]
        rates = [r["tokens"] / r["seconds"] / ar for r, ar in zip(runs, ar_rates)]
        systems[name] = {**runs[0], "vs_ar": rates[0], "quarters_vs_ar": rates[1:]}
    result = {"meta": {**vars(args), "rounds": len(rounds), "torch": torch.__version__}, "systems": systems,
              "calibration": calibration(rounds, sizes), "needed": needed(cost, rounds, sizes)}
    print(f"{len(rounds)} recorded rounds; per token against AR, by the cost model's round seconds:")
    for name, v in systems.items():
        top = sorted(v["picked"].items(), key=lambda kv: -kv[1])[:4]
        print(f"  {name:42s} {v['vs_ar']:.3f}x (quarters " + " ".join(f"{q:.2f}" for q in v["quarters_vs_ar"]) +
              f")  {v['tokens'] / len(rounds):.2f} tokens/round  picked {top}")
    print("calibration (quartiles of expected drafts: expected -> kept):")
    for s, qs in result["calibration"].items():
        print(f"  {s:5s} " + "  ".join(f"{q['expected']:.2f}->{q['kept']:.2f}" for q in qs))
    print("drafts a round must accept per row for a gain over AR (cost model) against what it kept here:")
    for v in result["needed"]:
        print(f"  {v['rows']} rows, {v['size']:5s} round {v['round_vs_ar']:.2f} AR; kept {v['kept']:.2f}; "
              + "; ".join(f"for {g} {a:.2f}" + (" (> depth)" if a > v["depth"] else "") for g, a in v["for"].items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "budget_replay.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
