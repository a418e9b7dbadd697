"""Rollouts in the rollout dtype, training with the master weights (DESIGN "Precision").

The policy's master weights (--dtype; float32 on a CPU) are what the optimizer steps. Rollouts run on a copy
in the rollout dtype (`RolloutCopy`, refreshed in place after every update, no reallocation); so does the
drafter. `rollout_copy` is the one place a rollout model is assembled: the copy, then the CPU layer's kernels
(`cpu.accelerate`), which also give the sampler the engine takes. `--rollout-dtype auto` picks bfloat16 on
CUDA, and on a CPU when the start-up measurement of this policy's decode steps says bfloat16 is faster there
(`cpu.tuning.bf16_speedup`), float32 otherwise.

Exactness is relative to the rollout model; the gap to the master weights is measured every step
(`mismatch`) and can be corrected with truncated importance sampling (`grpo.grpo_loss`, --tis-cap).
"""

from __future__ import annotations

import copy

import torch

from sparkrl.cpu.accelerate import accelerate
from sparkrl.cpu.tuning import DTYPES, bf16_speedup, float32_attention
from sparkrl.engine.sampling import SAMPLER
from sparkrl.model.transformer import Transformer
from sparkrl.train.sharding import full


def rollout_dtype(choice: str, policy: Transformer) -> torch.dtype:
    """The dtype rollouts run in for --rollout-dtype `choice` (auto: measured, see the module doc)."""
    if choice != "auto":
        return DTYPES[choice]
    w = policy.lm_head.weight
    if w.dtype != torch.float32:  # master weights already in a half type: sample in it
        return w.dtype
    if w.device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if bf16_speedup(policy) > 1.05 else torch.float32


def rollout_copy(
    module: torch.nn.Module,
    dtype: torch.dtype,
    cpu_kernels: str = "auto",
    head_float32: bool = False,
    separate: bool = False,
    attention32: bool | None = None,
) -> "RolloutCopy":
    """`module`'s `RolloutCopy` in `dtype`, run on the kernels of --cpu-kernels `cpu_kernels` (`cpu.accelerate`).
    attention32: whether a half-precision copy attends in float32 (None: `cpu.tuning.float32_attention`
    decides; a run records the decision so its ranks and its resumption agree)."""
    rc = RolloutCopy(module, dtype, separate=separate)
    args = rc.model.args if isinstance(rc.model, Transformer) else None
    f32 = (
        float32_attention(cpu_kernels, dtype, next(module.parameters()).device, args)
        if attention32 is None
        else attention32
    )
    acc = accelerate(rc.model, cpu_kernels, f32)
    rc.sampler, rc.kernels, rc.cpu_kernels = acc.sampler, acc.kernels, cpu_kernels
    if head_float32 and dtype != torch.float32:  # a float32 copy of the master's head (refreshed with the rest)
        rc.model.head32 = (full(module.lm_head.weight).detach().float().clone(),)
    return rc


class RolloutCopy:
    """`module` (a policy or a drafter) as the rollout runs it: the module itself when the dtypes agree
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
        self.sampler = SAMPLER  # how the engine samples from it, and the kernels that run it (`rollout_copy`)
        self.kernels: dict = {}
        self.cpu_kernels = "plain"

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
