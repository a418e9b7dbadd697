"""Objects from configs: the drafter, SPARK, the budget, the draft trainer and the rollout engine a
`DraftConfig` asks for.

Used by the entry points (trainer, CLI commands, bench, TRL adapter); the engine and the library below never
read configs of other components. A draft checkpoint is read once (`read_checkpoint`) and serves
both the drafter and SPARK's projection A. The drafter's rollout copy runs on the policy's kernels
(`precision.rollout_copy`, the one assembly path of a rollout model).
"""

from __future__ import annotations

import sys
import functools
from dataclasses import dataclass, field

import torch

from sparkrl.engine.budget import Budget, CostModel
from sparkrl.config import DraftConfig
from sparkrl.train.checkpoint import drafter_source
from sparkrl.train.draft_train import DraftTrainer
from sparkrl.drafters import KINDS, find_checkpoint, load_drafter
from sparkrl.drafters.base import read_checkpoint
from sparkrl.model.transformer import Transformer
from sparkrl.engine.spark import Projection, Spark
from sparkrl.engine.speculative import Autoregressive, Speculative, time_rounds
from sparkrl.train.precision import RolloutCopy, rollout_copy


def resolve_checkpoint(cfg: DraftConfig, policy: Transformer) -> tuple[str | None, dict | None]:
    """The draft checkpoint --draft-checkpoint names for this policy (`find_checkpoint`) and its
    contents, read once ((None, None): a freshly initialised drafter)."""
    source = find_checkpoint(cfg.draft_checkpoint, cfg.draft, policy) if cfg.draft != "none" else None
    return source, read_checkpoint(drafter_source(source)) if source else None


def make_drafter(cfg: DraftConfig, policy: Transformer, seed: int = 0, resolved: tuple | None = None):
    """The drafter, on the policy's device, bound to it (None for --draft none). resolved: the
    already resolved draft checkpoint (`resolve_checkpoint`; resolved here when not given)."""
    if cfg.draft == "none":
        return None
    source, ck = resolved or resolve_checkpoint(cfg, policy)
    if source:
        d = load_drafter(ck, policy.args, cfg.draft, source)
    else:
        if cfg.draft_checkpoint != "fresh":
            print(f"sparkrl: warning: --draft {cfg.draft} without --draft-checkpoint starts from a freshly initialised "
                  "drafter (low acceptance until it has trained; no drafter is shipped for this model); make one with "
                  "`sparkrl pretrain-draft`", file=sys.stderr)
        torch.manual_seed(seed)
        d = KINDS[cfg.draft](policy.args, **({"block_size": cfg.block_size} if cfg.draft == "dflash" else {}))
    if cfg.draft == "dflash":
        d.check_block(cfg.block_size)
    w = policy.lm_head.weight
    return d.to(device=w.device, dtype=w.dtype).bind(policy)


def make_spark(cfg: DraftConfig, policy: Transformer, drafter, temperature: float,
               resolved: tuple | None = None) -> tuple[Projection | None, Spark | None]:
    """SPARK's projection and rollout state ((None, None) without --spark). A comes from the drafter
    checkpoint when it holds one (a GRPO run's checkpoint does), else from the policy's output
    projection (QR)."""
    sc = cfg.spark_config
    if drafter is None or not sc.spark:
        return None, None
    proj = Projection.for_policy(policy, sc.spark_rank)
    source, ck = resolved or resolve_checkpoint(cfg, policy)
    if ck is not None and "spark" in ck:
        proj.load(ck["spark"], source)
    proj.to(policy.lm_head.weight.device)
    return proj, Spark.from_config(sc, proj.A, drafter.vocab_ids.numel(), temperature)


def make_budget(cfg: DraftConfig, rollout: RolloutCopy, drafter) -> Budget | None:
    """The per-round speculation budget for the rollout policy `rollout` (None: always the full proposal)."""
    if drafter is None or cfg.budget == "fixed":
        return None
    cost = CostModel.measure(rollout.model, drafter, cfg.shape(), functools.partial(time_rounds, sampler=rollout.sampler),
                             kernels=rollout.kernels)
    return Budget(cost, cfg.shape(), adaptive=cfg.budget == "adaptive")


@dataclass
class Drafting:
    """Everything speculative rollouts need (each part None when not asked for): the drafter (master
    weights, trained), its rollout copy (`precision.RolloutCopy`, in the rollout policy's dtype and
    bound to it), SPARK's projection and state, the budget."""

    drafter: object = None
    rollout: RolloutCopy | None = None
    projection: Projection | None = None
    spark: Spark | None = None
    budget: Budget | None = None
    engine: object = field(default_factory=Autoregressive)  # what generates rollouts: `Autoregressive`, `Speculative`

    def trainer(self, cfg: DraftConfig) -> DraftTrainer | None:
        """The drafter's online trainer (learning A too, unless --spark-frozen-a)."""
        if self.drafter is None:
            return None
        sc = cfg.spark_config
        return DraftTrainer(self.drafter, cfg.draft_lr, projection=self.projection, projection_lr=sc.spark_lr,
                            learn_projection=not sc.spark_frozen_a)


def make_drafting(cfg: DraftConfig, policy: Transformer, rollout: RolloutCopy, temperature: float,
                  seed: int = 0) -> Drafting:
    """The drafter, SPARK, the budget and the engine, with the draft checkpoint read once. policy: the master
    weights (what the drafter trains against); rollout: the policy's rollout copy (`rollout_copy`: what
    samples), whose dtype and kernels the drafter's rollout copy, the cost model and the budget follow."""
    resolved = resolve_checkpoint(cfg, policy)  # once: the shipped-drafter lookup reads a file and the policy
    drafter = make_drafter(cfg, policy, seed, resolved)
    if drafter is None:
        return Drafting()
    copy = rollout_copy(drafter, rollout.model.lm_head.weight.dtype, rollout.cpu_kernels,
                        attention32=rollout.kernels.get("attention") == str(torch.float32))
    copy.model.bind(rollout.model)
    projection, spark = make_spark(cfg, policy, drafter, temperature, resolved)
    budget = make_budget(cfg, rollout, copy.model)
    return Drafting(drafter, copy, projection, spark, budget, Speculative(copy.model, cfg.shape(), budget, spark))
