"""GRPO maths against float64 hand computations."""

from __future__ import annotations

import math

import torch

from sparkrl.train.grpo import ADV_EPS, group_advantages, grpo_loss, token_logprobs


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.2, 1.2, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(r, 4)
    for g in range(2):
        xs = r[4 * g : 4 * g + 4].tolist()
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
    hand = _hand_loss(
        logp.double().tolist(),
        old.double().tolist(),
        ref.double().tolist(),
        adv.double().tolist(),
        mask.tolist(),
        eps,
        beta,
        total,
    )
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
    parts = sum(
        grpo_loss(
            logp[i : i + 2], old[i : i + 2], ref[i : i + 2], adv[i : i + 2], mask[i : i + 2], eps, beta, total
        ).loss
        for i in range(0, B, 2)
    )
    assert abs(parts.item() - full.loss.item()) < 1e-6


def test_truncated_importance_sampling_by_hand_and_its_gradient():
    torch.manual_seed(2)
    B, T, eps, beta, C = 3, 5, 0.2, 0.04, 2.0
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 2).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.1
    roll = old + torch.randn(B, T, dtype=torch.float64) * 0.8  # some weights above the cap
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.1
    adv = torch.randn(B, dtype=torch.float64)
    mask = torch.rand(B, T) > 0.2
    total = int(mask.sum())
    parts = grpo_loss(logp, old, ref, adv, mask, eps, beta, total, rollout_logp=roll, tis_cap=C)
    s, grad = 0.0, torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            lp, o, r, a = float(logp.detach()[b, t]), float(old[b, t]), float(roll[b, t]), float(adv[b])
            w = min(math.exp(o - r), C)
            rho = math.exp(lp - o)
            clipped = min(max(rho, 1 - eps), 1 + eps)
            surr = min(rho * a, clipped * a)
            d = float(ref[b, t]) - lp
            s += -w * surr + beta * (math.exp(d) - d - 1)
            # d/dlogp: the unclipped branch carries rho * a, the clipped one nothing; the KL term beta (1 - e^d)
            g_surr = rho * a if rho * a <= clipped * a else 0.0
            grad[b, t] = (-w * g_surr + beta * (1 - math.exp(d))) / total
    assert abs(parts.loss.item() - s / total) < 1e-12
    parts.loss.backward()
    assert torch.allclose(logp.grad, grad, atol=1e-12)
    assert (torch.exp(old - roll)[mask] > C).any()  # the cap was exercised
    plain = grpo_loss(logp, old, ref, adv, mask, eps, beta, total)
    assert abs(plain.loss.item() - parts.loss.item()) > 1e-6  # and the weights changed the loss


def test_mismatch_by_hand():
    from sparkrl.train.grpo import mismatch

    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    roll = torch.tensor([[-1.1, -1.5, -9.0]])
    m = mismatch(lp, roll, torch.tensor([[True, True, False]]))
    assert math.isclose(m["abs_sum"], 0.1 + 0.5, rel_tol=1e-6) and math.isclose(m["abs_max"], 0.5, rel_tol=1e-6)
    k3 = lambda d: math.exp(d) - d - 1
    assert math.isclose(m["kl_sum"], k3(0.1) + k3(-0.5), rel_tol=1e-6)
