"""EAGLE-3-style drafter (Li et al. 2025; the paper's "EAGLE3-style" setup, via FastGRPO).

One decoder layer of the policy's own engine (`model.Stack`; the setting `num_layers` gives more). Its input
at position i pairs the embedding of token i+1 with a feature for position i: at committed positions the
policy's hidden states of a low, a middle and a high layer, concatenated and projected to d (`fc`); at drafted
tree nodes, where the policy has not run yet, the drafter's own output at the parent (EAGLE's feature
recurrence). Two layouts join them (the `layout` setting):

  * `eagle3` (EAGLE-3's own, the default for new drafters): the first layer's attention reads
    cat(input_layernorm(embedding), hidden_norm(feature)), 2d wide, and the feature is its residual
    (`Eagle3Layer`). vLLM's `eagle3` method, SGLang and `speculators` run this layout, so a drafter moves
    between them and sparkrl (`export_draft`);
  * `fused` (sparkrl's earlier one, which the drafters made before it keep): a linear 2d -> d of the
    concatenated embedding and feature in front of a standard decoder layer; `relayout` carries such a drafter
    into EAGLE-3's layout as the start of a continued run. It shares the policy's embedding and output head (not
    trained here); the head can be restricted
to a draft vocabulary of the most frequent tokens (`vocab_ids` maps back). At every drafted context it exposes
`h` (the normed feature entering the head) and `z` (the logits): what SPARK corrects.

Loss (paper appendix A, FastGRPO; `draft_loss`): 2 * SmoothL1(feature) + 0.1 * softCE(target distribution),
with EAGLE-3's training-time test; the feature weight is a setting (0: EAGLE-3's token-only loss). Position i
predicts token i+2: its pre-norm output is regressed on the policy's final normed hidden state at i+1, and its
distribution over the draft vocabulary is pulled towards the policy's at i+1.

Departure from EAGLE-3: the feature term of the loss; its target is the policy's final normed hidden state at
the next position (EAGLE-1's).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from sparkrl.drafters.base import SharedHeadDrafter, target_probs
from sparkrl.drafters.tree import propose
from sparkrl.engine.records import DraftStep
from sparkrl.model.kvcache import KVCache
from sparkrl.model.transformer import DecoderLayer, Linear, ModelArgs, RMSNorm, Stack

KIND = "eagle3"
LAYOUTS = ("eagle3", "fused")


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's first decoder layer. Its input x (B, T, 2d) is cat(embedding, feature): the attention reads
    cat(input_layernorm(embedding), hidden_norm(feature)) with 2d-wide q/k/v projections, and the feature is the
    residual (its normed form with norm_before_residual, as some published checkpoints are trained). The rest is a
    standard decoder layer (vLLM's `llama_eagle3.py` computes the same)."""

    def __init__(self, args: ModelArgs, norm_before_residual: bool = False):
        super().__init__(args)
        self.norm_before_residual = norm_before_residual
        d, a = args.hidden_size, self.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(a, name, Linear(2 * d, getattr(a, name).out_features, bias=args.qkv_bias))
        self.hidden_norm = RMSNorm(d, args.rms_norm_eps)

    def forward(self, x, cos, sin, layer, cache, ctx):
        emb, feat = x.chunk(2, dim=-1)
        normed = self.hidden_norm(feat)
        h = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        x = (normed if self.norm_before_residual else feat) + self.self_attn(h, cos, sin, layer, cache, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(SharedHeadDrafter):
    kind = KIND
    LEGACY = {"layout": "fused"}  # the settings a checkpoint that does not record them was made with

    def __init__(
        self,
        policy_args: ModelArgs,
        feature_layers: tuple[int, ...] | None = None,
        vocab_ids: torch.Tensor | None = None,
        feature_weight: float = 2.0,
        num_layers: int = 1,
        layout: str = "eagle3",
        layer: dict | None = None,
        own_head: bool = False,
        norm_before_residual: bool = False,
    ):
        """layer: the decoder layers' sizes where they are not the policy's (`ModelArgs` fields: heads, head_dim,
        intermediate_size, biases, q/k norms, RoPE theta), as an imported EAGLE-3 checkpoint has them; own_head: a
        trained output head over the draft vocabulary instead of the policy's rows (imported checkpoints)."""
        super().__init__(policy_args, feature_layers, vocab_ids)
        if layout not in LAYOUTS:
            raise ValueError(f"EAGLE3-style layout {layout!r}: one of {', '.join(LAYOUTS)}")
        self.feature_weight = feature_weight  # of the feature term in `draft_loss`; saved with the
        # checkpoint, so online training goes on with the loss the drafter was pretrained with
        self.num_layers = num_layers  # decoder layers (EAGLE-3: one)
        self.layout, self.layer, self.own_head = layout, dict(layer or {}), own_head
        self.norm_before_residual = norm_before_residual
        d = policy_args.hidden_size
        self.stack = Stack(dataclasses.replace(policy_args, num_layers=num_layers, **self.layer))
        if layout == "eagle3":
            self.stack.layers[0] = Eagle3Layer(self.stack.args, norm_before_residual)
        else:
            self.fuse = Linear(2 * d, d, bias=False)
        if own_head:
            self.head = Linear(d, int(self.vocab_ids.numel()), bias=False)

    def bind(self, policy) -> "Eagle3Drafter":
        """The policy's embedding (and its head's draft-vocabulary rows, unless the drafter has its own head)."""
        super().bind(policy)
        if self.own_head:
            self._head = (self.head,)
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        feats: torch.Tensor,
        cache: KVCache | None = None,
        *,
        tree_mask=None,
        depth=None,
        mask=None,
        past=None,
        head: bool = True,
    ) -> DraftStep:
        """tokens (B, T) (next tokens, policy ids), feats (B, T, d) -> DraftStep at these positions
        (head=False: without the logits; mask, past: training forwards, see `model.Stack.forward`)."""
        x = torch.cat([self.embed(tokens).to(feats.dtype), feats], dim=-1)
        if self.layout == "fused":
            x = self.fuse(x)
        last = self.num_layers - 1
        out = self.stack(x, cache, tree_mask=tree_mask, depth=depth, taps=(last,), mask=mask, past=past)
        return DraftStep(out.hidden, out.taps[last], self.logits(out.hidden) if head else None)

    def prefill(self, prompts: torch.Tensor, lens: torch.Tensor, feats: torch.Tensor, cache: KVCache) -> None:
        """Commit the drafter positions of the prompts: position i pairs token i+1 with feature i.

        prompts (P, L) right-padded, lens (P,), feats (P, L, d). The last prompt position is paired
        with the first sampled token later, by the engine's catch-up step.
        """
        if prompts.shape[1] > 1:
            self(prompts[:, 1:], feats[:, :-1], cache, head=False)
        cache.commit(n_keep=lens - 1)

    def settings(self) -> dict:
        return {
            "feature_weight": self.feature_weight,
            "num_layers": self.num_layers,
            "layout": self.layout,
            "layer": self.layer,
            "own_head": self.own_head,
            "norm_before_residual": self.norm_before_residual,
        }

    propose = propose  # trees or sampled chains (drafters/tree.py)

    def loss(
        self, tokens, taps, hidden, target_logits, mask, generator=None, held_out: bool = False
    ) -> tuple[torch.Tensor, dict]:
        """The online/pretraining loss (`draft_loss`; deterministic, `generator` unused; held-out scores
        are the same loss)."""
        return draft_loss(self, tokens, taps, hidden, target_logits, mask, feature_weight=self.feature_weight)


