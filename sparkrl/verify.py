"""Exact acceptance of draft proposals: pure tensor functions (DESIGN "Exactness").

Point-mass candidates (EAGLE trees, DFlash blocks), chosen deterministically from the draft: at the
current node walk its distinct children x1, x2, ... in order; accept xj with probability p(xj); on
rejection set p(xj) = 0 and renormalise; if no child is accepted, sample the committed token from
the remaining p. Continue from an accepted child. The committed tokens follow p exactly.

Sampled chains (the drafter drew x ~ q): accept with probability min(1, p(x) / q(x)); on rejection
sample from normalise(max(p - q, 0)) (Leviathan et al. 2023).

Randomness: every response brings its own row of uniforms `u`, drawn from its own generator in a
fixed amount per round (`uniforms_per_round`), so what a response commits never depends on the rest
of the batch. `p` is always the processed target distribution of `sampling.target_probs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkrl.sampling import logprob_of, nucleus, sample_from, target_probs


@dataclass
class Tree:
    """A batch of padded draft trees. Node 0 of every row is the root (the last committed token,
    not yet run through the policy); nodes are in topological order and siblings in the order they
    are tried (the builder puts the drafter's most likely child first)."""

    tokens: torch.Tensor  # (B, N) int64
    parents: torch.Tensor  # (B, N) int64, -1 for the root and for padding
    valid: torch.Tensor  # (B, N) bool
    depth: torch.Tensor  # (B, N) int64, 0 for the root
    rank: torch.Tensor | None = None  # (B, N) the builder's preference order (1 = best; root 0)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def ancestor_mask(self) -> torch.Tensor:
        """(B, N, N) bool: node i may attend to node j iff j is i or an ancestor of i."""
        B, N = self.tokens.shape
        mask = torch.eye(N, dtype=torch.bool, device=self.tokens.device).expand(B, N, N).clone()
        for i in range(1, N):  # parents come first, so row parent(i) is final when row i is built
            par = self.parents[:, i].clamp(min=0)
            has = self.parents[:, i] >= 0
            mask[:, i] |= mask[torch.arange(B), par] & has[:, None]
        return mask

    def children_of(self, node: torch.Tensor) -> torch.Tensor:
        """(B, N) bool: the valid children of node (B,) in every row."""
        return (self.parents == node[:, None]) & self.valid & (self.parents >= 0)

    def child_counts(self) -> torch.Tensor:
        """(B, N) number of valid children of every node."""
        counts = torch.zeros_like(self.tokens)
        ok = self.valid & (self.parents >= 0)
        return counts.scatter_add_(1, self.parents.clamp(min=0), ok.long())

    def max_children(self) -> int:
        if self.size <= 1:
            return 0
        return int(self.child_counts().max())  # host sync: loop bound


@dataclass
class Acceptance:
    path: torch.Tensor  # (B, D) accepted node indices in order (padding -1)
    n_accepted: torch.Tensor  # (B,) accepted draft tokens
    bonus: torch.Tensor  # (B,) the token sampled after the accepted path (residual or next)
    last: torch.Tensor  # (B,) node whose target distribution produced the bonus token
    visited: torch.Tensor  # (B, L) the node the walk stood on at each level it reached (meaningful for
    # levels <= n_accepted); L <= max depth + 1
    rejected: torch.Tensor  # (B, N) bool: the nodes the walk tried and rejected
    logp: torch.Tensor | None = None  # (B, L) float32 log softmax(logits / T) of the token committed at each
    # visited level (the accepted child's, then the bonus), the rollout model's log-probability of it
    targets: torch.Tensor | None = None  # (B, L, Vd) float32 target p at the visited nodes, before any
    # rejection, on the token ids `vocab` the caller asked for (None when it did not ask)


def uniforms_per_round(max_depth: int, max_children: int) -> int:
    """Uniforms each response draws per round: one per (depth, child) test, one per residual."""
    return (max_depth + 1) * (max_children + 1)


def accept_tree(tree: Tree, logits, temperature: float, top_p: float, u: torch.Tensor,
                max_depth: int, max_children: int, vocab: torch.Tensor | None = None) -> Acceptance:
    """Walk every row's tree with point-mass acceptance.

    logits: (B, N, V) policy logits at every node (the distribution of the token after the node),
    or a callable node (B,) -> (B, V) logits at those nodes (so the LM head runs only on the nodes
    the walk visits).
    u: (B, uniforms_per_round(max_depth, max_children)) float64 in [0, 1).
    No node may be deeper than max_depth or have more than max_children children.
    vocab: token ids (Vd,); when given, the result carries the target p on them at every visited
    node (SPARK's feedback).
    """
    B, N = tree.tokens.shape
    dev = tree.tokens.device
    rows = torch.arange(B, device=dev)
    u = u.to(dev)
    K = max_children + 1
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    path = torch.full((B, max_depth), -1, dtype=torch.long, device=dev)
    n_acc = torch.zeros(B, dtype=torch.long, device=dev)
    bonus = torch.zeros(B, dtype=torch.long, device=dev)
    last = torch.zeros(B, dtype=torch.long, device=dev)
    node_ids = torch.arange(N, device=dev)
    at = logits if callable(logits) else (lambda nodes: logits[rows, nodes])
    visited, targets, logps = [], [], []
    rejected = torch.zeros(B, N, dtype=torch.bool, device=dev)
    for level in range(max_depth + 1):
        lg = at(cur)  # (B, V)
        probs, ids = nucleus(lg, temperature, top_p)  # (B, W) p on its nucleus (a few hundred tokens), sparse
        p = probs.double()
        visited.append(cur)
        if vocab is not None:
            dense = torch.zeros(lg.shape, dtype=torch.float32, device=dev).scatter_(1, ids, probs)
            targets.append(dense[:, vocab])  # (B, Vd)
        # children of the current node, in node order
        is_child = tree.children_of(cur)  # (B, N)
        order = torch.where(is_child, node_ids, N).sort(-1).values[:, :max_children]  # (B, C) first C children
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        nxt = cur.clone()
        # p stays unnormalised: after rejections, p(x) / p.sum() is the renormalised probability
        for slot in range(order.shape[1]):
            node = order[:, slot]
            has = active & ~moved & (node < N)
            if not bool(has.any()):  # host sync: no row has a child left to test
                break
            node_c = node.clamp(max=N - 1)
            x = tree.tokens[rows, node_c]
            at_x = ids == x[:, None]  # (B, W) where x sits in the nucleus (nowhere: p(x) = 0)
            px = (p * at_x).sum(-1)
            acc = has & (u[:, level * K + slot] * p.sum(-1) < px)
            nxt = torch.where(acc, node_c, nxt)
            moved |= acc
            rej = has & ~acc
            p = p.masked_fill(at_x & rej[:, None], 0.0)  # reject: remove x (renormalised implicitly)
            rejected[rows[rej], node_c[rej]] = True
        # rows that did not move sample their committed token from the remaining p
        stop = active & ~moved
        if bool(stop.any()):
            # in token-id order, as over the dense p: which token a uniform picks then depends on the row
            # alone, not on how its probability ties were sorted (which can depend on the batch)
            tok, by_id = ids[stop].sort(-1)  # (S, W)
            col = sample_from(p[stop].gather(1, by_id), u[stop, level * K + max_children])  # (S,)
            bonus[stop] = tok.gather(1, col[:, None])[:, 0]
            last[stop] = cur[stop]
        if level < max_depth:
            path[moved, level] = nxt[moved]
        logps.append(logprob_of(lg, torch.where(moved, tree.tokens[rows, nxt], bonus), temperature))
        n_acc += moved.long()
        active = moved
        cur = nxt
        if not bool(active.any()):  # host sync: every row has its bonus token
            break
    return Acceptance(path, n_acc, bonus, last, torch.stack(visited, 1), rejected, torch.stack(logps, 1),
                      torch.stack(targets, 1) if vocab is not None else None)


def accept_chain(tokens: torch.Tensor, q: torch.Tensor, logits: torch.Tensor, temperature: float, top_p: float,
                 u: torch.Tensor, vocab: torch.Tensor | None = None) -> Acceptance:
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
