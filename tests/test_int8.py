"""The 8-bit kernels (`native.quantize_rows`, `native.int8_linear`, csrc/int8_linear.cpp): the quantizer against a
float64 one, the product against float64 products of the quantized operands and, on integer operands, against exact
integer products, and a row's output independent of its batch and of the thread count. And the int8 rollout copy
(--rollout-dtype int8): which layers it quantizes, that a refresh requantizes it, what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import hf_model, ours_from_hf

from sparkrl.config import DraftConfig
from sparkrl.cpu import native
from sparkrl.cpu.kernels import CpuLinear
from sparkrl.errors import UserError
from sparkrl.train.generation import RolloutPlan
from sparkrl.train.precision import inference_copy

F32, BF16 = torch.float32, torch.bfloat16
pytestmark = pytest.mark.skipif(not native.available(), reason="the compiled kernels are not available here")
SHAPES = [(1, 8), (5, 13), (162, 96), (7, 1539)]  # (outputs, inputs): tails of every tile and of the 32-value steps


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape", [(1, 8), (4, 100), (3, 1539), (2, 5)])
def test_the_quantizer_matches_a_float64_one(shape, dtype):
    """scale = max |x| / 127, q = x / scale rounded to nearest, in [-127, 127], zero padding to 32 values; a row of
    zeros gets scale 1."""
    torch.manual_seed(0)
    x = (torch.randn(shape) * torch.rand(shape[0], 1) * 5).to(dtype)
    x[-1] = 0 if shape[0] > 3 else x[-1]
    q, s = native.quantize_rows(x)
    K = shape[1]
    assert q.dtype == torch.int8 and q.shape == (shape[0], -(-K // 32) * 32) and (q[:, K:] == 0).all()
    x64 = x.double()
    top = x64.abs().amax(1)
    s64 = torch.where(top > 0, top / 127, torch.ones_like(top))
    assert torch.allclose(s.double(), s64, rtol=1e-6, atol=0)
    q64 = torch.round(x64 / s64[:, None]).clamp(-127, 127)
    off = (q[:, :K].double() - q64).abs()
    ratio = x64 / s64[:, None]
    near_tie = ((ratio - ratio.floor()) - 0.5).abs() < 1e-4
    assert off.max() <= 1 and not (off > 0)[~near_tie].any()  # only float32's rounding of a near-tie may differ
    assert ((q[:, :K].double() * s64[:, None] - x64).abs() <= s64[:, None] * (0.5 + 1e-4)).all()


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 17, 513])
@pytest.mark.parametrize("n_out,n_in", SHAPES)
def test_the_int8_product_matches_a_float64_product_of_its_quantized_operands(n_out, n_in, rows, bias, dtype):
    torch.manual_seed(1)
    x = torch.randn(rows, n_in).to(dtype)
    w = torch.randn(n_out, n_in)
    b = torch.randn(n_out).to(dtype) if bias else None
    wq, ws = native.quantize_rows(w)
    y = native.int8_linear(x, wq, ws, b)
    xq, xs = native.quantize_rows(x)
    ref = (xq.double() * xs.double()[:, None]) @ (wq.double() * ws.double()[:, None]).T
    if bias:
        ref += b.double()
    assert y.dtype == dtype and y.shape == (rows, n_out)
    tol = 1e-5 if dtype == F32 else 8e-3
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("n_out,n_in", SHAPES)
def test_the_int8_sums_are_exact(n_out, n_in):
    """Integer operands whose largest value is 127 quantize to themselves (scale 1): the product is the exact integer
    product (sums below 2^24, so float32 holds them)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-127, 128, (9, n_in), generator=g).float()
    w = torch.randint(-127, 128, (n_out, n_in), generator=g).float()
    x[:, 0], w[:, 0] = 127, -127
    n_in_used = min(n_in, (1 << 24) // (127 * 127) - 1)
    x, w = x[:, :n_in_used], w[:, :n_in_used]
    wq, ws = native.quantize_rows(w)
    assert (ws == 1).all()
    y = native.int8_linear(x, wq, ws)
    assert torch.equal(y.long(), x.long() @ w.long().T)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_row_of_the_int8_product_depends_on_nothing_else(dtype, threads):
    """A row alone, the same row among 1,100 others, at 1-3 threads: the same bits (what token identity between
    speculative and AR rollouts needs)."""
    torch.manual_seed(3)
    w = torch.randn(162, 1539)
    wq, ws = native.quantize_rows(w)
    x = torch.randn(1100, 1539).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        many = native.int8_linear(x, wq, ws)
        alone = [native.int8_linear(x[i : i + 1], wq, ws) for i in (0, 1, 548, 1099)]
        few = native.int8_linear(x[546:551], wq, ws)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a[0], many[i]) for a, i in zip(alone, (0, 1, 548, 1099)))
    assert torch.equal(few, many[546:551])


def test_an_int8_rollout_copy_quantizes_the_decoder_layers_and_follows_its_master():
    """The decoder layers' products take 8-bit weights, the head stays in bfloat16; after an update of the master
    weights a refresh gives what a fresh copy of the new weights gives (requantized, never stale)."""
    master = ours_from_hf(hf_model("llama"))
    ic = inference_copy(master, BF16, int8=True)
    lin = [m for m in ic.model.modules() if isinstance(m, CpuLinear)]
    assert ic.copied and ic.kernels.int8 and "int8" in ic.kernels.tags() and ic.kernels.key()["int8"]
    assert all(m.int8 for m in lin if m is not ic.model.lm_head) and not ic.model.lm_head.int8
    tokens = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5))

    def hidden(model):
        with torch.no_grad():
            cache = model.new_cache(2, 8)
            return model(tokens, cache).hidden

    before = hidden(ic.model)
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(1.1)  # an update
    ic.refresh()
    after = hidden(ic.model)
    assert not torch.equal(before, after)
    assert torch.equal(after, hidden(inference_copy(copy.deepcopy(master), BF16, int8=True).model))


def test_int8_rollouts_refuse_what_they_do_not_run_on():
    policy = ours_from_hf(hf_model("llama"))
    with pytest.raises(UserError, match="--rollout-dtype int8"):
        RolloutPlan.settle(policy, "int8", "packed", DraftConfig())
    plan = RolloutPlan.settle(policy, "int8", "auto", DraftConfig())
    assert plan.int8 and plan.dtype == BF16 and plan.record()["rollout_dtype"] == "int8"
    again = RolloutPlan.settle(policy, "auto", "auto", DraftConfig(), recorded=plan.record())  # a resumed run
    assert again.int8 and again.dtype == BF16
