"""The speculation budget: cost model measurement and caching, decisions, exactness with a budget."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROWS, Alternating, full_depth, small_policy, synthetic

from sparkrl.config import SamplingConfig, TreeShape
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.tree import build_tree
from sparkrl.engine.autoregressive import generate, response_generators
from sparkrl.engine.budget import (
    AR,
    EXPLORE_EVERY,
    LONGEST_WAIT,
    PRIOR_ROWS,
    PROBE_EVERY,
    Budget,
    CostModel,
    FixedBudget,
    at_zero,
    kept_drafts,
    nondecreasing,
    round_work,
    smoothed,
    timed_sizes,
    timing_work,
    tree_sizes,
)
from sparkrl.engine.records import Tree
from sparkrl.engine.speculative import generate_speculative, time_rounds


def test_tree_sizes_cover_every_depth_and_cap_the_nodes_a_depth_records():
    assert tree_sizes(TreeShape(3, 2, 6)) == [(1, 1), (2, 1), (2, 2), (4, 2), (4, 3), (6, 3)]
    assert tree_sizes(TreeShape(5, 4, 16)) == [
        (1, 1),
        (2, 1),
        (2, 2),
        (4, 1),
        (4, 2),
        (4, 3),
        (4, 4),
        (8, 2),
        (8, 3),
        (8, 4),
        (8, 5),
        (12, 3),
        (16, 4),
        (16, 5),
    ]
    assert tree_sizes(TreeShape.chain(3)) == [(3, 3)] and tree_sizes(TreeShape.block(15)) == [(15, 15)]


def test_budget_speculates_with_few_rows_and_not_with_many():
    b = Budget(synthetic(), TreeShape(3, 2, 6), prior_accept=1.5)
    assert b.sizes == [(1, 1), (2, 2), (4, 3), (6, 3)]  # the sizes the cost model timed
    # expected drafts start at 1.5 * depth / 3: 4 and 6 nodes both expect 1.5, 4 is cheaper
    assert b.choose(1) == (4, 3)  # (1.3 + 0.1) / 2.5 beats 1.0 and the other trees
    assert b.choose(8) == AR  # 2.0 beats (3.0 + 0.3) / 1.5 and the larger trees


def ranked_tree() -> Tree:
    """A 6-node tree of depth 3 (node: depth, builder rank): a 1-2, b 1-1, c 2-3 under b, d 3-4 under c, e 2-5
    under a, f 3-6 under e; two rows alike."""
    return Tree(
        tokens=torch.zeros(2, 7, dtype=torch.long),
        parents=torch.tensor([[-1, 0, 0, 2, 3, 1, 5]] * 2),
        valid=torch.ones(2, 7, dtype=torch.bool),
        depth=torch.tensor([[0, 1, 1, 2, 3, 2, 3]] * 2),
        rank=torch.tensor([[0, 2, 1, 3, 4, 5, 6]] * 2),
    )


PATHS = torch.tensor([[2, 3, 4], [1, 5, 6]])  # accepted: b, c, d in row 0; a, e, f in row 1


def test_kept_drafts_rank_the_nodes_of_each_depth_among_themselves():
    tree = ranked_tree()
    kept = lambda n, d: kept_drafts(tree, PATHS, (n, d)).tolist()
    assert kept(6, 3) == [3, 3] and kept(4, 3) == [3, 1] and kept(3, 3) == [2, 1] and kept(1, 3) == [1, 0]
    # depth 2 holds a, b, c, e ranked 2, 1, 3, 5 there: 2, 1, 3, 4 among themselves
    assert kept(4, 2) == [2, 2] and kept(2, 2) == [1, 1] and kept(2, 1) == [1, 1] and kept(1, 1) == [1, 0]
    tree.valid[1, 5:] = False  # padding (a stopped row) is never kept
    assert kept(6, 3) == [3, 1]


def test_a_verified_round_updates_every_size_it_contains():
    shape = TreeShape(3, 2, 6)
    b = Budget(
        CostModel(
            ROWS, {s: [1.0] * 4 for s in [AR] + tree_sizes(shape)}, {s: [0.0] * 4 for s in tree_sizes(shape)}, [0.0] * 4
        ),
        shape,
        prior_accept=1.5,
    )
    acc = type("Acc", (), {"path": PATHS})
    b.observe((6, 3), ranked_tree(), acc)  # the prior counts as PRIOR_ROWS rows, a round as its 2 rows
    prior = lambda d: 1.5 * d / 3
    kept = {(6, 3): 3.0, (4, 3): 2.0, (4, 2): 2.0, (2, 2): 1.0, (2, 1): 1.0, (1, 1): 0.5}  # the rows' mean
    mean = lambda s, *ks: (PRIOR_ROWS * prior(s[1]) + 2 * sum(ks)) / (PRIOR_ROWS + 2 * len(ks))
    assert all(b.accepted[s] == pytest.approx(mean(s, k)) for s, k in kept.items())
    other = type("Acc", (), {"path": torch.tensor([[1, -1, -1], [2, 3, -1]])})  # a; b, c: 1 and 2 drafts
    b.observe((2, 2), ranked_tree(), other)  # says nothing about larger or deeper trees
    assert all(b.accepted[s] == pytest.approx(mean(s, kept[s])) for s in [(4, 2), (4, 3), (6, 3)])
    assert b.seen[2, 2] == 4 and b.seen[4, 2] == 2
    again = {(2, 2): 1.0, (2, 1): 1.0, (1, 1): 0.5}  # c ranks 3rd; a 2nd, so a 1-node tree keeps only b
    assert all(b.accepted[s] == pytest.approx(mean(s, kept[s], again[s])) for s in again)
    b.seen = {s: 100 for s in b.seen}  # past 1 / (1 - momentum) rows: a running average, one step per row
    before = dict(b.accepted)
    b.observe((6, 3), ranked_tree(), acc)
    assert all(b.accepted[s] == pytest.approx(0.81 * before[s] + 0.19 * k) for s, k in kept.items())


def test_a_shallower_tree_is_the_deeper_trees_best_nodes_of_its_depths(tiny_llama):
    """What `kept_drafts` assumes: a tree of (n, d) drafted by the engine holds the n best-ranked nodes of
    depth <= d of the full tree, with the same tokens."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(tiny_llama.args).bind(tiny_llama)
    B = 3
    z, a, h = (
        torch.randn(B, drafter.vocab_ids.numel()),
        torch.randn(B, tiny_llama.args.hidden_size),
        torch.randn(B, tiny_llama.args.hidden_size),
    )
    root = torch.tensor([1, 2, 3])
    trees = {}
    for n, d in [(9, 4), (6, 2), (3, 1)]:
        cache = drafter.new_cache(B, 64)
        trees[n, d] = build_tree(drafter, cache, root, z, a, h, TreeShape(d, 3, max(n, d)), n).tree
    full = trees[9, 4]
    for (n, d), t in trees.items():
        for b in range(B):
            inside = [j for j in range(1, full.size) if full.depth[b, j] <= d]
            best = sorted(inside, key=lambda j: int(full.rank[b, j]))[:n]
            path = lambda tr, j: tuple(int(tr.tokens[b, k]) for k in _ancestry(tr, b, j))
            assert sorted(path(full, j) for j in best) == sorted(path(t, j) for j in range(1, t.size)), (n, d, b)


