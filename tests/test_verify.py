"""Exactness of acceptance (pure functions): committed sequences follow the target exactly.

A toy target and a toy drafter over a small vocabulary: logits are random tables indexed by the
whole context, so every position has its own distribution. Many rows generate L tokens through
rounds of (draft -> accept); the histogram of the committed sequences is tested by chi-square
against the exact product distribution.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import ALPHA, SEEDS, chi_square_pvalue

from sparkrl.engine.records import Tree
from sparkrl.engine.sampling import target_probs
from sparkrl.engine.verify import PathLogits, accept_chain, accept_tree

V, L = 4, 3  # vocabulary, committed tokens per sequence


class ToyLM:
    """Random logits per context (a tuple of previous tokens, up to length L + depth)."""

    def __init__(self, seed, scale=2.0):
        self.g = torch.Generator().manual_seed(seed)
        self.scale, self.table, self.dists = scale, {}, {}

    def logits(self, ctx: tuple) -> torch.Tensor:
        if ctx not in self.table:
            self.table[ctx] = torch.randn(V, generator=self.g) * self.scale
        return self.table[ctx]

    def probs(self, ctx: tuple) -> tuple[torch.Tensor, list[int]]:
        """softmax(logits) at `ctx`, and the tokens from most to least likely."""
        if ctx not in self.dists:
            q = torch.softmax(self.logits(ctx), -1)
            self.dists[ctx] = q, q.argsort(descending=True).tolist()
        return self.dists[ctx]


def exact_probs(target: ToyLM, temperature, top_p) -> dict:
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        pr = 1.0
        for i in range(L):
            pr *= float(target_probs(target.logits(seq[:i])[None], temperature, top_p)[0, seq[i]])
        out[seq] = pr
    return out


def build_tree(draft: ToyLM, ctx: tuple, depth: int, branch: int, keep_prob: float, g) -> tuple:
    """Top-`branch` children per node by draft probability, BFS; nodes randomly pruned (ragged) where
    keep_prob < 1."""
    tokens, parents, depths, paths = [0], [-1], [0], [()]
    frontier = [0]
    draws = iter(torch.rand(branch ** (depth + 1), generator=g).tolist() if keep_prob < 1 else [])
    for d in range(depth):
        nxt = []
        for n in frontier:
            for x in draft.probs(ctx + paths[n])[1][:branch]:
                if keep_prob < 1 and next(draws) > keep_prob:
                    continue
                tokens.append(x), parents.append(n), depths.append(d + 1), paths.append(paths[n] + (x,))
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return tokens, parents, depths, paths


def run_tree(target, draft, rows, temperature, top_p, depth=2, branch=2, keep_prob=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [() for _ in range(rows)]
    while any(len(s) < L for s in seqs):
        live = [i for i, s in enumerate(seqs) if len(s) < L]
        if keep_prob < 1:
            trees = [build_tree(draft, seqs[i], depth, branch, keep_prob, g) for i in live]
        else:  # one tree per context
            by_ctx = {ctx: build_tree(draft, ctx, depth, branch, 1.0, g) for ctx in {seqs[i]: None for i in live}}
            trees = [by_ctx[seqs[i]] for i in live]
        N = max(len(t[0]) for t in trees)

        def pad(xs: list, fill) -> list:
            return xs + [fill] * (N - len(xs))

        tok, par, dep = (torch.tensor([pad(t[k], fill) for t in trees]) for k, fill in ((0, 0), (1, -1), (2, 0)))
        val = torch.tensor([pad([True] * len(t[0]), False) for t in trees])
        logits = torch.stack(
            [
                torch.stack(pad([target.logits(seqs[i] + path) for path in t[3]], torch.zeros(V)))
                for i, t in zip(live, trees)
            ]
        )  # (B, N, V)
        u = torch.rand(len(live), depth + 1, generator=g, dtype=torch.float64)
        acc = accept_tree(Tree(tok, par, val, dep), logits, temperature, top_p, u, depth)
        for i, toks, path, n, bonus in zip(
            live, tok.tolist(), acc.path.tolist(), acc.n_accepted.tolist(), acc.bonus.tolist()
        ):
            seqs[i] = (seqs[i] + tuple(toks[node] for node in path[:n]) + (bonus,))[:L]
    return seqs


def run_chain(target, draft, rows, temperature, top_p, depth=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [() for _ in range(rows)]
    while any(len(s) < L for s in seqs):
        live = [i for i, s in enumerate(seqs) if len(s) < L]
        toks, q, logits = [], [], []  # per row: (depth,) drafts, (depth, V) q, (depth + 1, V) policy logits
        for i in live:
            ctx, row = seqs[i], []
            for d in range(depth):
                row.append(int(torch.multinomial(draft.probs(ctx)[0], 1, generator=g)))
                ctx = ctx + (row[-1],)
            toks.append(row)
            q.append(torch.stack([draft.probs(seqs[i] + tuple(row[:d]))[0] for d in range(depth)]))
            logits.append(torch.stack([target.logits(seqs[i] + tuple(row[:d])) for d in range(depth + 1)]))
        toks = torch.tensor(toks)  # (B, depth)
        u = torch.rand(len(live), depth + 1, generator=g, dtype=torch.float64)
        acc = accept_chain(toks, torch.stack(q), torch.stack(logits), temperature, top_p, u)
        for i, row, n, bonus in zip(live, toks.tolist(), acc.n_accepted.tolist(), acc.bonus.tolist()):
            seqs[i] = (seqs[i] + tuple(row[:n]) + (bonus,))[:L]
    return seqs


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
@pytest.mark.parametrize("keep_prob", [1.0, 0.6])  # full trees, and ragged pruned ones
@pytest.mark.parametrize("seed", SEEDS)
def test_tree_acceptance_is_exact(temperature, top_p, keep_prob, seed):
    target, draft = ToyLM(13 * seed + 1), ToyLM(13 * seed + 2)  # 13: targets whose top-p leaves several sequences
    seqs = run_tree(target, draft, 6000, temperature, top_p, depth=2, branch=2, keep_prob=keep_prob, seed=13 * seed + 3)
    assert chi_square_pvalue(seqs, exact_probs(target, temperature, top_p)) > ALPHA


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.7)])
@pytest.mark.parametrize("seed", SEEDS)
def test_chain_acceptance_is_exact(temperature, top_p, seed):
    target, draft = ToyLM(13 * seed + 4), ToyLM(13 * seed + 5)
    seqs = run_chain(target, draft, 6000, temperature, top_p, depth=2, seed=13 * seed + 6)
    assert chi_square_pvalue(seqs, exact_probs(target, temperature, top_p)) > ALPHA


def test_a_wrong_rule_is_detected():
    """The harness has power: accepting the draft's top child always (greedy drafting) is caught."""
    target, draft = ToyLM(1), ToyLM(2)
    exact = exact_probs(target, 1.0, 1.0)
    seqs = []
    for _ in range(3000):
        ctx = ()
        while len(ctx) < L:
            ctx += (int(torch.softmax(draft.logits(ctx), -1).argmax()),)
        seqs.append(ctx)
    assert chi_square_pvalue(seqs, exact) < ALPHA


