"""build_tree (EAGLE-2 dynamic trees) against a brute-force float64 reference.

The reference handles one batch row at a time: it re-runs the committed drafter prefix in float64,
computes every node's draft distribution by running the drafter along that node's own ancestor
chain only (a fresh copy of the committed cache per chain, one token at a time, each position fed
its token and the drafter's `a` output at its parent), re-derives the recorded nodes level by level
(frontier = the `branch` best of a level, each proposing its top-`branch` children) and keeps the
`nodes` best recorded nodes by cumulative log-probability.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from sparkrl.config import TreeShape
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.tree import build_tree

B = 3
CAPACITY = 32
PREFIX = (2, 5, 3)  # committed drafter positions per row before the root (ragged)
MARGIN = 1e-5  # every decision of the reference must win by this much (no near-ties)


def draft_tree(drafter, cache, root, z, a, h, shape, nodes):
    """The only call of build_tree here: (Tree, Contexts) from the uncorrected draft logits."""
    proposal = build_tree(drafter, cache, root, z, a, h, shape, nodes)
    return proposal.tree, proposal.contexts


def _randomised(drafter, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        # the tiny policy's head gives near-uniform logits (std ~0.2): scale the feature entering it,
        # so that the draft distributions are peaked and the decisions far from ties
        drafter.stack.norm.weight.mul_(20.0)
    return drafter


def _setup(policy, seed, reduced_vocab):
    """A random drafter with a committed prefix per row and the root's drafter state (float32)."""
    torch.manual_seed(seed)
    V, d = policy.args.vocab_size, policy.args.hidden_size
    vocab_ids = torch.randperm(V)[:60].sort().values if reduced_vocab else None
    drafter = _randomised(Eagle3Drafter(policy.args, vocab_ids=vocab_ids), seed).bind(policy).eval()
    g = torch.Generator().manual_seed(1000 + seed)
    prefix = torch.randint(0, V, (B, max(PREFIX)), generator=g)
    prefix_feat = torch.randn(B, max(PREFIX), d, generator=g)
    root = torch.randint(0, V, (B,), generator=g)
    root_feat = torch.randn(B, 1, d, generator=g)
    lens = torch.tensor(PREFIX)
    cache = drafter.new_cache(B, CAPACITY)
    with torch.no_grad():
        drafter(prefix, prefix_feat, cache)
        cache.commit(n_keep=lens)
        step = drafter(root[:, None], root_feat, cache)
        cache.commit(n_keep=torch.ones(B, dtype=torch.long))
    inputs = dict(prefix=prefix, prefix_feat=prefix_feat, lens=lens, root=root, root_feat=root_feat)
    return drafter, cache, root, step.z[:, 0], step.a[:, 0], step.h[:, 0], inputs


class Reference:
    """One row's draft distributions by brute force, in float64: path (policy ids) -> log-probs."""

    def __init__(self, drafter, policy, inputs, row):
        self.policy = copy.deepcopy(policy).double()
        self.drafter = copy.deepcopy(drafter).double().bind(self.policy)
        self.ids = drafter.vocab_ids
        self.head = self.policy.lm_head.weight.detach()[self.ids]  # (Vd, d) the drafter's shared head
        n = int(inputs["lens"][row])
        self.cache = self.drafter.new_cache(1, CAPACITY)
        with torch.no_grad():
            self.drafter(
                inputs["prefix"][row : row + 1, :n], inputs["prefix_feat"][row : row + 1, :n].double(), self.cache
            )
            self.cache.commit(n_keep=torch.tensor([n]))
            root = self.drafter(
                inputs["root"][row : row + 1, None], inputs["root_feat"][row : row + 1].double(), self.cache
            )
            self.cache.commit(n_keep=torch.tensor([1]))
        self.root_a = root.a[0, 0]
        self.memo = {(): self._logp(root.h[0, 0])}

    def _logp(self, h):
        return torch.log_softmax(h @ self.head.T, -1)

    def logp(self, path: tuple[int, ...]) -> torch.Tensor:
        """Log-probs of the children of the node `path`: the drafter run along the path alone."""
        if path not in self.memo:
            cache = self.cache.clone()
            feat = self.root_a
            with torch.no_grad():
                for depth, tok in enumerate(path):  # node at depth+1: its token and its parent's `a`
                    step = self.drafter(
                        torch.tensor([[tok]]),
                        feat[None, None],
                        cache,
                        tree_mask=torch.ones(1, 1, depth + 1, dtype=torch.bool),
                        depth=torch.tensor([[depth]]),
                    )
                    feat = step.a[0, 0]
            self.memo[path] = self._logp(step.h[0, 0])
        return self.memo[path]

    def tree(self, shape: TreeShape, nodes: int):
        """(kept paths ordered by depth then score, score of every recorded path, smallest decision margin)."""
        k = shape.branch
        margins = []

        def top(scores, paths, m):  # the m best; the score gaps among the m + 1 best are decisions
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            s = [scores[i] for i in order[: m + 1]]
            margins.extend(s[j] - s[j + 1] for j in range(len(s) - 1))
            return [paths[i] for i in order[:m]]

        def children(path):
            lp = self.logp(path)
            return [(path + (int(self.ids[i]),), float(lp[i])) for i in range(lp.shape[0])]

        score = {}
        cands = children(())
        for p, s in cands:
            score[p] = s
        frontier = top([s for _, s in cands], [p for p, _ in cands], k)
        recorded = list(frontier)
        for _ in range(2, shape.depth + 1):
            cands = []
            for parent in frontier:
                kids = children(parent)
                best = top([s for _, s in kids], [p for p, _ in kids], k)
                lp = dict(kids)
                cands += [(p, score[parent] + lp[p]) for p in best]
            for p, s in cands:
                score[p] = s
            frontier = top([s for _, s in cands], [p for p, _ in cands], k)
            recorded += frontier
        kept = top([score[p] for p in recorded], recorded, min(nodes, len(recorded)))
        kept.sort(key=lambda p: (len(p), -score[p]))
        return kept, {p: score[p] for p in recorded}, min(margins)


