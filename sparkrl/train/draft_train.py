"""Drafter training: the optimizer and its updates, online after every rollout and in pretraining.

Each drafter kind brings its loss (`drafter.loss`: `drafters/eagle3.draft_loss`,
`drafters/dflash.block_loss`); this module owns the optimizer step. Online, features come from the
forward that the GRPO policy update runs anyway (`DraftTrainer.observe` is called with its detached
taps before the policy's optimizer step, so the drafter learns the rollout policy's features with no
extra policy forward); in pretraining (`pretrain.py`) from a no-grad policy forward over whole
sequences.
"""

from __future__ import annotations

import time

import torch

from sparkrl.train.distributed import SINGLE, World

STATS = ("feat", "ce", "top1")  # loss statistics averaged over the drafter's trained positions


class DraftTrainer:
    """The drafter's optimizer and its online updates (one AdamW step per rollout)."""

    def __init__(
        self,
        drafter,
        lr: float = 1e-4,
        max_grad_norm: float = 1.0,
        projection=None,
        projection_lr: float = 1e-4,
        learn_projection: bool = True,
    ):
        """projection: SPARK's `spark.Projection` (saved with the drafter; learned in its own parameter
        group from the gradient the rollout accumulated, unless learn_projection is False)."""
        self.drafter = drafter
        self.projection = projection
        groups = [{"params": list(drafter.parameters())}]
        if projection is not None and learn_projection:
            groups.append({"params": [projection.A], "lr": projection_lr})
        self.opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm
        self.seconds = 0.0
        self._stats: list[dict] = []

    def observe(self, tokens, taps, hidden, logits, mask, weight: float = 1.0, generator=None) -> dict:
        """Accumulate the gradient of one micro-batch (weight: its share of the batch's positions);
        returns its loss statistics. generator: the loss's randomness (DFlash's anchors): one
        generator, one per row (`row_generators`), or None for the global RNG."""
        t0 = time.perf_counter()
        with torch.enable_grad():
            dt = self.drafter.fc.weight.dtype  # features of an autocast update come in bfloat16
            loss, st = self.drafter.loss(
                tokens,
                {i: t.detach().to(dt) for i, t in taps.items()},
                hidden.detach().to(dt),
                logits.detach(),
                mask,
                generator=generator,
            )
            (loss * weight).backward()
        st["loss"] = float(loss.detach())
        self._stats.append(st)
        self.seconds += time.perf_counter() - t0
        return st

    def evaluate(self, tokens, taps, hidden, logits, mask, generator=None) -> dict:
        """The loss statistics of a held-out micro-batch, without a gradient."""
        dt = self.drafter.fc.weight.dtype
        with torch.no_grad():
            loss, st = self.drafter.loss(
                tokens,
                {i: t.to(dt) for i, t in taps.items()},
                hidden.to(dt),
                logits,
                mask,
                generator=generator,
                held_out=True,
            )
        return {**st, "loss": float(loss)}

    def step(self, grad_A: torch.Tensor | None = None, world: World = SINGLE) -> dict:
        """Apply the accumulated gradient (and SPARK's A gradient from the rollout, if any); returns
        averaged stats and the time spent since the last step.

        world: the data-parallel ranks. Their gradients (each weighted by its share of the whole
        batch) and statistics are summed first, so every rank makes the same update."""
        t0 = time.perf_counter()
        world.sum_grads(self.drafter.parameters())
        if grad_A is not None and self.projection is not None:
            self.projection.A.grad = grad_A.to(self.projection.A)
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        local = [sum(s[k] * s["positions"] for s in self._stats) for k in STATS]
        local.append(sum(s["positions"] for s in self._stats))
        *sums, n = world.sum(torch.tensor(local, dtype=torch.float64)).tolist()
        self.seconds += time.perf_counter() - t0
        out = {f"draft_{k}": v / (n or 1.0) for k, v in zip(STATS, sums)}
        out["draft_train_s"] = self.seconds
        self._stats, self.seconds = [], 0.0
        return out

    def state_dict(self) -> dict:
        ck = self.drafter.checkpoint()
        if self.projection is not None:
            ck["spark"] = self.projection.checkpoint()
        return {"drafter": ck, "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict(state["drafter"]["state"])
        if self.projection is not None:
            self.projection.load(state["drafter"]["spark"], "the checkpoint")
        self.opt.load_state_dict(state["optimizer"])


def row_generators(seed: int, step: int, rows: range) -> list[torch.Generator]:
    """One generator per response of GRPO step `step` for the drafter loss's random choices (DFlash's
    anchors), seeded from (seed, step, the response's index in the step's whole batch): a response's
    choices do not depend on the rank or the micro-batch it lands in."""
    return [torch.Generator().manual_seed(hash((seed, step, r)) & 0x7FFF_FFFF_FFFF_FFFF) for r in rows]
