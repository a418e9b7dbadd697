"""The top-p nucleus (`sampling.nucleus`): this tree's version against another git revision's, side by side
in one process, on the logits of real decode steps.

The default model as sparkrl's rollout copy runs it (`--dtype`; kernels and attention as auto picks)
samples 128 tokens for each of --rows responses to held-out GSM8K prompts (T 1, top-p 0.95); every
decode step's logits are kept. Then both versions compute the nucleus of each step's logits in turn,
--calls times per step; per version, the sum over steps of the median time per step; the largest
difference between the two distributions' sorted probabilities, and how many rows end their nucleus at
another of two equal tokens (ties are broken by each top-k's order). Then the whole AR sampler with each version, alternating, --repeats
times (tokens/s).

    .venv/bin/python bench/nucleus.py --against 63f27be --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from accept_walk import module_at
from sparkrl import rollout, sampling
from sparkrl.config import SamplingConfig
from sparkrl.data import build_prompts, held_out, load_problems
from sparkrl.precision import rollout_copy
from sparkrl.weights import load_model
from timing import repeated


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="git revision whose nucleus to compare with")
    ap.add_argument("--rows", default="8x1,8x8", help="PROMPTSxGROUP per setting")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    lm = load_model("default", dtype=args.dtype)
    dt = lm.model.lm_head.weight.dtype
    lm.model = rollout_copy(lm.model, dt).model
    problems = [p for p in load_problems(args.data).problems if held_out(p, 0.05)]
    prompts = build_prompts(lm.tokenizer, problems[:8], 512, "skip").prompt_ids
    sc = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=128)
    versions = {"this tree": sampling.nucleus, args.against: module_at(args.against, "sparkrl/sampling.py").nucleus}
    results = []
    for spec in args.rows.split(","):
        P, G = map(int, spec.split("x"))
        run = lambda: rollout.generate(lm.model, prompts[:P], sc, lm.eos_ids, rollout.response_generators(0, P, G),
                                       group_size=G)
        seen = []
        real = sampling.nucleus
        sampling.nucleus = lambda logits, t, p: seen.append(logits.clone()) or real(logits, t, p)
        run()
        sampling.nucleus = real
        per_step = {name: [statistics.median(repeated(lambda: f(z, 1.0, 0.95), args.calls)) for z in seen]
                    for name, f in versions.items()}
        diff, ties = 0.0, 0
        for z in seen:  # the same probabilities per row; which of two equal tokens ends a nucleus may differ
            a, b = sampling.target_probs(z, 1.0, 0.95), _dense(versions[args.against], z)
            diff = max(diff, float((a.sort(-1).values - b.sort(-1).values).abs().max()))
            ties += int(((a > 0) != (b > 0)).any(-1).sum())
        tok_s = {name: [] for name in versions}
        for rep in range(args.repeats):
            for name in (list(versions) if rep % 2 == 0 else list(versions)[::-1]):
                sampling.nucleus = versions[name]
                t = time.perf_counter()
                n = run().num_tokens
                tok_s[name].append(n / (time.perf_counter() - t))
            sampling.nucleus = real
        row = {"responses": P * G, "steps": len(seen), "nucleus_s": {n: sum(v) for n, v in per_step.items()},
               "max_p_difference": diff, "rows_tie_broken_otherwise": ties, "tok_per_s": {n: statistics.median(v) for n, v in tok_s.items()}}
        row["nucleus_speedup"] = row["nucleus_s"][args.against] / row["nucleus_s"]["this tree"]
        row["sampler_speedup"] = row["tok_per_s"]["this tree"] / row["tok_per_s"][args.against]
        results.append(row)
        print(f"{P * G} responses, {len(seen)} steps: nucleus {row['nucleus_s']['this tree'] * 1e3:.0f} ms against "
              f"{row['nucleus_s'][args.against] * 1e3:.0f} ms ({row['nucleus_speedup']:.2f}x), largest difference of sorted p "
              f"{diff:.1e}, rows whose nucleus ends at another of equal tokens {ties}; AR sampler {row['tok_per_s']['this tree']:.1f} against {row['tok_per_s'][args.against]:.1f} "
              f"tok/s ({row['sampler_speedup']:.2f}x)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nucleus.json").write_text(json.dumps({"against": args.against, "dtype": args.dtype,
                                                  "torch": torch.__version__, "rows": results}, indent=2))


def _dense(nucleus, logits: torch.Tensor) -> torch.Tensor:
    probs, ids = nucleus(logits, 1.0, 0.95)
    return torch.zeros(logits.shape).scatter_(1, ids, probs)


if __name__ == "__main__":
    main()
