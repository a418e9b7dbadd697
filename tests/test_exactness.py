"""Exactness of speculative rollouts through the real engine, in cases test_speculative.py leaves out:
a reduced draft vocabulary, budget-mixed tree and autoregressive rounds, greedy sampled chains."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ALPHA,
    EOS,
    SEEDS,
    Alternating,
    chi_square_pvalue,
    exact_sequences,
    sequence_probs,
    small_policy,
    synthetic,
)

from sparkrl.config import SamplingConfig, TreeShape
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.selfdraft import SelfDrafter
from sparkrl.engine.autoregressive import generate, response_generators
from sparkrl.engine.budget import AR
from sparkrl.engine.records import HIT
from sparkrl.engine.speculative import generate_speculative

PROMPTS = [[1, 2, 3, 4], [2, 0]]  # ragged prefixes; EOS ends responses at different rounds
DRAFT_VOCAB = (0, 1, EOS)  # the target often samples 2, 3 and 4, which such a drafter never proposes


def stat(r, key):
    return getattr(r.stats, key)


def test_batched_sequence_probs_are_exact_sequences():
    """The batched `sequence_probs` the exactness tests use against `exact_sequences`, a forward per prefix."""
    policy = small_policy()
    for prompt in PROMPTS:
        want = exact_sequences(policy, prompt, 2, 0.8, 0.7)
        got = sequence_probs(policy, prompt, 2, 0.8, 0.7)
        assert got.keys() == want.keys()
        assert all(got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-9) for s in want)


def test_chi_square_pools_rare_outcomes_and_refuses_impossible_ones():
    """Counts exactly as expected fit perfectly (the rare d, e, f pooled into one cell of 5 expected), counts far
    from them do not, and one outcome of probability 0 fails whatever the rest."""
    probs = {"a": 0.5, "b": 0.3, "c": 0.15, "d": 0.03, "e": 0.01, "f": 0.01, "g": 0.0}
    samples = [s for s, p in probs.items() for _ in range(round(p * 100))]
    assert chi_square_pvalue(samples, probs) == pytest.approx(1.0)
    assert chi_square_pvalue(["a"] * 80 + ["b"] * 20, probs) < 1e-6
    with pytest.raises(AssertionError, match="probability 0"):
        chi_square_pvalue(samples + ["g"], probs)


def assert_exact(r, policy, L, temperature, top_p, G):
    for i, prompt in enumerate(PROMPTS):
        samples = [tuple(t) for t in r.tokens[i * G : (i + 1) * G]]
        assert chi_square_pvalue(samples, sequence_probs(policy, prompt, L, temperature, top_p)) > ALPHA


@pytest.mark.parametrize("mode", ["tree", "chain"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.7)])
@pytest.mark.parametrize("seed", SEEDS)
def test_reduced_draft_vocabulary_is_exact(temperature, top_p, mode, seed):
    """Tokens outside the draft vocabulary come only from the remaining p (trees) or the residual
    max(p - q, 0), q being zero there (chains)."""
    policy = small_policy(seed)
    drafter = Eagle3Drafter(policy.args, vocab_ids=torch.tensor(DRAFT_VOCAB))
    G, L = 3000, 3
    shape = TreeShape(depth=2, branch=2, nodes=4) if mode == "tree" else TreeShape.chain(2)
    r = generate_speculative(
        policy,
        drafter,
        PROMPTS,
        SamplingConfig(temperature, top_p, L),
        (EOS,),
        response_generators(1 + seed, 2, G),
        shape,
        group_size=G,
    )
    # the proposals were restricted: every accepted draft is in the draft vocabulary, and there were
    # many of them, while many committed tokens are outside it
    hits = [t for toks, outs in zip(r.tokens, r.outcome) for t, o in zip(toks, outs) if o == HIT]
    assert len(hits) > G / 4 and set(hits) <= set(DRAFT_VOCAB)
    assert sum(t not in DRAFT_VOCAB for toks in r.tokens for t in toks) > r.num_tokens / 4
    assert stat(r, "accepted_at_depth")[0] > 0
    assert_exact(r, policy, L, temperature, top_p, G)


class TwoAutoregressive(Alternating):
    """Two autoregressive rounds, then a tree round (the drafter then catches up on two tokens)."""

    def choose(self, B):
        self.calls += 1
        return AR if self.calls % 3 else (self.shape.nodes, self.shape.depth)


class FullAutoregressiveShallow(Alternating):
    """The full tree, an autoregressive round, then a depth-1 tree of 2 nodes (one-path proposals: the full
    one again)."""

    def choose(self, B):
        self.calls += 1
        full = (self.shape.nodes, self.shape.depth)
        return [(2, 1) if self.shape.mode == "tree" else full, full, AR][self.calls % 3]


@pytest.mark.parametrize(
    "budget",
    [Alternating, TwoAutoregressive, FullAutoregressiveShallow],
    ids=["tree-ar", "ar-ar-tree", "tree-ar-shallow"],
)
@pytest.mark.parametrize("mode,top_p", [("tree", 1.0), ("tree", 0.9), ("chain", 1.0), ("chain", 0.9)])
@pytest.mark.parametrize("seed", SEEDS)
def test_budget_mixed_rounds_are_exact_sampled(mode, top_p, budget, seed):
    """Rounds tree, autoregressive, tree or autoregressive, autoregressive, tree (L = 4): the
    autoregressive steps sample from the policy directly, the next tree round starts from their
    last token."""
    policy = small_policy(seed)
    G, L = 3000, 4
    shape = TreeShape(depth=2, branch=3, nodes=6) if mode == "tree" else TreeShape.chain(2)  # 3 siblings
    r = generate_speculative(
        policy,
        Eagle3Drafter(policy.args),
        PROMPTS,
        SamplingConfig(1.0, top_p, L),
        (EOS,),
        response_generators(2 + seed, 2, G),
        shape,
        group_size=G,
        budget=budget(synthetic(), shape),
    )
    assert 0 < stat(r, "tree_rounds") < stat(r, "rounds")
    # in both orders round 2 is a tree round after an autoregressive one: drafts were accepted there
    assert any(k == 2 and o == HIT for rounds, outs in zip(r.round_of, r.outcome) for k, o in zip(rounds, outs))
    assert_exact(r, policy, L, 1.0, top_p, G)


@pytest.mark.parametrize("kind", ["eagle3", "eagle3-reduced-vocab", "self"])
def test_greedy_chains_equal_greedy(kind):
    """Temperature 0: q and p are point masses, so a chain keeps exactly the drafts the greedy policy
    agrees with and the residual is the policy's argmax."""
    policy = small_policy(seed=3)
    torch.manual_seed(0)
    drafter = {
        "eagle3": lambda: Eagle3Drafter(policy.args),
        "eagle3-reduced-vocab": lambda: Eagle3Drafter(policy.args, vocab_ids=torch.tensor([0, 2, 3, EOS])),
        "self": lambda: SelfDrafter(policy),
    }[kind]()
    prompts = [[4, 3], [1, 2, 3, 4], [2, 0, 1, 3, 4], [0, 4, 3]]  # ends: EOS at 6, length, EOS first, EOS at 7
    sc = SamplingConfig(0.0, 1.0, 12)
    ar = generate(policy, prompts, sc, (EOS,), response_generators(0, 4, 2), group_size=2)
    assert {len(t) for t in ar.tokens} == {1, 6, 7, 12} and set(ar.finish_reason) == {"stop", "length"}
    shape = TreeShape.chain(3)
    sp = generate_speculative(policy, drafter, prompts, sc, (EOS,), response_generators(0, 4, 2), shape, group_size=2)
    assert sp.tokens == ar.tokens and sp.finish_reason == ar.finish_reason
    accepted, rows = stat(sp, "accepted_at_depth"), stat(sp, "tree_row_rounds")
    if kind == "self":  # the greedy policy accepts its own greedy chain whole
        assert accepted == [rows] * shape.depth
    else:  # drafts were accepted, and rejected (then the residual decided)
        assert 0 < accepted[0] < rows
