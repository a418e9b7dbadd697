"""The LM head of the GRPO update: token log-probabilities from full float32 logits (the plain form,
`grpo.token_logprobs(Transformer.logits(h))`) against the blocked `logprobs.head_logprobs`, side by side.

Part 1, the head alone (default model's head, 576 x 49,152, float32, forward + backward of a sum
over N rows): each measurement in its own process, the two forms alternating, for its peak memory
(resident set above the inputs) and time. Part 2 (`--update`), the whole GRPO update on one real
rollout (2 prompts x 4 responses x 128 tokens, default model and data): `trainer.policy_update` with
each form, alternating in one process, for float32 and bfloat16-autocast training. Medians.

    .venv/bin/python bench/head_logprobs.py --out bench/results --update
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparkrl.grpo import token_logprobs
from sparkrl.logprobs import head_logprobs
from sparkrl.model import Transformer

V, D = 49152, 576


def plain(self, hidden, targets, temperature=1.0, keep_logits=False):
    """`Transformer.token_logprobs` as it was: full logits, then log-softmax and gather."""
    logits = self.logits(hidden)
    return token_logprobs(logits, targets, temperature), (logits.detach() if keep_logits else None)


def child(form: str, n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(V, D, generator=g) * 0.02).requires_grad_()
    h = torch.randn(n, D, generator=g).requires_grad_()
    t = torch.randint(0, V, (n,), generator=g)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    lp = token_logprobs(F.linear(h, w), t) if form == "plain" else head_logprobs(h, w, t)[0]
    lp.sum().backward()
    return {"seconds": time.perf_counter() - t0,
            "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}


def head_alone(rows: list[int], repeats: int) -> dict:
    out = {}
    for n in rows:
        runs = {"plain": [], "blocked": []}
        for r in range(repeats):
            for form in (("plain", "blocked") if r % 2 == 0 else ("blocked", "plain")):
                res = subprocess.run([sys.executable, __file__, "--child", form, str(n)], check=True,
                                     capture_output=True, text=True)
                runs[form].append(json.loads(res.stdout.strip().splitlines()[-1]))
        out[n] = {form: {"seconds": statistics.median(x["seconds"] for x in v),
                         "peak_mb": max(x["peak_mb"] for x in v)} for form, v in runs.items()}
        p, b = out[n]["plain"], out[n]["blocked"]
        print(f"{n:5d} rows: plain {p['seconds']:.2f} s {p['peak_mb']:.0f} MB, blocked {b['seconds']:.2f} s "
              f"{b['peak_mb']:.0f} MB (time plain/blocked {p['seconds'] / b['seconds']:.2f}x)", flush=True)
    return out


def whole_update(train_dtype: str, repeats: int) -> dict:
    from sparkrl import trainer
    from sparkrl.config import DataConfig, GRPOConfig, ModelConfig, RunConfig, SamplingConfig

    cfg = RunConfig(out=tempfile.mkdtemp(), steps=1, checkpoint_every=10**6, model=ModelConfig(rollout_dtype="bfloat16"),
                    sampling=SamplingConfig(max_new_tokens=128), data=DataConfig(data="default"),
                    grpo=GRPOConfig(group_size=4, prompts_per_step=2, lr=1e-6, train_dtype=train_dtype))
    run = trainer.GRPORun(cfg)
    update, seen = trainer.policy_update, {}

    def capture(*a, **k):
        seen["call"] = (a, k)
        return update(*a, **k)

    trainer.policy_update = capture
    run.step(0)  # one real step; its rollout is the one every update below runs on
    trainer.policy_update = update
    run.grader.close()
    a, k = seen["call"]
    blocked, times = Transformer.token_logprobs, {"plain": [], "blocked": []}
    try:
        for r in range(repeats):
            for form in (("plain", "blocked") if r % 2 == 0 else ("blocked", "plain")):
                Transformer.token_logprobs = plain if form == "plain" else blocked
                t0 = time.perf_counter()
                update(*a, **k)
                times[form].append(time.perf_counter() - t0)
    finally:
        Transformer.token_logprobs = blocked
    med = {f: statistics.median(v) for f, v in times.items()}
    print(f"GRPO update, {train_dtype} training: plain {med['plain']:.2f} s, blocked {med['blocked']:.2f} s "
          f"({med['plain'] / med['blocked']:.2f}x); all: {json.dumps(times)}", flush=True)
    return {"median_s": med, "all_s": times}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="516,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--update", action="store_true", help="also time the whole GRPO update each way")
    ap.add_argument("--child", nargs=2, metavar=("FORM", "ROWS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]))))
        return
    res = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "head": head_alone([int(x) for x in a.rows.split(",")], a.repeats)}
    if a.update:
        res["update"] = {dt: whole_update(dt, a.repeats + 1) for dt in ("float32", "bfloat16")}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "head_logprobs.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