def _ancestry(tree, b, j):
    out = []
    while j > 0:
        out.append(j)
        j = int(tree.parents[b, j])
    return out[::-1]


def test_at_zero_brings_each_round_to_no_accepted_draft_before_the_median():
    """The median round at its own acceptance would be 0.6 s at 1 draft; each round at none: 0.5, 0.5, 0.4."""
    assert at_zero([(0.5, 0.0), (0.9, 2.0), (0.6, 1.0)], 0.2) == pytest.approx(0.5)
    assert at_zero([(0.3, 0.0)], 0.2) == 0.3


def test_cost_model_times_whole_engine_rounds_once_and_caches_them(tiny_llama, tmp_path, monkeypatch):
    """Measured through the engine (a fake clock: a round's time is how often it reads the clock), so a
    drafted round costs its drafting, catch-up, verify, acceptance walk and commit, not a bare forward."""
    import sparkrl.engine.speculative as engine

    monkeypatch.setenv("SPARKRL_CACHE", str(tmp_path))
    monkeypatch.setattr(engine, "time", FakeTime())
    d = Eagle3Drafter(tiny_llama.args).bind(tiny_llama)
    shape = TreeShape(2, 2, 3)
    seen = []
    cm = CostModel.measure(tiny_llama, d, shape, lambda *a: seen.append(time_rounds(*a)) or seen[-1], repeats=1)
    assert sorted(cm.rounds) == [AR, (1, 1), (2, 1), (2, 2), (3, 2)] and len(cm.level) == len(cm.rows)
    # the engine reads the clock twice in an AR round and six times in a drafted one, and twice per level timed
    raw = {s: sum((t.rounds[s] for t in seen), []) for s in cm.rounds}  # per row count, [(seconds, accepted)]
    assert all(t == 3.0 and a == 0 for B in raw[AR] for t, a in B) and all(t == 1.0 for t in cm.level)
    assert all(t == 7.0 and 0 <= a <= shape.depth for s in tree_sizes(shape) for B in raw[s] for t, a in B)
    timed = json.loads(next((tmp_path / "costs").glob("rounds-*.json")).read_text())["timed"]
    # each timed round brought to no accepted draft before the median; tree rounds then fitted (`smoothed`)
    assert all(timed[f"{n},{dd}"] == [at_zero(B, 1.0) for B in raw[n, dd]] for n, dd in cm.rounds)
    assert all(a == 0.0 for v in cm.accepted.values() for a in v)
    assert len(list((tmp_path / "costs").glob("rounds-*.json"))) == 1
    monkeypatch.setattr(engine, "time", None)  # cached: nothing is timed again
    assert CostModel.measure(tiny_llama, d, shape, time_rounds) == cm


