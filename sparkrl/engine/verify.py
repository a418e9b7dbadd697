"""Exact acceptance of draft proposals: pure tensor functions (DESIGN "Exactness").

Point-mass candidates (EAGLE trees, DFlash blocks), chosen deterministically from the draft: at the
current node sample the committed token x from p with the uniform of its position; if a child of the
node carries x, accept that child (the first such, in node order) and continue from it, otherwise
commit x and stop. This is the sequential walk "accept child xj with probability p(xj); on rejection set
p(xj) = 0, renormalise and try the next; with no child left, sample from what remains" in one draw:
both accept some child with probability sum_j p(xj), and commit every token with probability p. The
committed tokens are the ones autoregressive sampling draws with the same uniforms, whatever the tree.

Sampled chains (the drafter drew x ~ q): accept with probability min(1, p(x) / q(x)); on rejection
sample from normalise(max(p - q, 0)) (Leviathan et al. 2023).

Randomness: every response brings its own row of uniforms `u`: one per level for point masses, keyed
by the position that level commits (`autoregressive.Batch.uniforms`), and for chains a fixed amount per round
from its own generator, so what a response commits never depends on the rest of the batch.
`p` is always the processed target distribution of `sampling.target_probs`.
"""

from __future__ import annotations

import dataclasses

import torch

from sparkrl.engine.records import Acceptance, Tree
from sparkrl.engine.sampling import SAMPLER, Sampler, logprob_of, sample_from, target_probs


def _spread(t: torch.Tensor, walking: torch.Tensor, B: int) -> torch.Tensor:
    """Values (n, ...) of the walking rows into a batch (B, ...); rows that stopped earlier get zeros
    (never read: levels past n_accepted)."""
    return t.new_zeros((B, *t.shape[1:])).index_copy_(0, walking, t)


def _first_child(tree: Tree, cur: torch.Tensor, active: torch.Tensor, x: torch.Tensor, node_ids: torch.Tensor):
    """(first (B,), tried (B, N)): the first child of node cur carrying token x in each active row (N
    where none does), and the children the sequential walk tries and rejects before it."""
    N = tree.tokens.shape[1]
    is_child = tree.children_of(cur) & active[:, None]  # (B, N)
    match = is_child & (tree.tokens == x[:, None])
    first = torch.where(match, node_ids, N).min(-1).values
    return first, is_child & (node_ids < first[:, None])


@dataclasses.dataclass
class _Walk:
    """The acceptance walk of B rows over their trees, in progress: the node each row stands at (B,), whether it
    still walks (B,), its accepted nodes (B, max_depth; -1 past n_acc), how many (B,), its bonus token and the node
    it stopped at (B,), the children tried and rejected (B, N); and per level, the nodes visited (B,), the committed
    tokens' log-probabilities (B,) and, with a vocabulary, the target p on it (B, Vd)."""

    cur: torch.Tensor
    active: torch.Tensor
    path: torch.Tensor
    n_acc: torch.Tensor
    bonus: torch.Tensor
    last: torch.Tensor
    rejected: torch.Tensor
    visited: list = dataclasses.field(default_factory=list)
    logps: list = dataclasses.field(default_factory=list)
    targets: list = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, B: int, N: int, max_depth: int, dev) -> _Walk:
        """Every row at its root, walking."""
        return cls(
            cur=torch.zeros(B, dtype=torch.long, device=dev),
            active=torch.ones(B, dtype=torch.bool, device=dev),
            path=torch.full((B, max_depth), -1, dtype=torch.long, device=dev),
            n_acc=torch.zeros(B, dtype=torch.long, device=dev),
            bonus=torch.zeros(B, dtype=torch.long, device=dev),
            last=torch.zeros(B, dtype=torch.long, device=dev),
            rejected=torch.zeros(B, N, dtype=torch.bool, device=dev),
        )

    def advance(self, tree: Tree, x: torch.Tensor, level: int, node_ids: torch.Tensor) -> None:
        """Each walking row moves to the first child of its node carrying its committed token x (B,); a row whose
        node has no such child stops there, x its bonus token."""
        N = tree.tokens.shape[1]
        first, tried = _first_child(tree, self.cur, self.active, x, node_ids)
        moved = first < N
        nxt = torch.where(moved, first, self.cur)
        self.rejected |= tried
        stop = self.active & ~moved
        self.bonus = torch.where(stop, x, self.bonus)
        self.last = torch.where(stop, self.cur, self.last)
        if level < self.path.shape[1]:  # below the deepest level there is no child to move to
            self.path[moved, level] = nxt[moved]
        self.n_acc += moved.long()
        self.active = moved
        self.cur = nxt

    def acceptance(self, with_targets: bool) -> Acceptance:
        return Acceptance(
            self.path,
            self.n_acc,
            self.bonus,
            self.last,
            torch.stack(self.visited, 1),
            self.rejected,
            torch.stack(self.logps, 1),
            torch.stack(self.targets, 1) if with_targets else None,
        )


