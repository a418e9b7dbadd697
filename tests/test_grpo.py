"""GRPO maths against float64 hand computations."""

from __future__ import annotations

import math

import torch

from sparkrl.grpo import ADV_EPS, group_advantages, grpo_loss, token_logprobs


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.2, 1.2, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(r, 4)
    for g in range(2):
        xs = r[4 * g:4 * g + 4].tolist()
        mean = sum(xs) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / 3)
        for j, x in enumerate(xs):
            assert abs(adv[4 * g + j].item() - (x - mean) / (std + ADV_EPS)) < 1e-6
    assert torch.all(adv[4:] == 0)  # equal rewards: no signal


def test_token_logprobs_float64():
    torch.manual_seed(0)
    logits, tgt = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    got = token_logprobs(logits, tgt, temperature=0.7)
    ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tgt[..., None])[..., 0]
    assert torch.allclose(got.double(), ref, atol=1e-6)


def _hand_loss(logp, old, ref, adv, mask, eps, beta, total):
    s = 0.0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            rho = math.exp(logp[b][t] - old[b][t])
            surr = min(rho * adv[b], min(max(rho, 1 - eps), 1 + eps) * adv[b])
            d = ref[b][t] - logp[b][t]
            s += -surr + beta * (math.exp(d) - d - 1)
    return s / total


def test_grpo_loss_matches_float64_hand_computation_and_microbatches():
    torch.manual_seed(1)
    B, T = 6, 7
    logp = (torch.randn(B, T) * 0.3 - 2).requires_grad_()
    old = logp.detach() + torch.randn(B, T) * 0.2  # ratios away from 1: clipping active
    ref = logp.detach() + torch.randn(B, T) * 0.1
    adv = torch.randn(B)
    mask = torch.rand(B, T) > 0.3
    total = int(mask.sum())
    eps, beta = 0.1, 0.04
    full = grpo_loss(logp, old, ref, adv, mask, eps, beta, total)
    hand = _hand_loss(logp.double().tolist(), old.double().tolist(), ref.double().tolist(), adv.double().tolist(),
                      mask.tolist(), eps, beta, total)
    assert abs(full.loss.item() - hand) < 1e-5
    assert full.tokens == total and full.clipped > 0
    # gradient against float64 autograd of the same expression
    full.loss.backward()
    l64 = logp.detach().double().requires_grad_()
    rho = torch.exp(l64 - old.double())
    a = adv.double()[:, None]
    d = ref.double() - l64
    per = -torch.minimum(rho * a, rho.clamp(1 - eps, 1 + eps) * a) + beta * (torch.exp(d) - d - 1)
    ((per * mask).sum() / total).backward()
    assert torch.allclose(logp.grad.double(), l64.grad, atol=1e-6)
    # splitting into micro-batches sums to the same loss
    parts = sum(grpo_loss(logp[i:i + 2], old[i:i + 2], ref[i:i + 2], adv[i:i + 2], mask[i:i + 2], eps, beta, total).loss
                for i in range(0, B, 2))
    assert abs(parts.item() - full.loss.item()) < 1e-6
