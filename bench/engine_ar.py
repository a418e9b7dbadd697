"""The speculative engine's floor: plain autoregressive rollouts (`rollout.generate`) against the speculative
engine choosing an autoregressive round every round (its drafter bookkeeping: the policy's features kept,
the drafter's cache compacted as responses finish) and against it with the budget, interleaved in one
process, the same prompts and per-response seeds. Whatever the budget loses beyond the first gap is the
cost of its decisions (the trees it drafts, the drafter's catch-up they pay).

    .venv/bin/python bench/engine_ar.py --batches 1x8,8x8 --data ../shared/data/gsm8k/train.jsonl \
        --heldout 0.05 --dtype bfloat16 --out bench/results/avx512_bf16/engine_ar
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparkrl.budget import AR
from sparkrl.config import DraftConfig, SamplingConfig
from sparkrl.rollout import generate, response_generators
from sparkrl.speculative import generate_speculative

from default_rollouts import default_rollouts


class Never:
    """A budget that never drafts."""

    def choose(self, B):
        return AR

    def observe_round(self, *args):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1x8,8x8", help="PROMPTSxGROUP per setting")
    ap.add_argument("--data", default="default")
    ap.add_argument("--heldout", type=float, default=0.0, help="only problems held out of draft pretraining")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    dcfg = DraftConfig(draft="eagle3", draft_checkpoint="default", budget="auto")
    lm, d, prompts = default_rollouts(dcfg, args.dtype, args.data, args.heldout)
    sc = SamplingConfig(1.0, 0.95, args.max_new_tokens)
    rows = []
    for spec in args.batches.split(","):
        P, G = map(int, spec.split("x"))
        ps, gens = prompts[:P], lambda: response_generators(0, P, G)
        spec_with = lambda budget: lambda: generate_speculative(lm.model, d.rollout.model, ps, sc, lm.eos_ids, gens(),
                                                                dcfg.shape(), G, budget=budget)
        systems = {"autoregressive": lambda: generate(lm.model, ps, sc, lm.eos_ids, gens(), G),
                   "engine, never drafting": spec_with(Never()), "engine with the budget": spec_with(d.budget)}
        for f in systems.values():  # untimed: a process's first rollouts run cold
            f()
        runs = {k: [] for k in systems}
        for rep in range(args.repeats):
            for name in (list(systems) if rep % 2 == 0 else list(systems)[::-1]):
                o = systems[name]()
                runs[name].append({"s": o.gen_s, "tokens": o.num_tokens, "tree_rounds": o.stats.tree_rounds,
                                   "rounds": o.stats.rounds or o.stats.policy_forwards})
        ar_s = sum(r["s"] for r in runs["autoregressive"])
        row = {"prompts": P, "group": G, "runs": runs,
               "time_ratio": {k: ar_s / sum(r["s"] for r in v) for k, v in runs.items() if k != "autoregressive"}}
        rows.append(row)
        print(f"{P}x{G}: " + ", ".join(f"{k} {r:.3f}x of AR in time" for k, r in row["time_ratio"].items())
              + f" (the budget drafted {sum(r['tree_rounds'] for r in runs['engine with the budget'])} of "
              f"{sum(r['rounds'] for r in runs['engine with the budget'])} rounds)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {k: getattr(args, k) for k in ("data", "heldout", "dtype", "max_new_tokens", "repeats")}
    (out / f"engine_ar_{args.dtype}.json").write_text(json.dumps({"meta": {**meta, "torch": torch.__version__,
                                                                           "threads": torch.get_num_threads()},
                                                                  "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