def relayout(fused: Eagle3Drafter, emb: torch.Tensor, feats: torch.Tensor) -> Eagle3Drafter:
    """A fused-layout drafter carried into EAGLE-3's layout: the start of its continued training
    (`pretrain-draft --init FUSED --draft-layout eagle3`), which makes an older drafter exportable to vLLM.

    emb (N, d): token embeddings, feats (N, d): the fused drafter's `features` at the same N positions (a policy
    pass over a few sequences). The fused layer's attention reads g * x / rms(x) of x = W_e e + W_f f, and x is
    its residual; EAGLE-3's reads cat(g_e * e / rms(e), g_h * f' / rms(f')), and f' is its residual. Mapped:
    f' = W_f f (fc' = W_f fc), both norms' gains 1, q/k/v' = [P diag(g) W_e c_e, P diag(g) c_f] for each of the
    fused q/k/v weights P, with c_e and c_f the means over the N positions of rms(e) / rms(x) and
    rms(W_f f) / rms(x); the rest of the weights unchanged. So the attention reads what the fused one reads
    wherever those two ratios are at their means. Not exact: the ratios vary by position, the residual lacks
    W_e e, and at tree depth 2 and below the fed-back feature is the layer's output itself, not W_f of it; the
    continued training takes it from there."""
    d = fused.policy_args.hidden_size
    layer = fused.stack.layers[0]
    with torch.no_grad():
        w = fused.fuse.weight.double()
        w_e, w_f = w[:, :d], w[:, d:]
        if emb.numel() == 0:
            raise ValueError("relayout needs at least one position to measure the norms' ratios on")
        e, f = emb.reshape(-1, d).to(w), feats.reshape(-1, d).to(w) @ w_f.T
        rms = lambda x: x.pow(2).mean(-1).sqrt()
        x = rms(e @ w_e.T + f)
        c_e, c_f = float((rms(e) / x).mean()), float((rms(f) / x).mean())
        new = Eagle3Drafter(
            fused.policy_args,
            fused.feature_layers,
            fused.vocab_ids,
            fused.feature_weight,
            fused.num_layers,
            "eagle3",
            fused.layer,
            fused.own_head,
            norm_before_residual=False,
        ).to(fused.fc.weight)
        state = {k: v for k, v in fused.state_dict().items() if k != "fuse.weight"}
        state["fc.weight"] = w_f @ fused.fc.weight.double()
        gain = layer.input_layernorm.weight.double()
        for name in ("q_proj", "k_proj", "v_proj"):
            p = getattr(layer.self_attn, name).weight.double() * gain
            state[f"stack.layers.0.self_attn.{name}.weight"] = torch.cat([p @ w_e * c_e, p * c_f], 1)
        state["stack.layers.0.input_layernorm.weight"] = torch.ones(d)
        state["stack.layers.0.hidden_norm.weight"] = torch.ones(d)
        new.load_state_dict(state)  # (copied in the drafter's dtype)
    return new


