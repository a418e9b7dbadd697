"""The rollout copy: its float32 LM head (`--rollout-head float32`: float64 reference, refresh, scope), its
float32 attention, and the measured choice of the rollout dtype."""

from __future__ import annotations

import json

import pytest
import torch

from sparkrl.config import DraftConfig
from sparkrl.cpu import tuning
from sparkrl.cpu.accelerate import CpuAttention
from sparkrl.drafters import Eagle3Drafter
from sparkrl.model.transformer import Linear
from sparkrl.train.generation import RolloutPlan
from sparkrl.train.precision import inference_copy, rollout_dtype


def test_float32_head_matches_a_float64_reference_where_a_bf16_head_rounds(tiny_llama):
    master = tiny_llama  # float32 master weights
    fp32_head = inference_copy(master, torch.bfloat16, "plain", head_float32=True).model
    bf16_head = inference_copy(master, torch.bfloat16, "plain").model
    assert fp32_head.head32 and fp32_head.head32[0].dtype == torch.float32 and not bf16_head.head32
    h = (4 * torch.randn(5, master.args.hidden_size, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    ref = h.double() @ master.lm_head.weight.double().T  # the master's head on the rollout's hidden states
    err32 = (fp32_head.logits(h).double() - ref).abs().max()
    err16 = (bf16_head.logits(h).double() - ref).abs().max()
    assert fp32_head.logits(h).dtype == torch.float32
    assert err32 < 1e-4 * ref.abs().max() and err32 < err16 / 10, (float(err32), float(err16))


def test_float32_head_follows_the_master_after_refresh_and_only_for_half_copies(tiny_llama):
    copy = inference_copy(tiny_llama, torch.bfloat16, "plain", head_float32=True)
    with torch.no_grad():
        tiny_llama.lm_head.weight.mul_(1.5)  # an optimizer step, in place
    assert not torch.equal(copy.model.head32[0], tiny_llama.lm_head.weight)
    copy.refresh()
    assert torch.equal(copy.model.head32[0], tiny_llama.lm_head.weight)
    assert copy.model.head32[0] is not tiny_llama.lm_head.weight  # a copy the rollout owns
    assert (
        inference_copy(tiny_llama, torch.float32, "plain", head_float32=True).model.head32 == ()
    )  # float32: nothing to do


def test_the_float32_attention_decision_is_measured_once_and_cached_and_applied(monkeypatch, tmp_path, tiny_llama):
    """A bfloat16 copy on a CPU whose attention is torch's (here --cpu-kernels packed) attends in float32 (and
    keeps a float32 cache) where a measurement finds that faster; a float32 copy, a drafter (it follows its
    policy) and --cpu-kernels plain are not measured."""
    monkeypatch.setenv("SPARKRL_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(
        tuning,
        "_attention_seconds",
        lambda q, k, v, mask: calls.append(k.dtype) or (2.0 if k.dtype == torch.bfloat16 else 1.0),
    )
    attn = lambda model: {m.attn_dtype for m in model.modules() if isinstance(m, CpuAttention)}
    plan = RolloutPlan.settle(tiny_llama, "bfloat16", "packed", DraftConfig())  # where the choice is made
    copy = inference_copy(tiny_llama, plan.dtype, "packed", plan.float32_attention).model
    assert set(calls) == {torch.bfloat16, torch.float32}
    assert attn(copy) == {torch.float32}
    cache = copy.new_cache(2, 8)
    assert cache.k[0].dtype == cache.v[-1].dtype == torch.float32
    n = len(calls)
    assert tuning.float32_attention_pays(torch.bfloat16, tiny_llama.args) and len(calls) == n  # cached
    stored = json.loads(next((tmp_path / "costs").glob("attention-*.json")).read_text())
    assert stored["pays"] and stored["speedup"] == 2.0
    for model in (
        inference_copy(tiny_llama, torch.float32, "packed").model,
        inference_copy(Eagle3Drafter(tiny_llama.args), torch.bfloat16, "packed").model,
        inference_copy(tiny_llama, torch.bfloat16, "plain").model,
    ):
        assert attn(model) == {None}
    assert len(calls) == n
    monkeypatch.setenv("SPARKRL_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(tuning, "_attention_seconds", lambda q, k, v, mask: 1.0)
    assert not tuning.float32_attention_pays(torch.bfloat16, tiny_llama.args)  # a tie


def test_the_rollout_dtype_compares_each_dtype_as_its_rollout_copy_runs(monkeypatch, tmp_path, tiny_llama):
    """`--rollout-dtype auto` times float32 and bfloat16 decode steps on the kernels and attention each copy
    gets under --cpu-kernels auto, at 1, 8 and 64 rows, and picks bfloat16 only where the geometric mean of its
    speedups passes 1.05x; measured once and cached."""
    from sparkrl.cpu import native

    monkeypatch.setenv("SPARKRL_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "float32_attention_pays", lambda dtype, args: True)
    seen = set()
    speed = {torch.float32: {1: 2.0, 8: 4.0, 64: 8.0}, torch.bfloat16: {1: 1.0, 8: 4.0, 64: 16.0}}

    def fake_steps(model, rows=8, context=128, reps=5, tokens=1):
        w, attn = model.lm_head, model.model.layers[0].self_attn.attn_dtype
        seen.add((rows, w.weight.dtype, w.packed, w.native, attn))
        return [speed[w.weight.dtype][rows]] * reps

    monkeypatch.setattr(tuning, "_step_seconds", fake_steps)
    assert rollout_dtype("auto", tiny_llama) == torch.float32  # 2x, 1x, 0.5x: geometric mean 1
    on = native.available()  # the compiled kernels, and then their attention in bfloat16; else torch's, measured
    assert seen == {(r, torch.float32, False, on, None) for r in (1, 8, 64)} | {
        (r, torch.bfloat16, False, on, None if on else torch.float32) for r in (1, 8, 64)
    }
    stored = json.loads(next((tmp_path / "costs").glob("dtype-*.json")).read_text())
    assert stored["by_rows"] == {"1": 2.0, "8": 1.0, "64": 0.5} and abs(stored["speedup"] - 1.0) < 1e-12
    speed[torch.bfloat16] = {1: 0.5, 8: 2.0, 64: 16.0}
    assert rollout_dtype("auto", tiny_llama) == torch.float32  # cached
    assert (
        type(tiny_llama.lm_head) is Linear and tiny_llama.lm_head.weight.dtype == torch.float32
    )  # the policy untouched


def test_the_rollout_dtype_for_vllm_on_a_cpu_follows_what_its_products_take(monkeypatch, tiny_llama):
    """`--engine vllm --rollout-dtype auto` on a CPU: bfloat16 where vLLM-CPU's oneDNN products take it (AVX512-BF16),
    float32 otherwise (its fallback ran bfloat16 at 0.27x of float32 at 64 responses); sparkrl's own timing of its
    kernels is not asked, and a named dtype is kept."""
    from sparkrl.train import precision

    monkeypatch.setattr(precision, "bf16_speedup", lambda policy: pytest.fail("vLLM's dtype is not sparkrl's timing"))
    for avx512_bf16, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert rollout_dtype("auto", tiny_llama, "vllm") == want
        assert rollout_dtype("float32", tiny_llama, "vllm") == torch.float32
        assert rollout_dtype("bfloat16", tiny_llama, "vllm") == torch.bfloat16
