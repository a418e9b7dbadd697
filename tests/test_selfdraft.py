"""--draft self-int8: the policy's copy with 8-bit products drafts for itself. Its sibling shares the copy's
weights and follows their updates; the committed tokens follow the policy exactly (chi-square) and greedy chains
equal greedy decoding; a run trains, checkpoints and resumes with it; what it cannot do is one line."""

from __future__ import annotations

import pytest
import torch
from helpers import ALPHA, EOS, chi_square_pvalue, sequence_probs, small_policy

from sparkrl.commands.cli import main
from sparkrl.config import DraftConfig, SamplingConfig, SparkConfig, TreeShape
from sparkrl.cpu import native
from sparkrl.cpu.accelerate import accelerate
from sparkrl.cpu.kernels import CpuLinear
from sparkrl.drafters.selfdraft import SelfDrafter
from sparkrl.engine.autoregressive import generate, response_generators
from sparkrl.engine.speculative import generate_speculative
from sparkrl.errors import UserError
from sparkrl.train.generation import RolloutPlan
from sparkrl.train.precision import int8_sibling

pytestmark = pytest.mark.skipif(not native.available(), reason="the compiled CPU kernels cannot be built here")

PROMPTS = [[1, 2, 3, 4], [2, 0]]


def accelerated(seed: int = 0):
    return accelerate(small_policy(seed), "auto").model


def test_binding_keeps_the_sibling_of_the_same_policy_and_remakes_it_for_another():
    policy, other = accelerated(), accelerated(seed=2)
    d = SelfDrafter(policy, int8_sibling, "self-int8")
    sib = d.policy
    assert d.bind(policy).policy is sib and d.kind == "self-int8"
    assert d.bind(other).policy is not sib and d.policy.lm_head.weight is other.lm_head.weight and d.policy.lm_head.int8
    assert SelfDrafter(policy).bind(other).policy is other and SelfDrafter(policy).kind == "self"


def test_the_sibling_shares_the_weights_runs_8_bit_and_follows_their_updates():
    policy = accelerated()
    sib = int8_sibling(policy)
    assert all(a is b for a, b in zip(sib.parameters(), policy.parameters()))  # no second copy
    lin = [m for m in sib.modules() if isinstance(m, CpuLinear)]
    assert lin and all(m.int8 for m in lin) and sib.lm_head in lin  # the head too
    assert not any(m.int8 for m in policy.modules() if isinstance(m, CpuLinear))  # the policy is untouched
    tokens = torch.tensor([[1, 2, 3, 4, 0]])

    def logits(model):
        with torch.no_grad():
            return model.logits(model(tokens, model.new_cache(1, 8)).hidden)

    before = logits(sib)
    assert not torch.equal(before, logits(policy))  # 8-bit products: close, not equal
    assert torch.allclose(before, logits(policy), atol=0.3, rtol=0.05)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.1)  # an update in place, as a refresh makes it
    after = logits(sib)
    assert not torch.equal(before, after) and torch.equal(after, logits(int8_sibling(policy)))


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_self_int8_drafts_keep_the_policys_distribution(mode):
    """The policy's own 8-bit sibling proposes trees or sampled chains; the committed sequences are the float32
    policy's (chi-square against the exact sequence probabilities)."""
    policy = accelerated(seed=1)
    G, L, T, top_p = 3000, 4, 1.0, 0.8
    shape = TreeShape(depth=2, branch=3, nodes=6) if mode == "tree" else TreeShape.chain(2)
    drafter = SelfDrafter(policy, int8_sibling, "self-int8")
    r = generate_speculative(
        policy, drafter, PROMPTS, SamplingConfig(T, top_p, L), (EOS,), response_generators(7, 2, G), shape,
        group_size=G,
    )  # fmt: skip
    assert drafter.policy is not policy and drafter.policy.lm_head.int8  # it drafted in 8 bits
    accepted, rows = r.stats.accepted_at_depth, r.stats.tree_row_rounds
    assert r.stats.aal > 1.5 and 0 < accepted[0] < rows  # mostly accepted; the rejections' residuals sampled too
    for i, prompt in enumerate(PROMPTS):
        samples = [tuple(t) for t in r.tokens[i * G : (i + 1) * G]]
        assert chi_square_pvalue(samples, sequence_probs(policy, prompt, L, T, top_p)) > ALPHA


def test_greedy_self_int8_chains_equal_greedy_decoding():
    policy = accelerated(seed=3)
    prompts = [[4, 3], [1, 2, 3, 4], [2, 0, 1, 3, 4], [0, 4, 3]]
    sc = SamplingConfig(0.0, 1.0, 12)
    ar = generate(policy, prompts, sc, (EOS,), response_generators(0, 4, 2), group_size=2)
    drafter = SelfDrafter(policy, int8_sibling, "self-int8")
    gens = response_generators(0, 4, 2)
    sp = generate_speculative(policy, drafter, prompts, sc, (EOS,), gens, TreeShape.chain(3), group_size=2)
    assert sp.tokens == ar.tokens and sp.finish_reason == ar.finish_reason
    assert sp.stats.aal > 2.0


@pytest.mark.parametrize(
    "cfg,dtype,kernels,msg",
    [
        (DraftConfig(draft="self-int8"), "int8", "auto", "already 8-bit"),
        (DraftConfig(draft="self-int8"), "bfloat16", "packed", "drop --cpu-kernels"),
    ],
)
def test_self_int8_refuses_what_it_cannot_run(cfg, dtype, kernels, msg):
    with pytest.raises(UserError, match=msg):
        RolloutPlan.settle(small_policy(), dtype, kernels, cfg)


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"spark_config": SparkConfig(spark=True)}, "drop --spark"),
        ({"draft_checkpoint": "default"}, "reads no drafter checkpoint"),
        ({"engine": "vllm", "draft_mode": "chain", "budget": "fixed"}, "drop --engine vllm"),
    ],
)
def test_self_int8_settings_it_cannot_take_are_one_line(kw, msg):
    with pytest.raises(UserError, match=msg):
        DraftConfig(draft="self-int8", **kw)


def test_train_with_self_int8_resumes_and_generate_reports_it(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_model_dir), "--out", str(out), "--group-size", "2", "--prompts-per-step",
            "1", "--max-new-tokens", "6", "--default-size", "20", "--draft", "self-int8", "--tree-depth", "2",
            "--tree-branch", "2", "--tree-nodes", "3", "--budget", "fixed", "--rollout-dtype", "bfloat16"]  # fmt: skip
    assert main(argv + ["--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "trained 1 step ->" in err and "tokens per verification round (AAL)" in err
    assert main(argv + ["--steps", "2", "--resume"]) == 0
    assert "resuming " + str(out) + " from step 1" in capsys.readouterr().err
    gen = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-new-tokens", "4", "--draft",
           "self-int8", "--budget", "fixed"]  # fmt: skip
    assert main(gen) == 0
