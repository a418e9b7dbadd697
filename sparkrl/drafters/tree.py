"""Dynamic draft trees (EAGLE-2 / EAGLE-3): expand the most likely nodes, keep the best overall.

Level 1 is the top-`branch` tokens of the drafter's distribution after the root. At each further
level the current frontier (the `branch` best nodes of the previous level by cumulative draft
log-probability) is expanded in one drafter forward, each frontier node proposing its top-`branch`
children, and the `branch` best children by cumulative log-probability form the next frontier.
Finally the `nodes` best recorded nodes overall make the tree. With `shape.stop`, a row whose frontier holds
less draft probability than that records no deeper nodes (EAGLE-2's point: the draft's confidence tracks
acceptance; its tree is padded with invalid nodes), and once every row has stopped no deeper level is drafted,
so an unsure drafter proposes a shallower, smaller tree. A child's cumulative log-probability
never exceeds its parent's, so the chosen set is closed under ancestors. Everything here depends on
the drafter's distribution only, so the candidates are deterministic (point masses).

Expansion forwards append the frontier to the drafter cache's speculative region; each frontier
node attends to its own ancestors there. The caller rolls the region back after the tree is built.
"""

from __future__ import annotations

import dataclasses

import torch

from sparkrl.config import TreeShape
from sparkrl.engine.records import Contexts, Proposal, Tree
from sparkrl.engine.sampling import sample_from