def test_the_timing_progress_adds_up_to_the_work_announced(tiny_llama):
    """The progress bar's total (`timing_work`) is what `time_rounds` reports, so its ETA ends at the end."""
    d = Eagle3Drafter(tiny_llama.args).bind(tiny_llama)
    shape, reps, done = TreeShape(2, 2, 3), {1: 2, 3: 1}, []
    sizes = [AR, (1, 1), (3, 2)]
    time_rounds(tiny_llama, d, shape, (1, 3), sizes, 24, reps, done.append)
    assert sum(done) == timing_work((1, 3), sizes, 24, reps)
    assert done.count(round_work(3, (3, 2))) == 1 and round_work(3, (3, 2)) > round_work(1, (3, 2))


def test_a_few_sizes_are_timed_and_the_fit_gives_every_other_one():
    """Four tree sizes span the fit (the smallest, the widest one level deep, as many nodes at the deepest they
    reach, the full one); the fit of exactly linear timings gives every other size exactly; a one-path proposal
    times its one size."""
    shape = TreeShape(5, 4, 16)
    assert timed_sizes(shape) == [(1, 1), (4, 1), (4, 4), (16, 5)]
    line = lambda n, d: [0.5 + 0.1 * n + 0.3 * (d - 1), 1.0 + 0.2 * n + 0.5 * (d - 1)]  # two row counts
    timed = {AR: [1.0, 2.0], **{s: line(*s) for s in timed_sizes(shape)}}
    fit = smoothed(timed, tree_sizes(shape))
    assert sorted(fit) == sorted([AR] + tree_sizes(shape)) and fit[AR] == [1.0, 2.0]
    assert all(
        torch.allclose(torch.tensor(fit[s], dtype=torch.float64), torch.tensor(line(*s), dtype=torch.float64))
        for s in tree_sizes(shape)
    )
    assert timed_sizes(TreeShape(5, 1, 5)) == [(1, 1), (3, 3), (5, 5)]  # one branch a level: a middle size too
    assert timed_sizes(TreeShape.chain(3)) == [(3, 3)] and timed_sizes(TreeShape(2, 2, 3)) == tree_sizes(
        TreeShape(2, 2, 3)
    )