CE_WEIGHT = 0.1
TREE_BRANCH = 4  # children per tree node of the held-out estimate `tree_s` (the 16-node trees' branch)


def unrolled_mask(n: int, steps: int, device) -> torch.Tensor:
    """(1, 1, steps*n, steps*n) attention among `steps` segments of n positions: segment 1 is causal;
    position j of segment s (a depth s-1 tree node drafted from position j) sees segment 1 up to j
    (the committed prefix) and position j of segments 2..s (its ancestors and itself)."""
    j = torch.arange(n, device=device)
    seg = torch.arange(steps, device=device)
    qs, qj = seg.repeat_interleave(n), j.repeat(steps)  # segment and position of every row
    prefix = (qs[None, :] == 0) & (qj[None, :] <= qj[:, None])
    chain = (qs[None, :] > 0) & (qs[None, :] <= qs[:, None]) & (qj[None, :] == qj[:, None])
    return (prefix | chain)[None, None]


def unrolled(drafter, tokens: torch.Tensor, feats: torch.Tensor, steps: int, reuse: bool = True) -> list:
    """Drafter outputs of segments 1..steps (see `draft_loss`), each (a, z) over n = T - 1 positions.

    tokens (B, T) padded on the right by `steps` extra positions; feats (B, n, d) policy features.
    reuse: segment s's forward runs its own n positions and attends to the keys and values that the
    forwards of segments 1..s-1 made (`model.Stack.forward`'s past), so every position runs once; False
    runs segments 1..s again inside segment s's forward (the reference: the same sums, twice the
    decoder rows at 3 steps)."""
    B, n = feats.shape[:2]
    j = torch.arange(n, device=tokens.device)
    past = [] if reuse else None
    seg_tokens, seg_feats, seg_depth, outs = [], [], [], []
    for s in range(1, steps + 1):
        seg_tokens.append(tokens[:, s : s + n])
        seg_feats.append(feats if s == 1 else outs[-1][0])
        seg_depth.append(j + s - 1)
        mask = unrolled_mask(n, s, tokens.device)
        if reuse:
            step = drafter(
                seg_tokens[-1],
                seg_feats[-1],
                depth=seg_depth[-1].expand(B, -1),
                mask=mask[:, :, -n:],
                past=past,
                head=False,
            )
        else:
            step = drafter(
                torch.cat(seg_tokens, 1),
                torch.cat(seg_feats, 1),
                depth=torch.cat(seg_depth).expand(B, -1),
                mask=mask,
                head=False,
            )
        outs.append((step.a[:, -n:], drafter.logits(step.h[:, -n:])))
    return outs


