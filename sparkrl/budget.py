"""How much to speculate each round: a cost model measured on the running machine.

Verifying a tree of n nodes for each of B responses costs one policy forward of B x (n + 1) tokens
plus the drafting; it pays only if the tokens it commits per response (1 + accepted drafts) outweigh
that cost against a plain autoregressive step (B x 1 tokens). With many active responses the
forward is compute-bound and big trees lose (FastGRPO's concurrency-aware point); in the long tail
of a rollout few responses remain and speculation wins. On a CPU even one response's forward is
compute-bound, so the best tree is often small.

Each round the engine asks `Budget.choose(B)` for a node count n among 0 (a root-only tree: exactly
an autoregressive step, which keeps the drafter in sync), 1, 2, 4, ... up to the configured nodes,
minimising measured seconds / expected committed tokens. The `n` best nodes of a tree are also the
best of any larger one, so from a round that verified n nodes the accepted drafts a smaller tree
would have kept are known: the accepted path's leading nodes of rank <= n' (`observe`). Running
averages of those feed the expectations.

The cost model times whole rounds of the engine itself (`speculative.time_rounds`: drafting, the
drafter's catch-up, the verify forward, the acceptance walk, commit; an autoregressive round with its
drafter bookkeeping) for every size on a grid of row counts at start-up, once per machine, model,
thread count, tree shape and kernels (cached under the user cache dir), and interpolates. The timed
rounds run on a text the policy sampled itself (sampling's cost depends on the nucleus's width, and
random tokens make it thousands of tokens wide); each draft accepted more or fewer than there walks
one more or one fewer level (the LM head and the target distribution on B rows, timed too), which
the prediction corrects at the acceptance the budget expects. (It timed only the verify forward and
the drafting until it was measured that the rest is 20-30% of a round and made trees look cheaper
than they are.)

The acceptance estimates only move in rounds that draft, so once a run of unlucky rounds pushes an
estimate just below break-even the budget would stay autoregressive for good, however well the
drafter does (measured: with the shipped drafter at one response trees every round ran at 1.08x of
AR while the budget drafted 30 of 889 rounds, 0.99x). So a tree predicted within `EXPLORE_MARGIN` of
an autoregressive step per token is drafted once every `EXPLORE_EVERY` rounds that declined it: at
most 1/EXPLORE_EVERY of the rounds lose at most that margin, and a tree that pays is found again.
"""

from __future__ import annotations

import bisect
import json
import sys
from dataclasses import dataclass
import torch

from sparkrl import native
from sparkrl.config import TreeShape
from sparkrl.machine import measurement_path

ROWS = (1, 2, 4, 8, 16, 32, 64)
ENGINE = 9  # part of the timing cache's key: bumped when a round's work or its timing changes (2: a tree
# of n nodes drafts min(depth, n) levels; sizes timed in turn, 3 repeats, 7 row counts; 3: the
# acceptance walk runs the LM head only for the rows still walking; 4: timed on the policy's own text,
# not random tokens; the drafter's catch-up runs its head at one position per row; 5: weight-major products
# split per thread, from one row; 6: q/k/v and gate/up as one weight-major product each; 7: packed float32
# layers leave 1-4 rows to weight-major products; 8: the acceptance walk's LM head also covers first-child
# paths, `verify.PathLogits`; 9: sampling on the compiled nucleus with the compiled ops)
GAIN = 0.9  # a tree is chosen when predicted at least 10% faster per committed token than an AR step: the
# cost model's error (measured at 8 rows: 1-node trees predicted 1.08x ran at 0.96x) must not turn a
# predicted gain into a loss
EXPLORE_MARGIN = 1.15  # a tree predicted within 15% of an AR step per committed token (but not chosen) ...
EXPLORE_EVERY = 8  # ... is drafted once every 8 rounds that declined it
CONTEXT = 192  # committed tokens per row while timing (a typical mid-rollout length)