def _paths(tree, row):
    """Token path (policy ids below the root) of every node of one row, from tree.parents."""
    toks, par = tree.tokens[row].tolist(), tree.parents[row].tolist()
    paths = [()]
    for i in range(1, len(toks)):
        assert 0 <= par[i] < i, f"node {i}: parent {par[i]} is not an earlier node"
        paths.append(paths[par[i]] + (toks[i],))
    return paths


CASES = [  # (shape, smaller node budget, seed, reduced draft vocabulary)
    (TreeShape(3, 2, 5), 3, 0, False),
    (TreeShape(4, 3, 8), 5, 1, True),
    (TreeShape(2, 4, 6), 4, 2, False),
    (TreeShape(4, 2, 7), 2, 3, True),
]


@pytest.mark.parametrize("shape,smaller,seed,reduced", CASES)
def test_build_tree_equals_brute_force_reference(tiny_llama, shape, smaller, seed, reduced):
    drafter, cache, root, z, a, h, inputs = _setup(tiny_llama, seed, reduced)
    refs = [Reference(drafter, tiny_llama, inputs, r) for r in range(B)]
    lengths = cache.lengths.clone()
    inverse = {int(t): i for i, t in enumerate(drafter.vocab_ids)}  # policy id -> draft index
    for nodes in (shape.nodes, smaller, 1):
        with torch.no_grad():
            tree, ctx = draft_tree(drafter, cache, root, z, a, h, shape, nodes)
        # one drafter forward of `branch` tokens per level below the first, min(depth, nodes) levels
        assert cache.pending == shape.branch * (min(shape.depth, nodes) - 1)
        cache.commit(n_keep=torch.zeros(B, dtype=torch.long))  # roll the speculative region back
        assert torch.equal(cache.lengths, lengths)
        n = min(nodes, shape.depth * shape.branch)
        assert tree.tokens.shape == (B, n + 1) and bool(tree.valid.all())
        assert torch.equal(tree.tokens[:, 0], root) and (tree.parents[:, 0] == -1).all()
        assert (tree.depth[:, 0] == 0).all() and (ctx.node[:, 0] == 0).all()
        for r in range(B):
            want, score, margin = refs[r].tree(shape, nodes)
            assert margin > MARGIN, f"seed {seed} row {r}: a near-tie ({margin:.2e}); pick another seed"
            paths = _paths(tree, r)
            got = paths[1:]
            # the kept set is the reference's best-n set, ordered by depth then decreasing score
            assert set(got) == set(want), f"nodes={nodes} row {r}: kept {got}, reference {want}"
            assert got == want, f"nodes={nodes} row {r}: order {got}, reference {want}"
            assert len(set(got)) == n
            # ancestor-closed; depth and parents agree with the paths
            assert all(p[:-1] in set(paths) for p in got)
            assert tree.depth[r].tolist() == [len(p) for p in paths]
            depths = [len(p) for p in got]
            assert depths == sorted(depths)
            for i in range(1, n):
                if depths[i] == depths[i - 1]:
                    assert score[got[i]] < score[got[i - 1]]
            if tree.rank is not None:  # 1 = best score
                by_score = sorted(range(n), key=lambda i: -score[got[i]])
                assert [0] + [by_score.index(i) + 1 for i in range(n)] == tree.rank[r].tolist()
            # the cumulative log-probs build_tree drew from (its contexts' logits) match the reference
            node = ctx.node[r].tolist()
            cum = [0.0]
            for i in range(1, n + 1):
                par = int(tree.parents[r, i])
                assert node[par] >= 0, f"node {i}'s parent was not expanded"
                lp = torch.log_softmax(ctx.z[r, node[par]].double(), -1)
                cum.append(cum[par] + float(lp[inverse[int(tree.tokens[r, i])]]))
                assert abs(cum[i] - score[paths[i]]) < 1e-4, (nodes, r, paths[i], cum[i], score[paths[i]])
                assert abs(float(tree.prob[r, i]) - math.exp(score[paths[i]])) < 1e-4 * math.exp(score[paths[i]])
                # a node has a context iff it was expanded, i.e. it is above the last level drafted (a
                # tree of n nodes drafts min(depth, n) levels)
                assert (node[i] >= 0) == (len(paths[i]) < min(shape.depth, nodes))


