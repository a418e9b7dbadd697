"""Target distributions and sampling: pure tensor functions with explicit generators.

`p` is always the policy's processed next-token distribution: softmax(logits / temperature), then
top-p (the smallest set of most likely tokens whose mass reaches top_p, renormalised). Temperature 0
is greedy: p is a point mass on the argmax (lowest index on ties).

The nucleus is found with a top-k pre-selection instead of a full-vocabulary sort; when the top-k
mass does not reach top_p for some row, that row falls back to a full sort, so the result is exact.
"""

from __future__ import annotations

import torch

_PRESELECT = (256, 4096)  # candidate counts tried in turn before falling back to a full sort


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse p: (probs (N, K), token ids (N, K)), sorted by descending probability.

    Entries outside the nucleus have probability 0; each row sums to 1. logits: (N, V).
    """
    logits = logits.float()
    N, V = logits.shape
    if temperature == 0:
        ids = logits.argmax(-1, keepdim=True)  # (N, 1)
        return torch.ones_like(ids, dtype=torch.float32), ids
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (N, V)
    if top_p >= 1.0:
        probs, ids = logp.exp().sort(-1, descending=True)
        return probs, ids
    for k in _PRESELECT:
        vals, ids = logp.topk(min(k, V), dim=-1)  # (N, K) descending
        probs = vals.exp()
        before = probs.double().cumsum(-1) - probs.double()  # mass strictly above each candidate
        keep = before < top_p
        short = keep[:, -1]  # rows whose nucleus may extend past the K candidates
        if not bool(short.any()):  # host sync: is the nucleus inside the candidates?
            break
    if bool(short.any()):  # host sync: rare fallback to the full sort
        k = ids.shape[1]
        full_p, full_ids = logp[short].exp().sort(-1, descending=True)
        full_keep = (full_p.double().cumsum(-1) - full_p.double()) < top_p
        width = int(full_keep.sum(-1).max())
        k = max(k, width)
        pad = lambda t, fill: torch.cat([t, t.new_full((N, k - t.shape[1]), fill)], 1) if t.shape[1] < k else t
        probs, ids, keep = pad(probs, 0.0), pad(ids, 0), pad(keep, False)
        probs[short], ids[short], keep[short] = full_p[:, :k], full_ids[:, :k], full_keep[:, :k]
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True), ids


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Dense p (N, V) float32, rows summing to 1."""
    probs, ids = nucleus(logits, temperature, top_p)
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(1, ids, probs)


def uniforms(generators: list[torch.Generator], device=None) -> torch.Tensor:
    """One U[0, 1) draw per row from that row's own generator: (N,) float64."""
    u = torch.empty(len(generators), dtype=torch.float64)
    for i, g in enumerate(generators):
        u[i] = torch.rand((), generator=g, dtype=torch.float64)
    return u.to(device) if device is not None else u


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: column index (N,) of each row of probs (N, K) at uniform u (N,).

    Zero-probability columns are never chosen.
    """
    cdf = probs.double().cumsum(-1)  # (N, K)
    x = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # (N, 1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[1] - 1)


def logprob_of(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[token] per row (T = 0: the raw logits), float32: logits (N, V), tokens (N,)
    -> (N,). The rollout model's log-probability of a sampled token, as `grpo.token_logprobs` computes
    the trained model's (no top-p: the importance ratio compares the two models, not the nucleus)."""
    z = logits.float()
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    return z.gather(-1, tokens[:, None].to(z.device))[:, 0] - torch.logsumexp(z, -1)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator]) -> torch.Tensor:
    """Sample one token id per row of logits (N, V), row i with generators[i]: (N,) int64.

    Greedy (temperature 0) consumes no randomness.
    The uniform is inverted over the nucleus in token-id order, not in order of probability: then
    logits that differ by float noise (another batch layout, another kernel) give the same token
    unless the uniform falls within that noise of a boundary, whereas in probability order a noise-sized
    swap of two near-equal probabilities would swap the tokens they map to.
    """
    if temperature == 0:
        return nucleus(logits, temperature, top_p)[1][:, 0]
    u = uniforms(generators)
    if top_p >= 1.0:  # the whole vocabulary, already in id order
        return sample_from(torch.softmax(logits.float() / temperature, -1), u)
    probs, ids = nucleus(logits, temperature, top_p)
    ids, by_id = ids.sort(-1)
    return ids.gather(1, sample_from(probs.gather(1, by_id), u).to(ids.device)[:, None]).squeeze(1)
