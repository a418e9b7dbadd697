"""The records the engine and the drafters exchange: a round's draft tree and its acceptance, a drafter's
step, state and proposal, and what rollouts return (rounds, their statistics, the responses).

Plain data with a few derived views; nothing here runs a model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path

import torch

HIT, MISS, UNDRAFTED = 1, 0, -1
"""Per-token drafting outcome: an accepted draft; the target's token where the drafter proposed other
tokens (a miss, paper section 2); no proposal at that position (autoregressive step, first token, or
the token after a fully accepted branch)."""


@dataclass
class Round:
    """What one engine round did: the tokens it committed per active response, whether it verified a
    draft (False: an autoregressive step), and where its time went."""

    counts: list[int]  # (B,) tokens committed per active response
    drafted: bool
    draft_s: float = 0.0  # drafting, the drafter's catch-up and the adapter's feedback
    verify_s: float = 0.0  # the policy forward (the whole step for an autoregressive round)
    accept_s: float = 0.0  # acceptance walk and commit
    size: tuple[int, int] | None = None  # a drafted round's tree (nodes, depth)


@dataclass
class RoundStats:
    """A rollout's rounds, summed (paper metrics: AAL = tokens committed per round per response)."""

    depth: int = 0  # draft depth (0: autoregressive rollout)
    rounds: int = 0
    row_rounds: int = 0  # sum over rounds of the active responses
    committed: int = 0  # tokens committed by rounds (the prefill's first token not counted)
    policy_forwards: int = 1  # the prefill
    tree_rounds: int = 0  # rounds that verified a draft
    tree_row_rounds: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    ar_s: float = 0.0  # time of the autoregressive rounds
    accepted_at_depth: list[int] = field(default_factory=list)  # rows whose accepted path reached depth d+1
    active_aal: list[tuple[int, float]] = field(
        default_factory=list
    )  # (active responses, AAL) per drafted round (paper Fig. 5)
    adapter: dict = field(default_factory=dict)  # the drafter adapter's figures (SPARK's)
    sizes: dict[str, int] = field(default_factory=dict)  # drafted rounds per tree size "nodes,depth"

    def __post_init__(self):
        self.accepted_at_depth = self.accepted_at_depth or [0] * self.depth

    def add(self, r: Round) -> None:
        B, n = len(r.counts), sum(r.counts)
        self.rounds += 1
        self.row_rounds += B
        self.committed += n
        self.policy_forwards += 1
        self.draft_s += r.draft_s
        self.verify_s += r.verify_s
        self.accept_s += r.accept_s
        if not r.drafted:
            self.ar_s += r.verify_s
        else:
            self.tree_rounds += 1
            self.tree_row_rounds += B
            self.active_aal.append((B, n / B))
            if r.size is not None:
                key = f"{r.size[0]},{r.size[1]}"
                self.sizes[key] = self.sizes.get(key, 0) + 1
            for d in range(self.depth):
                self.accepted_at_depth[d] += sum(c > d + 1 for c in r.counts)

    @classmethod
    def merge(cls, parts: list["RoundStats"], concurrent: bool) -> "RoundStats":
        """Several rollouts' rounds as one: counts summed; times summed, or (concurrent: ranks that ran
        side by side) their maximum."""
        t = max if concurrent else sum
        out = cls(depth=parts[0].depth)
        for f in fields(cls):
            if f.name in ("depth", "accepted_at_depth", "active_aal", "adapter", "sizes"):
                continue
            setattr(out, f.name, (t if f.name.endswith("_s") else sum)(getattr(p, f.name) for p in parts))
        out.accepted_at_depth = [sum(n) for n in zip(*(p.accepted_at_depth for p in parts))]
        out.active_aal = [x for p in parts for x in p.active_aal]
        out.sizes = {k: sum(p.sizes.get(k, 0) for p in parts) for k in sorted({k for p in parts for k in p.sizes})}
        out.adapter = {k: (t if k.endswith("_s") else sum)(p.adapter[k] for p in parts) for k in parts[0].adapter}
        return out

    @property
    def aal(self) -> float:
        return self.committed / max(self.row_rounds, 1)

    @property
    def accept_at_depth(self) -> list[float]:
        """Share of drafted row-rounds whose accepted path reached depth d + 1."""
        return [n / max(self.tree_row_rounds, 1) for n in self.accepted_at_depth]

    def to_metrics(self) -> dict:
        """The figures for metrics.jsonl (speculative rollouts: AAL, rounds, time split, acceptance)."""
        if not self.depth:
            return {"policy_forwards": self.policy_forwards}
        return {
            "aal": self.aal,
            "rounds": self.rounds,
            "tree_rounds": self.tree_rounds,
            "committed": self.committed,
            "row_rounds": self.row_rounds,
            "policy_forwards": self.policy_forwards,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "accept_s": self.accept_s,
            "accept_at_depth": self.accept_at_depth,
            "tree_sizes": self.sizes,
            **self.adapter,
        }


