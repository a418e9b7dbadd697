"""Target distributions and sampling: pure tensor functions with explicit generators.

`p` is always the policy's processed next-token distribution: softmax(logits / temperature), then
top-p (the smallest set of most likely tokens whose mass reaches top_p, renormalised). Temperature 0
is greedy: p is a point mass on the argmax (lowest index on ties).

The nucleus is found with a top-k pre-selection instead of a full-vocabulary sort; the rows whose top-k
mass does not reach top_p take a wider top-k, then a full sort, so the result is exact. `Sampler` is how
the engine samples; the CPU layer gives it a compiled one that finds the nucleus in one pass.
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
    probs, ids, keep = _candidates(logp, top_p, _PRESELECT)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True), ids


def _in_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of the descending candidates probs (N, K) the nucleus keeps: those with less than top_p of
    mass above them."""
    return (probs.double().cumsum(-1) - probs.double()) < top_p


def _candidates(logp: torch.Tensor, top_p: float, sizes: tuple[int, ...]):
    """Descending candidates (probs, ids, kept (N, K)) holding every row's nucleus: the top `sizes[0]`;
    only the rows whose nucleus may pass them take the next size, and after the last one the full sort
    (a second top-k over every row would cost 20 ms of a 150 ms bfloat16 decode step at 64 rows)."""
    if sizes and sizes[0] < logp.shape[1]:
        vals, ids = logp.topk(sizes[0], dim=-1)
        probs = vals.exp()
    else:
        (probs, ids), sizes = logp.exp().sort(-1, descending=True), ()
    keep = _in_nucleus(probs, top_p)
    short = keep[:, -1]  # the nucleus may extend past the candidates
    if not sizes or not bool(short.any()):  # host sync
        return probs, ids, keep
    rows = short.nonzero()[:, 0]
    wide_p, wide_ids, wide_keep = _candidates(logp.index_select(0, rows), top_p, sizes[1:])
    width = max(ids.shape[1], int(wide_keep.sum(-1).max()))  # host sync: the widest nucleus
    if width > ids.shape[1]:  # the other rows' extra columns: distinct ids of probability 0
        probs, ids, keep = _padded(probs, ids, keep, width)
    probs[rows], ids[rows], keep[rows] = wide_p[:, :width], wide_ids[:, :width], wide_keep[:, :width]
    return probs, ids, keep


def _padded(probs: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor, width: int):
    """Candidates (N, K) widened to `width` columns with probability 0 and ids the row does not hold yet
    (the lowest such): every row's ids stay distinct (a filler equal to a held id would take that token's
    probability in the dense scatter). The caller replaces the widened rows."""
    N, K = ids.shape
    held = torch.zeros(N, width + 1, dtype=torch.bool, device=ids.device)
    held.scatter_(1, ids.clamp(max=width), True)  # ids past width-1 all land in the spare last column
    free = held[:, :width].to(torch.int8).argsort(dim=-1, stable=True)[:, : width - K]  # free ids, lowest first
    return (
        torch.cat([probs, probs.new_zeros(N, width - K)], 1),
        torch.cat([ids, free], 1),
        torch.cat([keep, keep.new_zeros(N, width - K)], 1),
    )


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Dense p (N, V) float32, rows summing to 1."""
    probs, ids = nucleus(logits, temperature, top_p)
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(1, ids, probs)


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping multiplication is uint64's; `(x >> k) & mask`
    is the logical shift)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _M1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def response_keys(generators: list[torch.Generator]) -> torch.Tensor:
    """Each response's key (N,) int64: the seed its generator was made with."""
    return torch.tensor([_signed(g.initial_seed()) for g in generators], dtype=torch.long)


def position_uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """U[0, 1) for each response key (B,) at each token position (B, n): (B, n) float64, a counter-based
    hash (splitmix64) of the pair. The token at position t of a response is sampled with the same uniform
    whichever engine, round, batch or drafter commits it, so the rollout is the same tokens autoregressive
    sampling would give (up to float noise; see `sample`), and two runs that differ only in how they
    draft make the same rollouts."""
    x = _mix(_mix(keys[:, None].to(positions.device) + _GOLDEN) ^ (positions + 1) * _GOLDEN)
    return ((x >> 11) & ((1 << 53) - 1)).double() * 2.0**-53


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


def sample(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Sample one token id per row of logits (N, V), row i at uniform u[i] (N,) float64: (N,) int64.

    Greedy (temperature 0) ignores u.
    The uniform is inverted over the nucleus in token-id order, not in order of probability: then
    logits that differ by float noise (another batch layout, another kernel) give the same token
    unless the uniform falls within that noise of a boundary, whereas in probability order a noise-sized
    swap of two near-equal probabilities would swap the tokens they map to.
    """
    if temperature == 0:
        return nucleus(logits, temperature, top_p)[1][:, 0]
    if top_p >= 1.0:  # the whole vocabulary, already in id order
        return sample_from(torch.softmax(logits.float() / temperature, -1), u)
    probs, ids = nucleus(logits, temperature, top_p)
    return sample_in_id_order(probs, ids, u)


def sample_nucleus(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor):
    """`nucleus`, the token `sample` draws at uniforms u (N,) and that token's `logprob_of`, together:
    (probs (N, K), ids (N, K), token (N,), logp (N,)), the sparse p in no particular order."""
    probs, ids = nucleus(logits, temperature, top_p)
    x = ids[:, 0] if temperature == 0 else sample_in_id_order(probs, ids, u)
    return probs, ids, x, logprob_of(logits, x, temperature)


def sample_in_id_order(probs: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token (N,) at uniform u (N,) of sparse p (probs, ids (N, W), any order) taken in token-id order."""
    ids, by_id = ids.sort(-1)
    return ids.gather(1, sample_from(probs.gather(1, by_id), u).to(ids.device)[:, None])[:, 0]


class Sampler:
    """How the engine samples from a row of logits: these PyTorch ops, the reference. The CPU layer hands the
    engine a compiled one with the same results (`cpu.accelerate.CompiledSampler`)."""

    def nucleus(self, logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor):
        """(probs (N, K), ids (N, K), token (N,), logp (N,)): `sample_nucleus`."""
        return sample_nucleus(logits, temperature, top_p, u)

    def token(self, logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor):
        """(token (N,), logp (N,)): the token `sample` draws at uniforms u and its `logprob_of`."""
        x = sample(logits, temperature, top_p, u)
        return x, logprob_of(logits, x, temperature)


SAMPLER = Sampler()