def test_smoothed_fits_tree_rounds_linearly_in_nodes_and_depth():
    """Per row count, seconds = a + b * nodes + c * (depth - 1) fitted over every tree size (float64 reference:
    noise-free timings come back exactly, the fit of noisy ones has the least squared error and removes a
    tree's lucky timing); AR rounds and shapes of fewer than three sizes stay as timed."""
    sizes = tree_sizes(TreeShape(5, 4, 16))
    exact = {
        AR: [1.0, 2.0],
        **{(n, d): [1.2 + 0.05 * n + 0.1 * (d - 1), 2.5 + 0.2 * n + 0.3 * (d - 1)] for n, d in sizes},
    }
    assert all(
        torch.allclose(torch.tensor(smoothed(exact)[s], dtype=torch.float64), torch.tensor(v, dtype=torch.float64))
        for s, v in exact.items()
    )
    noisy = {s: [v[0] * (0.8 if s == (4, 3) else 1.0), v[1]] for s, v in exact.items()}  # (4, 3) timed 20% low
    fit = smoothed(noisy)
    assert (
        fit[AR] == noisy[AR] and fit[4, 3][0] > 0.95 * exact[4, 3][0] and fit[4, 3][1] == pytest.approx(exact[4, 3][1])
    )
    X = torch.tensor([[1.0, n, d - 1] for n, d in sizes], dtype=torch.float64)
    y = torch.tensor([noisy[s][0] for s in sizes], dtype=torch.float64)
    best = X @ torch.linalg.pinv(X) @ y  # the least-squares projection
    assert torch.allclose(torch.tensor([fit[s][0] for s in sizes], dtype=torch.float64), best)
    two = {AR: [1.0], (2, 2): [1.5], (4, 2): [9.0]}
    assert smoothed(two) == two and smoothed({AR: [1.0], (15, 15): [3.0]}) == {AR: [1.0], (15, 15): [3.0]}


def test_the_fit_never_makes_a_bigger_tree_cheaper():
    """Timings whose least-squares depth slope is negative (one row here: trees growing in nodes and depth at once,
    noise on the deep one) are fitted with that slope 0, the rest refitted (float64 reference: the least squares
    of the remaining terms); a falling node slope likewise; rising slopes are kept as they are."""
    trees = [(1, 1), (4, 1), (8, 3), (16, 5)]
    timed = {AR: [17.5], (1, 1): [23.7], (4, 1): [41.4], (8, 3): [56.0], (16, 5): [78.9]}  # ms, measured here
    X = torch.tensor([[1.0, n, d - 1] for n, d in trees], dtype=torch.float64)
    y = torch.tensor([timed[s][0] for s in trees], dtype=torch.float64)
    assert torch.linalg.pinv(X).matmul(y)[2] < 0  # the plain fit's depth slope
    fit = smoothed(timed, tree_sizes(TreeShape(5, 4, 16)))
    a, b = (torch.linalg.pinv(X[:, :2]) @ y).tolist()
    assert all(fit[n, d][0] == pytest.approx(a + b * n) for n, d in fit if (n, d) != AR)
    assert fit[4, 4][0] >= fit[4, 1][0] and fit[16, 5][0] >= fit[8, 5][0]
    falling = {AR: [1.0], (1, 1): [5.0], (2, 1): [4.0], (2, 2): [6.0], (4, 2): [5.5]}  # more nodes, less time
    f = smoothed(falling)
    Xf = torch.tensor([[1.0, n, d - 1] for n, d in falling if n], dtype=torch.float64)
    yd = torch.tensor([v[0] for s, v in falling.items() if s != AR], dtype=torch.float64)
    assert (torch.linalg.pinv(Xf) @ yd)[1] < 0  # the plain fit's node slope
    Xd = Xf[:, [0, 2]]
    c0, c2 = (torch.linalg.pinv(Xd) @ yd).tolist()
    assert all(f[n, d][0] == pytest.approx(c0 + c2 * (d - 1)) for n, d in f if n)
    exact = {AR: [1.0], **{(n, d): [1.0 + 0.5 * n + 0.25 * (d - 1)] for n, d in trees}}
    assert all(smoothed(exact)[s][0] == pytest.approx(v[0]) for s, v in exact.items())


