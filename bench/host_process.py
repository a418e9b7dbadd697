"""Does a vLLM engine slow the process it lives in? sparkrl's own autoregressive rollouts (1 prompt x 1 and x 8, the
default policy in the rollout dtype the default picks) and one policy update of `train` (`policy_update` and
`apply_update` with the default GRPO settings: the float32 master, the frozen reference's forward for the KL term,
micro-batches of 4, AdamW's step) on 8 responses of 192 tokens, timed in a process that holds a started vLLM engine
(as `train --engine vllm` does: one request served first) and in one that does not. The two kinds of process
alternate (--rounds of each); each reports its median. Also records, per process, what could carry a slowdown:
torch's thread counts, the CPU affinity, the threads alive and the OpenMP / allocator settings vLLM changes. Writes
host_process.json into --out; nothing else may run while it measures.

    .venv/bin/python bench/host_process.py --out bench/results/host_process
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from sparkrl.commands.bench import machine
from sparkrl.config import DraftConfig, RunConfig, SamplingConfig
from sparkrl.engine.autoregressive import Autoregressive, response_generators
from sparkrl.engine.records import Rollout
from sparkrl.model.weights import load_model
from sparkrl.train.data import build_prompts, load_problems
from sparkrl.train.generation import RolloutPlan, build_generation
from sparkrl.train.update import apply_update, policy_update

SETTINGS = {"1 response": 1, "8 responses": 8}


def state() -> dict:
    env = ("LD_PRELOAD", "OMP_NUM_THREADS", "KMP_AFFINITY", "OMP_WAIT_POLICY")
    return {"torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "affinity": sorted(os.sched_getaffinity(0)), "threads_alive": len(os.listdir("/proc/self/task")),
            **{k: os.environ.get(k) for k in env}}  # fmt: skip


def update_work(master, prompt: list[int], responses: int = 8, length: int = 192):
    """A function timing one GRPO update of `master` as `train` makes it (its default settings, a reference copy
    for the KL term, AdamW) on fixed responses, so that every process does the same work; seconds."""
    cfg = RunConfig(out="unused")
    ref = copy.deepcopy(master).requires_grad_(False)
    opt = torch.optim.AdamW(master.parameters(), lr=cfg.grpo.lr, weight_decay=cfg.grpo.weight_decay)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (responses, length), generator=g).tolist()
    rollout = Rollout([prompt], responses, tokens, ["length"] * responses, logp=[[-1.0] * length] * responses)
    adv = torch.randn(responses, generator=g)

    def timed() -> float:
        t0 = time.perf_counter()
        policy_update(master, ref, opt, rollout, adv, cfg)
        apply_update(master, opt, cfg.grpo.max_grad_norm)
        return time.perf_counter() - t0

    return timed


def worker(with_vllm: bool, repeats: int, tokens: int) -> dict:
    """One process's medians: tokens/s per setting, and the update's seconds."""
    lm = load_model("default")
    master = lm.model
    dc = DraftConfig(draft="none")
    gen = build_generation(RolloutPlan.settle(master, "auto", "auto", dc), dc, master, 1.0, trains=False)
    policy, sampler = gen.policy.model, gen.policy.sampler
    prompts = build_prompts(lm.tokenizer, load_problems("default").problems[:8], 512, "skip").prompt_ids
    sampling = SamplingConfig(1.0, 0.95, tokens)
    if with_vllm:
        from sparkrl.vllm.engine import VllmEngine

        lm.model = policy
        engine = VllmEngine.serving(lm, None, policy.lm_head.weight.dtype, 1, 512 + tokens)
        engine.generate(prompts[:1], sampling, lm.eos_ids, 8, 0)
    out = {"state": state(), "tok_per_s": {}}
    for name, G in SETTINGS.items():
        rates = []
        for rep in range(repeats + 1):
            gens = response_generators(rep, 1, G)
            r = Autoregressive().generate(policy, prompts[rep % 8 : rep % 8 + 1], sampling, lm.eos_ids, gens, G,
                                          sampler=sampler)  # fmt: skip
            if rep:  # the first is untimed
                rates.append(r.num_tokens / r.gen_s)
        out["tok_per_s"][name] = statistics.median(rates)
    update = update_work(master, prompts[0])
    times = [update() for _ in range(repeats + 1)]
    out["update_s"] = statistics.median(times[1:])  # the first (AdamW's state made) is untimed
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/host_process")
    ap.add_argument("--rounds", type=int, default=2, help="processes of each kind, alternating")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--worker", choices=["alone", "vllm"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker == "vllm", a.repeats, a.max_new_tokens)), flush=True)
        return
    runs = {"alone": [], "vllm": []}
    for i in range(a.rounds):
        for kind in ("alone", "vllm") if i % 2 == 0 else ("vllm", "alone"):
            cmd = [sys.executable, __file__, "--worker", kind, "--repeats", str(a.repeats), "--max-new-tokens",
                   str(a.max_new_tokens)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = runs[kind][-1]
            print(f"{kind:5s}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in r["tok_per_s"].items())
                  + f", update {r['update_s']:.2f}s", flush=True)  # fmt: skip
    med = lambda kind, f: statistics.median(f(r) for r in runs[kind])
    ratios = {name: med("vllm", lambda r, n=name: r["tok_per_s"][n]) / med("alone", lambda r, n=name: r["tok_per_s"][n])
              for name in SETTINGS}  # fmt: skip
    ratios["update (time alone / time beside vLLM)"] = med("alone", lambda r: r["update_s"]) / med(
        "vllm", lambda r: r["update_s"]
    )
    for k, v in ratios.items():
        print(f"beside vLLM / alone, {k}: {v:.2f}x")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python bench/host_process.py " + " ".join(sys.argv[1:])
    result = {"command": command, "machine": machine(), "load": os.getloadavg(), "ratios": ratios, "runs": runs}
    (out / "host_process.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