def draft_loss(
    drafter,
    tokens: torch.Tensor,
    taps: dict[int, torch.Tensor],
    hidden: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    steps: int = 3,
    feature_weight: float = 2.0,
) -> tuple[torch.Tensor, dict]:
    """tokens (B, T); taps: policy layer outputs (B, T, d); hidden (B, T, d) policy final normed
    hidden; target_logits (B, T, V) policy logits; mask (B, T): position t is trained to predict
    token t + 2 from token t + 1 (targets at t + 1).

    feature_weight: of the SmoothL1 feature term (2: the paper's appendix A; 0: EAGLE-3's token-only loss).
    Training-time test (EAGLE-3): besides the teacher-forced step, `steps - 1` unrolled steps feed
    the drafter its own previous output as the feature, as at tree depth >= 2 (segment s, position j:
    token j + s, feature = segment s-1's output at j, targets at j + s, RoPE position j + s - 1).
    Returns (loss averaged over steps and trained positions, stats; per segment s: top1_s, the top-1
    agreement, and acc_s, the acceptance probability sum_x min(p, q) of a token sampled from the draft).
    """
    B, T = tokens.shape
    n = T - 1
    K = max(1, min(steps, n))
    pad = lambda t: torch.cat([t, t[:, -1:].expand(-1, K, *t.shape[2:])], 1)
    target = target_probs(target_logits, drafter.vocab_ids)  # (B, T, Vd), once
    toks_p, hid_p, p_p, m_p = pad(tokens), pad(hidden.detach()), pad(target), pad(mask)
    feats = drafter.features({i: t[:, :-1] for i, t in taps.items()})  # (B, n, d) features at 0..n-1
    j = torch.arange(n, device=tokens.device)
    total, stats = 0.0, {}
    for s, (a, z) in enumerate(unrolled(drafter, toks_p, feats, K), start=1):
        m = (m_p[:, s - 1 : s - 1 + n] & (j + s <= T - 1)).to(hidden.dtype)  # (B, n)
        cnt = m.sum().clamp(min=1)
        feat = F.smooth_l1_loss(a, hid_p[:, s : s + n], reduction="none").mean(-1)  # (B, n)
        p = p_p[:, s : s + n]  # (B, n, Vd) the policy's distribution on the draft vocabulary
        ce = -(p * torch.log_softmax(z, -1)).sum(-1)
        total = total + ((feature_weight * feat + CE_WEIGHT * ce) * m).sum() / cnt
        with torch.no_grad():
            top1 = float(((z.argmax(-1) == p.argmax(-1)).float() * m).sum() / cnt)
            stats[f"top1_{s}"] = top1
            # acceptance probability of a token sampled from the draft: sum_x min(p, q) (q: the draft's softmax)
            stats[f"acc_{s}"] = float((torch.minimum(p, torch.softmax(z, -1)).sum(-1) * m).sum() / cnt)
            # acceptance probability of a tree level: the policy's mass on the draft's TREE_BRANCH best tokens
            stats[f"tree_{s}"] = float((p.gather(-1, z.topk(TREE_BRANCH, -1).indices).sum(-1) * m).sum() / cnt)
            if s == 1:
                stats.update(
                    feat=float((feat.detach() * m).sum() / cnt),
                    ce=float((ce.detach() * m).sum() / cnt),
                    top1=top1,
                    positions=float(cnt),
                )
    return total / K, stats