def test_greedy_tree_commits_target_argmax():
    target = ToyLM(7)
    seqs = run_tree(target, target, 5, 0.0, 1.0, depth=2, branch=2)
    ctx = ()
    for _ in range(L):
        ctx += (int(target.logits(ctx).argmax()),)
    assert all(s == ctx for s in seqs)


def test_tree_masks():
    t = Tree(
        torch.tensor([[5, 1, 2, 3]]),
        torch.tensor([[-1, 0, 0, 1]]),
        torch.ones(1, 4, dtype=torch.bool),
        torch.tensor([[0, 1, 1, 2]]),
    )
    m = t.ancestor_mask()[0].int().tolist()
    assert m == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]


def test_ancestor_mask_of_random_trees_with_padding():
    """Each row's mask against a walk up the parents in Python: random trees (parents first), padding nodes."""
    g = torch.Generator().manual_seed(0)
    B, N = 6, 17
    parents = torch.full((B, N), -1)
    depth = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for i in range(1, N):
            if torch.rand(1, generator=g) < 0.2:
                continue  # padding: no parent
            p = int(torch.randint(0, i, (1,), generator=g))
            while p and parents[b, p] < 0:  # attach to a real node (the root or one with a parent)
                p = int(torch.randint(0, p, (1,), generator=g))
            parents[b, i], depth[b, i] = p, depth[b, p] + 1
    t = Tree(torch.zeros(B, N, dtype=torch.long), parents, parents >= 0, depth)
    mask = t.ancestor_mask()
    for b in range(B):
        for i in range(N):
            want, j = {i}, i
            while parents[b, j] >= 0:
                j = int(parents[b, j])
                want.add(j)
            assert set(mask[b, i].nonzero()[:, 0].tolist()) == want


class CountedHead:
    """An LM head over 'hidden states' that are the logits themselves, recording each call's row count."""

    def __init__(self):
        self.calls = []

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.calls.append(h.shape[0])
        return h.clone()