@dataclass
class Rollout:
    """Responses of one rollout, in prompt-major order (response r belongs to prompt r // G)."""

    prompt_ids: list[list[int]]  # (P,) distinct prompts
    group_size: int
    tokens: list[list[int]]  # (P*G,) generated ids, EOS included when it ended the response
    finish_reason: list[str]  # "stop" (EOS) or "length"
    gen_s: float = 0.0
    stats: RoundStats = field(default_factory=RoundStats)
    outcome: list[list[int]] = field(default_factory=list)  # per token: HIT, MISS or UNDRAFTED (speculative)
    round_of: list[list[int]] = field(default_factory=list)  # per token: the round that committed it
    logp: list[list[float]] = field(default_factory=list)  # per token: the rollout model's log-probability

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def prompt_of(self, r: int) -> list[int]:
        return self.prompt_ids[r // self.group_size]

    def append_round_log(self, path: str, **meta) -> None:
        """Append this rollout's per-token outcomes to a JSONL round log (`sparkrl analyze` reads it)."""
        rec = {
            **meta,
            "group_size": self.group_size,
            "prompts": len(self.prompt_ids),
            "prompt_ids": self.prompt_ids,
            "responses": [
                {"tokens": t, "outcome": o, "round": r} for t, o, r in zip(self.tokens, self.outcome, self.round_of)
            ],
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


@dataclass
class Tree:
    """A batch of padded draft trees. Node 0 of every row is the root (the last committed token,
    not yet run through the policy); nodes are in topological order and siblings in the order they
    are tried (the builder puts the drafter's most likely child first)."""

    tokens: torch.Tensor  # (B, N) int64
    parents: torch.Tensor  # (B, N) int64, -1 for the root and for padding
    valid: torch.Tensor  # (B, N) bool
    depth: torch.Tensor  # (B, N) int64, 0 for the root
    rank: torch.Tensor | None = None  # (B, N) the builder's preference order (1 = best; root 0)
    prob: torch.Tensor | None = None  # (B, N) float32: the drafter's probability of each node's path from the root
    # (its cumulative draft probability; root 1): with point-mass trees, the chance it is accepted if q were p

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def ancestor_mask(self) -> torch.Tensor:
        """(B, N, N) bool: node i may attend to node j iff j is i or an ancestor of i."""
        B, N = self.tokens.shape
        eye = torch.eye(N, dtype=torch.bool, device=self.tokens.device).expand(B, N, N)
        up = torch.where(
            self.parents >= 0, self.parents, torch.arange(N, device=self.tokens.device)
        )  # root, padding: self
        mask = eye
        for _ in range(
            int(self.depth.max())
        ):  # host sync; after d steps every node of depth <= d has all its ancestors
            mask = eye | mask.gather(1, up[:, :, None].expand(B, N, N))
        return mask

    def children_of(self, node: torch.Tensor) -> torch.Tensor:
        """(B, N) bool: the valid children of node (B,) in every row."""
        return (self.parents == node[:, None]) & self.valid & (self.parents >= 0)

    def child_counts(self) -> torch.Tensor:
        """(B, N) number of valid children of every node."""
        counts = torch.zeros_like(self.tokens)
        ok = self.valid & (self.parents >= 0)
        return counts.scatter_add_(1, self.parents.clamp(min=0), ok.long())


@dataclass
class Acceptance:
    """What the acceptance walk (`verify.accept_tree`, `verify.accept_chain`) decided for each row."""

    path: torch.Tensor  # (B, D) accepted node indices in order (padding -1)
    n_accepted: torch.Tensor  # (B,) accepted draft tokens
    bonus: torch.Tensor  # (B,) the token sampled after the accepted path (residual or next)
    last: torch.Tensor  # (B,) node whose target distribution produced the bonus token
    visited: torch.Tensor  # (B, L) the node the walk stood on at each level it reached (meaningful for
    # levels <= n_accepted); L <= max depth + 1
    rejected: torch.Tensor  # (B, N) bool: the nodes the walk tried and rejected
    logp: torch.Tensor | None = None  # (B, L) float32 log softmax(logits / T) of the token committed at each
    # visited level (the accepted child's, then the bonus), the rollout model's log-probability of it
    targets: torch.Tensor | None = None  # (B, L, Vd) float32 target p at the visited nodes, before any
    # rejection, on the token ids `vocab` the caller asked for (None when it did not ask)


class Contexts:
    """The drafted contexts of a round, for SPARK's feedback: every position where the drafter computed
    a distribution (the root and expanded tree nodes; chain and block positions).

    h (B, C, d) the features entering the draft head and z (B, C, Vd) the (corrected) logits the
    proposals came from, given as tensors or as lists of (B, c, .) parts (concatenated on first use,
    so a round nobody reads back costs nothing); node (B, N) the context index of each tree node's
    prediction, -1 where the drafter did not expand it. rejected_children: the feedback includes
    tried-and-rejected children (trees) rather than treating the last path position as the rejected
    one (one-path proposals: chains, blocks)."""

    def __init__(self, h, z, node: torch.Tensor, rejected_children: bool):
        self._h, self._z, self.node, self.rejected_children = h, z, node, rejected_children

    @cached_property
    def h(self) -> torch.Tensor:
        return self._h if isinstance(self._h, torch.Tensor) else torch.cat(self._h, 1)

    @cached_property
    def z(self) -> torch.Tensor:
        return self._z if isinstance(self._z, torch.Tensor) else torch.cat(self._z, 1)


@dataclass
class Proposal:
    """One round's candidates: the tree to verify, the distributions sampled from (chains; None for
    point masses) and the drafted contexts."""

    tree: Tree
    q: torch.Tensor | None  # (B, D, Vd)
    contexts: Contexts


@dataclass
class DraftStep:
    h: torch.Tensor  # (B, T, d) normed feature entering the head
    a: torch.Tensor  # (B, T, d) pre-norm output (EAGLE: the feature of children of these positions)
    z: torch.Tensor | None  # (B, T, Vd) draft logits over the draft vocabulary, float32 (None: not computed)


@dataclass
class DraftState:
    """Per active row: the root (last committed token, not yet run by the policy) and the drafter's
    output at the root's position (logits of the first draft level, feature of its nodes)."""

    root: torch.Tensor  # (B,)
    z: torch.Tensor | None  # (B, Vd) (None for a block drafter, which drafts from the root in one forward)
    a: torch.Tensor | None  # (B, d)
    h: torch.Tensor | None  # (B, d) the head feature behind z (SPARK corrects z with it)
    # a, h and z are None until the drafter has caught up on the root (`speculative.Speculation.catch_up`)

    def keep(self, rows: torch.Tensor) -> None:
        self.root = self.root[rows]
        self.z, self.a, self.h = (None if t is None else t[rows] for t in (self.z, self.a, self.h))
