"""How much to speculate each round: a cost model measured on the running machine.

Verifying a tree of n nodes for each of B responses costs one policy forward of B x (n + 1) tokens
plus the drafting; it pays only if the tokens it commits per response (1 + accepted drafts) outweigh
that cost against a plain autoregressive step (B x 1 tokens). With many active responses the
forward is compute-bound and big trees lose (FastGRPO's concurrency-aware point); in the long tail
of a rollout few responses remain and speculation wins. On a CPU even one response's forward is
compute-bound, so the best tree is often small.

Each round the engine asks `Budget.choose(B)` for a tree size (nodes n, depth d), or an autoregressive
round (AR: exactly a root-only tree's step, which keeps the drafter in sync): n among 1, 2, 4, ... up to the
configured nodes, at every depth up to the configured one (`tree_sizes`), minimising measured seconds /
expected committed tokens. A shallower tree drafts fewer levels, each a drafter forward (a depth-1 tree
none: its candidates are the root's logits), and verifies fewer nodes; it gives up the deep levels, where
acceptance is lowest. A tree of size (n, d) is the n best recorded nodes of depth <= d, so from a
verified round the accepted drafts a smaller or shallower tree would have kept follow: the accepted
path's leading nodes of depth <= d and of rank <= n among those (`kept_drafts`; exact for the trees the
verified one contains, a lower bound for the others). Running averages of those feed the expectations.

The cost model times whole rounds of the engine itself (`speculative.time_rounds`: drafting, the
drafter's catch-up, the verify forward, the acceptance walk, commit; an autoregressive round with its
drafter bookkeeping) for AR and four tree sizes (`timed_sizes`) at 1, 8 and 64 rows at start-up, once per
machine, model, thread count, tree shape and kernels (cached under the user cache dir; 25 s for the default model
here, with a progress bar and its ETA), fits the tree rounds' seconds linearly in nodes and depth per
row count and evaluates the fit at every size (`smoothed`: one size's timing is as noisy as sizes differ), keeps
every size non-decreasing in rows (`nondecreasing`), and interpolates. Whole rounds, because what follows the
verify forward is a fifth to a third of a round: the forward and the drafting alone make trees look cheaper
than they are. The timed rounds run on a text the policy sampled itself (sampling's cost depends on the
nucleus's width, and random tokens make it thousands of tokens wide). Each accepted draft walks one more level
(the LM head and the target distribution on B rows, timed too), so every timed round is first brought to no
accepted draft (`at_zero`) and the prediction adds the levels of the acceptance the budget expects; the drafts
a timed round happens to accept (0 or 1 at one row) would otherwise move a size's prediction at random by as
much as sizes differ.

The acceptance estimates only move in rounds that draft, so once a run of unlucky rounds pushes an
estimate just below break-even the budget would stay autoregressive for good, however well the
drafter does. So a tree predicted within `EXPLORE_MARGIN` of
an autoregressive step per token is drafted again after `EXPLORE_EVERY` declined rounds, any other best tree
after `PROBE_EVERY`, per row the last drafted round verified (at most `LONGEST_WAIT` rounds): a round over B
rows tells B rows' acceptance, and the estimates need fresh rows at a steady rate per round (acceptance drifts
with the prompts and the policy), not per row. At one response at most 1/EXPLORE_EVERY of the rounds lose at
most that margin; at many, an exploration also pays the drafter's catch-up on every AR round since the last
drafted one. The estimates likewise weigh a verified round by its rows. The measurements behind these choices:
docs/experiments/speculation-budget.md.
"""

from __future__ import annotations

import bisect
import json
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from sparkrl.config import TreeShape
from sparkrl.engine.seams import RoundBudget
from sparkrl.machine import measurement_path

