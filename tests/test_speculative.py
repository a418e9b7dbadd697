"""Speculative rollouts through the real engine: exactness by chi-square, greedy equalities."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ALPHA, EOS, SEEDS, V, chi_square_pvalue, sequence_probs, small_policy

from sparkrl.config import SamplingConfig, TreeShape
from sparkrl.cpu import native
from sparkrl.cpu.accelerate import COMPILED_SAMPLER, accelerate, use_float32_attention, use_native, use_weight_major
from sparkrl.cpu.kernels import is_packed, pack, packable
from sparkrl.drafters.dflash import DFlashDrafter
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.selfdraft import SelfDrafter
from sparkrl.engine.autoregressive import generate, response_generators
from sparkrl.engine.budget import AR
from sparkrl.engine.sampling import SAMPLER
from sparkrl.engine.spark import Spark, init_projection
from sparkrl.engine.speculative import Backlog, catch_up, generate_speculative
from sparkrl.train.precision import inference_copy

FAST = {(0.8, 0.7, "tree", True), (0.8, 0.7, "chain", True), (0.8, 0.7, "block", True), (1.0, 1.0, "tree", False)}


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.7)])
@pytest.mark.parametrize("mode", ["tree", "block"])
def test_point_mass_drafts_commit_the_autoregressive_tokens(temperature, top_p, mode):
    """Trees and blocks, with and without SPARK: the tokens autoregressive sampling gives with
    the same generators, so runs that differ only in drafting make the same rollouts."""
    torch.manual_seed(0)
    policy = small_policy()
    drafter = (DFlashDrafter(policy.args, block_size=3) if mode == "block" else Eagle3Drafter(policy.args)).bind(policy)
    prompts, G = [[1, 2, 3, 4], [2, 0]], 40
    sc = SamplingConfig(temperature, top_p, 12)
    shape = TreeShape(3, 2, 6) if mode == "tree" else TreeShape.block(3)
    ar = generate(policy, prompts, sc, (EOS,), response_generators(4, 2, G), group_size=G).tokens
    spark = Spark(init_projection(policy.lm_head.weight, 4), V, k=2, eta=5.0, temperature=temperature)
    for spark, budget in ((None, None), (spark, None), (None, EveryThirdAutoregressive(shape))):
        r = generate_speculative(
            policy,
            drafter,
            prompts,
            sc,
            (EOS,),
            response_generators(4, 2, G),
            shape,
            group_size=G,
            spark=spark,
            budget=budget,
        )
        assert r.stats.aal > 1.0 and r.tokens == ar
    assert 0 < r.stats.tree_rounds < r.stats.rounds  # the budget's rounds were mixed


class EveryThirdAutoregressive:
    """A budget that makes every third round an autoregressive step, and the one after it a depth-1 tree (a
    one-path proposal: the full one)."""

    def __init__(self, shape: TreeShape):
        self.shape, self.calls = shape, 0

    def choose(self, rows: int) -> tuple[int, int]:
        self.calls += 1
        full = (self.shape.nodes, self.shape.depth)
        shallow = (self.shape.branch, 1) if self.shape.mode == "tree" else full
        return [AR, shallow, full][self.calls % 3]

    def observe_round(self, *args):
        pass

    def observe(self, *args):
        pass


@pytest.mark.parametrize(
    "temperature,top_p,mode,spark",
    [
        pytest.param(
            t,
            p,
            m,
            s,
            id=f"{t}-{p}-{m}-{'spark' if s else 'baseline'}",
            marks=() if (t, p, m, s) in FAST else pytest.mark.slow,
        )
        for t, p in [(1.0, 1.0), (0.8, 0.7)]
        for m in ["tree", "chain", "block"]
        for s in [False, True]
    ],
)
@pytest.mark.parametrize("seed", SEEDS)
def test_rollouts_are_exact_in_ragged_batches(temperature, top_p, mode, spark, seed):
    """With SPARK adapting strongly (eta 5, so the proposals change a lot), too."""
    policy = small_policy(seed)
    drafter = (DFlashDrafter(policy.args, block_size=3) if mode == "block" else Eagle3Drafter(policy.args)).bind(policy)
    prompts = [[1, 2, 3, 4], [2, 0]]  # ragged prefixes; EOS ends responses at different rounds
    G, L = 3000, 3
    sc = SamplingConfig(temperature, top_p, L)
    shape = {"tree": TreeShape(2, 2, 4), "chain": TreeShape.chain(2), "block": TreeShape.block(2)}[mode]  # block size 3
    corr = Spark(init_projection(policy.lm_head.weight, 4), V, k=2, eta=5.0, temperature=temperature) if spark else None
    r = generate_speculative(
        policy, drafter, prompts, sc, (EOS,), response_generators(1 + seed, 2, G), shape, group_size=G, spark=corr
    )
    assert r.stats.tree_rounds == r.stats.rounds and r.stats.aal > 1.0  # drafts were accepted, so verified
    if spark:  # the correction changed the proposals: which drafts hit, and for sampled chains the tokens
        assert r.stats.adapter["spark_contexts"] > 0 and len(corr.store) > 0
        plain = generate_speculative(
            policy, drafter, prompts, sc, (EOS,), response_generators(1 + seed, 2, G), shape, group_size=G
        )
        assert r.outcome != plain.outcome
        assert (r.tokens != plain.tokens) if mode == "chain" else (r.tokens == plain.tokens)
    for i, prompt in enumerate(prompts):
        samples = [tuple(t) for t in r.tokens[i * G : (i + 1) * G]]
        assert chi_square_pvalue(samples, sequence_probs(policy, prompt, L, temperature, top_p)) > ALPHA


def test_greedy_self_drafting_accepts_every_level_and_equals_greedy():
    policy = small_policy(seed=3)
    prompts = [[1, 2, 3], [4, 0, 1, 2, 3]]
    sc = SamplingConfig(0.0, 1.0, 9)
    ar = generate(policy, prompts, sc, (), response_generators(0, 2, 2), group_size=2)
    for shape in (TreeShape(depth=3, branch=2, nodes=6), TreeShape(depth=3, branch=1, nodes=3)):
        sp = generate_speculative(
            policy, SelfDrafter(policy), prompts, sc, (), response_generators(0, 2, 2), shape, group_size=2
        )
        assert sp.tokens == ar.tokens
    # with one branch the tree is the drafter's greedy chain, which the greedy policy accepts whole:
    # 1 token from the prefill, then rounds of depth + 1 = 4 tokens: 9 = 1 + 4 + 4
    assert sp.stats.rounds == 2 and sp.stats.aal == 4.0


def test_greedy_with_random_drafter_equals_greedy(tiny_llama):
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    sc = SamplingConfig(0.0, 1.0, 12)
    ar = generate(tiny_llama, prompts, sc, (5,), response_generators(0, 2, 3), group_size=3)
    sp = generate_speculative(
        tiny_llama,
        Eagle3Drafter(tiny_llama.args),
        prompts,
        sc,
        (5,),
        response_generators(0, 2, 3),
        TreeShape(4, 3, 8),
        group_size=3,
    )
    assert sp.tokens == ar.tokens and sp.finish_reason == ar.finish_reason


def test_response_does_not_depend_on_batch_speculative(tiny_llama):
    drafter = Eagle3Drafter(tiny_llama.args)
    sc = SamplingConfig(1.0, 0.9, 10)
    shape = TreeShape(3, 2, 5)
    both = generate_speculative(
        tiny_llama, drafter, [[1, 2, 3], [9, 8, 7, 6]], sc, (5,), response_generators(0, 2, 2), shape, group_size=2
    )
    alone = generate_speculative(
        tiny_llama, drafter, [[1, 2, 3]], sc, (5,), response_generators(0, 1, 2), shape, group_size=2
    )
    assert both.tokens[:2] == alone.tokens


def test_tree_shape_errors():
    from sparkrl.errors import UserError

    for kw, msg in [
        (dict(depth=2, branch=2, nodes=0), "--tree-nodes"),
        (dict(depth=2, branch=0, nodes=4), "--tree-branch"),
        (dict(depth=5, branch=2, nodes=4), "larger than the node budget"),
    ]:
        with pytest.raises(UserError, match=msg):
            TreeShape(**kw)


@pytest.mark.parametrize("mode", ["ar", "tree", "chain", "block"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_rollouts_record_the_rollout_models_logprob_of_every_token(tiny_llama, mode, temperature):
    from sparkrl.train.grpo import token_logprobs

    prompts, G = [[1, 2, 3, 4, 5], [6, 7]], 3
    sc = SamplingConfig(temperature, 0.9, 10)
    gens = response_generators(0, 2, G)
    if mode == "ar":
        r = generate(tiny_llama, prompts, sc, (5,), gens, group_size=G)
    else:
        shape = {"tree": TreeShape(3, 2, 5), "chain": TreeShape.chain(3), "block": TreeShape.block(3)}[mode]
        d = DFlashDrafter(tiny_llama.args, block_size=4) if mode == "block" else Eagle3Drafter(tiny_llama.args)
        r = generate_speculative(tiny_llama, d, prompts, sc, (5,), gens, shape, group_size=G)
    for i, toks in enumerate(r.tokens):
        seq = torch.tensor([r.prompt_of(i) + toks])
        with torch.no_grad():
            logits = tiny_llama.logits(tiny_llama(seq).hidden)[:, len(r.prompt_of(i)) - 1 : -1]
        want = token_logprobs(logits, torch.tensor([toks]), temperature)[0]
        assert torch.allclose(torch.tensor(r.logp[i]), want, atol=1e-4), (i, r.logp[i], want.tolist())


def on_kernels(module, packed=False, weight_major=False, native=False, attn32=False):
    """`module` in the CPU layer's classes with these kernels on, in any combination (`cpu.accelerate` sets them
    per --cpu-kernels choice)."""
    accelerate(module, "plain")
    use_native(use_weight_major(pack(use_float32_attention(module, attn32), packed), weight_major), native)
    return module


@pytest.mark.parametrize(
    "dtype,packed,head32,attn32,fast",
    [
        (torch.bfloat16, False, False, False, False),
        (torch.bfloat16, False, False, True, False),
        (torch.bfloat16, True, False, True, False),
        (torch.bfloat16, True, True, False, False),
        (torch.bfloat16, False, False, True, True),
        (torch.float32, True, False, False, False),
        (torch.float32, True, False, False, True),
    ],
)
@pytest.mark.parametrize("mode", ["tree", "chain", "block"])
@pytest.mark.parametrize("seed", SEEDS)
def test_rollouts_are_exact_for_the_rollout_model(mode, dtype, packed, head32, attn32, fast, seed):
    """Exactness is relative to the rollout model: a bf16 policy and drafter sample from the bf16
    policy's own distribution (computed here from the bf16 model's full-sequence forward), also on
    prepacked weights (whose products round differently from the plain ones: the reference is then
    the packed model's own forward), with a float32 LM head and attending in float32 (`attn32`: a float32
    cache; the reference attends in float32 too); so do a float32 policy and drafter on prepacked weights
    (weight-major products for the fewest rows); both also on the compiled kernels (`fast`: in bf16
    the weights widened to float32 as they stream, sums in float32)."""
    if packed and not packable(dtype, "cpu"):
        pytest.skip(f"this torch/CPU cannot prepack {dtype} weights")
    if fast and not native.available():
        pytest.skip("the compiled kernels are not available here")
    master = small_policy(seed)
    policy = on_kernels(
        inference_copy(master, dtype, "plain", head_float32=head32).model, packed, dtype == torch.float32, fast, attn32
    )
    assert policy.lm_head.native == policy.model.norm.native == fast
    drafter = DFlashDrafter(policy.args, block_size=3) if mode == "block" else Eagle3Drafter(policy.args)
    drafter = on_kernels(drafter.to(dtype), packed, dtype == torch.float32, fast, attn32).bind(policy)
    assert is_packed(policy) == packed == is_packed(drafter)
    prompts, G, L = [[1, 2, 3, 4], [2, 0]], 3000, 3
    sc = SamplingConfig(0.8, 0.7, L)
    shape = {"tree": TreeShape(2, 2, 4), "chain": TreeShape.chain(2), "block": TreeShape.block(2)}[mode]
    r = generate_speculative(
        policy,
        drafter,
        prompts,
        sc,
        (EOS,),
        response_generators(1 + seed, 2, G),
        shape,
        group_size=G,
        sampler=COMPILED_SAMPLER if fast else SAMPLER,
    )
    assert r.stats.aal > 1.0
    for i, prompt in enumerate(prompts):
        samples = [tuple(t) for t in r.tokens[i * G : (i + 1) * G]]
        assert chi_square_pvalue(samples, sequence_probs(policy, prompt, L, 0.8, 0.7)) > ALPHA


def test_catch_up_computes_draft_logits_only_at_each_rows_last_position():
    """The drafter's head runs on one position per row (the root the next round drafts from), and its
    logits there equal the full forward's (float64)."""
    torch.manual_seed(0)
    policy = small_policy().double()
    drafter = Eagle3Drafter(policy.args).double().bind(policy)
    B, T, d = 2, 4, policy.args.hidden_size
    tokens, feats, n = torch.randint(0, V, (B, T)), torch.randn(B, T, d, dtype=torch.float64), torch.tensor([4, 2])
    full = drafter(tokens, feats, drafter.new_cache(B, 8))  # every position's logits
    seen, head = [], drafter.logits
    drafter.logits = lambda h: seen.append(tuple(h.shape)) or head(h)
    state = catch_up(drafter, drafter.new_cache(B, 8), tokens, feats, n)
    assert seen == [(B, d)]
    assert torch.allclose(state.z, full.z[torch.arange(B), n - 1], rtol=1e-12, atol=1e-12)
    assert torch.equal(state.root, tokens[torch.arange(B), n - 1])


