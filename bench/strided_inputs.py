"""Strided N-D inputs to frozen weights (`kernels.dense`): the drafters' training losses and a DFlash-style
block at inference, with the inputs made contiguous (now) and as they come (before), interleaved in one
process. Before, `F.linear` of a slice such as hidden[:, 1:] on a weight that needs no gradient (the
drafters' shared head) ran as a batched product over expanded copies of the weight.

Default model in float32, the shipped drafters. Training: one micro-batch of 8 sequences of 300 tokens
(random tokens, the last 240 positions trained), forward + backward of `eagle3.draft_loss` and of
`dflash.block_loss` at 8 and 32 blocks per sequence, medians of 4. Inference: `DFlashDrafter.block`
(15 drafted positions) over a 128-token context at 1, 8 and 32 rows, medians of 6. The two systems run
in alternating order.

    .venv/bin/python bench/strided_inputs.py --out bench/results/strided_inputs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import sparkrl.drafters.base as base
import sparkrl.kernels as kernels
from sparkrl.drafters import load_drafter, shipped_path
from sparkrl.drafters.dflash import block_loss
from sparkrl.drafters.eagle3 import draft_loss
from sparkrl.weights import load_model
from timing import seconds, speedup

SYSTEMS = {"strided (before)": lambda x: x, "contiguous (now)": kernels.dense}


def use(name: str) -> None:
    kernels.dense = base.dense = SYSTEMS[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/strided_inputs")
    args = ap.parse_args()
    policy = load_model("default").model.requires_grad_(False)
    drafters = {k: load_drafter(str(shipped_path(k)), policy.args).float().bind(policy) for k in ("eagle3", "dflash")}
    torch.manual_seed(0)
    toks = torch.randint(0, 8000, (8, 300))
    taps = tuple(sorted({i for d in drafters.values() for i in d.feature_layers}))
    with torch.no_grad():
        out = policy(toks, taps=taps)
        logits = policy.logits(out.hidden)
    mask = torch.ones(8, 300, dtype=torch.bool)
    mask[:, :60] = False
    losses = {"eagle3 draft_loss": lambda: draft_loss(drafters["eagle3"], toks, out.taps, out.hidden, logits, mask),
              **{f"dflash block_loss, {k} blocks": (lambda k=k: block_loss(
                  drafters["dflash"], toks, out.taps, logits, mask, anchors=k, generator=torch.Generator().manual_seed(0)))
                 for k in (8, 32)}}
    times = {case: {name: [] for name in SYSTEMS} for case in losses}
    for rep in range(4):
        for case, loss in losses.items():
            for name in (SYSTEMS if rep % 2 == 0 else reversed(SYSTEMS)):  # alternating order
                use(name)
                times[case][name].append(seconds(lambda: loss()[0].backward()))
                print(case, name, f"{times[case][name][-1]:.2f} s", flush=True)
    d = drafters["dflash"].requires_grad_(False)
    with torch.no_grad():
        for rows in (1, 8, 32):
            case = f"dflash block at {rows} rows"
            times[case] = {name: [] for name in SYSTEMS}
            cache = d.new_cache(rows, 200)
            d(None, torch.randn(rows, 128, policy.args.hidden_size), cache)
            cache.commit(n_keep=torch.full((rows,), 128))
            anchor = torch.randint(0, 8000, (rows,))
            for rep in range(7):
                for name in (SYSTEMS if rep % 2 == 0 else reversed(SYSTEMS)):
                    use(name)
                    s = seconds(lambda: d.block(anchor, cache, 15))
                    cache.commit(n_keep=torch.zeros(rows, dtype=torch.long))  # roll the block back
                    if rep:  # the first of each warms up
                        times[case][name].append(s)
    use("contiguous (now)")
    summary = {}
    for case, by in times.items():
        summary[case] = r = speedup(by, "strided (before)", "contiguous (now)")
        print(f"{case}: before {r['strided (before) s'] * 1e3:.1f} ms, now {r['contiguous (now) s'] * 1e3:.1f} ms, "
              f"{r['speedup']:.2f}x")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "strided_inputs.json").write_text(json.dumps({"summary": summary, "seconds": times}, indent=2))


if __name__ == "__main__":
    main()
