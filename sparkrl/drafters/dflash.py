"""DFlash-style block drafter (Chen et al. 2026; the paper's "DFlash-style" setup).

Three decoder layers of the policy's own engine (`model.Stack`). The context is the policy itself: every
committed position enters the drafter's KV cache from the policy's fused features there (a low, a middle and a
high layer, projected to d by `fc`; no token embedding, the features carry the tokens). A block of `block_size`
positions, the anchor (the last committed token, not yet run by the policy; its embedding) and block_size - 1
mask embeddings, is drafted in ONE forward: it attends to the whole context and bidirectionally within itself,
and position j predicts the token j places after the anchor. Proposals are the greedy tokens (point masses),
verified as a one-path tree (`verify.accept_tree`). It shares the policy's embedding and (reduced) head and
exposes h and z at every block position, so SPARK applies unchanged; its feedback contexts are the accepted
prefix and the first rejected position.

Two layouts say how the context enters (the `layout` setting):

* "dflash" (DFlash's own, which vLLM's `dflash` method runs; new drafters): each context position's feature,
  normed once (`hidden_norm`), is projected by every layer's own key and value projections (Qwen3-style per-head
  key norm, RoPE at its position) straight into that layer's cache: the context runs through no layer, and only
  the block's positions do. The layers are Qwen3's (per-head q/k norms). A block's mask positions read one
  learnt embedding, as vLLM reads it for `mask_token_id` (an anchor that is that token reads it too, as in vLLM).
  `drafters.dflash_format` writes such a drafter as vLLM loads it.
* "stacked" (sparkrl's earlier one; checkpoints that do not record a layout): the context features run through
  the layers as positions of their own, causally, and fill the cache with their keys and values. vLLM cannot run
  it; `pretrain-draft --init OLD --draft-layout dflash` carries its weights over as a continued run's start.

Training (`block_loss`): `anchors` distinct random anchors per sequence (a setting saved with the checkpoint),
each block attending to the context before its anchor, all in one forward with an explicit mask; soft
cross-entropy against the policy's distribution, weighted exp(-(j - 1) / gamma) by block position j. Position
j only counts if positions 1..j-1 were accepted, so its share of the expected acceptance length falls
geometrically, and DFlash decays its weights for that reason; gamma = 4 keeps position 5 at a third of position
1's weight.

Departure: online, the loss's context starts at the last prompt token (the GRPO update's forward covers the
response positions); pretraining uses whole sequences.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from sparkrl.drafters.base import SharedHeadDrafter, target_probs
from sparkrl.drafters.tree import identity, path_contexts, path_tree
from sparkrl.engine.records import DraftStep, Proposal
from sparkrl.errors import UserError
from sparkrl.model.kvcache import KVCache
from sparkrl.model.transformer import ModelArgs, RMSNorm, Stack

KIND = "dflash"
LAYOUTS = ("dflash", "stacked")
GAMMA = 4.0  # decay of the loss weight with block position
ANCHORS = 8  # training blocks per sequence (a fresh drafter's default)
EVAL_ANCHORS = 32  # blocks per held-out sequence: the same for every drafter, so held-out scores compare


class DFlashDrafter(SharedHeadDrafter):
    kind = KIND
    root_logits = False  # a block drafts from its own forward after the root
    LEGACY = {"layout": "stacked"}  # the settings a checkpoint that does not record them was made with

    def __init__(
        self,
        policy_args: ModelArgs,
        feature_layers: tuple[int, ...] | None = None,
        vocab_ids: torch.Tensor | None = None,
        block_size: int = 16,
        num_layers: int = 3,
        anchors: int = ANCHORS,
        layout: str = "dflash",
        mask_token_id: int | None = None,
    ):
        super().__init__(policy_args, feature_layers, vocab_ids)
        if layout not in LAYOUTS:
            raise ValueError(f"DFlash-style layout {layout!r}: one of {', '.join(LAYOUTS)}")
        self.block_size, self.num_layers, self.layout = block_size, num_layers, layout
        self.anchors = anchors  # training blocks per sequence (`block_loss`)
        qwen3 = layout == "dflash"  # DFlash's layers are Qwen3's: per-head q/k norms, no biases
        args = dataclasses.replace(policy_args, num_layers=num_layers)
        if qwen3:
            args = dataclasses.replace(args, qk_norm=True, qkv_bias=False, o_bias=False, mlp_bias=False)
        self.stack = Stack(args)
        self.mask_embed = nn.Parameter(torch.randn(policy_args.hidden_size) * 0.02)
        # the token id vLLM feeds at the mask positions (its embedding is `mask_embed`): the policy's last id
        self.mask_token_id = (policy_args.vocab_size - 1 if mask_token_id is None else mask_token_id) if qwen3 else None
        if qwen3:
            self.hidden_norm = RMSNorm(policy_args.hidden_size, policy_args.rms_norm_eps)

    def settings(self) -> dict:
        s = {"block_size": self.block_size, "num_layers": self.num_layers, "anchors": self.anchors}
        s["layout"] = self.layout
        if self.mask_token_id is not None:
            s["mask_token_id"] = self.mask_token_id
        return s

    def check_block(self, n: int) -> None:
        """Generation may use blocks up to the size the drafter was trained for."""
        if n > self.block_size:
            raise UserError(
                f"--block-size {n} is larger than the drafter was trained for ({self.block_size}); "
                f"pass --block-size {self.block_size} or less"
            )

    def forward(
        self,
        tokens,
        feats: torch.Tensor,
        cache: KVCache | None = None,
        *,
        tree_mask=None,
        depth=None,
        mask=None,
        head: bool = False,
    ) -> DraftStep:
        """Context positions: feats (B, T, d) fused policy features (tokens unused) into the cache, as the layout
        puts them there. No logits (a block drafts from its own forward, `block`)."""
        if self.layout == "dflash":
            c = self.hidden_norm(feats)
            self.stack.inject(c, cache, depth=depth)
            return DraftStep(c, c, None)
        out = self.stack(feats, cache, tree_mask=tree_mask, depth=depth, mask=mask)
        return DraftStep(out.hidden, out.hidden, None)

    def prefill(self, prompts: torch.Tensor, lens: torch.Tensor, feats: torch.Tensor, cache: KVCache) -> None:
        """Commit the context of the prompts but their last position (the engine's catch-up adds it)."""
        if prompts.shape[1] > 1:
            self(None, feats[:, :-1], cache)
        cache.commit(n_keep=lens - 1)

    def block_inputs(self, anchor: torch.Tensor, n: int) -> torch.Tensor:
        """(B, n + 1, d): the anchor's embedding, then n mask embeddings."""
        e = self.embed(anchor)[:, None].to(self.mask_embed.dtype)
        if self.mask_token_id is not None:  # vLLM embeds the mask token id as the mask, wherever it stands
            e = torch.where((anchor == self.mask_token_id)[:, None, None], self.mask_embed, e)
        return torch.cat([e, self.mask_embed.expand(anchor.shape[0], n, -1)], 1)

    def block(self, anchor: torch.Tensor, cache: KVCache, n: int) -> DraftStep:
        """Draft n tokens after each anchor (B,) in one forward over the cached context: h, z (B, n, .)."""
        B = anchor.shape[0]
        full = torch.ones(B, n + 1, cache.pending + n + 1, dtype=torch.bool, device=anchor.device)
        depth = (cache.pending + torch.arange(n + 1, device=anchor.device)).expand(B, -1)
        out = self.stack(self.block_inputs(anchor, n), cache, tree_mask=full, depth=depth)
        h = out.hidden[:, 1:]
        return DraftStep(h, h, self.logits(h))

    def propose(self, cache: KVCache, state, shape, nodes: int, temperature: float, u, correct=identity) -> Proposal:
        """Greedy blocks of `nodes` tokens after the roots (`records.DraftState`); u is unused (point masses)."""
        return build_block(self, cache, state.root, nodes, correct)

    def loss(
        self, tokens, taps, hidden, target_logits, mask, generator=None, held_out: bool = False
    ) -> tuple[torch.Tensor, dict]:
        """`block_loss` over `anchors` blocks per sequence; for held-out scores over EVAL_ANCHORS, whatever
        the drafter trains with."""
        k = EVAL_ANCHORS if held_out else self.anchors
        return block_loss(self, tokens, taps, target_logits, mask, anchors=k, generator=generator)


def relayout(stacked: DFlashDrafter) -> DFlashDrafter:
    """A stacked-layout drafter carried into DFlash's layout as the start of a continued run (`pretrain-draft --init
    OLD --draft-layout dflash`): every weight both layouts have is kept (fc, the layers' projections, MLPs and norms,
    the final norm, the mask embedding), the new ones (per-head q/k norms, the context norm) start at 1. Not the same
    function: the context no longer runs through the layers, so the run's training has to bring it back."""
    d = DFlashDrafter(
        stacked.policy_args,
        stacked.feature_layers,
        stacked.vocab_ids,
        block_size=stacked.block_size,
        num_layers=stacked.num_layers,
        anchors=stacked.anchors,
        layout="dflash",
    )
    keep = d.state_dict().keys()  # a Qwen2 policy's stacked layers' biases have no place in Qwen3's
    d.load_state_dict({k: v for k, v in stacked.state_dict().items() if k in keep}, strict=False)
    d._shared, d._head = stacked._shared, stacked._head
    return d.to(stacked.fc.weight.dtype)


def build_block(drafter: DFlashDrafter, cache: KVCache, root: torch.Tensor, n: int, correct=identity) -> Proposal:
    """Greedy blocks of n tokens after the roots (B,) as one-path trees (point masses); block position j
    is context j (the prediction after tree node j)."""
    step = drafter.block(root, cache, n)
    z = correct(step.z, step.h)  # (B, n, Vd)
    tok = drafter.vocab_ids[z.argmax(-1)]  # (B, n)
    return Proposal(path_tree(torch.cat([root[:, None], tok], 1)), None, path_contexts(step.h, z))


def block_mask(T: int, anchors: torch.Tensor, bs: int) -> torch.Tensor:
    """(B, 1, N, N) attention of one training forward over T context positions and K blocks of bs
    (N = T + K bs): the context is causal; block k sees the context before its anchor and itself."""
    B, K = anchors.shape
    dev = anchors.device
    N = T + K * bs
    q = torch.arange(N, device=dev)
    is_ctx = q < T
    blk = ((q - T) // bs).clamp(min=0)  # block of every block row/column
    ctx_rows = is_ctx[:, None] & is_ctx[None, :] & (q[None, :] <= q[:, None])  # (N, N)
    anchor_of = anchors.gather(1, blk[None].expand(B, -1))  # (B, N) the anchor of each row's block
    see_ctx = (~is_ctx)[None, :, None] & is_ctx[None, None, :] & (q[None, None, :] < anchor_of[:, :, None])
    same_blk = (~is_ctx)[:, None] & (~is_ctx)[None, :] & (blk[:, None] == blk[None, :])
    return (ctx_rows[None] | see_ctx | same_blk[None])[:, None]


def block_logits(drafter: DFlashDrafter, tokens: torch.Tensor, feats: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Draft logits (B, K, bs - 1, Vd) of blocks anchored at a (B, K), each seeing the context (fused
    features feats (B, T, d)) before its anchor: what `DFlashDrafter.block` computes at inference."""
    B, T = tokens.shape
    K, bs = a.shape[1], drafter.block_size
    dev = tokens.device
    blocks = torch.cat([drafter.block_inputs(tokens.gather(1, a[:, k : k + 1])[:, 0], bs - 1) for k in range(K)], 1).to(
        feats.dtype
    )  # (B, K bs, d)
    pos = torch.cat(
        [torch.arange(T, device=dev).expand(B, -1), (a[:, :, None] + torch.arange(bs, device=dev)).flatten(1)], 1
    )  # (B, N) RoPE positions
    mask = block_mask(T, a, bs)
    if drafter.layout == "dflash":  # the context enters every layer as keys and values only; the blocks run
        past = drafter.stack.context_kv(drafter.hidden_norm(feats), pos[:, :T])
        out = drafter.stack(blocks, mask=mask[:, :, T:], depth=pos[:, T:], past=past)
        return drafter.logits(out.hidden.view(B, K, bs, -1)[:, :, 1:])
    out = drafter.stack(torch.cat([feats, blocks], 1), mask=mask, depth=pos)
    return drafter.logits(out.hidden[:, T:].view(B, K, bs, -1)[:, :, 1:])


def sample_anchors(w: torch.Tensor, k: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct positions per row (B, k), drawn without replacement with probabilities proportional to
    the weights w (B, T) (exponential races: the k smallest -log(u) / w), and which of them are real
    (B, k): a row with fewer than k positions of positive weight fills the rest with weight-0 positions,
    marked False. Uniforms from one generator (None: the global RNG) or from a list of one CPU generator
    per row: a row's anchors then do not depend on the other rows of its micro-batch (data-parallel GRPO
    splits a batch across ranks)."""
    k = min(k, w.shape[1])
    if isinstance(generator, (list, tuple)):  # host side: the per-row generators are CPU generators
        u = torch.stack([torch.rand(w.shape[1], generator=g, dtype=torch.float64) for g in generator]).to(w.device)
    else:
        u = torch.rand(w.shape, generator=generator, dtype=torch.float64, device=w.device)
    race = torch.where(w > 0, -torch.log1p(-u) / w.double(), torch.inf)  # Exp(w) arrival times
    t, a = race.topk(k, -1, largest=False)
    return a, t.isfinite()


def block_loss(
    drafter: DFlashDrafter,
    tokens: torch.Tensor,
    taps: dict,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    anchors: int = ANCHORS,
    gamma: float = GAMMA,
    generator=None,
):
    """Position-weighted soft cross-entropy of `anchors` random blocks per sequence (distinct anchors).

    tokens (B, T); taps: policy layer outputs (B, T, d) at the same positions; target_logits (B, T, V)
    the policy's logits there (position t: the distribution of token t + 1); mask (B, T): position t's
    target may be trained. A block anchored at a (mask[a] true) predicts tokens a + j, j = 1..bs-1,
    against the policy's distribution at a + j - 1, weight exp(-(j - 1) / gamma) where mask allows.
    generator: the anchors' randomness (see `sample_anchors`).
    """
    B, T = tokens.shape
    dev = tokens.device
    n = drafter.block_size - 1
    a, real = sample_anchors(mask.float(), anchors, generator)  # (B, K) distinct anchors; real: mask[a]
    K = a.shape[1]
    z = block_logits(drafter, tokens, drafter.features({i: t.detach() for i, t in taps.items()}), a)
    tgt = (a[:, :, None] + torch.arange(n, device=dev)).clamp(max=T - 1)  # (B, K, n) target positions
    ok = (
        mask.gather(1, tgt.flatten(1)).view(B, K, n)
        & (a[:, :, None] + torch.arange(n, device=dev) < T)
        & real[:, :, None]
    )
    p = target_probs(target_logits, drafter.vocab_ids)  # (B, T, Vd)
    p = p.gather(1, tgt.flatten(1)[..., None].expand(-1, -1, p.shape[-1])).view(B, K, n, -1)
    ce = -(p * torch.log_softmax(z, -1)).sum(-1)  # (B, K, n)
    w = torch.exp(-torch.arange(n, device=dev, dtype=torch.float32) / gamma) * ok  # (B, K, n)
    loss = (w * ce).sum() / w.sum().clamp(min=1e-9)
    with torch.no_grad():
        best = z.argmax(-1, keepdim=True)
        hit = (best[..., 0] == p.argmax(-1)) & ok
        acc = p.gather(-1, best)[..., 0]  # (B, K, n) the policy's probability of the greedy draft token
        cnt = ok.sum().clamp(min=1)
        per = lambda x, j: float((x[..., j] * ok[..., j]).sum() / ok[..., j].sum().clamp(min=1))
        stats = {
            "feat": 0.0,
            "ce": float((ce * ok).sum() / cnt),
            "top1": float(hit.sum() / cnt),
            "positions": float(cnt),
            **{f"top1_{j + 1}": per(hit.float(), j) for j in range(n)},
            **{f"acc_{j + 1}": per(acc, j) for j in range(n)},
        }
    return loss, stats