def weight_major_pair(plain, mode):
    """A copy of `plain` whose LM head is a weight-major product (`kernels.weight_major_linear`: the same sums,
    logits as a transposed view), and a drafter for `mode` bound to it, whose head follows the policy's."""
    policy = accelerate(copy.deepcopy(plain), "plain").model
    policy.lm_head.weight_major = True
    drafter = (DFlashDrafter(policy.args, block_size=3) if mode == "block" else Eagle3Drafter(policy.args)).bind(policy)
    assert drafter._head[0].weight_major
    return policy, drafter


@pytest.mark.parametrize("mode", ["tree", "block"])
def test_a_weight_major_head_commits_the_plain_heads_tokens(mode):
    """Trees and blocks on a weight-major LM head commit the plain policy's autoregressive tokens."""
    torch.manual_seed(0)
    plain = small_policy()
    policy, drafter = weight_major_pair(plain, mode)
    shape = TreeShape(3, 2, 6) if mode == "tree" else TreeShape.block(3)
    prompts, G = [[1, 2, 3, 4], [2, 0]], 40
    sc = SamplingConfig(1.0, 0.9, 12)
    ar = generate(plain, prompts, sc, (EOS,), response_generators(4, 2, G), group_size=G).tokens
    r = generate_speculative(policy, drafter, prompts, sc, (EOS,), response_generators(4, 2, G), shape, group_size=G)
    assert r.stats.aal > 1.0 and r.tokens == ar