def accept_tree(
    tree: Tree,
    logits,
    temperature: float,
    top_p: float,
    u: torch.Tensor,
    max_depth: int,
    vocab: torch.Tensor | None = None,
    sampler: Sampler = SAMPLER,
) -> Acceptance:
    """Walk every row's tree with point-mass acceptance.

    logits: (B, N, V) policy logits at every node (the distribution of the token after the node), or a
    callable (rows (n,), nodes (n,)) -> (n, V) logits at those nodes (`PathLogits`): the LM head then runs
    only on the nodes the walk visits, for the rows still walking.
    u: (B, max_depth + 1) float64 in [0, 1): u[:, d] samples the token committed at level d; no node is
    deeper than max_depth. vocab: token ids (Vd,); when given, the result carries the target p on them
    at every visited node (SPARK's feedback). sampler: how the committed tokens are drawn.
    """
    B, N = tree.tokens.shape
    dev = tree.tokens.device
    u = u.to(dev)
    walk = _Walk.start(B, N, max_depth, dev)
    node_ids = torch.arange(N, device=dev)
    at = logits if callable(logits) else (lambda r, nodes: logits[r, nodes])
    walking = torch.arange(B, device=dev)  # the rows still walking (all at level 0)
    for level in range(max_depth + 1):
        lg = at(walking, walk.cur[walking])  # (n, V)
        # p on its nucleus (n, W), sparse, and the tokens committed here, sampled in token-id order: which token a
        # uniform picks depends on the row alone, not on how its probability ties were sorted (which can depend
        # on the batch)
        probs, ids, x_w, logp = sampler.nucleus(lg, temperature, top_p, u[walking, level])
        walk.visited.append(walk.cur)
        x = _spread(x_w, walking, B)  # (B,)
        walk.logps.append(_spread(logp, walking, B))
        if vocab is not None:
            dense = torch.zeros(lg.shape, dtype=torch.float32, device=dev).scatter_(1, ids, probs)
            walk.targets.append(_spread(dense[:, vocab], walking, B))
        walk.advance(tree, x, level, node_ids)
        walking = walk.active.nonzero()[:, 0]  # host sync: which rows go on
        if walking.numel() == 0:  # every row has its bonus token
            break
    return walk.acceptance(vocab is not None)