def identity(z: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The logit correction when nothing adapts the drafter: z unchanged."""
    return z


def build_tree(
    drafter,
    cache,
    root: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    h: torch.Tensor,
    shape: TreeShape,
    nodes: int | None = None,
    correct=identity,
) -> Proposal:
    """Trees for a batch of roots.

    root: (B,) policy ids of the roots; z: (B, Vd) drafter logits after the root; a: (B, d) the drafter
    feature at the root's position (parent feature of the level-1 nodes); h: (B, d) the root's head
    feature. nodes: keep this many nodes instead of shape.nodes (the `nodes` best are also the best of any
    larger tree, so smaller trees are subsets of larger ones). correct(z, h): the logit correction applied
    at every context (SPARK's; `identity` otherwise).
    """
    B = root.shape[0]
    dev = root.device
    k = shape.branch
    ids = drafter.vocab_ids
    z = correct(z, h)
    ctx_h, ctx_z, expanded = [h[:, None]], [z[:, None]], []  # expanded: (recorded ids, first context, rows going)
    logq = torch.log_softmax(z.float(), -1)  # (B, Vd)
    score, tok = logq.topk(min(k, logq.shape[-1]), dim=-1)  # (B, F)
    F = score.shape[1]
    rec = _Recorded()
    front_id = rec.add(ids[tok], score, torch.full((B, F), -1, device=dev), 1)  # recorded ids of the frontier
    front_feat = a[:, None].expand(B, F, a.shape[-1])
    front_anc = torch.zeros(B, F, 0, dtype=torch.bool, device=dev)  # ancestors in the speculative region
    n_ctx = 1
    # a node at depth d ranks below its d - 1 ancestors, so a tree of n nodes never reaches below depth n:
    # levels past that are not drafted (the budget's small trees cost less; the kept nodes are the same)
    going = None  # with shape.stop: the rows whose frontier is still likely enough to draft below
    for level in range(2, min(shape.depth, nodes or shape.nodes) + 1):
        if shape.stop:
            going = score.exp().sum(-1) >= shape.stop  # (B,) a stopped row's frontier scores are -inf
            if not bool(going.any()):  # host sync: every row stopped
                break
        P = cache.pending
        step = _expand(drafter, cache, rec.tok[-1], front_feat, front_anc, level)
        zs = correct(step.z, step.h)  # (B, F, Vd)
        expanded.append((front_id, n_ctx, going))
        ctx_h.append(step.h)
        ctx_z.append(zs)
        n_ctx += F
        score, slot, child = _best_children(zs, rec.score[-1], k, going)
        front_id = rec.add(ids[child], score, front_id.gather(1, slot), level)
        front_feat = step.a.gather(1, slot[..., None].expand(-1, -1, step.a.shape[-1]))
        front_anc = _child_ancestors(front_anc, slot, P, F)
        F = k
    tree, keep = rec.select(root, nodes or shape.nodes)
    node = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), _node_contexts(expanded, rec.n, keep, dev)], 1)
    return Proposal(tree, None, Contexts(ctx_h, ctx_z, node, rejected_children=True))


@dataclasses.dataclass
class _Recorded:
    """The nodes a tree is chosen from, level by level: policy ids (B, F), cumulative draft log-probabilities
    (B, F), recorded ids of their parents (B, F; -1: the root) and the level's depth; n: how many in all."""

    tok: list = dataclasses.field(default_factory=list)
    score: list = dataclasses.field(default_factory=list)
    parent: list = dataclasses.field(default_factory=list)
    depth: list = dataclasses.field(default_factory=list)
    n: int = 0

    def add(self, tok: torch.Tensor, score: torch.Tensor, parent: torch.Tensor, depth: int) -> torch.Tensor:
        """Record a level of F nodes; returns their recorded ids (B, F)."""
        B, F = score.shape
        self.tok.append(tok)
        self.score.append(score)
        self.parent.append(parent)
        self.depth.append(depth)
        ids = self.n + torch.arange(F, device=score.device).expand(B, F)
        self.n += F
        return ids

    def select(self, root: torch.Tensor, nodes: int) -> tuple[Tree, torch.Tensor]:
        """The tree of the `nodes` best recorded nodes below `root` (`_select`), and their recorded ids (B, n)."""
        return _select(
            torch.cat(self.tok, 1),
            torch.cat(self.score, 1),
            torch.cat(self.parent, 1),
            torch.cat([torch.full_like(s, d, dtype=torch.long) for s, d in zip(self.score, self.depth)], 1),
            root,
            nodes,
        )


def _best_children(zs: torch.Tensor, score: torch.Tensor, k: int, going: torch.Tensor | None):
    """The next frontier: of the children the frontier's F nodes propose (each its top-k tokens of its corrected
    logits zs (B, F, Vd)), the k best by cumulative draft log-probability (the frontier's own: score (B, F)); a row
    not `going` (`shape.stop`) gets -inf. Returns their scores (B, k), each one's parent's frontier slot (B, k) and
    its token's index in the draft vocabulary (B, k)."""
    cs, ci = torch.log_softmax(zs, -1).topk(k, dim=-1)  # (B, F, k)
    cum = (score[:, :, None] + cs).flatten(1)  # (B, F*k)
    best, sel = cum.topk(k, dim=-1)  # (B, k) next frontier
    if going is not None:  # a stopped row records no nodes below (each row's tree is its own, whatever the batch)
        best = best.masked_fill(~going[:, None], float("-inf"))
    slot = sel // k  # frontier slot of each child's parent
    return best, slot, ci.flatten(1).gather(1, sel)


def _expand(drafter, cache, tokens: torch.Tensor, feat: torch.Tensor, anc: torch.Tensor, level: int):
    """One drafter forward over the frontier (B, F) at tree level `level`: tokens, parent features feat
    (B, F, d), and anc (B, F, P) each node's ancestors among the P speculative positions already in the
    drafter's cache; a node attends to those and to itself."""
    B, F = tokens.shape
    mask = torch.cat([anc, torch.eye(F, dtype=torch.bool, device=anc.device).expand(B, F, F)], -1)
    return drafter(tokens, feat, cache, tree_mask=mask, depth=torch.full((B, F), level - 2, device=anc.device))


def _child_ancestors(anc: torch.Tensor, slot: torch.Tensor, P: int, F: int) -> torch.Tensor:
    """Ancestors (B, k, P + F) of the next frontier in the speculative region, once the current frontier (F
    nodes with ancestors anc (B, F, P)) has been written after the P positions: each child's parent's
    ancestors and the parent itself. slot (B, k): each child's parent in the current frontier."""
    B, k = slot.shape
    own = torch.zeros(B, k, P + F, dtype=torch.bool, device=anc.device)
    own.scatter_(2, (P + slot)[..., None], True)
    anc = torch.cat([anc, torch.zeros(B, F, F, dtype=torch.bool, device=anc.device)], -1)
    return anc.gather(1, slot[..., None].expand(-1, -1, P + F)) | own


def _node_contexts(expanded: list, n_rec: int, keep: torch.Tensor, dev) -> torch.Tensor:
    """(B, n) the context index of each kept node's prediction, -1 where the drafter did not expand it.
    expanded: per drafted level (recorded ids of its frontier, its first context, rows going or None); a
    stopped row's frontier was expanded for the other rows only, so it gets no context."""
    rec_ctx = torch.full((keep.shape[0], n_rec), -1, dtype=torch.long, device=dev)  # context of each recorded node
    for ids_, first, went in expanded:
        ctx = first + torch.arange(ids_.shape[1], device=dev).expand_as(ids_)
        rec_ctx.scatter_(1, ids_, ctx if went is None else torch.where(went[:, None], ctx, -1))
    return rec_ctx.gather(1, keep)


def propose(
    drafter, cache, state, shape: TreeShape, nodes: int, temperature: float, u: torch.Tensor, correct=identity
) -> Proposal:
    """EAGLE-style proposals from the drafter's state at the roots (`records.DraftState`): a dynamic tree of
    `nodes` nodes (shape.mode "tree"), or a chain sampled from q with uniforms u (B, depth) ("chain")."""
    if shape.mode == "chain":
        return build_chain(drafter, cache, state.root, state.z, state.a, state.h, shape.depth, temperature, u, correct)
    return build_tree(drafter, cache, state.root, state.z, state.a, state.h, shape, nodes, correct)


def path_tree(tokens: torch.Tensor) -> Tree:
    """A one-path tree over tokens (B, 1 + D): the root, then each token the child of the previous."""
    B, n = tokens.shape
    ar = torch.arange(n, device=tokens.device)
    return Tree(
        tokens=tokens,
        parents=(ar - 1).expand(B, -1).clone(),
        valid=torch.ones(B, n, dtype=torch.bool, device=tokens.device),
        depth=ar.expand(B, -1).clone(),
        rank=ar.expand(B, -1).clone(),
    )


def path_contexts(h: torch.Tensor, z: torch.Tensor) -> Contexts:
    """Contexts of a one-path proposal of D tokens: position d (the prediction after node d) is context d."""
    B, D = z.shape[:2]
    ar = torch.arange(D + 1, device=z.device)
    return Contexts(h, z, torch.where(ar < D, ar, -1).expand(B, -1).clone(), rejected_children=False)


def _select(tok, score, parent, depth, root, nodes) -> tuple[Tree, torch.Tensor]:
    """Keep the `nodes` best recorded nodes (ancestor-closed), ordered by depth then score."""
    B, M = tok.shape
    dev = tok.device
    n = min(nodes, M)
    rank = score.double() - 1e-6 * depth  # strict: a parent always ranks above its children
    keep = rank.topk(n, dim=-1).indices  # (B, n)
    order_key = depth.gather(1, keep) * 1e6 - rank.gather(1, keep)  # depth first, best first
    perm = order_key.argsort(-1)
    keep = keep.gather(1, perm)  # keep was in rank order: perm + 1 is each kept node's rank
    new_index = torch.zeros(B, M, dtype=torch.long, device=dev)
    new_index.scatter_(1, keep, torch.arange(1, n + 1, device=dev).expand(B, n))
    par = parent.gather(1, keep)
    par = torch.where(par < 0, 0, new_index.gather(1, par.clamp(min=0)))
    valid = rank.gather(1, keep).isfinite()  # not a node a stopped row recorded (`shape.stop`): padding
    return Tree(
        tokens=torch.cat([root[:, None], tok.gather(1, keep)], 1),
        parents=torch.cat([torch.full((B, 1), -1, device=dev), torch.where(valid, par, -1)], 1),
        valid=torch.cat([torch.ones(B, 1, dtype=torch.bool, device=dev), valid], 1),
        depth=torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), depth.gather(1, keep)], 1),
        rank=torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), perm + 1], 1),
        prob=torch.cat([torch.ones(B, 1, device=dev), score.gather(1, keep).float().exp()], 1),
    ), keep


