"""The drafting of speculative rollouts and its online training, from a `DraftConfig`: the drafter, SPARK's
projection and rollout state, the budget and the draft trainer, behind one `Drafting` (or, for --draft none,
`NoDrafting`, which does nothing). Both declare `OnlineDrafting`, what the trainer and the TRL adapter call.

`generation.build_generation` is the one caller that builds them (with the engine they run in); a draft
checkpoint is read once (`resolve_checkpoint`) and serves both the drafter and SPARK's projection A.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from sparkrl.config import DraftConfig
from sparkrl.drafters import KINDS, find_checkpoint, load_drafter
from sparkrl.drafters.base import read_checkpoint
from sparkrl.engine.budget import Budget, CostModel, FixedBudget
from sparkrl.engine.records import RoundStats
from sparkrl.engine.seams import DraftModel, RoundBudget
from sparkrl.engine.spark import Projection, Spark
from sparkrl.engine.speculative import time_rounds
from sparkrl.model.transformer import Transformer
from sparkrl.train.checkpoint import drafter_source
from sparkrl.train.distributed import SINGLE, World
from sparkrl.train.draft_train import DraftTrainer
from sparkrl.train.precision import InferenceCopy


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


def make_budget(cfg: DraftConfig, policy: InferenceCopy, drafter: DraftModel) -> RoundBudget:
    """The per-round speculation budget for the policy's inference copy `policy` and the drafter's (`FixedBudget`:
    always the full proposal)."""
    if cfg.budget == "fixed":
        return FixedBudget(cfg.shape())
    cost = CostModel.measure(
        policy.model,
        drafter,
        cfg.shape(),
        functools.partial(time_rounds, sampler=policy.sampler),
        kernels=policy.kernels.key(),
    )
    return Budget(cost, cfg.shape(), adaptive=cfg.budget == "adaptive")


PAUSE_SHARE = 0.02  # drafted rounds below this share of a step's: the drafter's online training pauses (`learns`)
PAUSED_EVERY = 8  # ... but for one step in this many


@runtime_checkable
class OnlineDrafting(Protocol):
    """What training calls on the drafting of its rollouts: the drafter follows the policy (`bind`), learns from
    the policy features of each update (`observe`, `learn`, `step`), checkpoints and resumes, and reports."""

    adapts: bool  # whether SPARK corrects the drafter during rollouts
    trains: bool  # whether there is a drafter to train online
    feature_layers: tuple[int, ...]  # the policy layers whose hidden states the drafter's training reads

    def bind(self, policy) -> None: ...

    def learns(self, stats: RoundStats, step: int, world: World = SINGLE) -> bool: ...

    def observe(self, tokens, taps, hidden, logits, mask, weight: float, generators) -> None: ...

    def learn(self, batches, world: World = SINGLE) -> dict: ...

    def step(self, world: World = SINGLE) -> dict: ...

    def drop_adaptation(self, world: World = SINGLE) -> None: ...

    def budget_state(self) -> dict: ...

    def state_dict(self, budgets: list[dict] | None = None) -> dict: ...

    def load_state_dict(self, ck: dict, world: World = SINGLE) -> None: ...

    def figures(self, stats: RoundStats) -> dict: ...


class NoDrafting(OnlineDrafting):
    """Autoregressive rollouts (--draft none): `Drafting`'s calls, each doing nothing, as there is no drafter to
    bind, train, adapt, checkpoint or time."""

    adapts = False  # SPARK corrects no drafter
    trains = False
    feature_layers: tuple[int, ...] = ()

    def bind(self, policy) -> None:
        pass

    def learns(self, stats: RoundStats, step: int, world: World = SINGLE) -> bool:
        return False  # nothing to train

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


def budget_entries(budget: RoundBudget, budgets: list[dict] | None = None) -> dict:
    """A checkpoint's budget entries: budget (its cost model and estimates; none for a fixed budget) and
    budget_of_ranks (`budgets`: every rank's, from several ranks)."""
    if not (state := budget.state_dict()):
        return {}
    return {"budget": state} | ({"budget_of_ranks": budgets} if budgets and len(budgets) > 1 else {})


def load_budget(budget: RoundBudget, ck: dict, world: World = SINGLE) -> None:
    """Resume `budget` from a checkpoint's entries (`budget_entries`): a rank takes its own when the run had as many
    ranks."""
    if "budget" in ck:
        ranks = ck.get("budget_of_ranks", [])
        budget.load_state_dict(ranks[world.rank] if len(ranks) == world.size else ck["budget"])


@dataclass
class SelfDrafting(NoDrafting):
    """--draft self-int8: the policy's copy drafts for itself (`SelfDrafter` over `precision.int8_sibling`), so there
    is nothing to bind, train or adapt (the 8-bit sibling shares the copy's weights and requantizes when a refresh
    changes them); only the budget has state to checkpoint and figures to report."""

    budget: RoundBudget

    def budget_state(self) -> dict:
        return self.budget.state_dict()

    def state_dict(self, budgets: list[dict] | None = None) -> dict:
        return budget_entries(self.budget, budgets)

    def load_state_dict(self, ck: dict, world: World = SINGLE) -> None:
        load_budget(self.budget, ck, world)

    def figures(self, stats: RoundStats) -> dict:
        return self.budget.figures(stats)


@dataclass
class Drafting(OnlineDrafting):
    """The drafter and its online training: the drafter (master weights, trained), its inference copy
    (`precision.InferenceCopy`, in the rollout dtype and bound to the policy's copy; under vLLM it also puts its
    weights there), SPARK's projection and rollout state (None without --spark; under vLLM, the state in vLLM's
    drafter), the budget and the drafter's trainer (learning A too, unless --spark-frozen-a)."""

    drafter: DraftModel
    copy: InferenceCopy
    projection: Projection | None
    spark: Spark | None
    budget: RoundBudget
    trainer: DraftTrainer
    trains = True

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

    def learns(self, stats: RoundStats, step: int, world: World = SINGLE) -> bool:
        """Whether the drafter trains on the rollout of training step `step` (its `stats`). Not while the budget
        declines drafting: where under PAUSE_SHARE of the step's rounds drafted, over all ranks (the budget's
        probes alone draft one round in 64 per row at most), the rollouts used almost nothing the drafter could
        learn, and its training would cost a forward and backward over every response. A paused drafter still
        trains every PAUSED_EVERY-th step, so it keeps up with the policy for when drafting pays again (fewer
        rows, a response's long tail). Every rank gets the same answer (one all-reduce)."""
        drafted, rounds = (int(x) for x in world.sum(torch.tensor([stats.tree_rounds, stats.rounds])))
        return rounds == 0 or drafted >= PAUSE_SHARE * rounds or step % PAUSED_EVERY == 0

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
        """The draft optimizer step, with SPARK's A gradient of the rollout, then the drafter's inference copy
        refreshed; returns the step's figures (`DraftTrainer.step`: draft_*, draft_train_s)."""
        figures = self.trainer.step(self.spark.take_grad(world.sum) if self.spark is not None else None, world)
        self.copy.refresh()
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
        return out | budget_entries(self.budget, budgets)

    def load_state_dict(self, ck: dict, world: World = SINGLE) -> None:
        """Resume from a checkpoint's entries (`state_dict`); a rank takes its own budget when the run had as
        many ranks."""
        self.trainer.load_state_dict(ck["draft"])
        if self.spark is not None and "spark_carry" in ck:
            self.spark.load_state_dict(ck["spark_carry"])
        load_budget(self.budget, ck, world)
        self.copy.refresh()

    def figures(self, stats: RoundStats) -> dict:
        """The budget's figures of a rollout for metrics.jsonl (`Budget.figures`: the autoregressive estimate)."""
        return self.budget.figures(stats)


def draft_trainer(cfg: DraftConfig, drafter: DraftModel, projection: Projection | None) -> DraftTrainer:
    """The drafter's online trainer (and A's, unless --spark-frozen-a)."""
    sc = cfg.spark_config
    return DraftTrainer(
        drafter, cfg.draft_lr, projection=projection, projection_lr=sc.spark_lr, learn_projection=not sc.spark_frozen_a
    )
