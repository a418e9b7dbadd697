"""What a speculative round of each tree size costs against an autoregressive one, interleaved round by round.

One engine (`speculative.Speculation`) per size (nodes, depth; 0,0 = an autoregressive round), all on the
same prompt with the same per-response generators, stepped in turn: every engine runs one round, then the
next engine, and so on. A machine that changes speed over seconds (this one's rollouts spread by +-10%
between runs) then slows every size alike, so the ratios hold where the absolute figures drift. Engines
restart on the next prompt every --rounds rounds (contexts stay rollout-like); nothing ends at EOS.

Per size: milliseconds per round and per committed token, tokens per round per response, the split
(drafting + catch-up / verify forward / acceptance + commit), and the speed per token against the
autoregressive engine of the same rows.

    .venv/bin/python bench/round_costs.py --rows 1,8 --out bench/results/round_costs
    .venv/bin/python bench/round_costs.py --rows 1 --sizes "0,0;1,1;4,1;c1;c2;c3" --out ...   # with sampled chains
    .venv/bin/python bench/round_costs.py --rows 1 --cost-model --out ...   # against the budget's cost model
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
from default_rollouts import default_rollouts

from sparkrl.config import DraftConfig, SamplingConfig, TreeShape
from sparkrl.engine.autoregressive import response_generators
from sparkrl.engine.budget import AR, CostModel
from sparkrl.engine.speculative import NoAdaptation, Speculation, time_rounds


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """ "n,d;..." trees of n nodes d deep (0,0: AR); "cD": a chain of D tokens sampled from the drafter, as
    (-D, D)."""
    return [
        (-int(s[1:]), int(s[1:])) if s.startswith("c") else tuple(int(x) for x in s.split(",")) for s in text.split(";")
    ]


def size_name(s) -> str:
    return f"c{s[1]}" if s[0] < 0 else f"{s[0]},{s[1]}"


@torch.no_grad()
def measure(policy, drafter, shape, prompts, rows: int, sizes, rounds: int, warmup: int, sampler) -> dict:
    """Round-robin over one engine per size on each prompt; totals per size."""
    sc = SamplingConfig(1.0, 0.95, (rounds + warmup) * (shape.depth + 1) + 2)
    tot = {s: {"s": 0.0, "rounds": 0, "tokens": 0, "draft_s": 0.0, "verify_s": 0.0, "accept_s": 0.0} for s in sizes}
    for j, prompt in enumerate(prompts):
        engines = {}
        for s in sizes:
            eng = Speculation(
                policy,
                drafter.bind(policy),
                sc,
                TreeShape.chain(s[1]) if s[0] < 0 else shape,
                response_generators(j, 1, rows),
                NoAdaptation(),
                sampler,
            )
            eng.start([prompt], rows, ())
            engines[s] = eng
        for r in range(warmup + rounds):
            for s, eng in engines.items():
                t = time.perf_counter()
                rd = eng.autoregressive_round() if s[0] == 0 else eng.speculative_round(abs(s[0]), s[1])[0]
                dt = time.perf_counter() - t
                if r >= warmup:
                    a = tot[s]
                    a["s"] += dt
                    a["rounds"] += 1
                    a["tokens"] += sum(rd.counts)
                    for k in ("draft_s", "verify_s", "accept_s"):
                        a[k] += getattr(rd, k)
    ar = tot[(0, 0)]
    ar_per_token = ar["s"] / ar["tokens"]
    out = {}
    for s, a in tot.items():
        n = a["rounds"]
        out[size_name(s)] = {
            "ms_per_round": 1e3 * a["s"] / n,
            "tokens_per_round": a["tokens"] / n / rows,
            "ms_per_token": 1e3 * a["s"] / a["tokens"],
            "speedup": ar_per_token / (a["s"] / a["tokens"]),
            "split_ms": {k: 1e3 * a[k] / n for k in ("draft_s", "verify_s", "accept_s")},
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-checkpoint", default="default")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--heldout", type=float, default=0.05, help="only problems held out of draft pretraining")
    ap.add_argument("--rows", default="1,8", help="responses per engine (one prompt's group)")
    ap.add_argument(
        "--sizes",
        default="0,0;1,1;2,1;4,1;4,2;8,2;8,3;16,5",
        help="nodes,depth;... (0,0: AR; cD: a sampled chain of D tokens)",
    )
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--skip", type=int, default=0, help="problems to skip (the rollout benches report on the first)")
    ap.add_argument("--rounds", type=int, default=48, help="timed rounds per engine and prompt")
    ap.add_argument("--warmup", type=int, default=4, help="untimed rounds per engine and prompt")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--cost-model",
        action="store_true",
        help="also the budget's cost model: each tree round against the AR round as it predicts them at "
        "the drafts accepted here (timed once per machine and cached, before the rounds here)",
    )
    ap.add_argument("--out", default="bench/results/round_costs")
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    if (0, 0) not in sizes:
        ap.error("--sizes must include 0,0 (the autoregressive reference)")
    dcfg = DraftConfig(draft="eagle3", draft_checkpoint=args.draft_checkpoint, budget="fixed")
    lm, gen, prompts = default_rollouts(dcfg, args.dtype, args.data, args.heldout, count=args.prompts, skip=args.skip)
    d, sampler = gen.drafting, gen.policy.sampler
    cost = (
        CostModel.measure(
            lm.model,
            d.copy.model,
            dcfg.shape(),
            functools.partial(time_rounds, sampler=sampler),
            kernels=gen.policy.kernels.key(),
        )
        if args.cost_model
        else None
    )
    result = {"meta": {**vars(args), "torch": torch.__version__, "threads": torch.get_num_threads()}, "rows": {}}
    for rows in map(int, args.rows.split(",")):
        res = measure(lm.model, d.copy.model, dcfg.shape(), prompts, rows, sizes, args.rounds, args.warmup, sampler)
        result["rows"][rows] = res
        if cost is not None:
            ar = res["0,0"]["ms_per_round"]
            for s in sizes:
                if s[0] > 0 and s in cost.rounds:
                    r = res[size_name(s)]
                    r["round_vs_ar"] = r["ms_per_round"] / ar
                    r["model_round_vs_ar"] = cost.seconds(rows, s, r["tokens_per_round"] - 1) / cost.seconds(rows, AR)
            print(f"{rows} rows, round / AR round: size, measured, the cost model's at these acceptances, its error")
            for k, r in res.items():
                if "model_round_vs_ar" in r:
                    print(
                        f"  {k:6s} {r['round_vs_ar']:.3f} {r['model_round_vs_ar']:.3f} "
                        f"{r['model_round_vs_ar'] / r['round_vs_ar'] - 1:+.1%}"
                    )
        print(
            f"{rows} rows: size, ms/round, tokens/round/response, ms/token, speed per token vs AR, "
            "draft/verify/accept ms"
        )
        for k, r in res.items():
            sp = r["split_ms"]
            print(
                f"  {k:6s} {r['ms_per_round']:7.2f} {r['tokens_per_round']:5.2f} {r['ms_per_token']:7.2f} "
                f"{r['speedup']:5.2f}x  {sp['draft_s']:.2f}/{sp['verify_s']:.2f}/{sp['accept_s']:.2f}",
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"round_costs_{args.dtype}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
