"""How much to speculate each round: a cost model measured on the running machine.

Verifying a tree of n nodes for each of B responses costs one policy forward of B x (n + 1) tokens
plus the drafting; it pays only if the tokens it commits per response (the AAL) outweigh that cost
against a plain autoregressive step (B x 1 tokens). With many active responses the forward is
compute-bound and big trees lose (FastGRPO's concurrency-aware point); in the long tail of a rollout
few responses remain and speculation wins. Each round the engine asks `Budget.choose(B)` for the
node count: the full tree or none (a root-only tree is exactly an autoregressive step, and keeps the
drafter in sync for later rounds).

The cost model times policy forwards (and tree drafting) on a grid of batch rows x new tokens at
start-up, once per machine, model and thread count (cached under the user cache dir), and
interpolates. The AAL of the full tree is a running average over the rounds that used it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import platform
import time
from dataclasses import dataclass

import torch

from sparkrl.drafters.tree import TreeShape, build_tree
from sparkrl.weights import cache_dir

ROWS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 192  # committed tokens per row while timing (a typical mid-rollout length)


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
    verify_ar: list[float]  # seconds of a B x 1 policy forward (+ LM head), per row count
    verify_tree: list[float]  # seconds of a B x (nodes + 1) policy forward (+ LM head)
    draft: list[float]  # seconds of drafting one tree per row

    def seconds_per_token(self, B: int, nodes: int, aal: float) -> float:
        if nodes == 0:
            return _interp(self.rows, self.verify_ar, B) / B
        t = _interp(self.rows, self.verify_tree, B) + _interp(self.rows, self.draft, B)
        return t / (B * aal)

    @classmethod
    def measure(cls, policy, drafter, shape: TreeShape, repeats: int = 3) -> "CostModel":
        """Time the policy and the drafter on this machine (cached per machine/model/threads/shape)."""
        key = hashlib.sha1(json.dumps([platform.processor(), platform.machine(), torch.get_num_threads(),
                                       str(policy.lm_head.weight.device), str(policy.lm_head.weight.dtype),
                                       policy.args.__dict__, drafter.kind, int(drafter.vocab_ids.numel()),
                                       shape.__dict__, ROWS, CONTEXT], sort_keys=True, default=str).encode()).hexdigest()[:16]
        path = cache_dir() / "costs" / f"{key}.json"
        if path.exists():
            d = json.loads(path.read_text())
            return cls(tuple(d["rows"]), d["verify_ar"], d["verify_tree"], d["draft"])
        ar, tree, draft = [], [], []
        dev = policy.lm_head.weight.device
        V = policy.args.vocab_size
        with torch.no_grad():
            for B in ROWS:
                pc = policy.new_cache(B, CONTEXT + shape.nodes + 2)
                dc = drafter.new_cache(B, CONTEXT + shape.depth * shape.branch + 2)
                pc.lengths += CONTEXT
                dc.lengths += CONTEXT
                root = torch.randint(0, V, (B,), device=dev)
                z = torch.randn(B, drafter.vocab_ids.numel(), device=dev)
                a = torch.randn(B, policy.args.hidden_size, device=dev, dtype=policy.lm_head.weight.dtype)

                def t_forward(T):
                    best = float("inf")
                    for _ in range(repeats):
                        t = time.perf_counter()
                        out = policy(torch.randint(0, V, (B, T), device=dev), pc, taps=tuple(drafter.feature_layers))
                        policy.logits(out.hidden[:, :shape.depth + 1])  # the head runs on the visited nodes
                        pc.commit(n_keep=torch.zeros(B, dtype=torch.long, device=dev))
                        best = min(best, time.perf_counter() - t)
                    return best

                def t_draft():
                    best = float("inf")
                    for _ in range(repeats):
                        t = time.perf_counter()
                        build_tree(drafter, dc, root, z, a, shape)
                        dc.commit(n_keep=torch.zeros(B, dtype=torch.long, device=dev))
                        best = min(best, time.perf_counter() - t)
                    return best

                ar.append(t_forward(1))
                tree.append(t_forward(shape.nodes + 1))
                draft.append(t_draft())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rows": ROWS, "verify_ar": ar, "verify_tree": tree, "draft": draft}))
        return cls(ROWS, ar, tree, draft)


class Budget:
    """Chooses each round's node count (the full tree or 0) from the number of active responses."""

    def __init__(self, cost: CostModel, shape: TreeShape, prior_aal: float = 2.0, momentum: float = 0.9):
        self.cost, self.shape = cost, shape
        self.aal = prior_aal  # running AAL of full-tree rounds; kept across rollouts
        self.momentum = momentum

    def choose(self, B: int) -> int:
        full = self.cost.seconds_per_token(B, self.shape.nodes, self.aal)
        return self.shape.nodes if full < self.cost.seconds_per_token(B, 0, 1.0) else 0

    def observe(self, nodes: int, aal: float) -> None:
        if nodes:
            self.aal = self.momentum * self.aal + (1 - self.momentum) * aal