def tree_sizes(nodes: int) -> list[int]:
    """Candidate node counts: powers of two below `nodes`, and `nodes`."""
    return [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n < nodes] + [nodes]


def _interp(xs, ys, x):
    """Piecewise-linear interpolation, linear extrapolation past the last point."""
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostModel:
    rows: tuple[int, ...]
    rounds: dict[int, list[float]]  # node count (0 = autoregressive) -> seconds of one whole engine round,
    # per row count: drafting, the drafter's catch-up, verification, acceptance walk, commit
    accepted: dict[int, list[float]]  # drafts accepted per row in those timed rounds
    level: list[float]  # seconds one more accepted level adds per round (the LM head, nucleus and sample on B rows)

    def seconds(self, B: int, nodes: int, accepted: float | None = None) -> float:
        """Seconds of a round of `nodes` nodes over B rows; with `accepted` (drafts per row), corrected
        from the timed rounds' acceptance to it (the walk runs one more level per accepted draft)."""
        t = _interp(self.rows, self.rounds[nodes], B)
        if nodes and accepted is not None:
            t += _interp(self.rows, self.level, B) * (accepted - _interp(self.rows, self.accepted[nodes], B))
        return max(t, 1e-9)

    @classmethod
    def measure(cls, policy, drafter, shape: TreeShape, time_rounds, repeats: int = 3) -> "CostModel":
        """Time whole engine rounds on this machine (cached per machine/model/threads/shape/kernels).
        time_rounds(policy, drafter, shape, rows, sizes, context, repeats) -> {"rounds", "accepted",
        "level"} is the engine's own timing (`speculative.time_rounds`)."""
        w = policy.lm_head.weight
        path = measurement_path("rounds", str(w.device), str(w.dtype), policy.args.__dict__, drafter.kind,
                                int(drafter.vocab_ids.numel()), shape.__dict__, ROWS, CONTEXT,
                                {"packed": policy.lm_head.packed, "weight_major": policy.lm_head.weight_major,
                                 "engine": ENGINE, "attention": str(policy.model.attn_dtype),
                                 **({"native": native.digest()} if policy.lm_head.native else {}),
                                 **({"ops": native.digest()} if policy.model.norm.native else {})})
        if path.exists():
            d = json.loads(path.read_text())
        else:
            print(f"sparkrl: timing the policy and the drafter on this machine for the speculation budget (once; "
                  f"cached in {path.parent})", file=sys.stderr, flush=True)
            sizes = [0] + (tree_sizes(shape.nodes) if shape.mode == "tree" else [shape.nodes])
            d = {"rows": ROWS, **time_rounds(policy, drafter, shape, ROWS, sizes, CONTEXT, repeats)}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(d))
        return cls(tuple(d["rows"]), {int(n): v for n, v in d["rounds"].items()},
                   {int(n): v for n, v in d["accepted"].items()}, d["level"])