ROWS = (1, 8, 64)  # row counts the cost model times; rounds over other counts are interpolated (a round's cost is
# close to linear in its rows between them)
ENGINE = 17  # part of the timing cache's key: bumped whenever a round's work or its timing changes
GAIN = 0.9  # a tree is chosen when predicted at least 10% faster per committed token than an AR step: the
# cost model's error (measured at 8 rows: 1-node trees predicted 1.08x ran at 0.96x) must not turn a
# predicted gain into a loss
EXPLORE_MARGIN = 1.15  # a tree predicted within 15% of an AR step per committed token (but not chosen) ...
EXPLORE_EVERY = 8  # ... is drafted again after 8 declined rounds per row its last drafted round verified
LONGEST_WAIT = 512  # declined rounds at most (4 rollouts of 128 tokens): estimates go stale as the policy moves
PROBE_EVERY = 64  # any other best tree after 64 per row: one response's rounds accept 0 to depth drafts, so a few
# unlucky ones could rate every tree past the margin, and with no drafted round no estimate moves again. At most
# 1/64 of the rounds lose what a tree costs beyond an AR step
CONTEXT = 192  # committed tokens per row while timing (a typical mid-rollout length)
PRIOR_ROWS = 4  # the optimistic prior acceptance weighs as much as this many verified rows: weighed as a running
# average's 1 / (1 - momentum) = 10, it keeps large trees overrated for dozens of rounds; replaced by the first
# round seen, one unlucky round at one response (0 or 1 drafts) could rate every tree too low to be tried again
REPEATS = {1: 9, 8: 6, 64: 1}  # timed rounds of each size per row count. At 1 and 8 rows, where trees can pay and
# a round takes 40-420 ms here, one size's rounds spread by 10-20%, as much as the sizes that decide between trees
# and AR differ; at 64 rows a round takes 0.25-3 s and two timings of a size differ by 0-8%, which the fit over
# the sizes (`smoothed`) pools. About 25 s in all for the default model here.

Size = tuple[int, int]  # (nodes, depth) of a round's tree; AR = (0, 0), an autoregressive round
AR: Size = (0, 0)


def tree_sizes(shape: TreeShape) -> list[Size]:
    """Candidate trees (nodes, depth): node counts n of powers of two below shape.nodes and shape.nodes,
    each at every depth d <= min(shape.depth, n), keeping at most the d * branch nodes a tree of depth d
    records (so (16, 2) is (8, 2)). A one-path proposal (chain, block) has one size."""
    if shape.mode != "tree":
        return [(shape.nodes, shape.depth)]
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n < shape.nodes] + [shape.nodes]
    return sorted({(min(n, d * shape.branch), d) for n in counts for d in range(1, min(shape.depth, n) + 1)})


def kept_drafts(tree, path: torch.Tensor, size: Size) -> torch.Tensor:
    """(B,) drafts a tree of `size` would have accepted in a verified round: tree (`verify.Tree`, with
    the builder's ranks) the verified tree, path (B, D) its accepted nodes (-1 past the end). A tree of
    n nodes and depth d holds the n best-ranked recorded nodes of depth <= d; of those the verified tree
    holds the ones it verified, so the count is exact when the smaller tree is a subset of the verified
    one (any tree of n' <= n nodes at full depth) and otherwise a lower bound (a node the verified tree
    left out might have been accepted)."""
    at = path.clamp(min=0)
    level = torch.arange(path.shape[1], device=path.device)
    ok = (path >= 0) & (level < size[1]) & size_nodes(tree, size).gather(1, at)
    return ok.long().cumprod(-1).sum(-1)


def size_nodes(tree, size: Size) -> torch.Tensor:
    """(B, N) bool: the nodes of a recorded tree (with the builder's ranks) that a tree of `size` holds, its n
    best-ranked nodes of depth 1..d."""
    n, d = size
    inside = tree.valid & (tree.depth >= 1) & (tree.depth <= d)  # (B, N)
    rank = torch.where(inside, tree.rank, tree.size + 1)  # (B, N)
    below = (rank[:, None, :] <= rank[:, :, None]).sum(-1)  # (B, N) rank among the inside nodes
    return inside & (below <= n)


