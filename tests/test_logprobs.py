"""The blocked LM-head log-probabilities against the plain form in float64."""

import pytest
import torch
import torch.nn.functional as F

from sparkrl.model.logprobs import head_logprobs
from sparkrl.train.grpo import token_logprobs
from sparkrl.train.precision import inference_copy


def plain(hidden, weight, targets, temperature):
    return token_logprobs(F.linear(hidden, weight), targets, temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("rows", [1, 3, 64])  # one row per block, blocks with a remainder, one block
def test_values_and_gradients_match_the_plain_form_in_float64(temperature, rows):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 37, (2, 5), generator=g)
    up = torch.randn(2, 5, generator=g, dtype=torch.float64)
    ref = plain(h, w, t, temperature)
    (ref * up).sum().backward()
    ref_h, ref_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    lp, logits = head_logprobs(h, w, t, temperature, rows=rows)
    assert logits is None and lp.dtype == torch.float32 and lp.shape == (2, 5)
    torch.testing.assert_close(lp, ref.float(), rtol=0, atol=1e-6)
    (lp.double() * up).sum().backward()
    # float32 log-probabilities carry float32 rounding into the backward: compare at that precision
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-5, atol=1e-6)


def test_gradients_pass_gradcheck():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)
    # the analytic backward against finite differences (float32 outputs: loose tolerance)
    assert torch.autograd.gradcheck(
        lambda a, b: head_logprobs(a, b, t, 0.8, rows=3)[0].double(), (h, w), eps=1e-3, atol=2e-3, rtol=1e-2
    )


def test_kept_logits_are_the_models_and_carry_no_gradient(tiny_llama):
    h = torch.randn(3, 4, tiny_llama.args.hidden_size, requires_grad=True)
    t = torch.randint(0, tiny_llama.args.vocab_size, (3, 4))
    lp, logits = tiny_llama.token_logprobs(h, t, 1.0, keep_logits=True)
    assert torch.equal(logits, tiny_llama.logits(h).detach()) and not logits.requires_grad
    torch.testing.assert_close(lp, token_logprobs(tiny_llama.logits(h), t), rtol=0, atol=1e-5)
    lp.sum().backward()  # the kept logits do not get in the way of the gradient
    want = torch.autograd.grad(token_logprobs(tiny_llama.logits(h), t).sum(), (h, tiny_llama.lm_head.weight))
    torch.testing.assert_close((h.grad, tiny_llama.lm_head.weight.grad), want, rtol=1e-4, atol=1e-5)


def test_only_what_needs_a_gradient_gets_one(tiny_llama):
    h = torch.randn(2, 3, tiny_llama.args.hidden_size, requires_grad=True)
    t = torch.randint(0, tiny_llama.args.vocab_size, (2, 3))
    tiny_llama.requires_grad_(False)
    tiny_llama.token_logprobs(h, t)[0].sum().backward()
    assert tiny_llama.lm_head.weight.grad is None
    want = torch.autograd.grad(token_logprobs(tiny_llama.logits(h), t).sum(), h)[0]
    torch.testing.assert_close(h.grad, want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert not tiny_llama.token_logprobs(h, t)[0].requires_grad


def test_a_float32_head_copy_scores_with_its_float32_weights(tiny_llama):
    copy = inference_copy(tiny_llama, torch.bfloat16, "plain", head_float32=True).model
    h = torch.randn(2, 3, tiny_llama.args.hidden_size).bfloat16()
    t = torch.randint(0, tiny_llama.args.vocab_size, (2, 3))
    torch.testing.assert_close(copy.token_logprobs(h, t)[0], token_logprobs(copy.logits(h), t), rtol=0, atol=1e-5)
