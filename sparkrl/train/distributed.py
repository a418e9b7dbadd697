"""Data-parallel plumbing: the ranks torchrun starts, and the few collectives GRPO needs.

`torchrun --nproc-per-node N -m sparkrl train ...` starts N processes; each finds its rank in the environment
(`World.from_env`), rolls out its contiguous share of every step's prompts with its own engine, and takes part
in the sums that make the update the one a single process would make on the whole batch. Gradients are summed
with `all_reduce`, not wrapped in DDP, because an update accumulates over micro-batches (with --shard-policy
fsdp FSDP2 sums them: `sharding.FullyShard`). Outside torchrun `SINGLE` stands in: every collective is the
identity and no process group exists.

Equal to one process on the same batch: the rollouts (a response's sampling generator and DFlash's training
anchors derive from its index in the whole batch), the policy gradient, SPARK's A gradient, the metrics, and
the drafter's gradient when --micro-batch divides each rank's P/N x G responses. A non-fixed --budget chooses
each rank's rounds from its own active responses, so the rollouts differ from one process's (their
distribution does not). `trainer.check_data_parallel` refuses what the ranks cannot share.

Backends: gloo on CPU, NCCL on CUDA (rank r uses cuda:LOCAL_RANK). Every collective times out after `TIMEOUT`,
so when one rank dies the others stop instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from sparkrl.engine.records import Rollout, RoundStats
from sparkrl.errors import UserError

TIMEOUT = datetime.timedelta(minutes=30)  # longer than a rank may wait for the slowest one's rollout
BUCKET = 1 << 26  # elements per gradient all-reduce (256 MB in float32): bounds the extra memory


class World:
    """This process's place among the data-parallel ranks: rank, size, and collectives over all of them."""

    def __init__(self, rank: int = 0, size: int = 1, device: torch.device | str = "cpu"):
        self.rank, self.size = rank, size
        self.device = torch.device(device)  # where collectives run: cpu (gloo) or this rank's GPU (NCCL)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run's files (metrics, checkpoints, the exported model)."""
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str, prompts_per_step: int) -> "World":
        """The world torchrun started this process in (`SINGLE` without torchrun's WORLD_SIZE, or with
        one rank). Checks that the ranks split a step's prompts evenly before anything is loaded."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size == 1:
            return SINGLE
        if prompts_per_step % size:
            raise UserError(
                f"--prompts-per-step {prompts_per_step} does not split over the {size} ranks torchrun "
                f"started (each takes whole prompt groups); pass a multiple of {size}"
            )
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is not None:
                raise UserError(
                    f"--device {device} under torchrun would put every rank on one GPU; pass --device "
                    "cuda (rank r uses cuda:LOCAL_RANK)"
                )
            dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(dev)
        rank = int(os.environ["RANK"])
        if dev.type == "cuda":
            dist.init_process_group("nccl", rank=rank, world_size=size, timeout=TIMEOUT, device_id=dev)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=size, timeout=TIMEOUT)
        return cls(rank, size, dev)

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def shard(self, n: int) -> range:
        """This rank's contiguous slice of n items (n a multiple of the size): rank r takes the r-th n/size."""
        k = n // self.size
        return range(self.rank * k, (self.rank + 1) * k)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    @contextmanager
    def main_first(self):
        """Rank 0 runs the block before the others (it checks and writes the out dir and caches the
        machine's one-off measurements, which the others then read)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks (a new tensor on t's device; t itself in one process)."""
        return self._reduce(t, dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.MAX)

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.size == 1:
            return t
        x = t.to(self.device, copy=True)
        dist.all_reduce(x, op)
        return x.to(t.device)

    def sum_grads(self, params) -> None:
        """Sum the parameters' gradients over the ranks, in place, in flat buckets per dtype and device.
        Parameters without a gradient are skipped; every rank has the same ones (the same modules run
        on every rank), so the buckets line up."""
        if self.size == 1:
            return
        bucket: list[torch.Tensor] = []
        size = 0
        for g in [p.grad for p in params if p.grad is not None]:
            if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device or size + g.numel() > BUCKET):
                self._sum_flat(bucket)
                bucket, size = [], 0
            bucket.append(g)
            size += g.numel()
        if bucket:
            self._sum_flat(bucket)

    def _sum_flat(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.device)
        dist.all_reduce(flat)
        for g, f in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(f.view_as(g))

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


SINGLE = World()
"""One process, no process group: every collective is the identity."""


# How the ranks' update figures combine: each rank's share of a whole-batch token mean (policy_update
# divides by the whole batch's tokens) is summed; maxima and times take the largest; the rest (the
# gradient norm, the drafter's statistics) are the same on every rank.
_SHARES = {"loss", "kl", "clip_frac", "rollout_logp_abs_mean", "rollout_kl", "reward_timeouts"}
_LARGEST = {"rollout_logp_abs_max", "train_s", "draft_train_s", "gen_ar_estimate_s"}


def gather_step(world: World, rollout: Rollout, scores: list, upd: dict) -> tuple[Rollout, list, dict]:
    """A step's rollout, scores and update figures over all ranks, in the whole batch's response order,
    on every rank: what one process would have had, but for the rounds (each rank's engine ran its own,
    so they add up) and the times (the slowest rank's). In one process, the arguments themselves."""
    if world.size == 1:
        return rollout, scores, upd
    parts = world.gather((dataclasses.replace(rollout, logp=[]), scores, upd))  # no figure needs the log-probs
    rollouts, scores, upds = zip(*parts)
    upd = {k: _combine(k, [u[k] for u in upds]) for k in upds[0]}
    return merge_rollouts(rollouts), [s for part in scores for s in part], upd


def _combine(key: str, values: list[float]) -> float:
    return sum(values) if key in _SHARES else max(values) if key in _LARGEST else values[0]


def merge_rollouts(parts: list[Rollout]) -> Rollout:
    """The ranks' rollouts of a step as one (rank order is the batch's order); see `gather_step`."""
    cat = lambda name: [x for p in parts for x in getattr(p, name)]
    stats = RoundStats.merge([p.stats for p in parts], concurrent=True)
    return Rollout(
        cat("prompt_ids"),
        parts[0].group_size,
        cat("tokens"),
        cat("finish_reason"),
        max(p.gen_s for p in parts),
        stats,
        cat("outcome"),
        cat("round_of"),
        cat("logp"),
    )