def _interp(xs, ys, x):
    """Piecewise-linear interpolation, linear extrapolation past the last point."""
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _key(size: Size) -> str:
    return f"{size[0]},{size[1]}"


def _size(key) -> Size:
    return tuple(int(x) for x in key.split(","))


@dataclass
class Timings:
    """Engine rounds timed for the cost model (`speculative.time_rounds`)."""

    rounds: dict[Size, list[list[tuple[float, float]]]]  # per size, per row count: the timed rounds as (seconds,
    # drafts accepted per row)
    level: list[float]  # per row count: the seconds one more accepted level adds (LM head, nucleus and a sample)


@dataclass
class CostModel:
    rows: tuple[int, ...]
    rounds: dict[Size, list[float]]  # size (nodes, depth; AR = (0, 0)) -> seconds of one whole engine round,
    # per row count: drafting, the drafter's catch-up, verification, acceptance walk, commit
    accepted: dict[Size, list[float]]  # drafts accepted per row that those seconds are for (0 from `measure`,
    # which brings every timed round to none; a cost model read from an older checkpoint may hold others)
    level: list[float]  # seconds one more accepted level adds per round (the LM head, nucleus and sample on B rows)

    def seconds(self, B: int, size: Size, accepted: float | None = None) -> float:
        """Seconds of a round of `size` over B rows; with `accepted` (drafts per row), corrected from the
        timed rounds' acceptance to it (the walk runs one more level per accepted draft)."""
        t = _interp(self.rows, self.rounds[size], B)
        if size != AR and accepted is not None:
            t += _interp(self.rows, self.level, B) * (accepted - _interp(self.rows, self.accepted[size], B))
        return max(t, 1e-9)

    def to_dict(self) -> dict:
        return {
            "rows": list(self.rows),
            "rounds": {_key(s): list(v) for s, v in self.rounds.items()},
            "accepted": {_key(s): list(v) for s, v in self.accepted.items()},
            "level": list(self.level),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":  # ("timed": the raw timings beside a fit, for the record)
        return cls(
            tuple(d["rows"]),
            {_size(k): v for k, v in d["rounds"].items()},
            {_size(k): v for k, v in d["accepted"].items()},
            d["level"],
        )

    @classmethod
    def measure(
        cls, policy, drafter, shape: TreeShape, time_rounds, repeats: int | None = None, kernels: dict | None = None
    ) -> "CostModel":
        """Time whole engine rounds on this machine (cached per machine/model/threads/shape/kernels): AR and a few
        tree sizes (`timed_sizes`) at `ROWS`, every other size fitted (`smoothed`), with a progress bar.
        time_rounds(policy, drafter, shape, rows, sizes, context, repeats per row, progress) -> `Timings` is the
        engine's
        own timing (`speculative.time_rounds`).
        repeats: timed rounds per size at every row count (default `REPEATS`). kernels: what runs the policy's
        forwards (`cpu.accelerate.Acceleration.kernels`), part of the cache key."""
        w = policy.lm_head.weight
        path = measurement_path(
            "rounds",
            str(w.device),
            str(w.dtype),
            policy.args.__dict__,
            drafter.kind,
            int(drafter.vocab_ids.numel()),
            shape.__dict__,
            ROWS,
            CONTEXT,
            {"engine": ENGINE, **(kernels or {})},
        )
        if path.exists():
            return cls.from_dict(json.loads(path.read_text()))
        sizes = [AR] + timed_sizes(shape)
        reps = dict(REPEATS) if repeats is None else {B: repeats for B in ROWS}
        print(
            f"sparkrl: timing the policy and the drafter for the speculation budget ({len(sizes)} round sizes at "
            f"{', '.join(map(str, ROWS))} rows), once: cached in {path.parent} for next time; --budget fixed "
            f"skips it",
            file=sys.stderr,
            flush=True,
        )
        with tqdm(
            total=timing_work(ROWS, sizes, CONTEXT, reps),
            desc="budget timing",
            file=sys.stderr,
            leave=False,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}, about {remaining} left",
        ) as bar:
            got = time_rounds(policy, drafter, shape, ROWS, sizes, CONTEXT, reps, bar.update)
        timed = {s: [at_zero(r, lv) for r, lv in zip(got.rounds[s], got.level)] for s in sizes}
        cost = cls(
            ROWS,
            nondecreasing(smoothed(timed, tree_sizes(shape))),
            {s: [0.0] * len(ROWS) for s in [AR] + tree_sizes(shape)},
            got.level,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**cost.to_dict(), "timed": {_key(s): v for s, v in timed.items()}}))
        return cost


