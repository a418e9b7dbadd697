"""Drafters propose tokens for the policy to verify: eagle3.py (trees, chains) and dflash.py (blocks).

A drafter exposes, at every drafted context, `h` (the feature entering its output head) and `z`
(its logits over its vocabulary `vocab_ids`), the interface SPARK corrects. The engine needs:
`bind(policy)`, `features(taps)`, `feature_layers`, `prefill(...)`, `forward(tokens, feats, cache,
tree_mask=, depth=) -> DraftStep` (its catch-up over committed positions), `new_cache(batch,
capacity)`, `logits(h)` and `vocab_ids`; `propose` below turns its output into a round's candidates.
"""

from __future__ import annotations

import sys

import torch

from sparkrl.drafters.base import load_drafter
from sparkrl.drafters.dflash import DFlashDrafter, build_block
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.tree import build_chain, build_tree

KINDS = {"eagle3": Eagle3Drafter, "dflash": DFlashDrafter}  # kind -> drafter class


def make_drafter(cfg, policy, seed: int = 0):
    """The drafter a `DraftConfig` asks for, on the policy's device, bound to it (None for --draft none)."""
    if cfg.draft == "none":
        return None
    if cfg.draft_checkpoint:
        d = load_drafter(cfg.draft_checkpoint, policy.args, cfg.draft)
    else:
        print(f"sparkrl: warning: --draft {cfg.draft} without --draft-checkpoint starts from a freshly initialised "
              "drafter (low acceptance until it has trained); make one with `sparkrl pretrain-draft`", file=sys.stderr)
        torch.manual_seed(seed)
        d = KINDS[cfg.draft](policy.args, **({"block_size": cfg.block_size} if cfg.draft == "dflash" else {}))
    if cfg.draft == "dflash":
        d.check_block(cfg.block_size)
    w = policy.lm_head.weight
    return d.to(device=w.device, dtype=w.dtype).bind(policy)


def propose(drafter, cache, state, shape, nodes: int, temperature: float, u, spark=None):
    """One round's candidates from the drafter's state at the roots: (Tree, q or None, Contexts or None).

    shape.mode: "tree" (EAGLE dynamic top-k tree of `nodes` nodes), "chain" (sampled; q the
    distributions sampled from; u (B, depth) uniforms) or "block" (DFlash greedy block of `nodes`).
    """
    if shape.mode == "tree":
        tree, ctx = build_tree(drafter, cache, state.root, state.z, state.a, shape, nodes, state.h, spark)
        return tree, None, ctx
    if shape.mode == "chain":
        tree, q, ctx = build_chain(drafter, cache, state.root, state.z, state.a, shape.depth, temperature, u,
                                   state.h, spark)
        return tree, q, ctx
    tree, ctx = build_block(drafter, cache, state.root, nodes, spark)
    return tree, None, ctx


def make_budget(cfg, policy, drafter):
    """The per-round speculation budget (None: always the full tree)."""
    if drafter is None or cfg.budget == "fixed":
        return None
    from sparkrl.budget import Budget, CostModel

    return Budget(CostModel.measure(policy, drafter, cfg.shape()), cfg.shape())
