"""Cached attention with each head's positions split into parts (`csrc/decode_ops.cpp`) against another git
revision's kernel, in whole policy forwards at one sequence, interleaved forward by forward in one process.

The other revision's decode_ops.cpp is built as a second extension under its own op namespace; the policy's
forwards call either kernel in turn (1, 2 and 5 new tokens, a tree mask for more than one), at each context
length in --contexts, after decode steps that grow the cache to it. Medians of --repeats forwards per case.

    .venv/bin/python bench/attention_parts.py --against c0e7cc4~1 --out bench/results/attention_parts
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from sparkrl import native
from sparkrl.config import DraftConfig
from sparkrl.rollout import prefill

from default_rollouts import default_rollouts


def kernel_at(rev: str):
    """`attention` of decode_ops.cpp at git revision `rev`, built under the namespace sparkrl_rev."""
    src = subprocess.check_output(["git", "show", f"{rev}:sparkrl/csrc/decode_ops.cpp"], text=True)
    src = src.replace("TORCH_LIBRARY_FRAGMENT(sparkrl_native", "TORCH_LIBRARY_FRAGMENT(sparkrl_rev")
    path = Path(tempfile.mkdtemp()) / "decode_ops_rev.cpp"
    path.write_text(src)
    from torch.utils.cpp_extension import load
    load("sparkrl_rev", [str(path)], extra_cflags=native.FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False)
    return torch.ops.sparkrl_rev.attention


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the git revision whose attention kernel to compare")
    ap.add_argument("--contexts", default="300,700,1500,2900")
    ap.add_argument("--tokens", default="1,2,5")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    assert native.available(), "the compiled kernels are what this compares"
    kernels = {"this": torch.ops.sparkrl_native.attention, args.against: kernel_at(args.against)}
    current = ["this"]

    def attention(q, k, v, mask, span, out_dtype):
        if span and mask.stride(-1) != 1:
            mask = mask.contiguous()
        return kernels[current[0]](q, k, v, mask, span, out_dtype)

    native.attention = attention
    dcfg = DraftConfig(draft="eagle3", draft_checkpoint="default", budget="fixed")
    lm, d, prompts = default_rollouts(dcfg, "bfloat16", args.data, 0.05, count=1)
    policy, taps = lm.model, tuple(d.rollout.model.feature_layers)
    contexts = [int(c) for c in args.contexts.split(",")]
    cache, _, _ = prefill(policy, prompts[:1], max(contexts) + 32, 1, taps)
    tokens = [int(t) for t in args.tokens.split(",")]
    g = torch.Generator().manual_seed(0)
    rows = []
    for context in contexts:
        while int(cache.lengths[0]) < context:
            policy(torch.randint(0, 1000, (1, 1), generator=g), cache, taps=taps)
            cache.commit(n_keep=torch.ones(1, dtype=torch.long))
        times = {(T, name): [] for T in tokens for name in kernels}
        for _ in range(args.repeats):
            for T, name in times:
                current[0] = name
                x = torch.randint(0, 1000, (1, T), generator=g)
                mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None]
                t = time.perf_counter()
                if T == 1:
                    policy(x, cache, taps=taps)
                else:
                    policy(x, cache, tree_mask=mask, depth=torch.arange(T)[None], taps=taps)
                times[(T, name)].append(time.perf_counter() - t)
                cache.commit(n_keep=torch.zeros(1, dtype=torch.long))
        for T in tokens:
            ms = {name: statistics.median(times[(T, name)]) * 1e3 for name in kernels}
            rows.append({"context": context, "tokens": T, "ms": ms, "speedup": ms[args.against] / ms["this"]})
            print(f"context {context:5d}, {T:2d} new tokens: {args.against} {ms[args.against]:.2f} ms, this "
                  f"{ms['this']:.2f} ms ({rows[-1]['speedup']:.3f}x)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_parts.json").write_text(json.dumps(
        {"against": args.against, "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows},
        indent=2))


if __name__ == "__main__":
    main()
