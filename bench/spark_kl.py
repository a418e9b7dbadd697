"""Does SPARK's correction move the draft toward the target within a rollout?

At every feedback context of a SPARK rollout (frozen policy, drafter and A), compare the draft
distribution with and without the correction B_g u against the verifier's target p: KL(p || q) and
top-1 agreement, by round range, for several adaptation rates eta. This isolates the correction's
effect from the sampling noise of end-to-end AAL comparisons.

    .venv/bin/python bench/spark_kl.py --draft-checkpoint runs/draft3/drafter.pt --eta 0.005 0.01 0.02 0.1 1

At a stage of a GRPO run (issue 16), give the run's checkpoint for both: its policy, drafter and
learned A (`--policy-checkpoint` loads the policy weights of a `checkpoints/step-N` folder):

    .venv/bin/python bench/spark_kl.py --policy-checkpoint CK --draft-checkpoint CK --eta 0.01 --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from sparkrl.checkpoint import load_checkpoint
from sparkrl.config import DraftConfig, SamplingConfig, SparkConfig
from sparkrl.data import build_prompts, load_problems
from sparkrl.build import make_drafter
from sparkrl.rollout import response_generators
from sparkrl.speculative import generate_speculative
from sparkrl.build import make_spark
from sparkrl.spark import Spark
from sparkrl.weights import load_model

RANGES = [(0, 10), (10, 40), (40, 10**9)]


class MeasuredSpark(Spark):
    """A Spark that, before each update, scores its corrected and uncorrected drafts against p."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log, self.u_cos, self.u_sum = [], [], {}

    def feedback(self, row, h, z, p, w):
        owner = self._owner[row]
        zraw = z.float()
        u = h.float() @ self.A
        corr = torch.zeros(len(z))
        if len(self.store):
            tok, rows = self.store.of_owners(owner)
            c = torch.einsum("nmr,nr->nm", rows, u)
            zraw = zraw.scatter_add(-1, tok, -c)
            corr = c.abs().amax(-1)
        pp = p.float()
        logp = torch.where(pp > 0, pp.log(), 0.0)
        kl = lambda zz: (pp * (logp - torch.log_softmax(zz.float(), -1))).sum(-1).mean()
        top1 = lambda zz: (zz.argmax(-1) == pp.argmax(-1)).float().mean()
        # how context-specific the correction can be: cosine of u_c with the mean u of its owner's
        # earlier feedback contexts (near 1: B_g u acts as one bias for the whole prompt)
        un = torch.nn.functional.normalize(u, dim=-1)
        for i, o in enumerate(owner.tolist()):
            prev = self.u_sum.get(o)
            if prev is not None:
                self.u_cos.append((self._round, float(un[i] @ torch.nn.functional.normalize(prev, dim=0))))
            self.u_sum[o] = un[i] if prev is None else prev + un[i]
        self.log.append((self._round, float(kl(zraw)), float(kl(z)), float(top1(zraw)), float(top1(z)),
                         float(u.norm(dim=-1).mean()), float(corr.mean()),
                         float(1 - pp.sum(-1).mean())))  # target mass outside the draft vocabulary
        super().feedback(row, h, z, p, w)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-checkpoint", required=True)
    ap.add_argument("--policy-checkpoint", default="", help="a GRPO run's checkpoints/step-N folder: its policy weights")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--skip", type=int, default=1000)
    ap.add_argument("--eta", type=float, nargs="+", default=[0.005, 0.01, 0.02, 0.1, 1.0])
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollout")
    ap.add_argument("--rank", type=int, default=8, help="SPARK's rank r")
    ap.add_argument("--k", type=int, default=16, help="SPARK's feedback tokens per context")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    lm = load_model("default")
    if args.policy_checkpoint:
        missing, unexpected = lm.model.load_weights(load_checkpoint(args.policy_checkpoint)["policy"])
        assert not missing and not unexpected, (missing[:3], unexpected[:3])
    base = DraftConfig(draft="eagle3", draft_checkpoint=args.draft_checkpoint, budget="fixed")
    drafter = make_drafter(base, lm.model)
    ds = load_problems(args.data)
    prompts = build_prompts(lm.tokenizer, ds.problems[args.skip:args.skip + args.prompts], 512, "skip").prompt_ids
    sc = SamplingConfig(args.temperature, 0.95, args.max_new_tokens)
    P, G = len(prompts), args.group
    rows = []
    for eta in args.eta:
        cfg = dataclasses.replace(base, spark_config=SparkConfig(spark=True, spark_eta=eta, spark_rank=args.rank,
                                                                 spark_k=args.k))
        proj, _ = make_spark(cfg, lm.model, drafter, sc.temperature)
        spark = MeasuredSpark(proj.A, drafter.vocab_ids.numel(), k=args.k, eta=eta, temperature=sc.temperature)
        r = generate_speculative(lm.model, drafter, prompts, sc, lm.eos_ids, response_generators(0, P, G),
                                 base.shape(), G, spark=spark)
        for lo, hi in RANGES:
            sel = [x for x in spark.log if lo <= x[0] < hi]
            if not sel:
                continue
            row = {"eta": eta, "rounds": [lo, hi if hi < 10**9 else None], "kl_uncorrected": statistics.mean(x[1] for x in sel),
                   "kl_corrected": statistics.mean(x[2] for x in sel), "top1_uncorrected": statistics.mean(x[3] for x in sel),
                   "top1_corrected": statistics.mean(x[4] for x in sel), "u_norm": statistics.mean(x[5] for x in sel),
                   "correction_absmax": statistics.mean(x[6] for x in sel), "aal": r.stats.aal,
                   "p_outside_draft_vocab": statistics.mean(x[7] for x in sel),
                   "u_cos_to_earlier_mean": statistics.mean([c for t, c in spark.u_cos if lo <= t < hi] or [float("nan")])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "spark_kl.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