@pytest.mark.parametrize("seed", SEEDS)
def test_a_weight_major_head_samples_what_the_plain_head_does(seed):
    """Sampled chains on a weight-major LM head pass the chi-square test against the plain policy's sequence
    probabilities."""
    plain = small_policy(seed)
    policy, drafter = weight_major_pair(plain, "chain")
    prompts, G, L = [[1, 2, 3, 4]], 3000, 3
    sc = SamplingConfig(0.8, 0.7, L)
    r = generate_speculative(
        policy, drafter, prompts, sc, (EOS,), response_generators(1 + seed, 1, G), TreeShape.chain(2), group_size=G
    )
    assert r.stats.aal > 1.0
    assert chi_square_pvalue([tuple(t) for t in r.tokens], sequence_probs(plain, prompts[0], L, 0.8, 0.7)) > ALPHA


@pytest.mark.skipif(not native.available(), reason="the compiled kernels are not available here")
@pytest.mark.parametrize("attn32", [False, True])
def test_bfloat16_greedy_speculative_equals_bfloat16_greedy(tiny_llama, attn32):
    """On the compiled kernels (--cpu-kernels auto), whose rows do not depend on the batch or the forward."""
    policy = on_kernels(tiny_llama.to(torch.bfloat16), native=True, attn32=attn32)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    sc = SamplingConfig(0.0, 1.0, 12)
    ar = generate(policy, prompts, sc, (5,), response_generators(0, 2, 3), group_size=3, sampler=COMPILED_SAMPLER)
    for shape in (TreeShape(4, 3, 8), TreeShape.chain(3)):
        d = on_kernels(Eagle3Drafter(policy.args).to(torch.bfloat16), native=True, attn32=attn32)
        sp = generate_speculative(
            policy, d, prompts, sc, (5,), response_generators(0, 2, 3), shape, group_size=3, sampler=COMPILED_SAMPLER
        )
        assert sp.tokens == ar.tokens


