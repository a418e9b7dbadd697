"""GRPO steps with float32 rollouts (default kernels; without the compiled few-row product; or weight-major
unpacked) vs bfloat16 rollouts (on plain or prepacked CPU kernels, with the LM head in bf16 or float32;
and bf16 autocast training), side by side.

Each configuration is a full GRPO run (`trainer.GRPORun`) on the default model from the same weights,
prompts and seeds, interleaved step by step with alternating order. Reported per configuration: the
step time split (generation / policy update), its ratio to the first configuration (--config; by
default the float32 run), the mismatch between the
rollout model and the trained weights (mean / max |log pi - log pi_rollout|, k3 KL per token) and the
reward per step. Writes bench/results/precision_step.json.

    .venv/bin/python bench/precision_step.py --steps 4
    .venv/bin/python bench/precision_step.py --config "fp32 rollouts" --config "fp32 rollouts, weight-major kernels"
    .venv/bin/python bench/precision_step.py --config "fp32 rollouts" --config "fp32 rollouts, BLAS kernels"
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from sparkrl.config import DataConfig, GRPOConfig, ModelConfig, RunConfig, SamplingConfig
from sparkrl.cpu.accelerate import use_native
from sparkrl.engine.sampling import SAMPLER
from sparkrl.train.trainer import GRPORun

CONFIGS = {
    "fp32 rollouts": dict(rollout_dtype="float32", train_dtype="float32"),
    "fp32 rollouts, BLAS kernels": dict(rollout_dtype="float32", train_dtype="float32", native=False),
    "fp32 rollouts, weight-major kernels": dict(
        rollout_dtype="float32", train_dtype="float32", cpu_kernels="weight-major"
    ),
    "bf16 rollouts, plain kernels": dict(rollout_dtype="bfloat16", train_dtype="float32", cpu_kernels="plain"),
    "bf16 rollouts": dict(rollout_dtype="bfloat16", train_dtype="float32"),
    "bf16 rollouts, float32 head": dict(rollout_dtype="bfloat16", train_dtype="float32", rollout_head="float32"),
    "bf16 rollouts + bf16 autocast update": dict(rollout_dtype="bfloat16", train_dtype="bfloat16"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--data", default="default")
    ap.add_argument(
        "--config",
        action="append",
        choices=list(CONFIGS),
        help="a configuration to run (repeatable; the first is the baseline; default: all)",
    )
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    names = a.config or list(CONFIGS)
    tmp = Path(tempfile.mkdtemp())
    runs = {}
    for name in names:
        c = CONFIGS[name]
        cfg = RunConfig(
            out=str(tmp / name.replace(" ", "_")),
            steps=a.steps,
            checkpoint_every=10**6,
            model=ModelConfig(**{k: v for k, v in c.items() if k not in ("train_dtype", "native")}),
            sampling=SamplingConfig(max_new_tokens=a.max_new_tokens),
            data=DataConfig(data=a.data),
            grpo=GRPOConfig(
                group_size=a.group_size, prompts_per_step=a.prompts_per_step, lr=a.lr, train_dtype=c["train_dtype"]
            ),
        )
        runs[name] = GRPORun(cfg)
        if c.get("native") is False:  # the default kernels less the compiled few-row product
            use_native(runs[name].generation.policy.model, False)
            runs[name].generation.policy.sampler = SAMPLER
    rows = {name: [] for name in runs}
    for step in range(a.steps):
        for name in list(runs) if step % 2 == 0 else list(runs)[::-1]:
            m = runs[name].step(step)
            rows[name].append(m)
            print(
                f"step {step + 1} {name}: gen {m['gen_s']:.1f}s ({m['gen_tok_per_s']:.0f} tok/s), update "
                f"{m['train_s']:.1f}s, reward {m['reward_mean']:.3f}, |dlogp| {m['rollout_logp_abs_mean']:.4f} "
                f"(max {m['rollout_logp_abs_max']:.3f}), KL {m['rollout_kl']:.2e}",
                flush=True,
            )
    for r in runs.values():
        r.grader.close()
    # per token: generation time / tokens (responses differ in length between the dtypes)
    base = rows[names[0]]
    per_tok = lambda ms: sum(m["gen_s"] for m in ms) / sum(m["gen_tokens"] for m in ms)
    upd = lambda ms: statistics.median(m["train_s"] for m in ms)
    summary = {}
    for name, ms in rows.items():
        summary[name] = {
            "gen_s_per_token": per_tok(ms),
            "gen_speedup": per_tok(base) / per_tok(ms),
            "update_s_median": upd(ms),
            "update_speedup": upd(base) / upd(ms),
            # a step at the fp32 run's token count: generation per token x tokens + the update
            "step_speedup": (per_tok(base) * statistics.mean(m["gen_tokens"] for m in base) + upd(base))
            / (per_tok(ms) * statistics.mean(m["gen_tokens"] for m in base) + upd(ms)),
            "logp_abs_mean": statistics.mean(m["rollout_logp_abs_mean"] for m in ms),
            "logp_abs_max": max(m["rollout_logp_abs_max"] for m in ms),
            "kl_per_token": statistics.mean(m["rollout_kl"] for m in ms),
            "reward_per_step": [m["reward_mean"] for m in ms],
        }
        print(name, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary[name].items()}))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "precision_step.json").write_text(
        json.dumps(
            {
                "args": vars(a),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "summary": summary,
                "steps": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
