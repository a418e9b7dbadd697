"""Objects from configs: the drafter, SPARK, the budget and the draft trainer a `DraftConfig` asks for.

Used by the entry points (trainer, CLI commands, bench); the engine and the library below never
read configs of other components. A draft checkpoint is read once (`read_checkpoint`) and serves
both the drafter and SPARK's projection A.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from sparkrl.budget import Budget, CostModel
from sparkrl.config import DraftConfig
from sparkrl.draft_train import DraftTrainer
from sparkrl.drafters import KINDS, find_checkpoint, load_drafter
from sparkrl.drafters.base import read_checkpoint
from sparkrl.model import Transformer
from sparkrl.precision import RolloutCopy
from sparkrl.spark import Projection, Spark
from sparkrl.speculative import time_rounds


def resolve_checkpoint(cfg: DraftConfig, policy: Transformer) -> tuple[str | None, dict | None]:
    """The draft checkpoint --draft-checkpoint names for this policy (`find_checkpoint`) and its
    contents, read once ((None, None): a freshly initialised drafter)."""
    source = find_checkpoint(cfg.draft_checkpoint, cfg.draft, policy) if cfg.draft != "none" else None
    return source, read_checkpoint(source) if source else None


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


def make_budget(cfg: DraftConfig, policy: Transformer, drafter) -> Budget | None:
    """The per-round speculation budget (None: always the full proposal)."""
    if drafter is None or cfg.budget == "fixed":
        return None
    cost = CostModel.measure(policy, drafter, cfg.shape(), time_rounds)
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

    def trainer(self, cfg: DraftConfig) -> DraftTrainer | None:
        """The drafter's online trainer (learning A too, unless --spark-frozen-a)."""
        if self.drafter is None:
            return None
        sc = cfg.spark_config
        return DraftTrainer(self.drafter, cfg.draft_lr, projection=self.projection, projection_lr=sc.spark_lr,
                            learn_projection=not sc.spark_frozen_a)


def make_drafting(cfg: DraftConfig, policy: Transformer, rollout_policy: Transformer, temperature: float,
                  seed: int = 0) -> Drafting:
    """The drafter, SPARK and the budget, with the draft checkpoint read once. policy: the master
    weights (what the drafter trains against); rollout_policy: what samples (the same module, or its
    copy in the rollout dtype), which the rollout drafter, the cost model and the budget follow."""
    resolved = resolve_checkpoint(cfg, policy)  # once: the shipped-drafter lookup reads a file and the policy
    drafter = make_drafter(cfg, policy, seed, resolved)
    if drafter is None:
        return Drafting()
    rollout = RolloutCopy(drafter, rollout_policy.lm_head.weight.dtype, packed=rollout_policy.lm_head.packed,
                          weight_major=rollout_policy.lm_head.weight_major,  # the drafter's kernels follow the policy's
                          native=rollout_policy.lm_head.native, ops=rollout_policy.model.norm.native,
                          attention32=rollout_policy.model.attn_dtype == torch.float32)
    rollout.model.bind(rollout_policy)
    projection, spark = make_spark(cfg, policy, drafter, temperature, resolved)
    return Drafting(drafter, rollout, projection, spark, make_budget(cfg, rollout_policy, rollout.model))
