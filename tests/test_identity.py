"""Same seed, same tokens (the README's pairing promise) on the default model, in float32, bfloat16 and int8 under
`--cpu-kernels auto`: greedy speculative rollouts (EAGLE3-style trees, DFlash-style blocks, each with and
without SPARK) equal greedy autoregressive ones, and at temperature 1 the point-mass drafts commit the tokens AR
sampling gives with the same generators. The shipped drafters accept often, so many verification forwards of
many tokens are compared with one-token decode steps, in batches whose rows finish at different rounds: a
kernel whose sums depend on the number of rows, new tokens, span or tree layout breaks it (the kernel-level
checks of that are in tests/test_kernels.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sparkrl.config import DraftConfig, SamplingConfig, SparkConfig
from sparkrl.engine.autoregressive import response_generators
from sparkrl.model.weights import load_model
from sparkrl.train.data import chat_prompt_ids
from sparkrl.train.generation import RolloutPlan, build_generation

pytestmark = pytest.mark.slow
KERNELS = "auto"  # the default; "packed" or "plain" (torch's kernels) fail here

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May?",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module")
def default_lm():
    return load_model("default")


@pytest.mark.parametrize(
    "dtype,temperature,top_p,n",
    [("bfloat16", 0.0, 1.0, 1), ("bfloat16", 1.0, 0.95, 2), ("float32", 0.0, 1.0, 1), ("int8", 1.0, 0.95, 2)],
)
def test_speculative_rollouts_are_the_autoregressive_tokens_on_the_default_model(
    default_lm, dtype, temperature, top_p, n
):
    """Both drafters with SPARK on (its corrected proposals take the drafter's code path and more), and the policy's
    8-bit sibling (--draft self-int8) but where the copy itself is 8-bit; int8: the policy copy's 8-bit products."""
    plan = RolloutPlan.settle(default_lm.model, dtype, KERNELS, DraftConfig())
    build = lambda cfg: build_generation(
        replace(plan, draft=cfg.draft), cfg, default_lm.model, temperature, separate=True
    )  # a copy in `dtype` (the default model's master weights are float32)
    prompts = [chat_prompt_ids(default_lm.tokenizer, p) for p in PROMPTS]
    sc = SamplingConfig(temperature, top_p, 40)
    gens = lambda: response_generators(0, len(prompts), n)
    ar = build(DraftConfig()).generate(prompts, sc, default_lm.eos_ids, gens(), group_size=n).tokens
    spark = SparkConfig(spark=True)
    drafts = [("eagle3", spark), ("dflash", spark)] + ([("self-int8", SparkConfig())] if dtype != "int8" else [])
    for draft, sc_ in drafts:
        cfg = DraftConfig(draft=draft, budget="fixed", spark_config=sc_)
        r = build(cfg).generate(prompts, sc, default_lm.eos_ids, gens(), n)
        assert r.stats.aal > 1.2, (draft, r.stats.aal)  # drafts were accepted: many verification forwards
        assert r.tokens == ar, draft