def test_nondecreasing_pools_adjacent_violators():
    """The least-squares non-decreasing fit over the row counts: violators pooled to their mean, the rest kept."""
    got = nondecreasing({AR: [14.0, 14.9, 20.6, 19.4, 38.0], (1, 1): [3.0, 1.0, 2.0, 5.0], (2, 2): [1.0, 2.0]})
    assert got[AR] == pytest.approx([14.0, 14.9, 20.0, 20.0, 38.0]) and got[2, 2] == [1.0, 2.0]
    assert got[1, 1] == pytest.approx([2.0, 2.0, 2.0, 5.0])


def test_the_prediction_follows_the_expected_acceptance():
    """Timed rounds accepted 0.2 drafts per row (random prompts); each further draft walks one more
    level (0.1 s at 1 row): at 0.5 expected drafts a 4-node tree loses to an AR step, at 1.0 it wins."""
    slow = [9.0, 9.0]  # smaller trees, out of the running
    cost = CostModel(
        (1, 2),
        full_depth({0: [1.0, 1.2], 1: slow, 2: slow, 4: [1.5, 2.0]}, 4),
        full_depth({1: [0.0, 0.0], 2: [0.0, 0.0], 4: [0.2, 0.4]}, 4),
        [0.1, 0.2],
    )
    T = (4, 4)
    assert cost.seconds(1, T, 1.2) == pytest.approx(1.6) and cost.seconds(2, T, 0.4) == pytest.approx(2.0)
    assert cost.seconds(1, T) == 1.5 and cost.seconds(1, AR, 3.0) == 1.0  # AR rounds walk no tree
    b = Budget(cost, TreeShape(4, 1, 4), prior_accept=0.5)
    assert b.accepted[T] == 0.5 and b.choose(1) == AR  # (1.5 + 0.03) / 1.5 > 1.0
    b.accepted[T] = 1.0
    assert b.choose(1) == T  # (1.5 + 0.08) / 2.0 < 1.0
    back = Budget(
        CostModel(
            (1, 2),
            full_depth({n: slow for n in (0, 1, 2, 4)}, 4),
            full_depth({n: [0.0] * 2 for n in (1, 2, 4)}, 4),
            [0.0] * 2,
        ),
        TreeShape(4, 1, 4),
    )
    back.load_state_dict(b.state_dict())  # a resumed run decides with the timing its start measured
    assert back.cost == cost and back.choose(1) == T


def test_a_tree_that_nearly_pays_is_tried_again_and_one_that_does_not_rarely():
    """AR 1.0 s; a 4-node tree 1.5 s. Expecting 0.4 drafts it costs 1.07 s per token: declined, but within
    the 15% margin, so every 8th round drafts it; once a drafted round shows it pays, every round does.
    Expecting 0.1 drafts (1.36 s per token) it is tried once every PROBE_EVERY rounds."""
    slow = [9.0, 9.0]
    cost = CostModel(
        (1, 2),
        full_depth({0: [1.0, 1.2], 1: slow, 2: slow, 4: [1.5, 2.0]}, 4),
        full_depth({n: [0.0, 0.0] for n in (1, 2, 4)}, 4),
        [0.0, 0.0],
    )
    T = (4, 4)
    b = Budget(cost, TreeShape(4, 1, 4))
    b.accepted[T], b.seen[T] = 0.4, 100  # as after many rounds
    picks = [b.choose(1) for _ in range(2 * EXPLORE_EVERY)]
    assert picks == ([AR] * (EXPLORE_EVERY - 1) + [T]) * 2
    for _ in range(3):
        b.choose(1)
    back = Budget(cost, TreeShape(4, 1, 4))
    back.load_state_dict(b.state_dict())  # a resumed run explores when the uninterrupted one would
    assert [back.choose(1) for _ in range(EXPLORE_EVERY)] == [b.choose(1) for _ in range(EXPLORE_EVERY)]
    path = torch.arange(1, 5)[None]
    b.observe(
        T,
        Tree(
            torch.zeros(1, 5, dtype=torch.long),
            path - 2,
            torch.ones(1, 5, dtype=torch.bool),
            torch.arange(5)[None],
            torch.arange(5)[None],
        ),
        type("Acc", (), {"path": path}),
    )
    assert b.accepted[T] == pytest.approx(0.76)  # the tried round accepted 4 drafts
    assert [b.choose(1) for _ in range(5)] == [T] * 5
    b.accepted[T] = 0.1
    b.declined = 0
    assert [b.choose(1) for _ in range(2 * PROBE_EVERY)] == ([AR] * (PROBE_EVERY - 1) + [T]) * 2


