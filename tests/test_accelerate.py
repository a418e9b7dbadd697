"""The CPU layer as an add-on (`cpu.accelerate`): the swapped model keeps the eager model's parameters, state
dict and gradients, and its no-grad forwards match the eager reference (and float64) on every --cpu-kernels
choice; the sampler it returns draws what the reference sampler draws."""

from __future__ import annotations

import copy

import pytest
import torch

from sparkrl.cpu import native
from sparkrl.cpu.accelerate import CHOICES, COMPILED_SAMPLER, CpuAttention, CpuRMSNorm, accelerate
from sparkrl.cpu.kernels import CpuLinear, packable
from sparkrl.engine.sampling import SAMPLER
from sparkrl.model.transformer import Linear, Transformer


def _logits(model: Transformer, tokens: torch.Tensor, cached: bool) -> torch.Tensor:
    """Logits of every position: one forward, or (cached) a prefill and then one token at a time."""
    with torch.no_grad():
        if not cached:
            return model.logits(model(tokens).hidden)
        cache = model.new_cache(tokens.shape[0], tokens.shape[1] + 1)
        outs = []
        for a, b in [(0, 5)] + [(t, t + 1) for t in range(5, tokens.shape[1])]:
            outs.append(model.logits(model(tokens[:, a:b], cache).hidden))
            cache.commit(n_keep=torch.full((tokens.shape[0],), b - a))
        return torch.cat(outs, 1)


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_accelerated_model_computes_what_the_eager_one_does(tiny_llama, choice, dtype):
    if choice == "packed" and not packable(dtype, "cpu"):
        pytest.skip(f"this torch cannot prepack {dtype}")
    eager = tiny_llama.to(dtype).requires_grad_(False)
    fast = copy.deepcopy(eager)
    acc = accelerate(fast, choice)
    assert acc.model is fast and isinstance(fast.lm_head, CpuLinear) and isinstance(fast.model.norm, CpuRMSNorm)
    assert list(fast.state_dict()) == list(eager.state_dict())  # the same names, so checkpoints load either way
    assert acc.sampler is (COMPILED_SAMPLER if choice == "auto" and native.available() else SAMPLER)
    tokens = torch.randint(0, eager.args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    ref64 = _logits(copy.deepcopy(tiny_llama).double(), tokens, cached=False)
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.1}[dtype]  # relative to the logits' scale
    for cached in (False, True):
        want, got = _logits(eager, tokens, cached), _logits(fast, tokens, cached)
        scale = float(ref64.abs().max())
        assert float((got.double() - want.double()).abs().max()) < tol * scale, (choice, cached)
        assert float((got.double() - ref64).abs().max()) < 2 * tol * scale, (choice, cached)
    if choice == "plain":  # torch's kernels: the eager model itself, bit for bit
        assert torch.equal(_logits(fast, tokens, True), _logits(eager, tokens, True))


def test_an_accelerated_model_trains_as_the_eager_one(tiny_llama):
    """Forwards that record gradients take the eager path: the same loss and gradients, bit for bit."""
    eager = tiny_llama
    fast = accelerate(copy.deepcopy(eager), "auto").model
    tokens = torch.randint(0, eager.args.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (eager, fast):
        model.zero_grad()
        loss = model.logits(model(tokens).hidden).logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(eager.parameters(), fast.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_the_eager_model_is_untouched_and_a_drafter_head_follows_its_policy(tiny_llama):
    from sparkrl.drafters.eagle3 import Eagle3Drafter

    fast = accelerate(copy.deepcopy(tiny_llama), "auto").model
    assert type(tiny_llama.lm_head) is Linear and not any(isinstance(m, CpuAttention) for m in tiny_llama.modules())
    d = accelerate(Eagle3Drafter(tiny_llama.args), "auto").model.bind(fast)
    assert isinstance(d._head[0], CpuLinear) and d._head[0].native == fast.lm_head.native
    assert type(Eagle3Drafter(tiny_llama.args).bind(tiny_llama)._head[0]) is Linear


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_the_compiled_sampler_draws_what_the_reference_draws(temperature, top_p):
    if not native.available():
        pytest.skip("the compiled kernels are not available here")
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 500, generator=g) * 3
    u = torch.rand(16, generator=g, dtype=torch.float64)
    a, b = COMPILED_SAMPLER.token(logits, temperature, top_p, u), SAMPLER.token(logits, temperature, top_p, u)
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1], atol=1e-5)
