"""One GRPO policy update's gradients (DESIGN "Data flow of one GRPO step"): the rollout's responses as right-padded
micro-batches, the policy's (and the reference's) forward over them, the clipped surrogate with KL and truncated
importance sampling (`grpo.grpo_loss`), and the rollout's gap to the master weights (`grpo.mismatch`). Each
micro-batch's policy features (taps of this same forward, taken before the policy changes) also feed the
drafter's online loss (`drafting.OnlineDrafting.observe`): no extra policy forward. `apply_update` then steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparkrl.config import RunConfig
from sparkrl.engine.records import Rollout
from sparkrl.model.transformer import Transformer, pad_right
from sparkrl.train.drafting import NoDrafting, OnlineDrafting
from sparkrl.train.grpo import grpo_loss, mismatch


def response_batch(rollout: Rollout, rows: list[int], device) -> tuple[torch.Tensor, ...]:
    """Responses `rows` of a rollout as one right-padded forward: tokens (b, L) prompt + response;
    pos (b, R+1) the positions whose hidden states predict the R response tokens, plus one (the
    drafter's last target); mask (b, R+1) which of them are real; targets (b, R) the response tokens."""
    toks, _ = pad_right([rollout.prompt_of(r) + rollout.tokens[r] for r in rows])
    L = toks.shape[1]
    R = max(len(rollout.tokens[r]) for r in rows)
    start = torch.tensor([len(rollout.prompt_of(r)) - 1 for r in rows])  # predicts the first response token
    pos = (start[:, None] + torch.arange(R + 1)).clamp(max=L - 1)  # (b, R+1)
    mask = torch.arange(R + 1)[None, :] < torch.tensor([len(rollout.tokens[r]) for r in rows])[:, None]
    targets = toks.gather(1, (pos[:, :R] + 1).clamp(max=L - 1))
    return toks.to(device), pos.to(device), mask.to(device), targets.to(device)


def at_positions(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """t (b, L, d) at positions pos (b, K) -> (b, K, d)."""
    return t.gather(1, pos[..., None].expand(-1, -1, t.shape[-1]))


def _forward(model: Transformer, toks, pos, targets, temperature: float, autocast, taps: tuple = ()):
    """A policy forward over right-padded responses (`response_batch`): the response tokens' log-probabilities
    (b, R), the hidden states at `pos` (b, R+1, d) and, with taps (the drafter's feature layers), the logits
    there and the tapped layers at `pos` (else None and {})."""
    R = targets.shape[1]
    with autocast:
        out = model(toks, taps=taps)
    h = at_positions(out.hidden, pos)  # (b, R+1, d)
    # the head over all R+1 positions (the last one's target a dummy), whether or not the drafter reads its logits
    # there: the same products in the same row blocks, so the update has the same bits with a drafter learning
    # and without one, and a speculative run's next rollouts stay the autoregressive run's
    logp, logits = model.token_logprobs(h, F.pad(targets, (0, 1)), temperature, keep_logits=bool(taps))
    return logp[:, :R], h, logits, {i: at_positions(t, pos) for i, t in out.taps.items()} if taps else {}


def policy_update(
    policy: Transformer,
    ref: Transformer | None,
    opt,
    rollout: Rollout,
    adv: torch.Tensor,
    cfg: RunConfig,
    drafting: OnlineDrafting = NoDrafting(),
    total: int | None = None,
    draft_generators: list[torch.Generator] | None = None,
) -> dict:
    """Gradients of one GRPO update on a rollout, accumulated over micro-batches (`micro_batch_update`);
    `apply_update` then steps the optimizer (the policy does not change here).

    total: the response tokens of the whole step's batch, the divisor of the token-level mean (default:
    this rollout's; a data-parallel rank passes the sum over all ranks, so its gradient and figures
    are its share of the whole batch's). draft_generators: one per response, for the drafter loss's
    randomness (`draft_train.row_generators`).
    """
    g = cfg.grpo
    device = policy.lm_head.weight.device
    rows = [r for r in range(len(rollout.tokens)) if rollout.tokens[r]]
    total = sum(len(rollout.tokens[r]) for r in rows) if total is None else total
    opt.zero_grad(set_to_none=True)
    kl = clipped = 0.0
    loss_sum = 0.0
    gap = {"abs_sum": 0.0, "abs_max": 0.0, "kl_sum": 0.0}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=g.train_dtype == "bfloat16")
    for i in range(0, len(rows), g.micro_batch):
        mb = rows[i : i + g.micro_batch]
        gens = [draft_generators[r] for r in mb] if draft_generators else None
        parts, m = micro_batch_update(policy, ref, rollout, mb, adv, cfg, drafting, total, gens, autocast)
        loss_sum += parts.loss.item()
        kl += parts.kl_sum
        clipped += parts.clipped
        gap = {
            "abs_sum": gap["abs_sum"] + m["abs_sum"],
            "abs_max": max(gap["abs_max"], m["abs_max"]),
            "kl_sum": gap["kl_sum"] + m["kl_sum"],
        }
    n = max(total, 1)
    return {
        "loss": loss_sum,
        "kl": kl / n,
        "clip_frac": clipped / n,
        "rollout_logp_abs_mean": gap["abs_sum"] / n,
        "rollout_logp_abs_max": gap["abs_max"],
        "rollout_kl": gap["kl_sum"] / n,
    }


def micro_batch_update(
    policy: Transformer,
    ref: Transformer | None,
    rollout: Rollout,
    mb: list[int],
    adv: torch.Tensor,
    cfg: RunConfig,
    drafting: OnlineDrafting,
    total: int,
    generators: list[torch.Generator] | None,
    autocast,
):
    """The gradient of responses `mb` of a rollout (backward done; the drafter observed their features); returns
    the loss's parts (`grpo.LossParts`) and the rollout's gap to the master weights on them (`grpo.mismatch`)."""
    g, T = cfg.grpo, cfg.sampling.temperature
    device = policy.lm_head.weight.device
    toks, pos, mask, targets = response_batch(rollout, mb, device)
    R = targets.shape[1]
    rollout_logp = torch.tensor([rollout.logp[r] + [0.0] * (R - len(rollout.logp[r])) for r in mb])  # (b, R)
    rollout_logp = rollout_logp.to(device)
    ref_logp = None
    if ref is not None:
        with torch.no_grad():
            ref_logp = _forward(ref, toks, pos, targets, T, autocast)[0]
    logp, h, logits, tapped = _forward(policy, toks, pos, targets, T, autocast, drafting.feature_layers)
    mask_r = mask[:, :R]
    weight = float(mask_r.sum()) / total
    drafting.observe(toks.gather(1, pos), tapped, h, logits, mask, weight, generators)
    adv_mb = adv[mb].to(device)
    parts = grpo_loss(
        logp, logp.detach(), ref_logp, adv_mb, mask_r, g.clip_eps, g.kl_beta, total, rollout_logp, g.tis_cap
    )
    parts.loss.backward()
    return parts, mismatch(logp, rollout_logp, mask_r)


def apply_update(policy: Transformer, opt, max_grad_norm: float) -> dict:
    """Clip the gradient to `max_grad_norm` and step, unless it is not finite (a diverging update: a loss or a
    gradient overflowed): then the step is refused, the weights and the optimizer's state untouched, and the
    figures say so (refused: 1)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
    if not torch.isfinite(grad_norm):
        opt.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "refused": 1}
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"grad_norm": float(grad_norm)}
