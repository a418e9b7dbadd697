"""The rollout copy's float32 LM head (`--rollout-head float32`): float64 reference, refresh, scope."""

from __future__ import annotations

import torch

from sparkrl.precision import RolloutCopy


def test_float32_head_matches_a_float64_reference_where_a_bf16_head_rounds(tiny_llama):
    master = tiny_llama  # float32 master weights
    fp32_head = RolloutCopy(master, torch.bfloat16, head_float32=True).model
    bf16_head = RolloutCopy(master, torch.bfloat16).model
    assert fp32_head.head32 and fp32_head.head32[0].dtype == torch.float32 and not bf16_head.head32
    h = (4 * torch.randn(5, master.args.hidden_size, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    ref = h.double() @ master.lm_head.weight.double().T  # the master's head on the rollout's hidden states
    err32 = (fp32_head.logits(h).double() - ref).abs().max()
    err16 = (bf16_head.logits(h).double() - ref).abs().max()
    assert fp32_head.logits(h).dtype == torch.float32
    assert err32 < 1e-4 * ref.abs().max() and err32 < err16 / 10, (float(err32), float(err16))


def test_float32_head_follows_the_master_after_refresh_and_only_for_half_copies(tiny_llama):
    copy = RolloutCopy(tiny_llama, torch.bfloat16, head_float32=True)
    with torch.no_grad():
        tiny_llama.lm_head.weight.mul_(1.5)  # an optimizer step, in place
    assert not torch.equal(copy.model.head32[0], tiny_llama.lm_head.weight)
    copy.refresh()
    assert torch.equal(copy.model.head32[0], tiny_llama.lm_head.weight)
    assert copy.model.head32[0] is not tiny_llama.lm_head.weight  # a copy the rollout owns
    assert RolloutCopy(tiny_llama, torch.float32, head_float32=True).model.head32 == ()  # float32: nothing to do
