"""What the rollout bench scripts start from: the embedded default policy as sparkrl's rollout copy, its
drafting (drafter and budget) and the GSM8K-style prompts they run on."""

from __future__ import annotations

from sparkrl.model.weights import load_model
from sparkrl.train.assemble import make_drafting
from sparkrl.train.data import build_prompts, held_out, load_problems
from sparkrl.train.precision import rollout_copy


def default_rollouts(
    dcfg, dtype: str, data: str, heldout: float = 0.0, kernels: str = "auto", count: int = 64, skip: int = 0
):
    """(the loaded model with its rollout copy in `dtype` as .model, `assemble.Drafting` in the same dtype, the
    prompts of the first `count` problems of `data` after `skip` (with `heldout`, of those held out of draft
    pretraining only), the sampler the rollout copy's kernels give the engine)."""
    lm = load_model("default", dtype=dtype)
    rollout = rollout_copy(lm.model, lm.model.lm_head.weight.dtype, kernels)  # as sparkrl's rollout copy
    lm.model = rollout.model
    d = make_drafting(dcfg, lm.model, rollout, 1.0)  # the drafter in the policy's dtype, kernels and attention
    problems = load_problems(data).problems
    problems = ([p for p in problems if held_out(p, heldout)] if heldout else problems)[skip:]
    return lm, d, build_prompts(lm.tokenizer, problems[:count], 512, "skip").prompt_ids, rollout.sampler