ROUND_OVERHEAD = 8  # a round's fixed cost in verified tokens' worth (measured here: an AR round over 1 row costs
# a third of a 16-node tree's, over 64 rows a tenth)


def round_work(B: int, size: tuple[int, int]) -> int:
    """A round's expected cost in verified tokens' worth, for a progress bar whose ETA holds: rounds over 64
    rows take 10-50x those over 1."""
    return ROUND_OVERHEAD + B * (size[0] + 1)


def timing_work(rows, sizes, context: int, repeats: dict) -> int:
    """The work `time_rounds` reports to its progress callback in all (`round_work` units)."""
    own = (context - 1) * round_work(1, AR)
    return own + sum(
        repeats[B] * sum(round_work(B, s) for s in sizes) + (repeats[B] + 2) * round_work(B, AR) for B in rows
    )  # the timed rounds; the warm-up round and the levels, AR rounds' worth


def timed_sizes(shape: TreeShape) -> list[Size]:
    """The tree sizes the cost model times: the smallest tree, the widest one level deep, that many nodes at the
    deepest they reach, and the full tree (enough to fit seconds = a + b * nodes + c * (depth - 1), `smoothed`);
    a one-path proposal's one size. The widest and the deep one differ in depth alone, so the fit tells a level's
    cost from a node's: sizes that grow in both at once (a middle tree and the full one) left the depth cost to
    noise, and at one row here it came out negative, rating a (4, 4) tree at 29 ms where it takes 45."""
    sizes = tree_sizes(shape)
    if len(sizes) <= 4:
        return sizes
    widest = max(s for s in sizes if s[1] == 1)
    deep = max(s for s in sizes if s[0] == widest[0])
    picked = {sizes[0], widest, deep, sizes[-1]}
    if len(picked) < 3:  # one branch a level: nodes and depth grow together, a middle size keeps the fit's three
        picked.add(sizes[len(sizes) // 2])
    return sorted(picked)


def at_zero(rounds: list[tuple[float, float]], level: float) -> float:
    """The median of timed rounds (seconds, drafts accepted per row), each brought to no accepted draft by
    `level` seconds per draft: what a round of that size costs before its acceptance walk goes deeper."""
    return sorted(t - level * a for t, a in rounds)[len(rounds) // 2]


def nondecreasing(rounds: dict[Size, list[float]]) -> dict[Size, list[float]]:
    """Each size's seconds over the row counts made non-decreasing (pooled adjacent violators, least squares):
    a round over more rows costs no less, and a timing noisy in that way (an AR step timed slower at 4 rows
    than at 8) would draft trees between them that lose."""
    out = {}
    for size, ys in rounds.items():
        blocks = []  # [mean, count]
        for y in ys:
            blocks.append([y, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
                blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
        out[size] = [m for m, c in blocks for _ in range(c)]
    return out


def smoothed(rounds: dict[Size, list[float]], sizes: list[Size] | None = None) -> dict[Size, list[float]]:
    """Timed tree rounds replaced by a least-squares fit, per row count, of seconds = a + b * nodes +
    c * (depth - 1) over all the timed trees, evaluated at every size in `sizes` (default: the timed ones; AR
    rounds as timed). One size's timing spreads by 10-20% between rounds here, as much as sizes differ from each
    other, so a per-size table lets noise pick the tree; verifying n nodes costs about linearly in n and each
    level below the first one drafter forward, so the fit pools every size's timing into three numbers per row
    count. Fewer than three distinct sizes (a chain, a block): as timed."""
    trees = [s for s in rounds if s != AR]
    if len(set(trees)) < 3:
        return dict(rounds)
    want = [s for s in (sizes or trees) if s != AR]
    X = torch.tensor([[1.0, n, d - 1] for n, d in trees], dtype=torch.float64)
    Y = torch.tensor([rounds[s] for s in trees], dtype=torch.float64)  # (sizes, row counts)
    coef = torch.stack([rising_line(X, y) for y in Y.T], 1)  # (3, row counts)
    fit = torch.tensor([[1.0, n, d - 1] for n, d in want], dtype=torch.float64) @ coef
    return {AR: list(rounds[AR]), **{s: fit[i].tolist() for i, s in enumerate(want)}}


def rising_line(X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Least-squares coefficients (a, b, c) of y ~ X = [1, nodes, depth - 1] with b, c >= 0: a tree with more
    nodes or levels never costs less, so a slope the noise makes negative is dropped (set to 0) and the rest
    refitted."""
    keep, coef = [0, 1, 2], torch.zeros(3, dtype=X.dtype)
    while True:
        coef.zero_()
        coef[keep] = torch.linalg.lstsq(X[:, keep], y[:, None], driver="gelsd").solution[:, 0]  # defined when X
        # is rank-deficient
        falling = [i for i in keep[1:] if coef[i] < 0]
        if not falling:
            return coef
        keep.remove(min(falling, key=lambda i: coef[i]))


class FixedBudget(RoundBudget):
    """The budget of `--budget fixed`: every round drafts the full shape; nothing is timed, learned or saved,
    and with no cost model there is no autoregressive estimate."""

    def __init__(self, shape: TreeShape):
        self.size = (shape.nodes, shape.depth)

    def choose(self, B: int) -> Size:
        return self.size

    def observe_round(self, size: Size, B: int, seconds: float) -> None:
        pass

    def observe(self, size: Size, tree, acc) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def figures(self, stats) -> dict:
        return {}


class Budget(RoundBudget):
    """Chooses each round's tree size (nodes, depth), or an autoregressive round, from the number of
    active responses. The candidates are the sizes the cost model timed (`tree_sizes`).

    adaptive: also learn from the rounds actually run. Each round's whole wall time (drafting, the
    drafter's catch-up, verification, acceptance, commit, SPARK) rescales the cost model's prediction
    for its size by a running ratio, so overheads the start-up timing does not see count. Decisions
    then depend on wall-clock timings: a resumed run is not bit-identical to an uninterrupted one
    (its distribution is unchanged), which is why `--budget auto` does not adapt."""

    def __init__(
        self,
        cost: CostModel,
        shape: TreeShape,
        prior_accept: float = 2.0,
        momentum: float = 0.9,
        adaptive: bool = False,
    ):
        self.cost, self.shape = cost, shape
        # expected accepted drafts per round for each size; optimistic at first, kept across rollouts
        self.accepted = {s: prior_accept * s[1] / shape.depth for s in self.sizes}
        self.seen = {s: 0 for s in self.sizes}  # verified rows that told each size's acceptance
        self.scale = {s: 1.0 for s in [AR] + self.sizes}  # measured / predicted round seconds (adaptive)
        self.momentum, self.adaptive = momentum, adaptive
        self.declined = 0  # autoregressive rounds chosen since the last drafted one, a tree nearly paying
        self.rows = 1  # rows of the last drafted round: the declined rounds before the next exploration scale with it

    def state_dict(self) -> dict:
        """What a resumed run needs to choose as the uninterrupted one would: the cost model it used
        and the running estimates."""
        return {
            "cost": self.cost.to_dict(),
            "accepted": {_key(s): a for s, a in self.accepted.items()},
            "seen": {_key(s): n for s, n in self.seen.items()},
            "scale": {_key(s): a for s, a in self.scale.items()},
            "declined": self.declined,
            "rows": self.rows,
        }

    def load_state_dict(self, state: dict) -> None:
        if "cost" not in state:  # a checkpoint from before sizes had depths: its estimates no longer apply
            return
        self.cost = CostModel.from_dict(state["cost"])
        self.accepted = {_size(k): a for k, a in state["accepted"].items()}
        self.seen = {_size(k): n for k, n in state.get("seen", {k: 1 << 20 for k in state["accepted"]}).items()}
        self.scale = {_size(k): a for k, a in state["scale"].items()}
        self.declined = state["declined"]
        self.rows = state.get("rows", 1)

    @property
    def sizes(self) -> list[Size]:
        """The candidate trees: the sizes the cost model timed."""
        return sorted(s for s in self.cost.rounds if s != AR)

    def seconds(self, B: int, size: Size) -> float:
        """Predicted seconds of a round of `size` (AR: autoregressive) over B rows at the acceptance
        expected for that size."""
        return self.cost.seconds(B, size, self.accepted.get(size)) * self.scale[size]

    def choose(self, B: int) -> Size:
        """The size for a round over B rows (AR: autoregressive): the tree with the fewest predicted
        seconds per committed token if it beats an autoregressive step by the margin GAIN, or if it comes within
        EXPLORE_MARGIN of one and EXPLORE_EVERY rounds per row the last drafted round verified (PROBE_EVERY when
        it does not come within the margin; at most LONGEST_WAIT) have declined it since."""
        ar = self.seconds(B, AR)
        costs = {s: self.seconds(B, s) / (1.0 + self.accepted[s]) for s in self.sizes}  # seconds per token
        best = min(costs, key=costs.get)
        per_token = costs[best]
        if per_token >= ar * GAIN:
            self.declined += 1
            every = EXPLORE_EVERY if per_token < ar * EXPLORE_MARGIN else PROBE_EVERY
            if self.declined < min(every * self.rows, LONGEST_WAIT):
                return AR
        self.declined, self.rows = 0, B
        return best

    def observe_round(self, size: Size, B: int, seconds: float) -> None:
        """A round of `size` over B rows took `seconds` in all (only used when adaptive)."""
        if self.adaptive and seconds > 0:
            ratio = seconds / self.cost.seconds(B, size, self.accepted.get(size))
            self.scale[size] = self.momentum * self.scale[size] + (1 - self.momentum) * ratio

    def autoregressive_estimate(self, stats) -> float:
        """Seconds an autoregressive rollout would have taken for what a speculative one (its
        `records.RoundStats`) committed: its autoregressive rounds as timed, and for every drafted round
        with B active responses and AAL a, a autoregressive steps of B rows (cost model)."""
        return stats.ar_s + sum(a * self.seconds(B, AR) for B, a in stats.active_aal)

    def figures(self, stats) -> dict:
        """A rollout's figures for metrics.jsonl: `gen_ar_estimate_s`, its `autoregressive_estimate`."""
        return {"gen_ar_estimate_s": self.autoregressive_estimate(stats)}

    def observe(self, size: Size, tree, acc) -> None:
        """A verified round of `size`: its `verify.Tree` (with the builder's ranks) and `Acceptance`. Updates
        the estimate of every size no larger in nodes and depth (`kept_drafts`): the mean of the prior, counted as
        `PRIOR_ROWS` rows, and the rows seen, while there are fewer than 1 / (1 - momentum) in all, then a
        running average over rows (a round over B rows moves it as B rows of its mean would)."""
        B = acc.path.shape[0]
        for s in self.sizes:
            if s[0] <= size[0] and s[1] <= size[1]:
                kept = kept_drafts(tree, acc.path, s).double().mean().item()  # host sync
                self.seen[s] += B
                w = max(1 - self.momentum**B, B / (self.seen[s] + PRIOR_ROWS))
                self.accepted[s] = (1 - w) * self.accepted[s] + w * kept
