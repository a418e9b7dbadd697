"""SPARK's feedback selection: which contexts of a verified round reach `Spark.feedback`, with which
target p and which weight w (DESIGN "SPARK": tree drafting feeds back the contexts on the verified
path and the eligible rejected children; chains and blocks the accepted prefix and the first
rejected position).

Everything is hand-built: small trees, acceptance results and contexts whose h and z carry a
recognisable code per (row, context), targets whose values name (row, level) on the path or
(row, node) at a rejected child, and a fake spark that records what `feedback` receives. The
expectations are literal lists of (row, context, target, weight) derived by hand from the walk.

`feed` below is the only place that calls into sparkrl's feedback selection. Which children the
walk tried is the walk's to say (`Acceptance.rejected`); `test_hand_built_rounds_are_real_walks`
checks that every hand-built round here is what `verify.accept_tree` / `accept_chain` produce.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from sparkrl.engine import spark as spark_mod
from sparkrl.engine.records import Acceptance, Contexts, Tree
from sparkrl.engine.verify import accept_chain, accept_tree

D_FEAT, VD = 3, 6  # feature size and draft vocabulary of the hand-built contexts


# --- recognisable values ----------------------------------------------------------------------------


def h_code(b: int, c: int) -> int:
    return 100 * b + c + 1  # h[b, c, :] == h_code, z[b, c, :] == -h_code


def path_code(b: int, level: int) -> int:
    return 1000 + 100 * b + level  # target p the walk saw at level `level` of row b


def child_code(b: int, node: int) -> int:
    return 5000 + 100 * b + node  # target p at rejected child `node` of row b (from target_at)


def P(b: int, level: int):
    return ("path", b, level)


def T(b: int, node: int):
    return ("child", b, node)


def decode_p(v: float):
    v = int(v)
    if 1000 <= v < 2000:
        return P((v - 1000) // 100, (v - 1000) % 100)
    if 5000 <= v < 6000:
        return T((v - 5000) // 100, (v - 5000) % 100)
    raise AssertionError(f"feedback got a target {v} that is neither a level's p nor target_at's")


class FakeSpark:
    """What the feedback selection reads of a `Spark`: the weights, the ablation switch, `feedback`
    (recorded) and `target` (the identity, so target_at's values pass through unchanged)."""

    def __init__(self, w_path: float = 0.7, w_rejected: float = 0.3, accepted_only: bool = False):
        self.w_path, self.w_rejected, self.accepted_only = w_path, w_rejected, accepted_only
        self.calls = []

    def feedback(self, row, h, z, p, w):
        self.calls.append(tuple(t.detach().clone() for t in (row, h, z, p, w)))

    def target(self, logits):
        return logits

    def received(self) -> list[tuple]:
        """Every context fed back, over all calls, sorted: (row, context, target, weight)."""
        out = []
        for row, h, z, p, w in self.calls:
            n = row.numel()
            assert h.shape == (n, D_FEAT) and z.shape == (n, VD) and p.shape == (n, VD) and w.shape == (n,)
            for i in range(n):
                b, code = int(row[i]), h[i, 0].item()
                assert (h[i] == code).all() and (z[i] == -code).all(), "h and z must come from one context"
                assert (p[i] == p[i, 0]).all()
                hb, c = divmod(int(code) - 1, 100)
                assert hb == b, f"row {b} got the context of row {hb}"
                tag = decode_p(p[i, 0].item())
                assert tag[1] == b, f"row {b} got the target of row {tag[1]}"
                out.append((b, c, tag, round(float(w[i]), 6)))
        return sorted(out)


def expect(entries, w_path: float, w_rejected: float) -> list[tuple]:
    """Hand-written (row, context, target, "path" | "rej") -> sorted (row, context, target, weight)."""
    return sorted((b, c, tag, round(w_path if kind == "path" else w_rejected, 6)) for b, c, tag, kind in entries)


# --- hand-built rounds --------------------------------------------------------------------------------


class Acc(NamedTuple):  # the acceptance walk's result, before it is shaped for sparkrl
    path: list  # per row, accepted nodes (padded with -1 to the max depth)
    n_accepted: list
    last: list
    rejected: list  # per row, the nodes the walk tried and rejected (expanded by the drafter or not)


class Ctx(NamedTuple):
    node: list  # per row, the context index of every tree node (-1: not expanded)
    n_contexts: int


def make_tree(parents: list[list[int]], valid: list[list[bool]] | None = None) -> Tree:
    par = torch.tensor(parents)
    B, N = par.shape
    val = torch.tensor(valid) if valid is not None else torch.ones(B, N, dtype=torch.bool)
    depth = torch.zeros(B, N, dtype=torch.long)
    for i in range(1, N):  # parents come first
        has = par[:, i] >= 0
        depth[:, i] = torch.where(has, depth.gather(1, par[:, i : i + 1].clamp(min=0))[:, 0] + 1, 0)
    return Tree(tokens=10 + torch.arange(N).expand(B, N).clone(), parents=par, valid=val, depth=depth)


def chain_tree(B: int, D: int) -> Tree:
    return make_tree([[-1] + list(range(D))] * B)


def levels_p(levels_nodes: list[torch.Tensor]) -> list[torch.Tensor]:
    B = levels_nodes[0].numel()
    return [
        torch.tensor([float(path_code(b, l)) for b in range(B)])[:, None].expand(B, VD).clone()
        for l in range(len(levels_nodes))
    ]


def target_at(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    return child_code(rows, nodes).float()[:, None].expand(-1, VD).clone()


def feed(spark, tree: Tree, acc: Acc, ctx: Ctx, levels_nodes: list[torch.Tensor], one_path: bool) -> None:
    """Run sparkrl's feedback selection on one hand-built round. The ONLY call into it in this file.

    levels_nodes: per level the walk reached, each row's current node (B,) (for rows that stopped,
    the node they stopped on). The target p seen at every level is `levels_p(levels_nodes)`; the
    policy's logits at a rejected child are `target_at` (FakeSpark.target is the identity).
    """
    B, N = tree.tokens.shape
    C = ctx.n_contexts
    codes = torch.tensor([[float(h_code(b, c)) for c in range(C)] for b in range(B)])  # (B, C)
    h = codes[..., None].expand(B, C, D_FEAT).clone()
    z = -codes[..., None].expand(B, C, VD).clone()
    rejected = torch.zeros(B, N, dtype=torch.bool)
    for b, nodes in enumerate(acc.rejected):
        rejected[b, nodes] = True
    A = Acceptance(
        path=torch.tensor(acc.path),
        n_accepted=torch.tensor(acc.n_accepted),
        bonus=torch.zeros(B, dtype=torch.long),
        last=torch.tensor(acc.last),
        visited=torch.stack(levels_nodes, 1),
        rejected=rejected,
        targets=torch.stack(levels_p(levels_nodes), 1),
    )  # (B, L), (B, N), (B, L, Vd)
    X = Contexts(h, z, torch.tensor(ctx.node), rejected_children=not one_path)
    spark_mod.round_feedback(spark, X, A, target_at)


# --- trees --------------------------------------------------------------------------------------------
#
#   node:    0 root;  1, 2, 3 children of 0;  4, 5 children of 2;  6 child of 1;  7, 8 children of 4;
#            9 padding.  Row 1 differs: node 2 is a child of 1 (so the root's children are 1 and 3),
#            4, 5 are children of 2, and 7, 8 are padding too.
#   Max depth 3, max children 3. Siblings are tried in node order.

PARENTS = [-1, 0, 0, 0, 2, 2, 1, 4, 4, -1]
VALID = [True] * 9 + [False]
PARENTS_ROW1 = [-1, 0, 1, 0, 2, 2, 1, -1, -1, -1]
VALID_ROW1 = [True] * 7 + [False] * 3

# context index of every node (-1: the drafter did not expand it); a different numbering per row
NODE_CTX = [
    [0, 1, 2, -1, 3, 4, -1, -1, -1, -1],
    [3, 0, 4, -1, -1, -1, -1, -1, -1, -1],
    [2, 0, 4, -1, 1, 3, -1, -1, -1, -1],
    [1, 2, 0, -1, 4, 3, -1, -1, -1, -1],
]


def four_row_round():
    """Row 0: root: 1 rejected, 2 accepted; at 2: 4 accepted; at 4: 7 rejected, 8 accepted; at 8 (max
             depth): the bonus. All 3 accepted.
    Row 1: root: 1 rejected, 3 rejected (its only children): nothing accepted.
    Row 2: root: 1 rejected, 2 accepted; at 2: 4 rejected, 5 rejected. One accepted.
    Row 3: root: 1 rejected, 2 rejected, 3 accepted; 3 is a leaf. One accepted.
    """
    tree = make_tree([PARENTS, PARENTS_ROW1, PARENTS, PARENTS], [VALID, VALID_ROW1, VALID, VALID])
    acc = Acc(
        path=[[2, 4, 8], [-1, -1, -1], [2, -1, -1], [3, -1, -1]],
        n_accepted=[3, 0, 1, 1],
        last=[8, 0, 2, 3],
        rejected=[[1, 7], [1, 3], [1, 4, 5], [1, 2]],
    )
    levels = [torch.tensor(x) for x in ([0, 0, 0, 0], [2, 0, 2, 3], [4, 0, 2, 3], [8, 0, 2, 3])]
    return tree, acc, Ctx(NODE_CTX, 5), levels


FOUR_ROW_FULL = [
    # row 0: path nodes 0, 2, 4 (contexts 0, 2, 3); node 8 has no context; rejected 1 (context 1);
    # rejected 7 is not expanded; 3 and 5 come after the accepted child, so they were never tried
    (0, 0, P(0, 0), "path"),
    (0, 2, P(0, 1), "path"),
    (0, 3, P(0, 2), "path"),
    (0, 1, T(0, 1), "rej"),
    # row 1: path node 0 (context 3); rejected 1 (context 0); rejected 3 is not expanded; node 2 with
    # its context is not a child of the root in this row
    (1, 3, P(1, 0), "path"),
    (1, 0, T(1, 1), "rej"),
    # row 2: path nodes 0, 2 (contexts 2, 4); rejected 1 at the root (context 0); at 2 the walk stopped,
    # so both children were tried: 4, 5 (contexts 1, 3)
    (2, 2, P(2, 0), "path"),
    (2, 4, P(2, 1), "path"),
    (2, 0, T(2, 1), "rej"),
    (2, 1, T(2, 4), "rej"),
    (2, 3, T(2, 5), "rej"),
    # row 3: path node 0 (context 1); node 3 has no context; rejected 1, 2 (contexts 2, 0)
    (3, 1, P(3, 0), "path"),
    (3, 2, T(3, 1), "rej"),
    (3, 0, T(3, 2), "rej"),
]


@pytest.mark.parametrize("w_path, w_rejected", [(0.7, 0.3), (0.25, 1.5)])
def test_tree_feedback_is_the_path_and_the_tried_expanded_children(w_path, w_rejected):
    tree, acc, ctx, levels = four_row_round()
    s = FakeSpark(w_path, w_rejected)
    feed(s, tree, acc, ctx, levels, one_path=False)
    assert s.received() == expect(FOUR_ROW_FULL, w_path, w_rejected)


def test_tree_feedback_accepted_only():
    """The ablation: only path contexts whose proposal was accepted (levels < n_accepted), no children."""
    tree, acc, ctx, levels = four_row_round()
    s = FakeSpark(0.7, 0.3, accepted_only=True)
    feed(s, tree, acc, ctx, levels, one_path=False)
    assert s.received() == expect(
        [
            (0, 0, P(0, 0), "path"),
            (0, 2, P(0, 1), "path"),
            (0, 3, P(0, 2), "path"),
            (2, 2, P(2, 0), "path"),
            (3, 1, P(3, 0), "path"),
        ],
        0.7,
        0.3,
    )


def early_round():
    """The walk reached two levels only. Row 0: every child of the root rejected. Row 1: 1 accepted
    (first child, so nothing was rejected before it), then its only child 6 rejected."""
    tree = make_tree([PARENTS, PARENTS])
    acc = Acc(path=[[-1, -1, -1], [1, -1, -1]], n_accepted=[0, 1], last=[0, 1], rejected=[[1, 2, 3], [6]])
    levels = [torch.tensor([0, 0]), torch.tensor([0, 1])]
    return tree, acc, Ctx([NODE_CTX[0], NODE_CTX[2]], 5), levels


def root_only_round():
    """One level: both rows reject every child of the root."""
    tree = make_tree([PARENTS, PARENTS])
    acc = Acc(path=[[-1, -1, -1]] * 2, n_accepted=[0, 0], last=[0, 0], rejected=[[1, 2, 3]] * 2)
    return tree, acc, Ctx([[4, 2, -1, 0, 1, 3, -1, -1, -1, -1], NODE_CTX[3]], 5), [torch.tensor([0, 0])]


def test_tree_feedback_when_the_walk_ends_early():
    tree, acc, ctx, levels = early_round()
    s = FakeSpark(0.7, 0.3)
    feed(s, tree, acc, ctx, levels, one_path=False)
    assert s.received() == expect(
        [
            (0, 0, P(0, 0), "path"),
            (0, 1, T(0, 1), "rej"),
            (0, 2, T(0, 2), "rej"),  # 3: not expanded
            (1, 2, P(1, 0), "path"),
            (1, 0, P(1, 1), "path"),  # 2, 3 after the accepted 1; 6 not expanded
        ],
        0.7,
        0.3,
    )


def test_tree_feedback_root_only_round():
    """Every tried child with a context is fed back; nothing at all with accepted-only."""
    tree, acc, ctx, levels = root_only_round()
    s = FakeSpark(0.7, 0.3)
    feed(s, tree, acc, ctx, levels, one_path=False)
    assert s.received() == expect(
        [
            (0, 4, P(0, 0), "path"),
            (0, 2, T(0, 1), "rej"),
            (0, 0, T(0, 3), "rej"),  # 2: not expanded
            (1, 1, P(1, 0), "path"),
            (1, 2, T(1, 1), "rej"),
            (1, 0, T(1, 2), "rej"),  # 3: not expanded
        ],
        0.7,
        0.3,
    )
    s = FakeSpark(0.7, 0.3, accepted_only=True)
    feed(s, tree, acc, ctx, levels, one_path=False)
    assert s.received() == []


# --- chains and blocks (one path) ---------------------------------------------------------------------
#
# D = 4 drafted tokens, nodes 0..4 (node j + 1 is draft token j); context j is the prediction after
# node j, so node 4 (the last token) has none. Rows: all 4 accepted; rejected at position 0; two
# accepted, rejected at position 2.

D = 4
N_ACC = [4, 0, 2]


def one_path_round(kind: str, n_acc: list[int]):
    """kind "block": the levels of the point-mass walk (`accept_tree` on a one-path tree: levels it
    reached, a stopped row stays on its last node); "chain": `accept_chain`'s, every position."""
    B = len(n_acc)
    tree = chain_tree(B, D)
    acc = Acc(
        path=[[j + 1 if j < n else -1 for j in range(D)] for n in n_acc],
        n_accepted=n_acc,
        last=n_acc,
        rejected=[[n + 1] if n < D else [] for n in n_acc],
    )
    L = D + 1 if kind == "chain" else min(max(n_acc) + 1, D + 1)
    levels = [torch.tensor([l if kind == "chain" else min(l, n) for n in n_acc]) for l in range(L)]
    ctx = Ctx([list(range(D)) + [-1]] * B, D)
    return tree, acc, ctx, levels


ONE_PATH_FULL = [
    (0, 0, P(0, 0), "path"),
    (0, 1, P(0, 1), "path"),
    (0, 2, P(0, 2), "path"),
    (0, 3, P(0, 3), "path"),
    (1, 0, P(1, 0), "rej"),
    (2, 0, P(2, 0), "path"),
    (2, 1, P(2, 1), "path"),
    (2, 2, P(2, 2), "rej"),
]


@pytest.mark.parametrize("kind", ["block", "chain"])
@pytest.mark.parametrize("w_path, w_rejected", [(0.7, 0.3), (0.25, 1.5)])
def test_one_path_feedback_is_the_accepted_prefix_and_the_first_rejected_position(kind, w_path, w_rejected):
    tree, acc, ctx, levels = one_path_round(kind, N_ACC)
    s = FakeSpark(w_path, w_rejected)
    feed(s, tree, acc, ctx, levels, one_path=True)
    assert s.received() == expect(ONE_PATH_FULL, w_path, w_rejected)


@pytest.mark.parametrize("kind", ["block", "chain"])
def test_one_path_feedback_accepted_only(kind):
    tree, acc, ctx, levels = one_path_round(kind, N_ACC)
    s = FakeSpark(0.7, 0.3, accepted_only=True)
    feed(s, tree, acc, ctx, levels, one_path=True)
    assert s.received() == expect([e for e in ONE_PATH_FULL if e[3] == "path"], 0.7, 0.3)


@pytest.mark.parametrize("kind", ["block", "chain"])
def test_one_path_feedback_when_no_row_reaches_the_end(kind):
    """Block: the walk reached two levels only (positions 0 and 1)."""
    tree, acc, ctx, levels = one_path_round(kind, [1, 0])
    s = FakeSpark(0.7, 0.3)
    feed(s, tree, acc, ctx, levels, one_path=True)
    assert s.received() == expect([(0, 0, P(0, 0), "path"), (0, 1, P(0, 1), "rej"), (1, 0, P(1, 0), "rej")], 0.7, 0.3)


# --- the hand-built rounds are real walks -------------------------------------------------------------

OFF_TREE = 31  # a token no tree here proposes


def walk(tree: Tree, path: list[list[int]], max_depth: int = 3):
    """`accept_tree` with policy logits forcing each row's walk down `path`: at every node the policy
    puts (almost) all its mass on the next path node's token, or on a token off the tree."""
    B, N = tree.tokens.shape
    logits = torch.zeros(B, N, 32)
    logits[:, :, OFF_TREE] = 60.0
    for b, nodes in enumerate(path):
        cur = 0
        for n in (n for n in nodes if n >= 0):
            logits[b, cur] = 0.0
            logits[b, cur, tree.tokens[b, n]] = 60.0
            cur = n
    u = torch.full((B, max_depth + 1), 0.5, dtype=torch.float64)
    return accept_tree(tree, logits, 1.0, 1.0, u, max_depth)


def chain_walk(n_acc: list[int]):
    """`accept_chain` on point-mass drafts whose policy target accepts the first n_acc tokens of each row."""
    B = len(n_acc)
    tokens = 10 + torch.arange(1, D + 1).expand(B, D)
    q = torch.nn.functional.one_hot(tokens, 32).float()
    logits = torch.zeros(B, D + 1, 32)
    for b, n in enumerate(n_acc):
        for d in range(D + 1):
            logits[b, d, int(tokens[b, d]) if d < n else OFF_TREE] = 60.0
    return accept_chain(tokens, q, logits, 1.0, 1.0, torch.full((B, D + 1), 0.5, dtype=torch.float64))


@pytest.mark.parametrize("name", ["four rows", "early", "root only", "block", "block early", "chain", "chain early"])
def test_hand_built_rounds_are_real_walks(name):
    """Every round fed back above (path, n_accepted, last, the levels' nodes and the tried-and-rejected
    nodes, including that a child after the accepted one is never tried) is what the walk does."""
    tree, acc, _, levels = {
        "four rows": four_row_round,
        "early": early_round,
        "root only": root_only_round,
        "block": lambda: one_path_round("block", N_ACC),
        "block early": lambda: one_path_round("block", [1, 0]),
        "chain": lambda: one_path_round("chain", N_ACC),
        "chain early": lambda: one_path_round("chain", [1, 0]),
    }[name]()
    if name.startswith("chain"):
        res = chain_walk(acc.n_accepted)
    else:
        res = walk(tree, acc.path, D if name.startswith("block") else 3)
    assert res.path.tolist() == acc.path
    assert res.n_accepted.tolist() == acc.n_accepted
    assert res.last.tolist() == acc.last
    assert res.visited.tolist() == torch.stack(levels, 1).tolist()
    assert [r.nonzero()[:, 0].tolist() for r in res.rejected] == acc.rejected