def _frontier_mass(ref: Reference, shape: TreeShape) -> list[float]:
    """Draft probability held by the frontier (the `branch` best recorded nodes) of levels 1 .. depth - 1."""
    k = shape.branch
    lp = ref.logp(())
    kids = [((int(ref.ids[i]),), float(lp[i])) for i in range(lp.shape[0])]
    out = []
    for level in range(1, shape.depth):
        frontier = sorted(kids, key=lambda c: -c[1])[:k]
        out.append(sum(torch.tensor(s, dtype=torch.float64).exp().item() for _, s in frontier))
        kids = []
        for path, s in frontier:
            lp = ref.logp(path)
            best = lp.topk(k).indices.tolist()
            kids += [(path + (int(ref.ids[i]),), s + float(lp[i])) for i in best]
    return out


@pytest.mark.parametrize("level", [1, 2, 3])
def test_a_tree_stops_below_the_first_level_whose_every_frontier_is_unlikely(tiny_llama, level):
    """With `stop`, build_tree drafts no level below the first one whose frontier holds less draft probability
    than `stop` in every row (float64 reference), and each row's tree is the one drafted to the depth where its
    own frontier fell below `stop`."""
    shape = TreeShape(4, 2, 8)
    drafter, cache, root, z, a, h, inputs = _setup(tiny_llama, 1, False)
    rows = [_frontier_mass(Reference(drafter, tiny_llama, inputs, r), shape) for r in range(B)]
    mass = [max(m) for m in zip(*rows)]
    assert all(x > y for x, y in zip(mass, mass[1:]))  # a child's path is never likelier than its parent's
    stop = (mass[level - 1] + (mass[level - 2] if level > 1 else 1.0)) / 2  # below level - 1's, above level's
    own = [next((i + 1 for i, m in enumerate(r) if m < stop), shape.depth) for r in rows]  # each row's depth
    assert max(own) == level
    with torch.no_grad():
        tree, _ = draft_tree(drafter, cache, root, z, a, h, TreeShape(4, 2, 8, stop=stop), 8)
        assert cache.pending == shape.branch * (level - 1)  # levels 2 .. level drafted
        cache.commit(n_keep=torch.zeros(B, dtype=torch.long))
        for r in range(B):
            want, _ = draft_tree(drafter, cache, root, z, a, h, TreeShape(own[r], 2, 8), 8)
            cache.commit(n_keep=torch.zeros(B, dtype=torch.long))
            assert sorted(_paths_valid(tree, r)) == sorted(_paths_valid(want, r))
    assert int(tree.depth[tree.valid].max()) == level


def test_a_tree_with_a_stop_is_each_rows_own_whatever_the_batch(tiny_llama):
    """A stop between the rows' frontier probabilities stops some rows and not others: each row's valid nodes
    are those it gets drafted alone (a batch, or a data-parallel rank's share of it, changes no row's tree),
    and a stopped row has no valid node below its stopping level."""
    shape = TreeShape(4, 2, 8)
    drafter, cache, root, z, a, h, inputs = _setup(tiny_llama, 1, False)
    level2 = [_frontier_mass(Reference(drafter, tiny_llama, inputs, r), shape)[1] for r in range(B)]
    stop = (sorted(level2)[0] + sorted(level2)[1]) / 2  # the least likely row stops below level 2, the others go on
    stopped = [m < stop for m in level2]
    assert any(stopped) and not all(stopped)
    stopping = TreeShape(4, 2, 8, stop=stop)

    def valid_paths(tree, r):
        return sorted(_paths_valid(tree, r))

    with torch.no_grad():
        batch, _ = draft_tree(drafter, cache, root, z, a, h, stopping, 8)
        cache.commit(n_keep=torch.zeros(B, dtype=torch.long))
        for r in range(B):
            alone = copy.deepcopy(cache)
            alone.keep_rows(torch.tensor([r]))
            tree, _ = draft_tree(drafter, alone, root[r : r + 1], z[r : r + 1], a[r : r + 1], h[r : r + 1], stopping, 8)
            assert valid_paths(batch, r) == valid_paths(tree, 0)
            if stopped[r]:
                assert max(map(len, valid_paths(batch, r))) <= 2


def _paths_valid(tree, row):
    """Token paths of a row's valid nodes (padding nodes have parent -1 and are skipped)."""
    toks, par, val = tree.tokens[row].tolist(), tree.parents[row].tolist(), tree.valid[row].tolist()
    paths = {0: ()}
    for i in range(1, len(toks)):
        if val[i]:
            assert 0 <= par[i] < i and par[i] in paths
            paths[i] = paths[par[i]] + (toks[i],)
        else:
            assert par[i] == -1
    return [p for i, p in paths.items() if i]
