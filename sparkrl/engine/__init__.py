"""The rollout engine: sampling with counter-based uniforms, exact verification of drafted trees, chains and
blocks, autoregressive and speculative rounds over a ragged KV cache, the budget that chooses each round's
drafting shape, and SPARK's in-rollout correction. `records` holds what the engine and the drafters exchange;
`seams` declares what the engine takes (drafter, budget, adapter) and what an engine is.
Imports only `model` (and the base modules); never `cpu` (an add-on composed from above)."""