def test_round_stats_merge_sums_counts_and_sums_or_maxes_times():
    from sparkrl.engine.records import Round, RoundStats

    a, b = RoundStats(depth=2), RoundStats(depth=2)
    a.add(Round([3, 1], True, draft_s=1.0, verify_s=2.0, accept_s=0.5))
    b.add(Round([1], False, verify_s=4.0))
    b.add(Round([2], True, draft_s=0.5, verify_s=1.0, accept_s=0.25))
    a.adapter, b.adapter = {"spark_s": 1.0, "spark_contexts": 3}, {"spark_s": 2.0, "spark_contexts": 4}
    for concurrent, t in ((False, sum), (True, max)):
        m = RoundStats.merge([a, b], concurrent)
        assert (m.rounds, m.row_rounds, m.committed, m.policy_forwards, m.tree_rounds, m.tree_row_rounds) == (
            3,
            4,
            7,
            5,
            2,
            3,
        )
        assert m.aal == 7 / 4 and m.accepted_at_depth == [2, 1] and m.active_aal == [(2, 2.0), (1, 2.0)]
        assert (m.draft_s, m.verify_s, m.accept_s, m.ar_s) == (
            t([1.0, 0.5]),
            t([2.0, 5.0]),
            t([0.5, 0.25]),
            t([0.0, 4.0]),
        )
        assert m.adapter == {"spark_s": t([1.0, 2.0]), "spark_contexts": 7}


def test_backlog_keeps_rows_by_index_as_a_copy_would():
    """Rounds added between drops (rows ascending, as finished responses leave) come out of `pop` as if every
    stored round had been cut to the kept rows at each drop; with and without features."""
    g = torch.Generator().manual_seed(0)
    for with_feats in (True, False):
        back, ref, rows = Backlog(), [], 6
        for keep in (None, [0, 2, 3, 5], None, None, [1, 2], None):
            if keep is not None:
                back.keep(torch.tensor(keep))
                ref = [(t[keep], None if f is None else f[keep]) for t, f in ref]
                rows = len(keep)
            t = torch.randint(0, 100, (rows, 1), generator=g)
            f = torch.randn(rows, 1, 3, generator=g) if with_feats else None
            back.add(t, f)
            ref.append((t, f))
        tokens, feats, n = back.pop()
        assert torch.equal(tokens, torch.cat([t for t, _ in ref], 1)) and n.tolist() == [len(ref)] * rows
        assert (feats is None) if not with_feats else torch.equal(feats, torch.cat([f for _, f in ref], 1))
        assert not back
