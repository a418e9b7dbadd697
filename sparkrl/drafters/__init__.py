"""Drafters propose tokens for the policy to verify; see eagle3.py (trees) and tree.py.

A drafter exposes, at every drafted context, `h` (the feature entering its output head) and `z`
(its logits over its vocabulary `vocab_ids`), the interface SPARK corrects. The engine needs:
`bind(policy)`, `features(taps)`, `feature_layers`, `prefill(...)`, `forward(tokens, feats, cache,
tree_mask=, depth=) -> DraftStep`, `new_cache(batch, capacity)` and `vocab_ids`.
"""

from __future__ import annotations

import sys


def make_drafter(cfg, policy, seed: int = 0):
    """The drafter a `DraftConfig` asks for, on the policy's device, bound to it (None for --draft none)."""
    import torch

    from sparkrl.drafters.eagle3 import Eagle3Drafter, load_drafter

    if cfg.draft == "none":
        return None
    if cfg.draft_checkpoint:
        d = load_drafter(cfg.draft_checkpoint, policy.args)
    else:
        print("sparkrl: warning: --draft eagle3 without --draft-checkpoint starts from a freshly initialised "
              "drafter (low acceptance until it has trained); make one with `sparkrl pretrain-draft`", file=sys.stderr)
        torch.manual_seed(seed)
        d = Eagle3Drafter(policy.args)
    w = policy.lm_head.weight
    return d.to(device=w.device, dtype=w.dtype).bind(policy)


def make_budget(cfg, policy, drafter):
    """The per-round speculation budget (None: always the full tree)."""
    if drafter is None or cfg.budget == "fixed":
        return None
    from sparkrl.budget import Budget, CostModel

    return Budget(CostModel.measure(policy, drafter, cfg.shape()), cfg.shape())