def test_a_round_over_more_rows_waits_longer_before_the_next_exploration():
    """A drafted round over B rows told B rows' acceptance: a tree within the margin is explored again after
    EXPLORE_EVERY declined rounds per row of it, any other after PROBE_EVERY per row, at most LONGEST_WAIT."""
    cost = CostModel(
        (1, 64),
        full_depth({0: [1.0, 1.0], 1: [9.0, 9.0], 2: [9.0, 9.0], 4: [1.5, 1.5]}, 4),
        full_depth({n: [0.0, 0.0] for n in (1, 2, 4)}, 4),
        [0.0, 0.0],
    )
    T = (4, 4)
    b = Budget(cost, TreeShape(4, 1, 4))
    b.accepted[T], b.seen[T] = 0.4, 100  # 1.07 s per token: within the margin, declined

    def gaps(runs):
        out = []
        for rows, after in runs:  # explore over `rows`, then decline over `after`
            b.declined = LONGEST_WAIT  # due: the next round over `rows` explores
            assert b.choose(rows) == T
            picks = [b.choose(after) for _ in range(LONGEST_WAIT + 1)]
            out.append(picks.index(T) + 1)
        return out

    assert gaps([(2, 1), (1, 2), (8, 1), (64, 64)]) == [
        2 * EXPLORE_EVERY,
        EXPLORE_EVERY,
        8 * EXPLORE_EVERY,
        LONGEST_WAIT,
    ]
    b.accepted[T] = 0.1  # 1.36 s per token: past the margin
    assert gaps([(1, 1), (2, 2), (64, 1)]) == [PROBE_EVERY, 2 * PROBE_EVERY, LONGEST_WAIT]
    b.accepted[T] = 0.4
    rows = torch.arange(1, 5)[None].expand(8, -1)  # a verified round over 8 rows, all 4 drafts accepted
    b.seen[T] = 100
    b.observe(
        T,
        Tree(
            torch.zeros(8, 5, dtype=torch.long),
            rows - 2,
            torch.ones(8, 5, dtype=torch.bool),
            torch.arange(5)[None].expand(8, -1),
            torch.arange(5)[None].expand(8, -1),
        ),
        type("Acc", (), {"path": rows}),
    )
    assert b.accepted[T] == pytest.approx(0.9**8 * 0.4 + (1 - 0.9**8) * 4)  # as 8 rows one by one


def test_mixed_rounds_stay_exact_greedy(tiny_llama):
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    sc = SamplingConfig(0.0, 1.0, 14)
    shape = TreeShape(3, 2, 5)
    ar = generate(tiny_llama, prompts, sc, (7,), response_generators(0, 2, 3), group_size=3)
    b = Alternating(synthetic(), shape)
    sp = generate_speculative(
        tiny_llama,
        Eagle3Drafter(tiny_llama.args),
        prompts,
        sc,
        (7,),
        response_generators(0, 2, 3),
        shape,
        group_size=3,
        budget=b,
    )
    assert sp.tokens == ar.tokens
    assert 0 < sp.stats.tree_rounds < sp.stats.rounds


def test_drafter_catches_up_after_autoregressive_rounds():
    """After autoregressive rounds the drafter runs their backlog in one forward: a self-drafter kept
    in sync then has every greedy chain accepted whole."""
    from sparkrl.drafters.selfdraft import SelfDrafter

    policy = small_policy(seed=3)
    shape = TreeShape(3, 1, 3)
    sc = SamplingConfig(0.0, 1.0, 25)
    sp = generate_speculative(
        policy,
        SelfDrafter(policy),
        [[1, 2, 3], [4, 0, 1]],
        sc,
        (),
        response_generators(0, 2, 2),
        shape,
        group_size=2,
        budget=Alternating(synthetic(), shape),
    )
    st = sp.stats
    assert 0 < st.tree_rounds < st.rounds
    assert st.accepted_at_depth == [st.tree_row_rounds] * 3


