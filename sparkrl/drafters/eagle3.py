"""EAGLE-3-style drafter (Li et al. 2025; the paper's "EAGLE3-style" setup, via FastGRPO).

One decoder layer of the policy's own engine (`model.Stack`). Its input at position i fuses the
embedding of token i+1 with a feature for position i:
  * at committed positions, the policy's hidden states of a low, a middle and a high layer,
    concatenated and projected to d (`fc`);
  * at drafted tree nodes, where the policy has not run yet, the drafter's own output at the parent
    (EAGLE's feature recurrence).
It shares the policy's embedding and output head (not trained here); the head can be restricted to
a reduced draft vocabulary (the most frequent tokens; `vocab_ids` maps back to the full vocabulary).
At every drafted context it exposes `h` (the normed feature entering the head) and `z` (the logits),
which is what SPARK corrects.

Departures from EAGLE-3: the embedding/feature fusion is a linear 2d -> d in front of a standard
decoder layer (so the policy's layer code serves unchanged); the feature-regression target of the
online loss is the policy's final normed hidden state at the next position (EAGLE-1's target).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from sparkrl.drafters.base import DraftStep, SharedHeadDrafter
from sparkrl.model import KVCache, ModelArgs, Stack

KIND = "eagle3"


class Eagle3Drafter(SharedHeadDrafter):
    kind = KIND

    def __init__(self, policy_args: ModelArgs, feature_layers: tuple[int, ...] | None = None,
                 vocab_ids: torch.Tensor | None = None):
        super().__init__(policy_args, feature_layers, vocab_ids)
        d = policy_args.hidden_size
        self.fuse = nn.Linear(2 * d, d, bias=False)
        self.stack = Stack(dataclasses.replace(policy_args, num_layers=1))

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, cache: KVCache | None = None, *,
                tree_mask=None, depth=None, mask=None) -> DraftStep:
        """tokens (B, T) (next tokens, policy ids), feats (B, T, d) -> DraftStep at these positions."""
        x = self.fuse(torch.cat([self.embed(tokens).to(feats.dtype), feats], dim=-1))
        out = self.stack(x, cache, tree_mask=tree_mask, depth=depth, taps=(0,), mask=mask)
        return DraftStep(out.hidden, out.taps[0], self.logits(out.hidden))

    def prefill(self, prompts: torch.Tensor, lens: torch.Tensor, feats: torch.Tensor, cache: KVCache) -> None:
        """Commit the drafter positions of the prompts: position i pairs token i+1 with feature i.

        prompts (P, L) right-padded, lens (P,), feats (P, L, d). The last prompt position is paired
        with the first sampled token later, by the engine's catch-up step.
        """
        if prompts.shape[1] > 1:
            self(prompts[:, 1:], feats[:, :-1], cache)
        cache.commit(n_keep=lens - 1)

    def loss(self, tokens, taps, hidden, target_logits, mask) -> tuple[torch.Tensor, dict]:
        """The online/pretraining loss (`draft_train.draft_loss`)."""
        from sparkrl.draft_train import draft_loss

        return draft_loss(self, tokens, taps, hidden, target_logits, mask)
