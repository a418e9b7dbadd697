"""The one way to build what makes rollouts: `build_generation` takes a `RolloutPlan` (how rollouts run, settled
once), the drafting settings and the policy, and returns a `Generation`: the policy's inference copy (what
samples, with its sampler), the drafting (`drafting.Drafting`: the drafter and its copy, SPARK, the budget and
the drafter's trainer) and the engine that runs them, sparkrl's (`engine.speculative`, `engine.autoregressive`)
or vLLM's (`vllm.engine`), chosen here and nowhere else. The trainer, `generate`, `pretrain-draft`, the TRL
adapter and the bench scripts call it; nothing else builds rollouts.

A run settles its plan on rank 0 (`RolloutPlan.settle`: --rollout-dtype auto and the float32-attention choice
are measured on this machine), records it in config.json (`RolloutPlan.record`), and a resumed run, and every
rank under torchrun, takes what rank 0 recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from sparkrl.config import CpuKernels, DraftConfig, SamplingConfig
from sparkrl.cpu.tuning import float32_attention
from sparkrl.drafters.selfdraft import SelfDrafter
from sparkrl.drafters.vllm_export import served_weights
from sparkrl.engine.autoregressive import Autoregressive
from sparkrl.engine.budget import FixedBudget
from sparkrl.engine.records import Rollout
from sparkrl.engine.seams import RolloutEngine
from sparkrl.engine.speculative import NoAdaptation, Speculative
from sparkrl.errors import UserError
from sparkrl.model.transformer import Transformer
from sparkrl.train.distributed import SINGLE, World
from sparkrl.train.drafting import (
    Drafting,
    NoDrafting,
    OnlineDrafting,
    SelfDrafting,
    draft_trainer,
    make_budget,
    make_drafter,
    make_spark,
    resolve_checkpoint,
)
from sparkrl.train.precision import InferenceCopy, dtype_name, inference_copy, int8_sibling, parse_dtype, rollout_dtype
from sparkrl.vllm.engine import VllmEngine, VllmGeneration
from sparkrl.vllm.spark import exported


@dataclass(frozen=True)
class RolloutPlan:
    """How rollouts run, settled once for a run (`settle`) and recorded in its config.json (`record`)."""

    dtype: torch.dtype
    """The dtype the policy's and the drafter's inference copies run in (--rollout-dtype)."""
    float32_attention: bool = False
    """Whether a half-precision copy attends in float32 over a float32 KV cache (`cpu.tuning.float32_attention`)."""
    cpu_kernels: CpuKernels = "auto"
    """The CPU kernels that run the copies (--cpu-kernels)."""
    head_float32: bool = False
    """A float32 LM head on a half-precision policy copy (--rollout-head float32)."""
    engine: Literal["sparkrl", "vllm"] = "sparkrl"
    """What generates (--engine)."""
    draft: Literal["none", "eagle3", "dflash", "self-int8"] = "none"
    """What drafts (--draft)."""
    int8: bool = False
    """8-bit products in the policy copy's decoder layers (--rollout-dtype int8; `dtype` is then bfloat16)."""

    @classmethod
    def settle(
        cls,
        policy: Transformer,
        dtype_choice: str,
        cpu_kernels: CpuKernels,
        draft: DraftConfig,
        head_float32: bool = False,
        world: World = SINGLE,
        recorded: dict | None = None,
    ) -> RolloutPlan:
        """The plan for `policy` under --rollout-dtype `dtype_choice` (`precision.rollout_dtype`), --cpu-kernels
        and the drafting settings. Rank 0 decides what `recorded` (a resumed run's config.json "resolved") does
        not hold, so a resumed run keeps what its start measured; every rank takes rank 0's decision."""
        recorded = recorded or {}
        int8 = recorded.get("rollout_dtype", dtype_choice) == "int8"
        if int8 and (draft.engine == "vllm" or cpu_kernels != "auto"):
            raise UserError("--rollout-dtype int8 runs on sparkrl's engine and its compiled kernels: drop "
                            "--engine vllm and --cpu-kernels, or use --rollout-dtype bfloat16")  # fmt: skip
        if draft.draft == "self-int8":
            if int8:
                raise UserError("--draft self-int8 drafts with an 8-bit copy of a rollout copy that is already "
                                "8-bit (--rollout-dtype int8): pass --rollout-dtype bfloat16 or another "
                                "--draft")  # fmt: skip
            if cpu_kernels != "auto" or policy.lm_head.weight.device.type != "cpu":
                raise UserError("--draft self-int8 runs on sparkrl's compiled CPU kernels: drop --cpu-kernels and "
                                "run on a CPU, or pass --draft eagle3")  # fmt: skip
        decided = None
        if world.is_main:
            named = recorded.get("rollout_dtype")
            if int8:
                dtype = torch.bfloat16
            else:
                dtype = parse_dtype(named) if named else rollout_dtype(dtype_choice, policy, draft.engine)
            f32 = recorded.get("float32_attention")
            if f32 is None:
                f32 = float32_attention(cpu_kernels, dtype, policy.lm_head.weight.device, policy.args)
            decided = (dtype, bool(f32))
        dtype, f32 = world.broadcast(decided)
        return cls(dtype, f32, cpu_kernels, head_float32, draft.engine, draft.draft, int8)

    def record(self) -> dict:
        """The plan's measured choices as config.json's "resolved" records them."""
        dtype = "int8" if self.int8 else dtype_name(self.dtype)
        return {"rollout_dtype": dtype, "float32_attention": self.float32_attention}


