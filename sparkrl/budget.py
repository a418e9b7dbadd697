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

The cost model times policy forwards and tree drafting on a grid of rows x sizes at start-up, once
per machine, model, thread count and tree shape (cached under the user cache dir), and interpolates.
"""

from __future__ import annotations

import bisect
import json
import sys
import time
from dataclasses import dataclass
import torch

from sparkrl.config import TreeShape
from sparkrl.drafters.base import DraftState
from sparkrl.machine import measurement_path

ROWS = (1, 4, 16, 64)
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
    verify: dict[int, list[float]]  # node count (0 = autoregressive) -> seconds per row count
    draft: list[float]  # seconds of drafting one tree per row, per row count

    def seconds(self, B: int, nodes: int) -> float:
        t = _interp(self.rows, self.verify[nodes], B)
        return t + (_interp(self.rows, self.draft, B) if nodes else 0.0)

    @classmethod
    def measure(cls, policy, drafter, shape: TreeShape, repeats: int = 2) -> "CostModel":
        """Time the policy and the drafter on this machine (cached per machine/model/threads/shape)."""
        w = policy.lm_head.weight
        path = measurement_path("costs", str(w.device), str(w.dtype), policy.args.__dict__, drafter.kind,
                                int(drafter.vocab_ids.numel()), shape.__dict__, ROWS, CONTEXT,
                                {"packed": policy.lm_head.packed})
        if path.exists():
            d = json.loads(path.read_text())
            return cls(tuple(d["rows"]), {int(k): v for k, v in d["verify"].items()}, d["draft"])
        sizes = [0] + (tree_sizes(shape.nodes) if shape.mode == "tree" else [shape.nodes])
        verify = {n: [] for n in sizes}
        draft = []
        dev = policy.lm_head.weight.device
        V = policy.args.vocab_size

        def best_of(fn):
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            return best

        print(f"sparkrl: timing the policy and the drafter on this machine for the speculation budget (once; "
              f"cached in {path.parent})", file=sys.stderr, flush=True)
        g = torch.Generator(device=dev).manual_seed(0)  # random inputs that leave the global RNG alone
        with torch.no_grad():
            for B in ROWS:
                pc = policy.new_cache(B, CONTEXT + shape.nodes + 2)
                dc = drafter.new_cache(B, CONTEXT + shape.draft_region + 2)
                pc.lengths += CONTEXT
                dc.lengths += CONTEXT
                root = torch.randint(0, V, (B,), device=dev, generator=g)
                z = torch.randn(B, drafter.vocab_ids.numel(), device=dev, generator=g)
                a = torch.randn(B, policy.args.hidden_size, device=dev, generator=g).to(policy.lm_head.weight.dtype)
                zeros = torch.zeros(B, dtype=torch.long, device=dev)

                def forward(T):
                    out = policy(torch.randint(0, V, (B, T), device=dev, generator=g), pc, taps=tuple(drafter.feature_layers))
                    policy.logits(out.hidden[:, :shape.depth + 1])  # the head runs on the visited nodes
                    pc.commit(n_keep=zeros)

                state = DraftState(root=root, z=z, a=a, h=a)
                u = torch.rand(B, shape.depth, device=dev, dtype=torch.float64, generator=g)

                def tree():
                    drafter.propose(dc, state, shape, shape.nodes, 1.0, u)
                    dc.commit(n_keep=zeros)

                for n in sizes:
                    verify[n].append(best_of(lambda: forward(n + 1)))
                draft.append(best_of(tree))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rows": ROWS, "verify": verify, "draft": draft}))
        return cls(ROWS, verify, draft)


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

    def state_dict(self) -> dict:
        """What a resumed run needs to choose as the uninterrupted one would: the cost model it used
        and the running estimates."""
        c = self.cost
        return {"rows": list(c.rows), "verify": {n: list(v) for n, v in c.verify.items()}, "draft": list(c.draft),
                "accepted": dict(self.accepted), "scale": dict(self.scale)}

    def load_state_dict(self, state: dict) -> None:
        self.cost = CostModel(tuple(state["rows"]), {int(n): v for n, v in state["verify"].items()}, state["draft"])
        self.accepted = {int(n): a for n, a in state["accepted"].items()}
        self.scale = {int(n): a for n, a in state.get("scale", self.scale).items()}

    def seconds(self, B: int, nodes: int) -> float:
        """Predicted seconds of a round of `nodes` nodes (0: autoregressive) over B rows."""
        return self.cost.seconds(B, nodes) * self.scale[nodes]

    def choose(self, B: int) -> int:
        best, best_t = 0, self.seconds(B, 0)
        for n in self.sizes:
            t = self.seconds(B, n) / (1.0 + self.accepted[n])
            if t < best_t:
                best, best_t = n, t
        return best

    def observe_round(self, nodes: int, B: int, seconds: float) -> None:
        """A round of `nodes` nodes over B rows took `seconds` in all (only used when adaptive)."""
        if self.adaptive and seconds > 0:
            ratio = seconds / max(self.cost.seconds(B, nodes), 1e-9)
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
