"""Target distributions (float64 reference), sampling statistics and sampler invariants."""

from __future__ import annotations

import pytest
import torch
from helpers import ALPHA, SEEDS, chi_square_pvalue
from scipy.stats import kstest

from sparkrl.config import SamplingConfig
from sparkrl.cpu import native
from sparkrl.cpu.accelerate import COMPILED_SAMPLER
from sparkrl.engine.autoregressive import generate, response_generators
from sparkrl.engine.sampling import (
    logprob_of,
    nucleus,
    position_uniforms,
    sample,
    sample_from,
    sample_nucleus,
    target_probs,
)


def reference_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """float64, full sort, one row at a time."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for i, row in enumerate(logits.double()):
        if temperature == 0:
            out[i, row.argmax()] = 1.0
            continue
        p = torch.softmax(row / temperature, -1)
        vals, idx = p.sort(descending=True)
        mass = 0.0
        for v, j in zip(vals.tolist(), idx.tolist()):
            if mass >= top_p and top_p < 1:
                break
            out[i, j] = v
            mass += v
        out[i] /= out[i].sum()
    return out


@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0])  # flat (full-sort fallback), typical, peaked
@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.95), (0.7, 0.5), (1.3, 1.0), (1.0, 0.999), (0.0, 0.9)])
def test_target_probs_match_float64_reference(scale, temperature, top_p):
    torch.manual_seed(0)
    logits = torch.randn(5, 6000) * scale
    got = target_probs(logits, temperature, top_p).double()
    ref = reference_p(logits, temperature, top_p)
    if temperature == 0:
        assert torch.equal(got, ref)
        return
    # float32 rounding may order near-equal tokens differently from float64, so check the nucleus
    # rule itself in float64 on the kernel's support: the kept tokens are the most likely ones, their
    # mass reaches top_p and would not without the least likely kept token; values renormalised.
    p64 = torch.softmax(logits.double() / temperature, -1)
    for row, keep, r in zip(p64, got > 0, ref):
        kept, dropped = row[keep], row[~keep]
        if len(dropped):
            assert kept.min() >= dropped.max() * (1 - 1e-6)  # float32 resolution
        assert kept.sum() >= top_p - 1e-6
        if top_p < 1:
            assert kept.sum() - kept.min() < top_p + 1e-6
        assert abs(int(keep.sum()) - int((r > 0).sum())) <= 1
    assert torch.allclose(got[got > 0], (p64 / (p64 * (got > 0)).sum(-1, keepdim=True))[got > 0], atol=1e-6)
    assert torch.allclose(got, ref, atol=1e-3)


@pytest.mark.parametrize("width", [256, 4096])  # the pre-selection sizes
@pytest.mark.parametrize("flat_row", [False, True])
def test_a_nucleus_exactly_as_wide_as_the_candidates(width, flat_row):
    """A nucleus of exactly K tokens reaches the last of K candidates, so the full-sort fallback runs and
    finds no wider nucleus (it crashed on this once: a mask that was a view of the tensor it wrote);
    beside a flat row whose nucleus is wider than every candidate set, the other rows keep their own
    distinct ids (they were once padded with token 0, which then lost its probability)."""
    logits = torch.full((2 + flat_row, 8192), -40.0)
    logits[0, :width] = 0.0  # K equal tokens hold all but ~1e-14 of the mass
    logits[1, 0] = 5.0
    p = target_probs(logits, 1.0, 0.9999).double()
    ref = reference_p(logits, 1.0, 0.9999)
    assert (p[0] > 0).sum() == width and torch.allclose(
        p[0, :width], torch.full((width,), 1 / width, dtype=torch.double)
    )
    assert p[1, 0] > 0.999 and torch.allclose(p.sum(-1), torch.ones(len(p), dtype=torch.double))
    assert torch.allclose(p, ref, atol=1e-6)
    assert torch.allclose(target_probs(logits[:1], 1.0, 0.9999).double(), p[:1])  # alone, as a walk's last row


def test_a_batch_nucleus_equals_each_rows_own_with_distinct_ids():
    """Rows whose nucleus passes the first pre-selection take wider candidates (the second, or the full sort)
    alone; the others are widened with ids of probability 0 that they do not hold: every row's p equals
    the row's own, and its ids stay distinct."""
    torch.manual_seed(0)
    logits = torch.randn(6, 8192) * 8  # peaked rows: inside the first pre-selection
    logits[4] = torch.randn(8192) * 0.01  # flat: the full sort
    logits[5] = -40.0
    logits[5, 3000:4000] = 0.0  # 1000 equal tokens: the second pre-selection
    probs, ids = nucleus(logits, 1.0, 0.95)
    assert ids.shape[1] > 4096 and (probs[:4, 256:] == 0).all()
    assert all(len(set(row.tolist())) == len(row) for row in ids)  # distinct in every row
    alone = torch.cat([target_probs(row[None], 1.0, 0.95) for row in logits])
    assert torch.allclose(target_probs(logits, 1.0, 0.95), alone, atol=1e-7)
    assert int((target_probs(logits[5:], 1.0, 0.95) > 0).sum()) in (950, 951)  # 0.95 of 1000 equal tokens, rounded


