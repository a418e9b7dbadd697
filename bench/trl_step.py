"""One TRL GRPO step with TRL's own generation vs sparkrl's rollout function (autoregressive and
speculative + SPARK), side by side in one process.

Every method trains its own copy of the same policy with its own GRPOTrainer (same GRPOConfig, same
prompts and seeds per repeat); repeats alternate the methods' order, and each repeat is one GRPO
step (a fresh GRPOTrainer with max_steps=1 on the method's model, which keeps its weights across
repeats; the sparkrl rollout functions keep their engines and drafters). Repeat 0 is a warm-up (the
engines are built, the speculation budget's cost model is timed once) and is not counted. Reported
per method, medians over the counted repeats: the step time, the generation time (TRL's `_generate`
with the rollout function inside it, so sparkrl's weight sync and online draft training count as
generation), generated tokens per second, and the ratios to TRL's generation. Writes
OUT/trl_step.json with the command, the settings and every raw timing.

    .venv/bin/python bench/trl_step.py --repeats 3                       # the default model (minutes)
    .venv/bin/python bench/trl_step.py --model DIR --max-new-tokens 8 --repeats 1 --draft-checkpoint fresh
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from sparkrl.commands.trl_rollout import SparkRollout, math_reward, problem_dataset  # noqa: E402
from sparkrl.config import DraftConfig, SparkConfig, TRLConfig  # noqa: E402
from sparkrl.model.weights import resolve_model_path  # noqa: E402
from sparkrl.train.data import load_problems  # noqa: E402
from sparkrl.train.rewards import Grader  # noqa: E402


class TimedTrainer(trl.GRPOTrainer):
    """GRPOTrainer that times its generation (`_generate`: TRL's own, or the rollout function)."""

    gen_s: list[float]

    def _generate(self, prompts):
        t = time.perf_counter()
        out = super()._generate(prompts)
        self.gen_s.append(time.perf_counter() - t)
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="default, or a local Hugging Face folder")
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="counted GRPO steps per method (after one warm-up)")
    ap.add_argument("--draft", default="eagle3", choices=("eagle3", "dflash"))
    ap.add_argument("--draft-checkpoint", default="", help="empty: the shipped drafter for the default model")
    ap.add_argument("--budget", default="auto", choices=("auto", "adaptive", "fixed"))
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()

    folder = resolve_model_path(a.model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    problems = load_problems("default", 200, a.seed).problems
    data = problem_dataset(problems)
    grader = Grader()

    tmp = Path(tempfile.mkdtemp())

    def grpo_args(rep: int) -> trl.GRPOConfig:
        return trl.GRPOConfig(
            output_dir=str(tmp / "out"),
            max_steps=1,
            num_generations=a.group_size,
            per_device_train_batch_size=a.prompts_per_step * a.group_size,
            max_completion_length=a.max_new_tokens,
            temperature=1.0,
            top_p=0.95,
            learning_rate=a.lr,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            bf16=False,
            seed=a.seed + rep,
            disable_tqdm=True,
        )

    draft = DraftConfig(
        draft=a.draft, draft_checkpoint=a.draft_checkpoint, budget=a.budget, spark_config=SparkConfig(spark=True)
    )
    methods = {
        "trl": None,
        "sparkrl-ar": SparkRollout(TRLConfig(draft=DraftConfig(), seed=a.seed), grpo_args(0)),
        f"sparkrl-{a.draft}+spark": SparkRollout(TRLConfig(draft=draft, seed=a.seed), grpo_args(0)),
    }
    models = {name: copy.deepcopy(base) for name in methods}
    raw = {name: [] for name in methods}
    for rep in range(a.repeats + 1):
        for name in list(methods) if rep % 2 == 0 else list(methods)[::-1]:
            trainer = TimedTrainer(
                model=models[name],
                args=grpo_args(rep),
                reward_funcs=math_reward(grader),
                train_dataset=data,
                processing_class=tok,
                rollout_func=methods[name],
            )
            trainer.gen_s = []
            t = time.perf_counter()
            trainer.train()
            step_s = time.perf_counter() - t
            log = next(h for h in trainer.state.log_history if "completions/mean_length" in h)
            tokens = log["completions/mean_length"] * a.prompts_per_step * a.group_size
            row = {
                "repeat": rep,
                "step_s": step_s,
                "gen_s": sum(trainer.gen_s),
                "tokens": tokens,
                "reward": log["reward"],
                **{k: v for k, v in log.items() if k.startswith("sparkrl/")},
            }
            raw[name].append(row)
            aal = f", AAL {row['sparkrl/aal']:.2f}" if "sparkrl/aal" in row else ""
            print(
                f"{'warm-up' if rep == 0 else f'repeat {rep}'} {name}: step {step_s:.1f}s, generation "
                f"{row['gen_s']:.1f}s ({tokens / row['gen_s']:.1f} tok/s){aal}",
                flush=True,
            )
    grader.close()

    counted = {name: rows[1:] for name, rows in raw.items()}
    med = lambda name, k: statistics.median(r[k] for r in counted[name])
    summary = {}
    for name in methods:
        gen_per_tok = statistics.median(r["gen_s"] / r["tokens"] for r in counted[name])
        summary[name] = {
            "step_s": med(name, "step_s"),
            "gen_s": med(name, "gen_s"),
            "gen_tok_per_s": 1 / gen_per_tok,
            **({"aal": med(name, "sparkrl/aal")} if "sparkrl/aal" in counted[name][0] else {}),
        }
    ref = summary["trl"]
    for name, s in summary.items():
        s["step_speedup_vs_trl"] = ref["step_s"] / s["step_s"]
        s["gen_speedup_vs_trl"] = s["gen_tok_per_s"] / ref["gen_tok_per_s"]
    print("\nmethod                     step s   gen s   gen tok/s   step x   gen x   AAL")
    for name, s in summary.items():
        print(
            f"{name:26s} {s['step_s']:7.1f} {s['gen_s']:7.1f} {s['gen_tok_per_s']:11.1f} "
            f"{s['step_speedup_vs_trl']:8.2f} {s['gen_speedup_vs_trl']:7.2f}   {s.get('aal', float('nan')):.2f}"
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
        "settings": vars(a),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "threads": torch.get_num_threads(),
        "summary": summary,
        "raw": raw,
    }
    (out / "trl_step.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'trl_step.json'}")


if __name__ == "__main__":
    main()
