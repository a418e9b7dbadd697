"""The policy as its own drafter: proposals from the policy's own distribution.

For tests (a greedy tree then accepts every level: depth + 1 tokens per round) and as an upper
bound on acceptance. It keeps its own KV cache one position ahead of an EAGLE-style drafter's
(drafter position i processes token i + 1, which the policy processes at position i + 1).
"""

from __future__ import annotations

import torch

from sparkrl.drafters.tree import propose
from sparkrl.engine.records import DraftStep
from sparkrl.engine.seams import DraftModel
from sparkrl.model.kvcache import KVCache
from sparkrl.model.transformer import Transformer


class SelfDrafter(DraftModel):
    kind = "self"
    feature_layers = ()
    root_logits = True

    propose = propose  # trees or sampled chains (drafters/tree.py)

    def __init__(self, policy: Transformer):
        self.policy = policy
        self.vocab_ids = torch.arange(policy.args.vocab_size, device=policy.lm_head.weight.device)

    def bind(self, policy):
        self.policy = policy
        return self

    def features(self, taps):
        return None

    def prefill(self, prompts, lens, feats, cache: KVCache) -> None:
        self(prompts, None, cache, head=False)
        cache.commit(n_keep=lens)

    def __call__(self, tokens, feats, cache=None, *, tree_mask=None, depth=None, head: bool = True) -> DraftStep:
        out = self.policy(tokens, cache, tree_mask=tree_mask, depth=depth)
        return DraftStep(out.hidden, out.hidden, self.policy.logits(out.hidden) if head else None)

    def logits(self, h):
        return self.policy.logits(h)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return self.policy.new_cache(batch, capacity + 1)