needs_native = pytest.mark.skipif(not native.available(), reason="the compiled kernels are not available here")


def dense(probs: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    return torch.zeros(len(probs), V, dtype=torch.float64).scatter_(1, ids, probs.double())


def id_order_token(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """float64 reference of sampling in token-id order: the first id whose cumulative p exceeds u * total."""
    cdf = p.double().cumsum(-1)
    return (cdf <= (u * cdf[:, -1])[:, None]).sum(-1).clamp(max=p.shape[1] - 1)


@needs_native
@pytest.mark.parametrize("V", [1001, 49152])  # not a multiple of 8; the default model's vocabulary
@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0])  # flat (a nucleus of most tokens), typical, peaked
@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.95), (0.7, 0.5), (1.3, 0.999), (1.0, 0.05)])
def test_the_compiled_nucleus_matches_a_float64_reference(V, scale, temperature, top_p):
    """`native.nucleus`: the nucleus rule checked in float64 on its support (as for `target_probs`), p
    renormalised, distinct ids (the padding of narrower rows too), the token the float64
    inverse CDF in id order picks at each uniform, and its log-probability before top-p."""
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(5, V, generator=g) * scale
    logits[4, :3] += 30.0  # one row with a nucleus of a few tokens beside wide ones: padded
    u = torch.rand(5, generator=g, dtype=torch.float64)
    probs, ids, token, logp = native.nucleus(logits, temperature, top_p, u)
    got = dense(probs, ids, V)
    p64 = torch.softmax(logits.double() / temperature, -1)
    for row, keep in zip(p64, got > 0):
        kept, dropped = row[keep], row[~keep]
        if len(dropped):
            assert kept.min() >= dropped.max() * (1 - 1e-6)
        assert kept.sum() >= top_p - 1e-6 and kept.sum() - kept.min() < top_p + 1e-6
    assert torch.allclose(got[got > 0], (p64 / (p64 * (got > 0)).sum(-1, keepdim=True))[got > 0], atol=1e-6)
    assert torch.allclose(got, reference_p(logits, temperature, top_p), atol=1e-3)
    assert torch.allclose(probs.double().sum(-1), torch.ones(5).double())
    assert all(len(set(row.tolist())) == len(row) for row in ids)
    assert torch.equal(token, id_order_token(got, u))
    ref_logp = torch.log_softmax(logits.double() / temperature, -1).gather(1, token[:, None])[:, 0]
    assert torch.allclose(logp.double(), ref_logp, atol=2e-5)


@needs_native
def test_the_compiled_nucleus_keeps_ties_lower_ids_first_and_skips_impossible_tokens():
    """Equal logits at the nucleus's edge: the lower ids are kept; -inf logits never enter it; a row with one
    possible token samples it whatever the uniform."""
    logits = torch.full((3, 1000), -float("inf"))
    logits[0, 100:200] = 0.0  # 100 equal tokens: top-p 0.495 keeps the first 50 by id
    logits[1, 7] = 0.0  # one possible token
    logits[2] = torch.arange(1000).float() % 3  # three tie groups of 333-334 tokens each
    u = torch.tensor([0.3, 0.999, 0.6], dtype=torch.float64)
    probs, ids, token, logp = native.nucleus(logits, 1.0, 0.495, u)
    got = dense(probs, ids, 1000)
    assert set(got[0].nonzero()[:, 0].tolist()) == set(range(100, 150))
    assert got[1, 7] == 1.0 and token[1] == 7 and logp[1] == 0.0
    top = (torch.arange(1000) % 3 == 2).nonzero()[:, 0]  # the most likely group (0.665 of the mass) ...
    kept = got[2].nonzero()[:, 0]
    assert torch.equal(kept, top[: len(kept)])  # ... its lowest ids, as many as reach top-p
    assert torch.equal(token, id_order_token(got, u))