@pytest.mark.parametrize("rows", [1, 3, 8, 1000])
def test_path_logits_walk_equals_the_full_table(rows):
    """`PathLogits` (the head on asked nodes and the best-ranked nodes below them, within `rows` rows a call)
    gives the walk over the full logits table, on ragged trees; no call exceeds max(rows, rows asked), and
    with rows 1 it makes one call per level walked, as a per-level head does."""
    g = torch.Generator().manual_seed(1)
    B, depth = 24, 3
    target, draft = ToyLM(3), ToyLM(4)
    trees = [build_tree(draft, (), depth, 2, 0.8, g) for _ in range(B)]
    N = max(len(t[0]) for t in trees)
    tok, par = torch.zeros(B, N, dtype=torch.long), torch.full((B, N), -1)
    val, dep = torch.zeros(B, N, dtype=torch.bool), torch.zeros(B, N, dtype=torch.long)
    logits = torch.zeros(B, N, V)
    for b, (t, p, d, paths) in enumerate(trees):
        n = len(t)
        tok[b, :n], par[b, :n], dep[b, :n], val[b, :n] = torch.tensor(t), torch.tensor(p), torch.tensor(d), True
        logits[b, :n] = torch.stack([target.logits(q) for q in paths])
    tree = Tree(tok, par, val, dep)
    u = torch.rand(B, depth + 1, generator=g, dtype=torch.float64)
    head = CountedHead()
    lazy = accept_tree(tree, PathLogits(head, logits, tree, rows), 1.0, 0.9, u, depth, vocab=torch.arange(V))
    full = accept_tree(tree, logits, 1.0, 0.9, u, depth, vocab=torch.arange(V))
    for f in ("path", "n_accepted", "bonus", "last", "rejected", "logp", "targets"):
        assert torch.equal(getattr(lazy, f), getattr(full, f)), f
    walked = (lazy.n_accepted + 1).clamp(max=depth + 1)
    length = max(1, rows // B)  # the first call: every row's root and the nodes below it, this many at most
    assert head.calls[0] == sum(min(length, int(val[b].sum())) for b in range(B))
    assert all(c <= max(rows, B) for c in head.calls)
    if rows == 1:
        assert len(head.calls) == int(walked.max()) and sum(head.calls) == int(walked.sum())


@pytest.mark.parametrize("rows, calls_first, calls_second", [(3, [3, 2], [3, 1]), (8, [6], [6])])
def test_path_logits_cover_the_best_ranked_nodes_below(rows, calls_first, calls_second):
    """One response: each head call covers the asked node and the drafter's best-ranked nodes below it not
    computed yet, `rows` in all. With 3 rows the first call holds the root and its two children; a walk down
    the first child needs one more call, for the nodes below it (2), one down the second child one for its
    child (1); with 8 rows the whole tree is one call."""
    # root 0; children 1 (token 1) and 2 (token 2); 1 -> 3 (token 1) -> 4 (token 1); 2 -> 5 (token 3)
    tree = Tree(
        torch.tensor([[0, 1, 2, 1, 1, 3]]),
        torch.tensor([[-1, 0, 0, 1, 3, 2]]),
        torch.ones(1, 6, dtype=torch.bool),
        torch.tensor([[0, 1, 1, 2, 3, 2]]),
        rank=torch.tensor([[0, 1, 2, 3, 5, 4]]),
    )
    u = torch.full((1, 4), 0.5, dtype=torch.float64)
    for favoured, calls, path in ((1, calls_first, [1, 3, 4]), (2, calls_second, [2, 5, -1])):
        logits = torch.full((1, 6, V), -30.0)
        logits[0, :, 1] = 30.0  # along the first children: token 1 everywhere
        logits[0, 0] = -30.0
        logits[0, 0, favoured] = 30.0  # the root's token: the first child's or the second's
        logits[0, 2, :] = -30.0
        logits[0, 2, 3] = 30.0  # below the second child: its child's token 3
        head = CountedHead()
        acc = accept_tree(tree, PathLogits(head, logits, tree, rows), 1.0, 1.0, u, 3)
        assert acc.path[0].tolist() == path and head.calls == calls


def test_tree_walk_asks_for_logits_only_where_rows_still_walk():
    """With a callable, level d's logits are computed only for the rows whose walk reached it, and the
    result equals the walk over the full logits table."""
    g = torch.Generator().manual_seed(0)
    B, depth = 32, 2
    target, draft = ToyLM(1), ToyLM(2)
    trees = [build_tree(draft, (), depth, 2, 1.0, g) for _ in range(B)]
    tok = torch.tensor([t[0] for t in trees])
    N = tok.shape[1]
    par, dep = torch.tensor([t[1] for t in trees]), torch.tensor([t[2] for t in trees])
    logits = torch.stack([torch.stack([target.logits(p) for p in t[3]]) for t in trees])  # (B, N, V)
    tree = Tree(tok, par, torch.ones(B, N, dtype=torch.bool), dep)
    u = torch.rand(B, depth + 1, generator=g, dtype=torch.float64)
    asked = []

    def head(rows, nodes):
        asked.append(rows.tolist())
        return logits[rows, nodes]

    lazy = accept_tree(tree, head, 1.0, 1.0, u, depth, vocab=torch.arange(V))
    full = accept_tree(tree, logits, 1.0, 1.0, u, depth, vocab=torch.arange(V))
    for f in ("path", "n_accepted", "bonus", "last", "rejected"):
        assert torch.equal(getattr(lazy, f), getattr(full, f)), f
    walked = (lazy.n_accepted + 1).clamp(max=depth + 1)
    assert asked[0] == list(range(B)) and 0 < len(asked[1]) < B  # some rows stopped at level 0
    assert sum(map(len, asked)) == int(walked.sum())  # one LM-head row per (row, level walked)
    for d, rows in enumerate(asked):
        assert rows == (walked > d).nonzero()[:, 0].tolist()
        lv = torch.tensor(rows)
        assert torch.allclose(lazy.targets[lv, d], full.targets[lv, d]) and torch.equal(
            lazy.logp[lv, d], full.logp[lv, d]
        )
