"""Dynamic draft trees (EAGLE-2 / EAGLE-3): expand the most likely nodes, keep the best overall.

Level 1 is the top-`branch` tokens of the drafter's distribution after the root. At each further
level the current frontier (the `branch` best nodes of the previous level by cumulative draft
log-probability) is expanded in one drafter forward, each frontier node proposing its top-`branch`
children, and the `branch` best children by cumulative log-probability form the next frontier.
Finally the `nodes` best recorded nodes overall make the tree. A child's cumulative log-probability
never exceeds its parent's, so the chosen set is closed under ancestors. Everything here depends on
the drafter's distribution only, so the candidates are deterministic (point masses).

Expansion forwards append the frontier to the drafter cache's speculative region; each frontier
node attends to its own ancestors there. The caller rolls the region back after the tree is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkrl.errors import UserError
from sparkrl.verify import Tree


@dataclass(frozen=True)
class TreeShape:
    depth: int  # draft levels below the root
    branch: int  # children per expanded node, and nodes expanded per level
    nodes: int  # draft nodes kept (the root not counted)
    mode: str = "tree"  # "tree": point-mass top-k trees; "chain": `depth` tokens sampled from q;
    # "block": DFlash greedy blocks of `depth` tokens (point masses)

    def __post_init__(self):
        if self.mode not in ("tree", "chain", "block"):
            raise UserError(f"--draft-mode must be tree or chain, got {self.mode!r}")
        if self.mode in ("chain", "block"):
            object.__setattr__(self, "branch", 1)
            object.__setattr__(self, "nodes", self.depth)
        if self.nodes < 1:
            raise UserError(f"--tree-nodes must be >= 1, got {self.nodes}")
        if self.branch < 1:
            raise UserError(f"--tree-branch must be >= 1, got {self.branch}")
        if self.depth < 1:
            raise UserError(f"--tree-depth must be >= 1, got {self.depth}")
        if self.depth > self.nodes:
            raise UserError(f"--tree-depth {self.depth} is larger than the node budget --tree-nodes {self.nodes}")

    @property
    def max_children(self) -> int:
        return self.branch


@dataclass
class Contexts:
    """The drafted contexts of a round, for SPARK's feedback: every position where the drafter computed
    a distribution (the root, expanded tree nodes, chain positions)."""

    h: torch.Tensor  # (B, C, d) features entering the draft head
    z: torch.Tensor  # (B, C, Vd) the (corrected) logits the proposals came from
    node: torch.Tensor  # (B, N) context index of each tree node, -1 where the drafter did not expand it


def build_tree(drafter, cache, root: torch.Tensor, z: torch.Tensor, a: torch.Tensor, shape: TreeShape,
               nodes: int | None = None, h: torch.Tensor | None = None, spark=None) -> tuple[Tree, Contexts | None]:
    """Trees for a batch of roots.

    root: (B,) policy ids of the roots; z: (B, Vd) drafter logits after the root; a: (B, d) the
    drafter feature at the root's position (parent feature of the level-1 nodes). nodes: keep this
    many nodes instead of shape.nodes (the `nodes` best are also the best of any larger tree, so
    smaller trees are subsets of larger ones). spark: a `spark.Spark` correcting every context's
    logits (h (B, d): the root's head feature); then the contexts are returned too, else None.
    """
    B = root.shape[0]
    dev = root.device
    k = shape.branch
    ids = drafter.vocab_ids
    if spark is not None:
        z = spark.correct(z, h)
        ctx_h, ctx_z, expanded = [h[:, None]], [z[:, None]], []  # expanded: (recorded ids, first context)
    logq = torch.log_softmax(z.float(), -1)  # (B, Vd)
    score, tok = logq.topk(min(k, logq.shape[-1]), dim=-1)  # (B, F)
    F = score.shape[1]
    rec_tok, rec_score, rec_parent, rec_depth = [ids[tok]], [score], [torch.full((B, F), -1, device=dev)], [1]
    front_id = torch.arange(F, device=dev).expand(B, F)  # recorded ids of the frontier
    front_feat = a[:, None].expand(B, F, a.shape[-1])
    front_anc = torch.zeros(B, F, 0, dtype=torch.bool, device=dev)  # ancestors in the speculative region
    n_rec = F
    for level in range(2, shape.depth + 1):
        P = cache.pending
        mask = torch.cat([front_anc, torch.eye(F, dtype=torch.bool, device=dev).expand(B, F, F)], -1)
        step = drafter(rec_tok[-1], front_feat, cache, tree_mask=mask,
                       depth=torch.full((B, F), level - 2, device=dev))
        zs = step.z
        if spark is not None:
            zs = spark.correct(zs, step.h)  # (B, F, Vd)
            expanded.append((front_id, sum(c.shape[1] for c in ctx_z)))
            ctx_h.append(step.h)
            ctx_z.append(zs)
        cs, ci = torch.log_softmax(zs, -1).topk(k, dim=-1)  # (B, F, k)
        cum = (rec_score[-1][:, :, None] + cs).flatten(1)  # (B, F*k)
        score, sel = cum.topk(k, dim=-1)  # (B, k) next frontier
        slot = sel // k  # frontier slot of each child's parent
        rec_tok.append(ids[ci.flatten(1).gather(1, sel)])
        rec_score.append(score)
        rec_parent.append(front_id.gather(1, slot))
        rec_depth.append(level)
        front_id = n_rec + torch.arange(k, device=dev).expand(B, k)
        n_rec += k
        front_feat = step.a.gather(1, slot[..., None].expand(-1, -1, step.a.shape[-1]))
        own = torch.zeros(B, k, P + F, dtype=torch.bool, device=dev)
        own.scatter_(2, (P + slot)[..., None], True)
        anc = torch.cat([front_anc, torch.zeros(B, F, F, dtype=torch.bool, device=dev)], -1)
        front_anc = anc.gather(1, slot[..., None].expand(-1, -1, P + F)) | own
        F = k
    tree, keep = _select(torch.cat(rec_tok, 1), torch.cat(rec_score, 1), torch.cat(rec_parent, 1),
                         torch.cat([torch.full_like(s, d, dtype=torch.long) for s, d in zip(rec_score, rec_depth)], 1),
                         root, nodes or shape.nodes)
    if spark is None:
        return tree, None
    rec_ctx = torch.full((B, n_rec), -1, dtype=torch.long, device=dev)  # context of each recorded node
    for ids_, first in expanded:
        rec_ctx.scatter_(1, ids_, first + torch.arange(ids_.shape[1], device=dev).expand_as(ids_))
    node = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), rec_ctx.gather(1, keep)], 1)
    return tree, Contexts(torch.cat(ctx_h, 1), torch.cat(ctx_z, 1), node)


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
    return Tree(
        tokens=torch.cat([root[:, None], tok.gather(1, keep)], 1),
        parents=torch.cat([torch.full((B, 1), -1, device=dev), par], 1),
        valid=torch.ones(B, n + 1, dtype=torch.bool, device=dev),
        depth=torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), depth.gather(1, keep)], 1),
        rank=torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), perm + 1], 1),
    ), keep


def build_chain(drafter, cache, root, z, a, depth: int, temperature: float, u: torch.Tensor, h=None, spark=None):
    """Chains of `depth` tokens sampled from the draft distribution q = softmax(z / temperature).

    u: (B, depth) uniforms. Returns (Tree, q (B, depth, Vd), Contexts | None): q[:, d] is the
    distribution token d was drawn from (point masses at temperature 0), after SPARK's correction
    when `spark` is given (h (B, d): the root's head feature); chain position d is context d.
    """
    from sparkrl.sampling import sample_from

    B = root.shape[0]
    dev = root.device
    ids = drafter.vocab_ids
    qs, toks, hs, zs = [], [], [], []
    feat = a[:, None]
    for d in range(depth):
        if d:
            step = drafter(toks[-1][:, None], feat, cache, depth=torch.full((B, 1), d - 1, device=dev))
            z, feat, h = step.z[:, 0], step.a, step.h[:, 0]
        if spark is not None:
            z = spark.correct(z, h)
            hs.append(h)
            zs.append(z)
        q = torch.softmax(z.float() / temperature, -1) if temperature > 0 else \
            torch.nn.functional.one_hot(z.argmax(-1), z.shape[-1]).float()
        qs.append(q)
        toks.append(ids[sample_from(q, u[:, d])])
    n = torch.arange(depth + 1, device=dev)
    tree = Tree(
        tokens=torch.cat([root[:, None], torch.stack(toks, 1)], 1),
        parents=(n - 1).expand(B, -1).clone(),
        valid=torch.ones(B, depth + 1, dtype=torch.bool, device=dev),
        depth=n.expand(B, -1).clone(),
    )
    ctx = None
    if spark is not None:
        node = torch.where(n < depth, n, -1).expand(B, -1).clone()
        ctx = Contexts(torch.stack(hs, 1), torch.stack(zs, 1), node)
    return tree, torch.stack(qs, 1), ctx
