"""The policy as its own drafter: proposals from the policy's own distribution.

`SelfDrafter(policy)`: the policy itself, for tests (a greedy tree then accepts every level: depth + 1 tokens per
round) and as an upper bound on acceptance. `SelfDrafter.int8(policy)` (--draft self-int8): the policy's modules
over the same weights with every product, the head's too, on 8-bit weights and activations
(`cpu.accelerate.use_int8`): no drafter to train, never stale (a refresh of the policy's weights requantizes it),
and the verification by the policy keeps the responses exactly the policy's. It keeps its own KV cache one position
ahead of an EAGLE-style drafter's (drafter position i processes token i + 1, which the policy processes at
position i + 1).
"""

from __future__ import annotations

import copy
import itertools

import torch

from sparkrl.cpu.accelerate import use_int8
from sparkrl.drafters.tree import propose
from sparkrl.engine.records import DraftStep
from sparkrl.engine.seams import DraftModel
from sparkrl.model.kvcache import KVCache
from sparkrl.model.transformer import Transformer


class SelfDrafter(DraftModel):
    feature_layers = ()
    root_logits = True

    propose = propose  # trees or sampled chains (drafters/tree.py)

    def __init__(self, policy: Transformer, quantized: bool = False):
        self.quantized, self.source = quantized, policy
        self.policy = int8_sibling(policy) if quantized else policy  # what drafts
        self.vocab_ids = torch.arange(policy.args.vocab_size, device=policy.lm_head.weight.device)
        self.kind = "self-int8" if quantized else "self"

    @classmethod
    def int8(cls, policy: Transformer) -> "SelfDrafter":
        """--draft self-int8: `int8_sibling(policy)` drafting for `policy` (a CPU copy on the compiled kernels)."""
        return cls(policy, quantized=True)

    def bind(self, policy):
        """Draft for `policy`: itself, or its 8-bit sibling (made again only for another policy object: the
        sibling shares its weights, so it already follows their updates)."""
        if policy is not self.source:
            self.__init__(policy, self.quantized)
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


def int8_sibling(policy: Transformer) -> Transformer:
    """`policy`'s modules over the very same weight tensors (no second copy of them), every product, the LM head's
    too, on 8-bit weights and activations: each layer keeps its quantized weight and remakes it when the weight's
    version counter moves, so the sibling follows every in-place refresh of `policy`. The head runs in 8 bits even
    where `policy` computes its logits in float32 (`head32`): a drafter's logits only decide what is proposed."""
    shared = itertools.chain(policy.parameters(), policy.buffers(), policy.head32)
    sibling = copy.deepcopy(policy, {id(t): t for t in shared})
    sibling.head32 = ()
    return use_int8(sibling)