class Served:
    """An inference copy whose `refresh` also puts the new weights into the vLLM engine that serves them (--engine
    vllm): after every policy update, and after every draft step for the drafter."""

    def __init__(self, copy: InferenceCopy, push):
        self.copy, self.push = copy, push

    def __getattr__(self, name):  # the copy's model, kernels, sampler...
        return getattr(self.copy, name)

    def refresh(self) -> None:
        self.copy.refresh()
        self.push()


@dataclass
class Generation:
    """What makes rollouts (`build_generation`): the plan, the policy's inference copy (what samples, refreshed
    after every policy update: `refresh`), the drafting, and the engine that generates with them."""

    plan: RolloutPlan
    policy: InferenceCopy | Served
    drafting: OnlineDrafting
    engine: RolloutEngine

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        eos_ids: tuple[int, ...],
        generators: list[torch.Generator],
        group_size: int = 1,
        progress=None,
    ) -> Rollout:
        """`group_size` responses to each prompt (one generator per response), from the policy's inference copy."""
        return self.engine.generate(
            self.policy.model, prompts, sampling, eos_ids, generators, group_size, progress, self.policy.sampler
        )

    def refresh(self) -> None:
        """The policy's inference copy (and the weights vLLM serves) follow the master weights."""
        self.policy.refresh()


def build_generation(
    plan: RolloutPlan,
    cfg: DraftConfig,
    policy: Transformer,
    temperature: float,
    seed: int = 0,
    *,
    trains: bool = True,
    separate: bool = False,
    lm=None,
    max_len: int = 0,
) -> Generation:
    """Everything a rollout needs, for the master weights `policy`.

    trains: whether the master weights train (the trainer, the TRL adapter): the drafter and SPARK's projection
    are made from them. Where nothing trains (generate, pretrain-draft, the bench scripts), sparkrl's engine makes
    them from the policy's inference copy, what samples. separate: the policy's copy is made even in its own dtype
    (before the master is sharded: `sharding.FullyShard`). lm, max_len: with plan.engine 'vllm', the loaded model
    (`weights.LoadedModel`) whose folder vLLM serves and the longest sequence it holds (`vllm.engine.model_len`).
    """
    copy = inference_copy(
        policy, plan.dtype, plan.cpu_kernels, plan.float32_attention, plan.head_float32, separate, plan.int8
    )
    if plan.engine == "vllm":
        return served_generation(plan, cfg, lm, copy, temperature, max_len, seed)
    if plan.draft == "none":
        return Generation(plan, copy, NoDrafting(), Autoregressive())
    if plan.draft == "self-int8":  # the copy drafts for itself with 8-bit products: nothing to train
        drafter = SelfDrafter(copy.model, int8_sibling, "self-int8")
        budget = make_budget(cfg, copy, drafter)
        return Generation(plan, copy, SelfDrafting(budget), Speculative(drafter, cfg.shape(), budget, NoAdaptation()))
    drafter, draft_copy, projection, spark = drafter_parts(
        plan, cfg, policy if trains else copy.model, copy, temperature, seed
    )
    budget = make_budget(cfg, copy, draft_copy.model)
    drafting = Drafting(drafter, draft_copy, projection, spark, budget, draft_trainer(cfg, drafter, projection))
    engine = Speculative(draft_copy.model, cfg.shape(), budget, spark or NoAdaptation())
    return Generation(plan, copy, drafting, engine)


def drafter_parts(
    plan: RolloutPlan, cfg: DraftConfig, master: Transformer, copy: InferenceCopy, temperature: float, seed: int
) -> tuple:
    """The --draft drafter made for `master` (trained there), its inference copy bound to the policy's `copy`, and
    SPARK's projection and rollout state (None, None without --spark), the draft checkpoint read once."""
    resolved = resolve_checkpoint(cfg, master)  # once: the shipped-drafter lookup reads a file and the policy
    drafter = make_drafter(cfg, master, seed, resolved)
    draft_copy = inference_copy(drafter, plan.dtype, plan.cpu_kernels, plan.float32_attention)
    draft_copy.model.bind(copy.model)
    projection, spark = make_spark(cfg, master, drafter, temperature, resolved)
    return drafter, draft_copy, projection, spark


def served_generation(
    plan: RolloutPlan, cfg: DraftConfig, lm, copy: InferenceCopy, temperature: float, max_len: int, seed: int
) -> Generation:
    """--engine vllm: one vLLM engine serving the loaded policy `lm` and the drafter, exported to it (with SPARK's
    projection under --spark); every refresh of an inference copy also puts its weights into vLLM, and SPARK's
    rollout state is the one in vLLM's drafter, which accumulates A's gradient there."""
    if lm is None or max_len < 1:
        raise ValueError("--engine vllm serves a loaded model's folder: build_generation needs lm and max_len")
    policy, drafter, draft_copy, projection = lm.model, None, None, None
    if plan.draft != "none":  # SPARK's rollout state is vLLM's own (below)
        drafter, draft_copy, projection, _ = drafter_parts(plan, cfg, policy, copy, temperature, seed)
    spark = exported(projection, cfg.spark_config)
    engine = VllmEngine.serving(lm, drafter, plan.dtype, cfg.shape().depth, max_len, seed, temperature, spark=spark)
    served = Served(copy, lambda: engine.load_policy(policy.weights()))
    generation = VllmGeneration(engine, cfg.shape().depth if drafter is not None else 0)
    if drafter is None:
        return Generation(plan, served, NoDrafting(), generation)
    push = lambda: engine.load_drafter(
        served_weights(drafter, policy, plan.dtype), None if projection is None else projection.A
    )
    adapter = engine.spark().spark if projection is not None else None
    trainer = draft_trainer(cfg, drafter, projection)
    drafting = Drafting(drafter, Served(draft_copy, push), projection, adapter, FixedBudget(cfg.shape()), trainer)
    return Generation(plan, served, drafting, generation)