@needs_native
@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.95), (0.6, 0.8)])
def test_sample_nucleus_compiled_or_not_gives_the_same_tokens(temperature, top_p):
    """`sample_nucleus` and the compiled sampler's nucleus give the same p up to float32 rounding and sample the same
    token at each
    uniform, but where the uniform falls within that rounding of a token's edge in the CDF (a nucleus of some
    20,000 tokens may end one token apart); where the kernel does not serve (greedy, top-p 1) it takes the
    tensor ops."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=g) * torch.linspace(0.5, 6, 64)[:, None]
    u = torch.rand(64, generator=g, dtype=torch.float64)
    a, b = COMPILED_SAMPLER.nucleus(logits, temperature, top_p, u), sample_nucleus(logits, temperature, top_p, u)
    pa, pb = dense(*a[:2], 49152), dense(*b[:2], 49152)
    edge = ((pa > 0) != (pb > 0)).sum(-1)  # rows whose nuclei end one token apart: renormalised a little apart
    assert edge.max() <= 1 and torch.allclose(pa[edge == 0], pb[edge == 0], rtol=1e-5, atol=1e-9)
    differ = (a[2] != b[2]).nonzero()[:, 0]
    assert len(differ) <= 2
    for r in differ.tolist():  # the uniform within rounding of the edge between the two tokens
        edge = pa[r, : max(a[2][r], b[2][r])].sum()
        assert abs(float(edge) - float(u[r] * pa[r].sum())) < 1e-4
    same = a[2] == b[2]
    assert torch.allclose(a[3][same], b[3][same], atol=1e-5)
    assert torch.equal(b[3], logprob_of(logits, b[2], temperature))
    for t, p in ((0.0, 0.9), (1.0, 1.0)):
        assert torch.equal(COMPILED_SAMPLER.nucleus(logits, t, p, u)[2], sample(logits, t, p, u))


def test_greedy_is_argmax_whatever_the_uniform():
    logits = torch.randn(4, 50)
    for u in (torch.zeros(4), torch.rand(4), torch.full((4,), 1 - 1e-16)):
        assert torch.equal(sample(logits, 0.0, 0.9, u.double()), logits.argmax(-1))


@pytest.mark.parametrize("top_p", [0.9, 1.0])
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_native)])
@pytest.mark.parametrize("seed", SEEDS)
def test_samples_follow_p_chi_square(top_p, compiled, seed):
    """`sample`, and the compiled sampler's nucleus where it serves (top-p < 1), against p; never outside the
    top-p support."""
    torch.manual_seed(seed + 1)
    logits = torch.randn(1, 12) * 1.5
    p = target_probs(logits, 0.8, top_p)[0].double()
    n = 20000  # the uniforms of one response's first n positions
    u = position_uniforms(torch.tensor([7 + seed]), torch.arange(n)[None])[0]
    draws = (
        COMPILED_SAMPLER.nucleus(logits.expand(n, -1).contiguous(), 0.8, top_p, u)[2]
        if compiled
        else sample(logits.expand(n, -1), 0.8, top_p, u)
    )
    assert chi_square_pvalue(draws.tolist(), dict(enumerate(p.tolist()))) > ALPHA


@pytest.mark.parametrize("top_p", [0.95, 1.0])
def test_float_noise_in_the_logits_rarely_changes_the_token(top_p):
    """Near-equal probabilities (a random model's) whose order float noise swaps: inverting the uniform
    in token-id order keeps the token; in order of probability most of these rows would change. (With
    top-p a row may still change when the noise moves a token across the nucleus's edge.)"""
    torch.manual_seed(0)
    logits = torch.randn(256, 4096) * 0.01
    noisy = logits + torch.randn_like(logits) * 1e-6
    u = torch.rand(256, dtype=torch.float64)
    assert (logits.argsort(-1) != noisy.argsort(-1)).any(-1).all()  # the noise does reorder every row
    same = sample(logits, 1.0, top_p, u) == sample(noisy, 1.0, top_p, u)
    assert int(same.sum()) >= 250


def _splitmix_reference(x: int) -> int:
    """splitmix64's finaliser on Python ints, mod 2**64."""
    m = (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_position_uniforms_match_a_python_reference_and_look_uniform():
    m, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15
    keys = [0, 1, 7, (1 << 63) - 1, hash((0, 3, 1)) & 0x7FFF_FFFF_FFFF_FFFF]
    pos = torch.tensor([0, 1, 2, 1000, 123456789])
    u = position_uniforms(torch.tensor(keys), pos.expand(len(keys), -1))
    for i, k in enumerate(keys):
        for j, t in enumerate(pos.tolist()):
            x = _splitmix_reference(_splitmix_reference((k + golden) & m) ^ (((t + 1) * golden) & m))
            assert u[i, j].item() == (x >> 11) * 2.0**-53
    # many responses x many positions: uniform, and neighbouring positions and keys uncorrelated
    big = position_uniforms(torch.arange(200), torch.arange(500).expand(200, -1))
    assert kstest(big.flatten().numpy(), "uniform").pvalue > 1e-3
    for a, b in ((big[:, 1:], big[:, :-1]), (big[1:], big[:-1])):
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.01


def test_sample_from_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(1000, 1)
    u = torch.rand(1000, dtype=torch.float64)
    idx = sample_from(probs, u)
    assert set(idx.tolist()) <= {1, 3}
    assert sample_from(probs[:1], torch.tensor([0.0], dtype=torch.float64)).item() == 1
    assert sample_from(probs[:1], torch.tensor([1 - 1e-16], dtype=torch.float64)).item() == 3


def _gen(model, prompts, n, seed=0, **kw):
    sc = SamplingConfig(**{"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 12, **kw})
    return generate(model, prompts, sc, (5,), response_generators(seed, len(prompts), n), group_size=n)


def test_response_does_not_depend_on_batch(tiny_llama):
    a, b = [1, 2, 3, 4, 5, 6], [7, 8]
    together = _gen(tiny_llama, [a, b], 3)
    alone = _gen(tiny_llama, [a], 3)
    assert together.tokens[:3] == alone.tokens
    # prompt b's responses use the generators of prompt index 1
    gens = response_generators(0, 2, 3)[3:]
    alone_b = generate(tiny_llama, [b], SamplingConfig(1.0, 0.95, 12), (5,), gens, group_size=3)
    assert together.tokens[3:] == alone_b.tokens


def test_greedy_generation_equals_argmax_rollout(tiny_llama):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    r = _gen(tiny_llama, [prompt], 2, temperature=0.0, max_new_tokens=10)
    seq = list(prompt)
    for tok in r.tokens[0]:
        with torch.no_grad():
            nxt = int(tiny_llama.logits(tiny_llama(torch.tensor([seq])).hidden)[0, -1].argmax())
        assert tok == nxt
        seq.append(tok)
    assert r.tokens[0] == r.tokens[1]


def test_eos_and_length_stopping(tiny_llama):
    r = _gen(tiny_llama, [[1, 2, 3]], 16, max_new_tokens=30, temperature=2.0, top_p=1.0)
    for toks, why in zip(r.tokens, r.finish_reason):
        if why == "stop":
            assert toks[-1] == 5 and 5 not in toks[:-1]
        else:
            assert len(toks) == 30 and 5 not in toks
    assert r.num_tokens == sum(len(t) for t in r.tokens)


def test_top_p_support_in_generation(tiny_llama):
    """Every sampled token lies in the nucleus of the policy at its context."""
    prompt = [10, 20, 30]
    r = _gen(tiny_llama, [prompt], 4, top_p=0.5, max_new_tokens=8)
    for toks in r.tokens:
        seq = list(prompt)
        for t in toks:
            with torch.no_grad():
                logits = tiny_llama.logits(tiny_llama(torch.tensor([seq])).hidden)[:, -1]
            probs, ids = nucleus(logits, 1.0, 0.5)
            assert t in ids[0][probs[0] > 0].tolist()
            seq.append(t)
