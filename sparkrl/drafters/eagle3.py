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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sparkrl.errors import UserError
from sparkrl.model import KVCache, ModelArgs, Stack, Transformer

KIND = "eagle3"


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle, high policy layers (EAGLE-3 uses 2, L/2, L-3)."""
    top = num_layers - 1
    return (min(2, top), num_layers // 2, max(num_layers - 3, 0))


@dataclass
class DraftStep:
    h: torch.Tensor  # (B, T, d) normed feature entering the head
    a: torch.Tensor  # (B, T, d) pre-norm output: the feature of children of these positions
    z: torch.Tensor  # (B, T, Vd) draft logits over the draft vocabulary, float32


class Eagle3Drafter(nn.Module):
    kind = KIND

    def __init__(self, policy_args: ModelArgs, feature_layers: tuple[int, ...] | None = None,
                 vocab_ids: torch.Tensor | None = None):
        super().__init__()
        d = policy_args.hidden_size
        self.policy_args = policy_args
        self.feature_layers = tuple(feature_layers or default_feature_layers(policy_args.num_layers))
        self.fc = nn.Linear(len(self.feature_layers) * d, d, bias=False)
        self.fuse = nn.Linear(2 * d, d, bias=False)
        self.stack = Stack(dataclasses.replace(policy_args, num_layers=1))
        ids = torch.arange(policy_args.vocab_size) if vocab_ids is None else vocab_ids.long()
        self.register_buffer("vocab_ids", ids)  # (Vd,) draft vocabulary -> policy token ids
        self._shared = ()  # (policy embedding,): a tuple, so it is not a submodule of the drafter
        self._head = None

    def bind(self, policy: Transformer) -> "Eagle3Drafter":
        """Share the policy's embedding and (reduced) output head; call after every policy update."""
        self._shared = (policy.model.embed_tokens,)
        self._head = policy.lm_head.weight.detach()[self.vocab_ids].contiguous()  # (Vd, d)
        return self

    def features(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """Policy hidden states of the feature layers -> (B, T, d) fused feature."""
        return self.fc(torch.cat([taps[i] for i in self.feature_layers], dim=-1))

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, cache: KVCache | None = None, *,
                tree_mask=None, depth=None, mask=None) -> DraftStep:
        """tokens (B, T) (next tokens, policy ids), feats (B, T, d) -> DraftStep at these positions."""
        with torch.no_grad():
            emb = self._shared[0](tokens)
        x = self.fuse(torch.cat([emb.to(feats.dtype), feats], dim=-1))
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

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self._head.to(h.dtype)).float()

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        w = self.fc.weight
        return self.stack.new_cache(batch, capacity, w.device, w.dtype)

    # --- checkpoints ----------------------------------------------------------------------------

    def signature(self) -> dict:
        a = self.policy_args
        return {"arch": a.arch, "hidden_size": a.hidden_size, "vocab_size": a.vocab_size, "num_layers": a.num_layers}

    def checkpoint(self) -> dict:
        return {"kind": self.kind, "policy": self.signature(), "feature_layers": list(self.feature_layers),
                "state": {k: v for k, v in self.state_dict().items()}}


def read_checkpoint(path: str | Path | dict) -> dict:
    """The drafter entry of a file (a `pretrain-draft` drafter.pt, or a GRPO run's step-N.pt) or dict."""
    if isinstance(path, dict):
        ck = path
    else:
        p = Path(path)
        if not p.exists():
            raise UserError(f"--draft-checkpoint {p} does not exist")
        try:
            ck = torch.load(p, map_location="cpu", weights_only=False)
        except Exception as e:
            raise UserError(f"--draft-checkpoint {p} is not a readable checkpoint ({type(e).__name__}); "
                            "make one with `sparkrl pretrain-draft`") from None
    if isinstance(ck, dict) and "kind" not in ck and isinstance(ck.get("draft"), dict):
        ck = ck["draft"].get("drafter")  # a training checkpoint: its drafter
    if not isinstance(ck, dict) or "kind" not in ck or "state" not in ck:
        raise UserError(f"{path} is not a sparkrl drafter checkpoint; make one with `sparkrl pretrain-draft`")
    return ck


def load_drafter(path: str | Path | dict, policy_args: ModelArgs) -> Eagle3Drafter:
    """A drafter checkpoint (file or dict) checked against the policy it will serve."""
    ck = read_checkpoint(path)
    if ck["kind"] != KIND:
        raise UserError(f"{path} is a {ck['kind']!r} drafter, not {KIND!r}; pass --draft {ck['kind']} or another checkpoint")
    d = Eagle3Drafter(policy_args, tuple(ck["feature_layers"]), ck["state"]["vocab_ids"])
    want = d.signature()
    for k, v in ck["policy"].items():
        if want.get(k) != v:
            raise UserError(f"drafter checkpoint {path} was made for a policy with {k}={v}, this policy has "
                            f"{k}={want.get(k)}; pretrain a drafter for this model")
    try:
        d.load_state_dict(ck["state"])
    except RuntimeError as e:
        raise UserError(f"drafter checkpoint {path} does not fit the drafter ({str(e).splitlines()[0]})") from None
    return d
