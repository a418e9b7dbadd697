"""Why rollouts collapse when another job shares the CPU: torch's OpenMP threads against each other.

Times one autoregressive decode step of the default model (8 rows, 128-token context) in a fresh
process, alone and next to a competing process that runs the same loop, for several thread counts and
OpenMP wait policies. Each configuration runs in its own processes (OpenMP reads its settings at
start-up). Writes bench/results/threads.json; read the ratios to the quiet 2-thread step.

    .venv/bin/python bench/threads.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from sparkrl.model.weights import load_model


def worker(threads: int, seconds: float) -> None:
    torch.set_num_threads(threads)
    policy = load_model("default", with_tokenizer=False).model
    B, T = 8, 128
    cache = policy.new_cache(B, T + 8)
    with torch.no_grad():
        policy(torch.randint(0, 1000, (B, T)), cache)
        cache.commit(n_keep=torch.full((B,), T))
        tok = torch.randint(0, 1000, (B, 1))
        times, end = [], time.time() + seconds
        while time.time() < end:
            t0 = time.perf_counter()
            policy.logits(policy(tok, cache).hidden[:, -1])
            cache.commit(n_keep=torch.zeros(B, dtype=torch.long))  # same context every step
            times.append(time.perf_counter() - t0)
    print(json.dumps({"median_s": statistics.median(times[2:]), "steps": len(times)}), flush=True)


def run(threads: int, competitor: bool, env_extra: dict, seconds: float) -> float:
    env = {**os.environ, **env_extra}
    cmd = [sys.executable, __file__, "--worker", "--threads", str(threads), "--seconds"]
    comp = subprocess.Popen(cmd + [str(seconds + 20)], env=env, stdout=subprocess.DEVNULL) if competitor else None
    if comp:
        time.sleep(8)  # the competitor has loaded its model and is stepping
    out = subprocess.run(cmd + [str(seconds)], env=env, capture_output=True, text=True, check=True).stdout
    if comp:
        comp.kill()
        comp.wait()
    return json.loads(out.strip().splitlines()[-1])["median_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    if a.worker:
        return worker(a.threads, a.seconds)
    cores = os.cpu_count()
    configs = [
        ("alone", cores, False, {}),
        ("alone, OMP_WAIT_POLICY=PASSIVE", cores, False, {"OMP_WAIT_POLICY": "PASSIVE"}),
        ("shared", cores, True, {}),
        ("shared, 1 thread each", 1, True, {}),
        ("shared, OMP_WAIT_POLICY=PASSIVE", cores, True, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ]
    rows = []
    for name, threads, comp, env in configs:
        s = run(threads, comp, env, a.seconds)
        rows.append({"config": name, "threads": threads, "env": env, "median_step_s": s})
        print(f"{name:34s} threads {threads}: {s * 1000:7.1f} ms/step", flush=True)
    base = rows[0]["median_step_s"]
    for r in rows:
        r["ratio_to_alone"] = r["median_step_s"] / base
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "threads.json").write_text(
        json.dumps({"cores": cores, "torch": torch.__version__, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
