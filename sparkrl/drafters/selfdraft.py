"""The policy as its own drafter: proposals from the policy's own distribution.

`SelfDrafter(policy)`: the policy itself, for tests (a greedy tree then accepts every level: depth + 1 tokens per
round) and as an upper bound on acceptance. `SelfDrafter(policy, sibling, kind)`: `sibling(policy)` drafts, a model
over the policy's own weights run otherwise (--draft self-int8: `train.precision.int8_sibling`, every product on 8-bit
weights and activations), so there is nothing to train and it never goes stale. It keeps its own KV cache one
position ahead of an EAGLE-style drafter's (drafter position i processes token i + 1, which the policy processes at
position i + 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparkrl.drafters.tree import propose
from sparkrl.engine.records import DraftStep
from sparkrl.engine.seams import DraftModel
from sparkrl.model.kvcache import KVCache
from sparkrl.model.transformer import Transformer


class SelfDrafter(DraftModel):
    feature_layers = ()
    root_logits = True

    propose = propose  # trees or sampled chains (drafters/tree.py)

    def __init__(self, policy: Transformer, sibling: Callable[[Transformer], Transformer] | None = None, kind="self"):
        self.source, self.sibling, self.kind = policy, sibling, kind
        self.policy = policy if sibling is None else sibling(policy)  # what drafts
        self.vocab_ids = torch.arange(policy.args.vocab_size, device=policy.lm_head.weight.device)

    def bind(self, policy):
        """Draft for `policy`: itself, or its sibling (made again only for another policy object: a sibling over
        the policy's weights already follows their updates)."""
        if policy is not self.source:
            self.__init__(policy, self.sibling, self.kind)
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
