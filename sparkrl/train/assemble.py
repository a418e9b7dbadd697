"""Objects from configs: the drafter, SPARK, the budget, the draft trainer and the rollout engine a
`DraftConfig` asks for, behind one `Drafting` (or, for --draft none, `NoDrafting`, which does nothing).

Used by the entry points (trainer, CLI commands, bench, TRL adapter); the engine and the library below never
read configs of other components. A draft checkpoint is read once (`read_checkpoint`) and serves
both the drafter and SPARK's projection A. The drafter's rollout copy runs on the policy's kernels
(`precision.rollout_copy`, the one assembly path of a rollout model).
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass

import torch

from sparkrl.config import DraftConfig
from sparkrl.drafters import KINDS, find_checkpoint, load_drafter
from sparkrl.drafters.base import read_checkpoint
from sparkrl.drafters.eagle3_format import eagle3_weights
from sparkrl.engine.budget import Budget, CostModel, FixedBudget
from sparkrl.engine.records import RoundStats
from sparkrl.engine.spark import Projection, Spark
from sparkrl.engine.speculative import Autoregressive, NoAdaptation, Speculative, time_rounds
from sparkrl.model.transformer import Transformer
from sparkrl.train.checkpoint import drafter_source
from sparkrl.train.distributed import SINGLE, World
from sparkrl.train.draft_train import DraftTrainer
from sparkrl.train.precision import RolloutCopy, rollout_copy
from sparkrl.vllm.engine import VllmEngine, VllmGeneration
from sparkrl.vllm.spark import exported


def resolve_checkpoint(cfg: DraftConfig, policy: Transformer) -> tuple[str | None, dict | None]:
    """The draft checkpoint --draft-checkpoint names for this policy (`find_checkpoint`) and its
    contents, read once ((None, None): a freshly initialised drafter)."""
    source = find_checkpoint(cfg.draft_checkpoint, cfg.draft, policy)
    return source, read_checkpoint(drafter_source(source)) if source else None


def make_drafter(cfg: DraftConfig, policy: Transformer, seed: int = 0, resolved: tuple | None = None):
    """The --draft drafter (eagle3 or dflash), on the policy's device, bound to it. resolved: the already
    resolved draft checkpoint (`resolve_checkpoint`; resolved here when not given)."""
    source, ck = resolved or resolve_checkpoint(cfg, policy)
    if source:
        d = load_drafter(ck, policy.args, cfg.draft, source)
    else:
        if cfg.draft_checkpoint != "fresh":
            print(
                f"sparkrl: warning: --draft {cfg.draft} without --draft-checkpoint starts from a freshly initialised "
                "drafter (low acceptance until it has trained; no drafter is shipped for this model); make one with "
                "`sparkrl pretrain-draft`",
                file=sys.stderr,
            )
        torch.manual_seed(seed)
        d = KINDS[cfg.draft](policy.args, **({"block_size": cfg.block_size} if cfg.draft == "dflash" else {}))
    if cfg.draft == "dflash":
        d.check_block(cfg.block_size)
    w = policy.lm_head.weight
    return d.to(device=w.device, dtype=w.dtype).bind(policy)


def make_spark(
    cfg: DraftConfig, policy: Transformer, drafter, temperature: float, resolved: tuple | None = None
) -> tuple[Projection | None, Spark | None]:
    """SPARK's projection and rollout state ((None, None) without --spark). A comes from the drafter
    checkpoint when it holds one (a GRPO run's checkpoint does), else from the policy's output
    projection (QR)."""
    sc = cfg.spark_config
    if not sc.spark:
        return None, None
    proj = Projection.for_policy(policy, sc.spark_rank)
    source, ck = resolved or resolve_checkpoint(cfg, policy)
    if ck is not None and "spark" in ck:
        proj.load(ck["spark"], source)
    proj.to(policy.lm_head.weight.device)
    return proj, Spark.from_config(sc, proj.A, drafter.vocab_ids.numel(), temperature)


def make_budget(cfg: DraftConfig, rollout: RolloutCopy, drafter) -> Budget | FixedBudget:
    """The per-round speculation budget for the rollout policy `rollout` (`FixedBudget`: always the full proposal)."""
    if cfg.budget == "fixed":
        return FixedBudget(cfg.shape())
    cost = CostModel.measure(
        rollout.model,
        drafter,
        cfg.shape(),
        functools.partial(time_rounds, sampler=rollout.sampler),
        kernels=rollout.kernels,
    )
    return Budget(cost, cfg.shape(), adaptive=cfg.budget == "adaptive")


class NoDrafting:
    """Autoregressive rollouts (--draft none): `Drafting`'s calls, each doing nothing, as there is no drafter to
    bind, train, adapt, checkpoint or time."""

    engine = Autoregressive()
    adapts = False  # SPARK corrects no drafter
    feature_layers: tuple[int, ...] = ()

    def bind(self, policy) -> None:
        pass

    def observe(self, *batch) -> None:
        pass

    def learn(self, batches, world: World = SINGLE) -> dict:
        return {}

    def step(self, world: World = SINGLE) -> dict:
        return {}

    def drop_adaptation(self, world: World = SINGLE) -> None:
        pass

    def budget_state(self) -> dict:
        return {}

    def state_dict(self, budgets: list[dict] | None = None) -> dict:
        return {}

    def load_state_dict(self, ck: dict, world: World = SINGLE) -> None:
        pass

    def figures(self, stats: RoundStats) -> dict:
        return {}


@dataclass
class Drafting:
    """Speculative rollouts and the drafter's online training: the drafter (master weights, trained), its
    rollout copy (`precision.RolloutCopy`, in the rollout policy's dtype and bound to it), SPARK's projection
    and state (None without --spark), the budget, the engine and the drafter's trainer (learning A too,
    unless --spark-frozen-a)."""

    drafter: object
    rollout: RolloutCopy
    projection: Projection | None
    spark: Spark | None
    budget: Budget | FixedBudget
    engine: Speculative
    trainer: DraftTrainer

    @property
    def adapts(self) -> bool:
        """Whether SPARK corrects the drafter during rollouts."""
        return self.spark is not None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The policy layers whose hidden states the drafter's training reads."""
        return tuple(self.drafter.feature_layers)

    def bind(self, policy) -> None:
        """The trained drafter's head follows the policy it learns from (before the policy's update)."""
        self.drafter.bind(policy)

    def observe(self, tokens, taps, hidden, logits, mask, weight: float, generators) -> None:
        """One micro-batch's gradient of the drafter's online loss (`DraftTrainer.observe`)."""
        self.trainer.observe(tokens, taps, hidden, logits, mask, weight, generators)

    def learn(self, batches, world: World = SINGLE) -> dict:
        """`observe` each of `batches` (made as they are read: their policy forward counts as draft training
        time), then `step`."""
        t0, s0 = time.perf_counter(), self.trainer.seconds
        for batch in batches:
            self.trainer.observe(*batch)
        self.trainer.seconds = s0 + time.perf_counter() - t0
        return self.step(world)

    def step(self, world: World = SINGLE) -> dict:
        """The draft optimizer step, with SPARK's A gradient of the rollout, then the drafter's rollout copy
        refreshed; returns the step's figures (`DraftTrainer.step`: draft_*, draft_train_s)."""
        figures = self.trainer.step(self.spark.take_grad(world.sum) if self.spark is not None else None, world)
        self.rollout.refresh()
        return figures

    def drop_adaptation(self, world: World = SINGLE) -> None:
        """Discard SPARK's A gradient of a rollout that trains nothing (an evaluation)."""
        if self.spark is not None:
            self.spark.take_grad(world.sum)

    def budget_state(self) -> dict:
        """This rank's budget estimates ({}: a fixed budget learns none)."""
        return self.budget.state_dict()

    def state_dict(self, budgets: list[dict] | None = None) -> dict:
        """Its checkpoint entries: draft (the drafter, A and their optimizer), spark_carry (--spark-carry's
        corrections), budget (its cost model and estimates) and budget_of_ranks (`budgets`: every rank's,
        from several ranks)."""
        out = {"draft": self.trainer.state_dict()}
        if self.spark is not None and self.spark.carry:
            out["spark_carry"] = self.spark.state_dict()
        if budget := self.budget.state_dict():
            out["budget"] = budget
            if budgets and len(budgets) > 1:
                out["budget_of_ranks"] = budgets
        return out

    def load_state_dict(self, ck: dict, world: World = SINGLE) -> None:
        """Resume from a checkpoint's entries (`state_dict`); a rank takes its own budget when the run had as
        many ranks."""
        self.trainer.load_state_dict(ck["draft"])
        if self.spark is not None and "spark_carry" in ck:
            self.spark.load_state_dict(ck["spark_carry"])
        if "budget" in ck:
            ranks = ck.get("budget_of_ranks", [])
            self.budget.load_state_dict(ranks[world.rank] if len(ranks) == world.size else ck["budget"])
        self.rollout.refresh()

    def figures(self, stats: RoundStats) -> dict:
        """The budget's figures of a rollout for metrics.jsonl (`Budget.figures`: the autoregressive estimate)."""
        return self.budget.figures(stats)


def make_drafting(
    cfg: DraftConfig, policy: Transformer, rollout: RolloutCopy, temperature: float, seed: int = 0
) -> Drafting | NoDrafting:
    """The drafter, SPARK, the budget, the engine and the draft trainer, with the draft checkpoint read once.
    policy: the master weights (what the drafter trains against); rollout: the policy's rollout copy
    (`rollout_copy`: what samples), whose dtype and kernels the drafter's rollout copy, the cost model and the
    budget follow."""
    if cfg.draft == "none":
        return NoDrafting()
    resolved = resolve_checkpoint(cfg, policy)  # once: the shipped-drafter lookup reads a file and the policy
    drafter = make_drafter(cfg, policy, seed, resolved)
    copy = rollout_copy(
        drafter,
        rollout.model.lm_head.weight.dtype,
        rollout.cpu_kernels,
        attention32=rollout.kernels.get("attention") == str(torch.float32),
    )
    copy.model.bind(rollout.model)
    projection, spark = make_spark(cfg, policy, drafter, temperature, resolved)
    budget = make_budget(cfg, rollout, copy.model)
    sc = cfg.spark_config
    trainer = DraftTrainer(
        drafter, cfg.draft_lr, projection=projection, projection_lr=sc.spark_lr, learn_projection=not sc.spark_frozen_a
    )
    return Drafting(
        drafter,
        copy,
        projection,
        spark,
        budget,
        Speculative(copy.model, cfg.shape(), budget, spark or NoAdaptation()),
        trainer,
    )


class Served:
    """A rollout copy (`precision.RolloutCopy`) whose `refresh` also puts the new weights into the vLLM engine that
    serves them (--engine vllm): after every policy update, and after every draft step for the drafter."""

    def __init__(self, copy: RolloutCopy, push):
        self.copy, self.push = copy, push

    def __getattr__(self, name):  # the copy's model, kernels, sampler...
        return getattr(self.copy, name)

    def refresh(self) -> None:
        self.copy.refresh()
        self.push()


def serve_with_vllm(
    cfg: DraftConfig,
    lm,
    rollout: RolloutCopy,
    drafting: Drafting | NoDrafting,
    temperature: float,
    max_len: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Served:
    """--engine vllm: one vLLM engine for the run, serving the policy `lm` (and the drafter, exported to it), which
    `drafting.engine` then generates with; returns the policy's rollout copy that also refreshes vLLM (the drafter's
    becomes one too)."""
    policy, drafter = lm.model, drafting.drafter if isinstance(drafting, Drafting) else None
    projection = drafting.projection if drafter is not None else None
    engine = VllmEngine.serving(
        lm, drafter, dtype, cfg.tree_depth, max_len, seed, temperature, spark=exported(projection, cfg.spark_config)
    )
    drafting.engine = VllmGeneration(engine, cfg.tree_depth if drafter is not None else 0)
    if drafter is not None:
        if projection is not None:  # SPARK's state lives in vLLM's drafter, which accumulates A's gradient there
            drafting.spark = engine.spark().spark
        drafting.rollout = Served(
            drafting.rollout,
            lambda: engine.load_drafter(
                eagle3_weights(drafting.drafter, policy, dtype), None if projection is None else projection.A
            ),
        )
    return Served(rollout, lambda: engine.load_policy(policy.weights()))
