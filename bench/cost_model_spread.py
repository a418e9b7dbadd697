"""How much the speculation budget's cost model moves between timings of the same machine: `CostModel.measure`
run --timings times in one process (each into a fresh cache), and for every tree size the spread of its
round's cost relative to an AR round, as timed (a per-size table of the median rounds) and as the budget uses
it (`budget.smoothed`: fitted linearly in nodes and depth, then `budget.nondecreasing` in rows).

    .venv/bin/python bench/cost_model_spread.py --timings 4 --out bench/results/cost_model_spread
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from sparkrl.budget import AR, CostModel, _key
from sparkrl.build import make_drafting
from sparkrl.config import DraftConfig
from sparkrl.precision import rollout_copy
from sparkrl.speculative import time_rounds
from sparkrl.weights import cache_dir, load_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timings", type=int, default=4)
    ap.add_argument("--rows", default="1,8", help="row counts to report")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default="bench/results/cost_model_spread")
    args = ap.parse_args()
    lm = load_model("default", dtype=args.dtype)
    lm.model = rollout_copy(lm.model, lm.model.lm_head.weight.dtype, "auto").model
    dcfg = DraftConfig(draft="eagle3", draft_checkpoint="default", budget="fixed")
    d = make_drafting(dcfg, lm.model, lm.model, 1.0)
    models = cache_dir() / "models"
    runs = []
    for i in range(args.timings):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["SPARKRL_CACHE"] = tmp
            (Path(tmp) / "models").symlink_to(models)
            cost = CostModel.measure(lm.model, d.rollout.model, dcfg.shape(), time_rounds)
            saved = json.loads(next((Path(tmp) / "costs").glob("rounds-*.json")).read_text())
        runs.append({"fitted": cost.to_dict()["rounds"], "timed": saved["timed"], "rows": list(cost.rows)})
        print(f"timing {i + 1} of {args.timings} done", flush=True)
    rows = runs[0]["rows"]
    report = {}
    for B in map(int, args.rows.split(",")):
        j = rows.index(B)
        for kind in ("timed", "fitted"):
            ratios = {k: [r[kind][k][j] / r[kind][_key(AR)][j] for r in runs] for k in runs[0][kind] if k != _key(AR)}
            report[f"{kind} at {B}"] = {k: {"mean": statistics.mean(v), "sd": statistics.stdev(v)} for k, v in ratios.items()}
            sds = [x["sd"] for x in report[f"{kind} at {B}"].values()]
            print(f"{B} rows, {kind:6s}: tree / AR round, sd over timings: median {statistics.median(sds):.3f}, "
                  f"max {max(sds):.3f}  |  " + "  ".join(f"{k} {x['mean']:.2f}+-{x['sd']:.2f}"
                                                       for k, x in report[f"{kind} at {B}"].items()), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cost_model_spread_{args.dtype}.json").write_text(json.dumps({"runs": runs, "report": report}, indent=1))


if __name__ == "__main__":
    main()