class PathLogits:
    """Policy logits at tree nodes for `accept_tree`, computed on demand. Each LM-head call also covers the
    best-ranked nodes (`Tree.rank`) below every node asked for, up to `rows` rows in all: while the product is
    bound by reading the head's weights a few rows cost what one does, so a one-response walk usually takes one
    pass over the head per round instead of one per level. With more than `rows` / 2 walking rows, each call
    covers just the nodes asked for.

    head: hidden (n, d) -> logits (n, V); hidden (B, N, d): the verify forward's final hidden states;
    ancestors: the tree's `ancestor_mask()` if the caller has it (else computed here)."""

    def __init__(self, head, hidden: torch.Tensor, tree: Tree, rows: int, ancestors: torch.Tensor | None = None):
        self.head, self.hidden, self.rows = head, hidden, rows
        B, N = tree.tokens.shape
        dev = tree.tokens.device
        self.below = ancestors if ancestors is not None else tree.ancestor_mask()  # [b, j, i]: j is i or below it
        rank = tree.rank if tree.rank is not None else torch.arange(N, device=dev).expand(B, N)
        self.rank = torch.where(tree.valid, rank, N + 1)  # padding never chosen (nor below any valid node)
        self.call = torch.full((B, N), -1, dtype=torch.long, device=dev)  # which head call holds (row, node)
        self.row = torch.zeros((B, N), dtype=torch.long, device=dev)  # and in which of its rows
        self.kept = []  # each head call's logits

    def __call__(self, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        call = self.call[rows, nodes]
        lo, hi = torch.stack([call.min(), call.max()]).tolist()  # host sync
        if lo < 0:
            missing = call < 0
            self._compute(rows[missing], nodes[missing])
            call = self.call[rows, nodes]
            lo, hi = torch.stack([call.min(), call.max()]).tolist()
        at = self.row[rows, nodes]
        if lo == hi:
            return self.kept[lo][at]
        out = self.kept[-1].new_empty(rows.numel(), self.kept[-1].shape[-1])
        for c in range(lo, hi + 1):
            m = call == c
            out[m] = self.kept[c][at[m]]
        return out

    def _compute(self, rows: torch.Tensor, nodes: torch.Tensor) -> None:
        """Logits at (rows, nodes) and at the best-ranked nodes below each one not computed yet, within
        `self.rows` rows."""
        length = min(max(1, self.rows // rows.numel()), self.call.shape[1])
        if length == 1:
            r, n = rows, nodes
        else:  # the asked node ranks above everything below it (a parent above its children): it comes first
            N = self.call.shape[1]
            wanted = self.below[rows, :, nodes] & (self.call[rows] < 0)  # (n, N)
            key = torch.where(wanted, self.rank[rows], N + 1)
            best, at = key.topk(length, dim=-1, largest=False)  # (n, length)
            ok = best <= N
            r, n = rows[:, None].expand_as(at)[ok], at[ok]
        self.kept.append(self.head(self.hidden[r, n]))
        self.call[r, n] = len(self.kept) - 1
        self.row[r, n] = torch.arange(r.numel(), device=r.device)


def accept_chain(
    tokens: torch.Tensor,
    q: torch.Tensor,
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    u: torch.Tensor,
    vocab: torch.Tensor | None = None,
) -> Acceptance:
    """Speculative sampling for chains drawn from q.

    tokens: (B, D) drafted tokens, token d drawn from q[:, d]; q: (B, D, V) the draft distributions
    actually sampled from; logits: (B, D + 1, V) policy logits at the root and after each draft
    token. u: (B, D + 1) float64 uniforms: u[:, d] tests token d, u[:, D] samples the bonus.
    Node indices in `path` count the root as 0, so draft token d is node d + 1.
    vocab: token ids (Vd,); when given, the result carries p on them at every position (B, D + 1, Vd).
    """
    B, D = tokens.shape
    dev = tokens.device
    rows = torch.arange(B, device=dev)
    u = u.to(dev)
    p = target_probs(logits.reshape(B * (D + 1), -1), temperature, top_p).view(B, D + 1, -1).double()
    targets = None if vocab is None else p[..., vocab].float()
    q = q.double()
    px = p[:, :D].gather(-1, tokens[..., None])[..., 0]  # (B, D)
    qx = q.gather(-1, tokens[..., None])[..., 0]
    ok = u[:, :D] * qx < px  # accept with probability min(1, p/q)
    n_acc = torch.where(ok.all(-1), D, (~ok).long().argmax(-1))  # first rejection
    stop = n_acc  # distribution used for the bonus: residual at the rejected slot, or p after the chain
    p_stop = p[rows, stop]
    q_stop = q[rows, stop.clamp(max=D - 1)]
    resid = torch.where((n_acc < D)[:, None], (p_stop - q_stop).clamp(min=0), p_stop)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_stop)  # p == q: no residual mass
    bonus = sample_from(resid, u[:, D])
    path = torch.where(torch.arange(D, device=dev)[None] < n_acc[:, None], torch.arange(1, D + 1, device=dev)[None], -1)
    visited = torch.arange(D + 1, device=dev).expand(B, -1)  # chain position d is node d
    rejected = torch.zeros(B, D + 1, dtype=torch.bool, device=dev)
    rejected[rows, (n_acc + 1).clamp(max=D)] = n_acc < D  # the first rejected draft token
    committed = torch.cat([tokens, bonus[:, None]], 1).scatter(1, n_acc[:, None], bonus[:, None])  # (B, D + 1)
    logp = logprob_of(logits.reshape(B * (D + 1), -1), committed.reshape(-1), temperature).view(B, D + 1)
    return Acceptance(path, n_acc, bonus, stop, visited, rejected, logp, targets)