class Budget:
    """Chooses each round's node count from the number of active responses.

    adaptive: also learn from the rounds actually run. Each round's whole wall time (drafting, the
    drafter's catch-up, verification, acceptance, commit, SPARK) rescales the cost model's prediction
    for its size by a running ratio, so overheads the start-up timing does not see count. Decisions
    then depend on wall-clock timings: a resumed run is not bit-identical to an uninterrupted one
    (its distribution is unchanged), which is why `--budget auto` does not adapt."""

    def __init__(self, cost: CostModel, shape: TreeShape, prior_accept: float = 2.0, momentum: float = 0.9,
                 adaptive: bool = False):
        self.cost, self.shape = cost, shape
        self.sizes = tree_sizes(shape.nodes) if shape.mode == "tree" else [shape.nodes]
        # expected accepted drafts per round for each size; optimistic at first, kept across rollouts
        self.accepted = {n: prior_accept * min(n, shape.depth) / shape.depth for n in self.sizes}
        self.scale = {n: 1.0 for n in [0] + self.sizes}  # measured / predicted round seconds (adaptive)
        self.momentum, self.adaptive = momentum, adaptive
        self.declined = 0  # autoregressive rounds chosen since the last drafted one, a tree nearly paying

    def state_dict(self) -> dict:
        """What a resumed run needs to choose as the uninterrupted one would: the cost model it used
        and the running estimates."""
        c = self.cost
        return {"rows": list(c.rows), "rounds": {n: list(v) for n, v in c.rounds.items()},
                "timed_accepted": {n: list(v) for n, v in c.accepted.items()}, "level": list(c.level),
                "accepted": dict(self.accepted), "scale": dict(self.scale), "declined": self.declined}

    def load_state_dict(self, state: dict) -> None:
        if "rounds" in state:  # (a checkpoint from before whole-round timing keeps today's timing)
            self.cost = CostModel(tuple(state["rows"]), {int(n): v for n, v in state["rounds"].items()},
                                  {int(n): v for n, v in state["timed_accepted"].items()}, state["level"])
        self.accepted = {int(n): a for n, a in state["accepted"].items()}
        self.scale = {int(n): a for n, a in state.get("scale", self.scale).items()}
        self.declined = state.get("declined", 0)

    def seconds(self, B: int, nodes: int) -> float:
        """Predicted seconds of a round of `nodes` nodes (0: autoregressive) over B rows at the acceptance
        expected for that size."""
        return self.cost.seconds(B, nodes, self.accepted[nodes] if nodes else None) * self.scale[nodes]

    def choose(self, B: int) -> int:
        """The node count for a round over B rows (0: autoregressive): the tree with the fewest predicted
        seconds per committed token if it beats an autoregressive step by the margin GAIN, or if it comes within
        EXPLORE_MARGIN of one and EXPLORE_EVERY rounds have declined it since the last drafted round."""
        ar = self.seconds(B, 0)
        costs = {n: self.seconds(B, n) / (1.0 + self.accepted[n]) for n in self.sizes}  # seconds per token
        best = min(costs, key=costs.get)
        per_token = costs[best]
        if per_token < ar * GAIN:
            self.declined = 0
            return best
        if per_token < ar * EXPLORE_MARGIN:
            self.declined += 1
            if self.declined >= EXPLORE_EVERY:
                self.declined = 0
                return best
        return 0

    def observe_round(self, nodes: int, B: int, seconds: float) -> None:
        """A round of `nodes` nodes over B rows took `seconds` in all (only used when adaptive)."""
        if self.adaptive and seconds > 0:
            ratio = seconds / self.cost.seconds(B, nodes, self.accepted[nodes] if nodes else None)
            self.scale[nodes] = self.momentum * self.scale[nodes] + (1 - self.momentum) * ratio

    def autoregressive_estimate(self, stats) -> float:
        """Seconds an autoregressive rollout would have taken for what a speculative one (its
        `rollout.RoundStats`) committed: its autoregressive rounds as timed, and for every drafted round
        with B active responses and AAL a, a autoregressive steps of B rows (cost model)."""
        return stats.ar_s + sum(a * self.seconds(B, 0) for B, a in stats.active_aal)

    def observe(self, nodes: int, tree, acc) -> None:
        """A verified round of `nodes` nodes: its `verify.Tree` (with the builder's ranks) and `Acceptance`."""
        rank = tree.rank.gather(1, acc.path.clamp(min=0))  # (B, D) rank of each accepted node
        self.observe_ranks(nodes, torch.where(acc.path >= 0, rank, tree.size + 1))

    def observe_ranks(self, nodes: int, path_ranks: torch.Tensor) -> None:
        """path_ranks (B, D): ranks of the accepted path's nodes (a large number past its end)."""
        for n in self.sizes:
            if n > nodes:
                break
            kept = (path_ranks <= n).long().cumprod(-1).sum(-1).double().mean().item()  # host sync
            self.accepted[n] = self.momentum * self.accepted[n] + (1 - self.momentum) * kept