def build_chain(
    drafter, cache, root, z, a, h, depth: int, temperature: float, u: torch.Tensor, correct=identity
) -> Proposal:
    """Chains of `depth` tokens sampled from the draft distribution q = softmax(z / temperature).

    u: (B, depth) uniforms. The proposal's q[:, d] (B, depth, Vd) is the distribution token d was drawn
    from (point masses at temperature 0), after the correction `correct(z, h)`.
    """
    B = root.shape[0]
    dev = root.device
    ids = drafter.vocab_ids
    qs, toks, hs, zs = [], [], [], []
    feat = a[:, None]
    for d in range(depth):
        if d:
            step = drafter(toks[-1][:, None], feat, cache, depth=torch.full((B, 1), d - 1, device=dev))
            z, feat, h = step.z[:, 0], step.a, step.h[:, 0]
        z = correct(z, h)
        hs.append(h)
        zs.append(z)
        q = (
            torch.softmax(z.float() / temperature, -1)
            if temperature > 0
            else torch.nn.functional.one_hot(z.argmax(-1), z.shape[-1]).float()
        )
        qs.append(q)
        toks.append(ids[sample_from(q, u[:, d])])
    tree = path_tree(torch.cat([root[:, None], torch.stack(toks, 1)], 1))
    return Proposal(tree, torch.stack(qs, 1), path_contexts(torch.stack(hs, 1), torch.stack(zs, 1)))
