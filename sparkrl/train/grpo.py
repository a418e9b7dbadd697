"""GRPO loss as pure functions (Shao et al. 2024; settings of the paper's Table 3).

* Advantages: rewards standardised within each group of G responses, A = (r - mean) / (std + 1e-4)
  with the unbiased std (as TRL); a group whose rewards are all equal gets A = 0.
* Per token: clipped surrogate min(rho A, clip(rho, 1 - eps, 1 + eps) A) with rho = pi / pi_old, minus
  beta times the k3 estimate of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1.
* Rollouts from another model (bf16 rollouts of fp32 weights): each token's policy-gradient term is
  weighted by min(pi_old / pi_rollout, C), detached (truncated importance sampling, Yao et al. 2025),
  when the rollout's log-probabilities and a cap C are given.
* Aggregation: the sum over all response tokens of the batch divided by their count (token-level
  mean, as DAPO / Dr. GRPO). Each token weighs the same, so long responses are not down-weighted
  per token as in GRPO's per-sequence mean, and the result does not depend on how the batch is split
  into micro-batches (the divisor is the whole batch's token count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADV_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards (P*G,) in prompt-major order -> advantages (P*G,)."""
    r = rewards.view(-1, group_size).double()  # (P, G)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + ADV_EPS)
    return adv.view(-1).to(rewards.dtype)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target]: logits (B, T, V), targets (B, T) -> (B, T) float32."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@dataclass
class LossParts:
    loss: torch.Tensor  # scalar: this micro-batch's share of the batch loss
    kl_sum: float
    clipped: float  # tokens whose ratio was clipped
    tokens: float


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    beta: float,
    total_tokens: int,
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float = 0.0,
) -> LossParts:
    """logp/old_logp/ref_logp/mask/rollout_logp: (B, T) over response tokens; adv (B,); tis_cap: C
    (0: no importance weight).

    Returns the micro-batch's contribution sum(per-token loss * mask) / total_tokens, so summing the
    contributions of all micro-batches gives the batch's token-level mean.
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)  # (B, T)
    a = adv[:, None].to(logp.dtype)
    surr = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    if rollout_logp is not None and tis_cap > 0:
        surr = surr * torch.exp(old_logp - rollout_logp).clamp(max=tis_cap).detach()
    per_token = -surr
    kl_sum = 0.0
    if ref_logp is not None and beta > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1  # k3 estimator, >= 0
        per_token = per_token + beta * kl
        kl_sum = float((kl.detach() * mask).sum())
    loss = (per_token * mask).sum() / total_tokens
    clipped = float((((ratio.detach() - 1).abs() > clip_eps).to(mask.dtype) * mask).sum())
    return LossParts(loss, kl_sum, clipped, float(mask.sum()))


def mismatch(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the rollout model is from the trained one on the sampled tokens (B, T): sums over the
    masked tokens of |log pi - log pi_rollout| and of the k3 estimate of KL(pi_rollout || pi), and the
    max |difference| (the caller divides the sums by the token count)."""
    d = (logp.detach() - rollout_logp).double() * mask
    k3 = (torch.exp(d) - d - 1) * mask
    return {
        "abs_sum": float(d.abs().sum()),
        "abs_max": float(d.abs().max()) if d.numel() else 0.0,
        "kl_sum": float(k3.sum()),
    }
