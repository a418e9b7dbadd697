"""Finished responses leaving the KV cache: `KVCache.keep_rows` (in-place compaction) against a gather of
the kept rows into new buffers (what it did before), in autoregressive rollouts of the default model,
the two interleaved with the same prompts and seeds (the same tokens).

    .venv/bin/python bench/keep_rows.py --batches 2x8,8x8 --out bench/results/keep_rows
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparkrl.config import SamplingConfig
from sparkrl.data import build_prompts, load_problems
from sparkrl.model import KVCache
from sparkrl.precision import rollout_copy
from sparkrl.rollout import generate, response_generators
from sparkrl.weights import load_model


def gather_rows(cache: KVCache, rows: torch.Tensor) -> None:
    """The previous `keep_rows`: every kept row copied into new buffers."""
    cache.kv = cache.store = cache.kv.index_select(2, rows)
    cache._views()
    cache.lengths = cache.lengths.index_select(0, rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--batches", default="2x8,8x8", help="PROMPTSxGROUP per setting")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default="bench/results/keep_rows")
    args = ap.parse_args()
    lm = load_model("default", dtype=args.dtype)
    lm.model = rollout_copy(lm.model, lm.model.lm_head.weight.dtype, "auto").model
    prompts = build_prompts(lm.tokenizer, load_problems(args.data).problems[:64], 512, "skip").prompt_ids
    sc = SamplingConfig(1.0, 0.95, args.max_new_tokens)
    compact = KVCache.keep_rows
    rows = []
    for spec in args.batches.split(","):
        P, G = map(int, spec.split("x"))
        seconds, tokens = {"gather": 0.0, "in place": 0.0}, {}
        for rep in range(args.repeats + 1):  # the first, untimed: a process's first rollouts run cold
            for name in (list(seconds) if rep % 2 == 0 else list(seconds)[::-1]):
                KVCache.keep_rows = gather_rows if name == "gather" else compact
                r = generate(lm.model, prompts[:P], sc, lm.eos_ids, response_generators(0, P, G), G)
                if rep:
                    seconds[name] += r.gen_s
                    assert tokens.setdefault(name, r.tokens) == r.tokens
        KVCache.keep_rows = compact
        assert tokens["gather"] == tokens["in place"]
        n = sum(map(len, tokens["gather"])) * args.repeats
        row = {"prompts": P, "group": G, "tok_per_s": {k: n / v for k, v in seconds.items()},
               "ratio": seconds["gather"] / seconds["in place"]}
        rows.append(row)
        print(f"{P}x{G}: gather {row['tok_per_s']['gather']:.1f} tok/s, in place {row['tok_per_s']['in place']:.1f} "
              f"tok/s ({row['ratio']:.3f}x)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"keep_rows_{args.dtype}.json").write_text(json.dumps({"meta": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
