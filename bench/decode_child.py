"""One process's timing of the default policy's autoregressive decode step, for the benches that set processes side
by side (`against_commit.py`: another commit's tree on PYTHONPATH; `vs_llamacpp.py`: beside llama.cpp). It uses
only what every recent commit has: the rollout copy and kernels `RolloutPlan.settle` picks for --rollout-dtype,
`prefill`, then `decode_one_token` as a rollout runs it. Prints one line `RESULT {json}`: per setting "BxCTX", the
seconds per step and the tokens sampled (the same uniforms in every process).

    python bench/decode_child.py '{"responses": [1], "contexts": [128], "steps": 16, "dtype": "auto"}'
"""

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from child_process import report, result_of

from sparkrl.config import DraftConfig, SamplingConfig
from sparkrl.engine.autoregressive import decode_one_token, prefill
from sparkrl.model.weights import load_model
from sparkrl.train.data import load_problems
from sparkrl.train.generation import RolloutPlan, build_generation


def context_ids(tokenizer, P: int, length: int) -> list[list[int]]:
    """P prompts of `length` tokens of the default problems' text (natural logits: the nucleus's cost depends on
    them), each from another offset."""
    text = " ".join(f"{p.question} {p.answer}" for p in load_problems("default").problems)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= length + P * 97, "the default problems hold too little text for this context"
    return [ids[i * 97 : i * 97 + length] for i in range(P)]


def time_steps(model, sampler, prompts, G: int, n: int, around=None) -> tuple[float, list[list[int]]]:
    """Seconds per decode step over n steps after the prompts (each copied to G responses, 2 untimed steps first), and
    the tokens of every timed step; `around`: a context manager the timed steps run in (a profiler)."""
    cache, logits, _ = prefill(model, prompts, len(prompts[0]) + n + 4, G)
    u = torch.rand(n + 3, len(prompts) * G, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(1.0, 0.95, n)
    nxt, _ = sampler.token(logits, 1.0, 0.95, u[0])
    for i in range(2):
        nxt, _, _ = decode_one_token(model, cache, nxt, sampling, u[1 + i], sampler=sampler)
    toks = []
    with around if around is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        for i in range(n):
            nxt, _, _ = decode_one_token(model, cache, nxt, sampling, u[3 + i], sampler=sampler)
            toks.append(nxt.tolist())  # the engine's host sync each step
        step_s = (time.perf_counter() - t0) / n
    return step_s, toks


def run_child(settings: dict, tree: Path | None = None, extensions: Path | None = None) -> dict:
    """This script in a fresh process (on `tree`'s sparkrl, its compiled kernels built into `extensions`, where
    given): its RESULT."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    cmd = [sys.executable, str(Path(__file__).resolve()), json.dumps(settings)]
    return result_of(cmd, f"the decode timing ({settings}, tree {tree})", env=env, cwd=tree, stderr=subprocess.PIPE)


def main() -> None:
    s = json.loads(sys.argv[1])
    n = s["steps"]
    lm, dc = load_model("default"), DraftConfig(draft="none")
    gen = build_generation(
        RolloutPlan.settle(lm.model, s.get("dtype", "auto"), "auto", dc), dc, lm.model, 1.0, trains=False
    )
    model, sampler = gen.policy.model, gen.policy.sampler
    out = {}
    with torch.no_grad():
        for ctx in s["contexts"]:
            for B in s["responses"]:
                P = max(1, B // 8)
                step_s, toks = time_steps(model, sampler, context_ids(lm.tokenizer, P, ctx), B // P, n)
                out[f"{B}x{ctx}"] = {"step_s": step_s, "tokens": toks}
    out["dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    report(out)


if __name__ == "__main__":
    main()
