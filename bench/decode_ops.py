"""The compiled RMSNorm and RoPE (`sparkrl.native.rms_norm` / `rope`) against torch's ops, in the default
model's decode step: the rollout copy as `--cpu-kernels auto` makes it in each dtype (its products on
whatever kernels it measured), with every norm and attention's RoPE compiled or on torch's tensor ops.
Interleaved within each repeat, medians; also the largest hidden-state difference between the two.

    .venv/bin/python bench/decode_ops.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from sparkrl import native
from sparkrl.model import Attention, RMSNorm
from sparkrl.precision import _step_seconds, rollout_copy
from sparkrl.weights import load_model


def use_ops(model, on: bool) -> None:
    for m in model.modules():
        if isinstance(m, (RMSNorm, Attention)):
            m.native = on


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit("the compiled kernels cannot be built here")
    policy = load_model("default", with_tokenizer=False).model
    results = []
    for name in args.dtypes.split(","):
        model = rollout_copy(policy, getattr(torch, name), "auto").model
        tokens = torch.randint(0, policy.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            hidden = {}
            for on in (False, True):
                use_ops(model, on)
                hidden[on] = model(tokens).hidden.float()
        diff = float((hidden[True] - hidden[False]).abs().max())
        for rows in map(int, args.rows.split(",")):
            t = {False: [], True: []}
            for _ in range(args.repeats):  # interleaved: drift hits both alike
                for on in (False, True):
                    use_ops(model, on)
                    t[on] += _step_seconds(model, rows=rows, context=192, reps=5)
            ms = {on: statistics.median(v) * 1e3 for on, v in t.items()}
            results.append({"dtype": name, "rows": rows, "torch_ms": ms[False], "compiled_ms": ms[True],
                            "speedup": ms[False] / ms[True], "products_compiled": model.lm_head.native,
                            "max_hidden_diff": diff})
            print(f"{name} {rows:3d} rows: torch ops {ms[False]:.1f} ms, compiled {ms[True]:.1f} ms, "
                  f"{ms[False] / ms[True]:.3f}x (largest hidden-state difference {diff:.2e})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_ops.json").write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                                     "results": results}, indent=2))


if __name__ == "__main__":
    main()