def test_a_rollout_whose_rounds_are_all_declined_never_runs_the_drafter():
    """The drafter's prefill waits for a drafted round (and its catch-up with it): declined rounds cost what an
    autoregressive step costs, and the tokens are AR's."""

    class Declines(FixedBudget):
        def choose(self, B):
            return AR

    class Counted(Eagle3Drafter):
        calls = 0

        def forward(self, *args, **kwargs):
            Counted.calls += 1
            return super().forward(*args, **kwargs)

    policy, shape = small_policy(seed=3), TreeShape(3, 2, 4)
    torch.manual_seed(0)
    drafter = Counted(policy.args)
    sc, prompts = SamplingConfig(1.0, 0.9, 12), [[1, 2, 3], [4, 0, 1, 2]]
    ar = generate(policy, prompts, sc, (4,), response_generators(0, 2, 3), group_size=3)
    sp = generate_speculative(
        policy, drafter, prompts, sc, (4,), response_generators(0, 2, 3), shape, group_size=3,
        budget=Declines(shape),
    )  # fmt: skip
    assert sp.tokens == ar.tokens and sp.stats.tree_rounds == 0 and Counted.calls == 0
    generate_speculative(policy, drafter, prompts, sc, (4,), response_generators(0, 2, 3), shape, group_size=3)
    assert Counted.calls > 0  # the same drafter runs where rounds are drafted


def test_adaptive_budget_learns_the_whole_round_from_a_clock():
    """Rounds that take longer than the cost model predicts (acceptance, commit, catch-up) move an
    adaptive budget to autoregressive steps; --budget auto ignores the clock."""
    shape = TreeShape(3, 2, 6)
    fixed, adaptive = (
        Budget(synthetic(), shape, prior_accept=1.5),
        Budget(synthetic(), shape, prior_accept=1.5, adaptive=True),
    )
    T = (4, 3)
    assert fixed.choose(1) == adaptive.choose(1) == T
    for _ in range(30):  # the clock says a 4-node round over 1 row takes 3x what the cost model predicts
        for b in (fixed, adaptive):
            b.observe_round(T, 1, 3 * synthetic().seconds(1, T))
            b.observe_round(AR, 1, synthetic().seconds(1, AR))  # autoregressive steps as predicted
    assert fixed.choose(1) == T and adaptive.choose(1) != T
    assert adaptive.scale[T] == pytest.approx(3.0, rel=0.05) and adaptive.scale[AR] == pytest.approx(1.0)
    back = Budget(synthetic(), shape, adaptive=True)
    back.load_state_dict(adaptive.state_dict())
    assert back.scale == adaptive.scale and back.accepted == adaptive.accepted


class FakeTime:
    """A clock for the engine: every reading advances it by one second, so a round's measured time is
    the number of clock readings it makes (a drafted round reads it far more often)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


def test_adaptive_budget_through_the_engine_with_a_fake_clock(tiny_llama, monkeypatch):
    import sparkrl.engine.speculative as engine

    monkeypatch.setattr(engine, "time", FakeTime())
    shape = TreeShape.chain(3)  # one proposal size, so the budget has one cost to learn
    cost = CostModel(ROWS, {AR: [1.0] * 4, (3, 3): [0.5] * 4}, {(3, 3): [0.0] * 4}, [0.0] * 4)  # a 3-token
    # chain cheaper than a step
    prompts, sc = [[1, 2, 3], [4, 5, 6, 7]], SamplingConfig(0.0, 1.0, 40)  # greedy: a random drafter rarely hits
    runs = {}
    for adaptive in (False, True):
        b = Budget(cost, shape, prior_accept=2.0, adaptive=adaptive)
        runs[adaptive] = generate_speculative(
            tiny_llama,
            Eagle3Drafter(tiny_llama.args),
            prompts,
            sc,
            (),
            response_generators(0, 2, 2),
            shape,
            group_size=2,
            budget=b,
        ).stats
    assert runs[False].tree_rounds == runs[False].rounds  # the cost model alone says trees always pay
    assert runs[True].tree_rounds < runs[True].rounds / 2  # the clock says they do not: mostly AR steps
