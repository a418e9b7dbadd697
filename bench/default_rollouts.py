"""What the rollout bench scripts start from: the embedded default policy, what makes its rollouts
(`generation.build_generation`: its inference copy, the drafting and the engine) and the GSM8K-style prompts they
run on."""

from __future__ import annotations

from sparkrl.model.weights import load_model
from sparkrl.train.data import build_prompts, held_out, load_problems
from sparkrl.train.generation import RolloutPlan, build_generation


def default_rollouts(
    dcfg, dtype: str, data: str, heldout: float = 0.0, kernels: str = "auto", count: int = 64, skip: int = 0
):
    """(the loaded model, with its inference copy in `dtype` as .model; `generation.Generation` in the same
    dtype, nothing training; the prompts of the first `count` problems of `data` after `skip` (with `heldout`, of
    those held out of draft pretraining only))."""
    lm = load_model("default", dtype=dtype)
    plan = RolloutPlan.settle(lm.model, "model", kernels, dcfg)
    gen = build_generation(plan, dcfg, lm.model, 1.0, trains=False)
    lm.model = gen.policy.model
    return lm, gen, default_prompts(lm.tokenizer, data, heldout, count, skip)


def default_prompts(tokenizer, data: str, heldout: float = 0.0, count: int = 64, skip: int = 0) -> list[list[int]]:
    """The GRPO prompts (token ids) of the first `count` problems of `data` after `skip` (with `heldout`, of those
    held out of draft pretraining only)."""
    problems = load_problems(data).problems
    problems = ([p for p in problems if held_out(p, heldout)] if heldout else problems)[skip:]
    return build_prompts(tokenizer, problems[:count], 512, "skip").prompt_ids
