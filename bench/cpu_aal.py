"""Acceptance lengths of the shipped drafters on this CPU, per drafting shape, for the GPU cost script.

`bench/gpu_costs.py` times rounds at the paper's model sizes with random weights, so it cannot measure how
many tokens a round commits; it predicts the generation speedup from the AAL measured here on the default
policy (an assumption: that AAL carries over to larger policies with drafters of their own). This script
measures that AAL for every shape the GPU script times: EAGLE3-style trees (depth 5, 16 nodes), sampled
EAGLE3-style chains of 3, 4 and 5, DFlash-style blocks of 16, each with and without SPARK, `--budget fixed`,
on held-out GSM8K problems (held out of draft pretraining, and past the first `--skip` of them).

    .venv/bin/python bench/cpu_aal.py --data ../shared/data/gsm8k/train.jsonl --heldout 0.05 --skip 16 \
        --count 8 --group-size 4 --out bench/results/avx512_bf16/cpu_aal.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sparkrl.config import DraftConfig, SamplingConfig, SparkConfig
from sparkrl.engine.autoregressive import response_generators
from sparkrl.engine.speculative import generate_speculative

sys.path.insert(0, str(Path(__file__).parent))
from default_rollouts import default_rollouts  # noqa: E402

SHAPES = {  # method name (as gpu_costs.py's rows) -> DraftConfig fields
    "tree": dict(draft="eagle3", tree_depth=5, tree_nodes=16),
    "chain3": dict(draft="eagle3", draft_mode="chain", tree_depth=3),
    "chain4": dict(draft="eagle3", draft_mode="chain", tree_depth=4),
    "chain5": dict(draft="eagle3", draft_mode="chain", tree_depth=5),
    "block": dict(draft="dflash", block_size=16),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="default")
    ap.add_argument("--heldout", type=float, default=0.0)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--count", type=int, default=8, help="prompts")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sc = SamplingConfig(1.0, 0.95, args.max_new_tokens)
    out = {"settings": vars(args), "aal": {}}
    for name, fields in SHAPES.items():
        for spark in (False, True):
            cfg = DraftConfig(**fields, budget="fixed", spark_config=SparkConfig(spark=spark))
            lm, gen, prompts = default_rollouts(
                cfg, args.dtype, args.data, args.heldout, count=args.count, skip=args.skip
            )
            d, sampler = gen.drafting, gen.policy.sampler
            r = generate_speculative(
                lm.model,
                d.copy.model,
                prompts,
                sc,
                lm.eos_ids,
                response_generators(0, len(prompts), args.group_size),
                cfg.shape(),
                group_size=args.group_size,
                spark=d.spark,
                sampler=sampler,
            )
            key = name + ("+spark" if spark else "")
            out["aal"][key] = r.stats.aal
            print(f"{key}: AAL {r.stats.aal:.3f} ({r.num_tokens} tokens, {r.stats.rounds} rounds)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
