"""Drafters propose tokens for the policy to verify; see eagle3.py (trees) and tree.py.

A drafter exposes, at every drafted context, `h` (the feature entering its output head) and `z`
(its logits over its vocabulary `vocab_ids`), the interface SPARK corrects. The engine needs:
`bind(policy)`, `features(taps)`, `feature_layers`, `prefill(...)`, `forward(tokens, feats, cache,
tree_mask=, depth=) -> DraftStep`, `new_cache(batch, capacity)` and `vocab_ids`.
"""
