"""How well the speculation budget predicts the rounds it chooses: per tree size and number of active
responses, the cost model's predicted round seconds against the measured ones, and the accepted drafts
it expected against those accepted. Rollouts with `--budget auto` (the shipped drafter, bfloat16 by
default), alternating with autoregressive ones of the same prompts for the speed ratio.

    .venv/bin/python bench/budget_accuracy.py --data ../shared/data/gsm8k/train.jsonl --heldout 0.05 \
        --batches 1x1,1x8 --out bench/results/budget_accuracy
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from sparkrl.config import DraftConfig, SamplingConfig
from sparkrl.rollout import generate, response_generators
from sparkrl.speculative import generate_speculative

from default_rollouts import default_rollouts


class Recording:
    """Wraps a `budget.Budget`: records each round's size, rows, predicted and measured seconds, and
    expected and kept drafts."""

    def __init__(self, budget):
        self.budget, self.rounds = budget, []

    def choose(self, B):
        size = self.budget.choose(B)
        self.rounds.append({"size": size, "B": B, "predicted_s": self.budget.seconds(B, size),
                            "expected": self.budget.accepted.get(size, 0.0)})
        return size

    def observe_round(self, size, B, seconds):
        self.rounds[-1]["measured_s"] = seconds
        self.budget.observe_round(size, B, seconds)

    def observe(self, size, tree, acc):
        self.rounds[-1]["accepted"] = float(acc.n_accepted.double().mean())
        self.budget.observe(size, tree, acc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-checkpoint", default="default")
    ap.add_argument("--data", default="default")
    ap.add_argument("--heldout", type=float, default=0.0, help="only problems held out of draft pretraining")
    ap.add_argument("--batches", default="1x1,1x8", help="PROMPTSxGROUP per setting")
    ap.add_argument("--sets", type=int, default=2, help="prompt sets per setting, each run twice")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default="bench/results/budget_accuracy")
    args = ap.parse_args()
    dcfg = DraftConfig(draft="eagle3", draft_checkpoint=args.draft_checkpoint, budget="auto")
    lm, d, prompts = default_rollouts(dcfg, args.dtype, args.data, args.heldout)
    sc = SamplingConfig(1.0, 0.95, args.max_new_tokens)
    result = {"meta": vars(args), "settings": []}
    for spec in args.batches.split(","):
        P, G = map(int, spec.split("x"))
        budget = Recording(d.budget)
        tokens, seconds = defaultdict(int), defaultdict(float)
        ps = prompts[:P]  # untimed and unrecorded, once each: the first rollouts of a process run cold
        generate(lm.model, ps, sc, lm.eos_ids, response_generators(0, P, G), G)
        generate_speculative(lm.model, d.rollout.model, ps, sc, lm.eos_ids, response_generators(0, P, G), dcfg.shape(),
                             G, budget=d.budget)
        for rep in range(2):
            for j in range(args.sets):
                ps = prompts[j * P:(j + 1) * P]
                gens = lambda: response_generators(0, P, G)
                runs = {"autoregressive": lambda: generate(lm.model, ps, sc, lm.eos_ids, gens(), G),
                        "budget": lambda: generate_speculative(lm.model, d.rollout.model, ps, sc, lm.eos_ids, gens(),
                                                               dcfg.shape(), G, budget=budget)}
                for name in (runs if rep % 2 == 0 else list(runs)[::-1]):
                    r = runs[name]()
                    tokens[name] += r.num_tokens
                    seconds[name] += r.gen_s
        by = defaultdict(list)
        for r in budget.rounds:
            by[f"{r['size'][0]},{r['size'][1]} at {r['B']}"].append(r)
        table = {k: {"rounds": len(v), "predicted_ms": 1e3 * sum(x["predicted_s"] for x in v) / len(v),
                     "measured_ms": 1e3 * sum(x["measured_s"] for x in v) / len(v),
                     "expected": sum(x["expected"] for x in v) / len(v),
                     "accepted": sum(x.get("accepted", 0.0) for x in v) / len(v)} for k, v in sorted(by.items())}
        tps = {k: tokens[k] / seconds[k] for k in tokens}
        result["settings"].append({"prompts": P, "group": G, "tok_per_s": tps,
                                   "ratio": tps["budget"] / tps["autoregressive"], "by_size_and_rows": table})
        print(f"{P}x{G}: budget {tps['budget']:.1f} tok/s, AR {tps['autoregressive']:.1f} "
              f"({tps['budget'] / tps['autoregressive']:.2f}x)", flush=True)
        for k, v in table.items():
            print(f"  size {k:>10} rows: {v['rounds']:4d} rounds, predicted {v['predicted_ms']:6.1f} ms, measured "
                  f"{v['measured_ms']:6.1f} ms ({v['measured_ms'] / v['predicted_ms']:.2f}x), drafts expected "
                  f"{v['expected']:.2f}, accepted {v['accepted']:.2f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"budget_accuracy_{args.dtype}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
