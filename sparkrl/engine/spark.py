"""SPARK: a rollout-local, prompt-shared low-rank correction of the draft logits (paper sections 3.2-3.4,
appendix B; defaults from its Table 3).

At a drafted context c of owner g (the response's prompt group by default):
    u_c = A^T h_c,   z~_c = z_c + B_g u_c,   q_c = softmax(z~_c / T)
After every verification round, from the target distributions p_c the verifier already computed:
    B_g <- B_g - eta * sum_{c in C_g} (w_c / W_g) delta_c u_c^T,   W_g = sum_{c in C_g} w_c        (Eq. 5)
where delta_c = q_c - p_c on S_c = TopK(p_c, k) U TopK(q_c, k) and one tail bucket for the rest. The
tail's update is a common shift of every token outside S_c, which softmax cannot tell from the opposite
shift of the tokens in S_c, so it is folded in as `delta_c(v) - tail_c` on S_c: B keeps rows only for
tokens some S_c contained (`SparseRows`), and the ratio of two never-seen tokens is unchanged
(Prop. B.5(i)). The A gradient of the truncated per-context loss, G^A_c = h_c (B_g^T delta_c)^T (Eq. 6,
B_g the matrix used at c), is accumulated during the rollout and applied by the draft optimizer step.

Exactness: the correction used in round t is built from rounds < t only (`end_round` is called after
the round has committed), so the proposals of a round are fixed before it is verified (Theorem B.8).

Composition: the engine takes a `Spark` as its drafter adapter (`speculative.NoAdaptation` is the one
that does nothing); `Spark` gives the protocol of a round.

Departures: p is the target restricted to the drafter's vocabulary (its mass outside that vocabulary
belongs to the tail); at temperature 0 (p a point mass) q is taken at temperature 1. On the verified
path and on chains p is the verifier's own processed target; at rejected tree children, which the
acceptance walk never visits, it is the policy's softmax over the draft vocabulary from the
verification forward's hidden state (no extra policy forward; see `Spark.target`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from sparkrl.engine.seams import DraftAdapter
from sparkrl.errors import UserError


def init_projection(head: torch.Tensor, rank: int) -> torch.Tensor:
    """A (d, r): `rank` evenly spaced rows of the output projection head (V, d), orthonormalised (QR)."""
    V, d = head.shape
    if not 1 <= rank <= min(d, V):
        raise UserError(f"--spark-rank must be in [1, {min(d, V)}] for this model (hidden size {d}), got {rank}")
    idx = torch.linspace(0, V - 1, rank, dtype=torch.float64).round().long()
    q, _ = torch.linalg.qr(head.detach()[idx].double().T)  # (d, r)
    return q.float().contiguous()


def sparse_delta(q: torch.Tensor, p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_c on S_c = TopK(p, k) U TopK(q, k), with the tail bucket folded in.

    q, p: (n, V) draft and target distributions (p may sum to less than 1: its missing mass is tail).
    Returns idx (n, 2k) token ids (sorted; a repeated id carries 0) and delta (n, 2k).
    """
    k = min(k, q.shape[-1])
    idx = torch.cat([p.topk(k, dim=-1).indices, q.topk(k, dim=-1).indices], -1).sort(-1).values  # (n, 2k)
    dup = torch.zeros_like(idx, dtype=torch.bool)
    dup[:, 1:] = idx[:, 1:] == idx[:, :-1]
    d = (q.gather(-1, idx) - p.gather(-1, idx)).masked_fill(dup, 0.0)  # (n, 2k)
    tail = -d.sum(-1, keepdim=True)  # q(T) - p(T), T the tokens outside S_c
    return idx, (d - tail).masked_fill(dup, 0.0)


class SparseRows:
    """The rows of every owner's B_g that feedback has touched: memory O(m r) per owner, not O(V r).

    keys (M,) sorted, key = owner * V + token; rows (M, r) float32.
    """

    def __init__(self, vocab: int, rank: int, device):
        self.V = vocab
        self.keys = torch.empty(0, dtype=torch.long, device=device)
        self.rows = torch.empty(0, rank, device=device)

    def __len__(self) -> int:
        return self.keys.numel()

    def add(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """B[key] += rows (repeated keys add up)."""
        if keys.numel() == 0:
            return
        allk, inv = torch.unique(torch.cat([self.keys, keys]), sorted=True, return_inverse=True)
        self.rows = torch.zeros(allk.numel(), self.rows.shape[1], device=rows.device).index_add_(
            0, inv, torch.cat([self.rows, rows])
        )
        self.keys = allk

    def drop(self, owners: torch.Tensor) -> None:
        """Forget every row of `owners` (B_g = 0 again)."""
        keep = ~torch.isin(torch.div(self.keys, self.V, rounding_mode="floor"), owners)
        self.keys, self.rows = self.keys[keep], self.rows[keep]

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows at keys (any shape) -> (*keys.shape, r), zero for untouched rows."""
        r = self.rows.shape[1]
        if len(self) == 0:
            return torch.zeros(*keys.shape, r, device=keys.device)
        pos = torch.searchsorted(self.keys, keys.reshape(-1)).clamp(max=len(self) - 1)
        hit = self.keys[pos] == keys.reshape(-1)
        return torch.where(hit[:, None], self.rows[pos], 0.0).view(*keys.shape, r)

    def of_owners(self, owners: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each owner's touched rows, padded: tokens (B, m), rows (B, m, r) (padding: token 0, row 0)."""
        start = torch.searchsorted(self.keys, owners * self.V)
        count = torch.searchsorted(self.keys, (owners + 1) * self.V) - start  # (B,)
        m = int(count.max()) if owners.numel() else 0  # host sync: padded width
        j = start[:, None] + torch.arange(m, device=owners.device)  # (B, m)
        ok = torch.arange(m, device=owners.device) < count[:, None]
        j = j.clamp(max=max(len(self) - 1, 0))
        tok = torch.where(ok, self.keys[j] - owners[:, None] * self.V, 0) if m else j
        rows = (
            torch.where(ok[..., None], self.rows[j], 0.0)
            if m
            else self.rows.new_zeros(len(owners), 0, self.rows.shape[1])
        )
        return tok, rows


class Projection(nn.Module):
    """The shared projection A (d, r), fp32, learned across rollouts by the draft optimizer."""

    def __init__(self, A: torch.Tensor):
        super().__init__()
        self.A = nn.Parameter(A.float().clone())

    @classmethod
    def for_policy(cls, policy, rank: int) -> "Projection":
        return cls(init_projection(policy.lm_head.weight, rank))

    def checkpoint(self) -> dict:
        return {"A": self.A.detach().clone(), "hidden_size": self.A.shape[0], "rank": self.A.shape[1]}

    def load(self, ck: dict, where: str = "checkpoint") -> None:
        d, r = self.A.shape
        if ck.get("hidden_size") != d or ck.get("rank") != r:
            raise UserError(
                f"the SPARK projection in {where} is {ck.get('hidden_size')} x {ck.get('rank')}, this run "
                f"needs {d} x {r} (hidden size x --spark-rank); pass --spark-rank {ck.get('rank')} or "
                "a checkpoint made for this model"
            )
        with torch.no_grad():
            self.A.copy_(ck["A"])


class Spark(DraftAdapter):
    """One rollout's corrections B_g and the feedback that updates them.

    Engine protocol per round: `select(rows)` (owners of the active responses) -> `correct(z, h)` at
    every drafted context -> verification -> `observe(proposal, acc, logits_at)`, which feeds the
    round's feedback contexts to `feedback` -> `end_round()`, which applies the update (every `every`
    rounds) for the next round to use.
    """

    needs_targets = True  # the engine asks the acceptance walk for p at the visited nodes

    def __init__(
        self,
        A: torch.Tensor,
        vocab: int,
        k: int = 16,
        eta: float = 0.01,
        every: int = 1,
        temperature: float = 1.0,
        learn_A: bool = True,
        scope: str = "group",
        carry: bool = False,
        w_path: float = 1.0,
        w_rejected: float = 1.0,
        accepted_only: bool = False,
    ):
        self.A = A.detach().float()  # fixed during the rollout (Theorem B.8, step 1)
        self.V, self.k, self.eta, self.every = vocab, k, eta, every
        self.temperature = temperature if temperature > 0 else 1.0
        self.greedy = temperature == 0
        self.learn_A, self.scope, self.carry = learn_A, scope, carry
        self.w_path, self.w_rejected, self.accepted_only = w_path, w_rejected, accepted_only
        self.store = SparseRows(vocab, A.shape[1], A.device)
        self.grad_A = torch.zeros_like(self.A, dtype=torch.float64)
        self.updates = 0  # owner-round updates accumulated in grad_A
        self.stats = {"spark_contexts": 0, "spark_skipped": 0}
        self.seconds = 0.0
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._owner = torch.zeros(0, dtype=torch.long, device=A.device)
        self._tok = self._rows = None
        self._round = 0

    @classmethod
    def from_config(cls, cfg, A: torch.Tensor, vocab: int, temperature: float) -> "Spark":
        """From a `config.SparkConfig`."""
        return cls(
            A,
            vocab,
            cfg.spark_k,
            cfg.spark_eta,
            cfg.spark_every,
            temperature,
            not cfg.spark_frozen_a,
            cfg.spark_scope,
            cfg.spark_carry,
            cfg.spark_path_weight,
            cfg.spark_rejected_weight,
            cfg.spark_feedback == "accepted",
        )

    def begin(self, n_prompts: int, group_size: int) -> None:
        """A new rollout of n_prompts x group_size responses (prompt-major). B = 0 unless `carry`.

        The scope says which responses share a B: "group" (the paper: the G responses of a prompt),
        "response" (each its own) or "batch" (all)."""
        self.reset()
        r = torch.arange(n_prompts * group_size, device=self.A.device)
        self._owners_all = {"group": r // group_size, "response": r, "batch": r * 0}[self.scope]

    def reset(self) -> None:
        """A new rollout: B = 0 (unless `carry`), its figures zeroed."""
        if not self.carry:
            self.store = SparseRows(self.V, self.A.shape[1], self.A.device)
        self._pending, self._round = [], 0
        self.stats = {"spark_contexts": 0, "spark_skipped": 0}
        self.seconds = 0.0

    def select(self, responses) -> None:
        """The active batch rows for this round: their response indices (a list or a (B,) tensor)."""
        self.select_owners(self._owners_all[torch.as_tensor(responses, device=self.A.device)])

    def select_owners(self, owner: torch.Tensor) -> None:
        """The owner of each batch row `correct` and `feedback` see, (B,) long (an engine that keeps its own map
        from responses to owners, as vLLM's does, calls this instead of `begin` and `select`)."""
        t0 = time.perf_counter()
        self._owner = owner
        self._tok, self._rows = self.store.of_owners(self._owner) if len(self.store) else (None, None)
        self.seconds += time.perf_counter() - t0

    def correct(self, z: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """z (B, [T,] V) draft logits, h (B, [T,] d) features of the selected rows -> z + B_g A^T h."""
        if self._tok is None or self._tok.shape[1] == 0:
            return z  # B = 0: exactly the baseline's logits
        t0 = time.perf_counter()
        squeeze = z.dim() == 2
        if squeeze:
            z, h = z[:, None], h[:, None]
        B, T, _ = z.shape
        u = h.float() @ self.A  # (B, T, r)
        corr = u @ self._rows.transpose(1, 2)  # (B, T, m)
        out = z.float().scatter_add(-1, self._tok[:, None, :].expand(B, T, -1), corr)
        self.seconds += time.perf_counter() - t0
        return out[:, 0] if squeeze else out

    def feedback(self, row: torch.Tensor, h: torch.Tensor, z: torch.Tensor, p: torch.Tensor, w: torch.Tensor) -> None:
        """Feedback contexts of this round: row (n,) batch row, h (n, d), z (n, V) the corrected logits the
        proposals came from, p (n, V) the target's distribution there, w (n,) weights."""
        if row.numel():
            self.feedback_of(self._owner[row], h, z, p, w)

    def feedback_of(
        self, owner: torch.Tensor, h: torch.Tensor, z: torch.Tensor, p: torch.Tensor, w: torch.Tensor
    ) -> None:
        """`feedback` with each context's owner (n,) given instead of its batch row."""
        q = torch.softmax(z.float() / self.temperature, -1)  # (n, V)
        p = p.float()
        u = h.float() @ self.A  # (n, r)
        ok = torch.isfinite(q).all(-1) & torch.isfinite(p).all(-1) & torch.isfinite(u).all(-1)
        bad = torch.unique(owner[~ok])
        if bad.numel():  # a broken target or drafter must not poison B: skip those owners' updates
            self.stats["spark_skipped"] += bad.numel()
            keep = ~torch.isin(owner, bad)
            owner, q, p, u, w, h = owner[keep], q[keep], p[keep], u[keep], w[keep], h[keep]
            if owner.numel() == 0:
                return
        self.stats["spark_contexts"] += owner.numel()
        idx, delta = sparse_delta(q, p, self.k)  # (n, 2k)
        owners, of = torch.unique(owner, return_inverse=True)  # host sync: size
        W = torch.zeros(owners.numel(), device=w.device).index_add_(0, of, w.float())
        coef = w.float() / W[of]  # (n,) w_c / W_g
        keys = owner[:, None] * self.V + idx  # (n, 2k)
        if self.learn_A:  # G^A_c = h_c (B_g^T delta_c)^T with the B_g this round used (Eq. 6)
            btd = (delta[..., None] * self.store.lookup(keys)).sum(1)  # (n, r)
            self.grad_A += ((coef[:, None] * h.float()).T @ btd).double()
            self.updates += owners.numel()
        step = -self.eta * (coef[:, None] * delta)[..., None] * u[:, None, :]  # (n, 2k, r)
        self._pending.append((keys.reshape(-1), step.reshape(-1, u.shape[1])))

    def target(self, logits: torch.Tensor) -> torch.Tensor:
        """The target at a rejected child from the policy's logits there on the draft vocabulary (n, V):
        softmax at the sampling temperature (a point mass at temperature 0), without top-p: the
        nucleus would need a full-vocabulary sort per context, and the walk never visited these
        nodes. Only B, never exactness, depends on this."""
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return torch.softmax(logits.float() / self.temperature, -1)

    def observe(self, proposal, acc, logits_at) -> None:
        """A verified round (`records.Proposal`, `records.Acceptance` with targets): its feedback."""
        t0 = time.perf_counter()
        round_feedback(self, proposal.contexts, acc, logits_at)
        self.seconds += time.perf_counter() - t0

    def end_round(self) -> None:
        """The round has committed: apply the pending update (every `every` rounds)."""
        t0 = time.perf_counter()
        self._round += 1
        if self._round % self.every == 0 and self._pending:
            self.store.add(torch.cat([k for k, _ in self._pending]), torch.cat([s for _, s in self._pending]))
            self._pending = []
        self.seconds += time.perf_counter() - t0

    def metrics(self) -> dict:
        """The rollout's SPARK figures: its own time, feedback contexts, skipped owners, rows of B."""
        return {"spark_s": self.seconds, **self.stats, "spark_rows": len(self.store)}

    def state_dict(self) -> dict:
        """The corrections carried into the next rollout (only meaningful with `carry`)."""
        return {"keys": self.store.keys.clone(), "rows": self.store.rows.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.store = SparseRows(self.V, self.A.shape[1], self.A.device)
        self.store.keys, self.store.rows = state["keys"].to(self.A.device), state["rows"].to(self.A.device)

    def take_grad(self, sum_ranks: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor | None:
        """The rollout's mean A gradient (None when nothing was accumulated); resets the accumulator.
        sum_ranks: the sum over data-parallel ranks (`World.sum`); the mean is over all their owner-round
        updates (the same on every rank, as one process would compute it on the whole batch)."""
        updates = int(sum_ranks(torch.tensor(self.updates)))
        if not updates:
            return None
        g = (sum_ranks(self.grad_A) / updates).float()
        self.grad_A.zero_()
        self.updates = 0
        return g


# --- feedback contexts of a verified round ------------------------------------------------------


def round_feedback(spark: Spark, ctx, acc, logits_at) -> None:
    """Feed one verified round back (DESIGN "SPARK"): the contexts on the verified path, and

    * trees (ctx.rejected_children): the eligible rejected children, i.e. the nodes the walk tried and
      rejected that the drafter expanded (so q exists there); their target comes from the policy's
      logits there, logits_at(rows (n,), nodes (n,)) -> (n, Vd) (hidden states of the verification
      forward; no extra policy forward);
    * one-path proposals (chains, blocks): the last path position, where the walk stopped, is the
      first rejected position (weight w_rejected).

    ctx: the round's `records.Contexts`; acc: its `records.Acceptance`, with `targets` (the
    walk's p at every visited node). spark.accepted_only (ablation): only path contexts whose proposal
    was accepted.
    """
    n_acc = acc.n_accepted[:, None]
    lvl = torch.arange(acc.visited.shape[1], device=n_acc.device)[None]  # (1, L)
    ctx_at = ctx.node.gather(1, acc.visited)  # (B, L) context of each visited node, -1: none
    on = (lvl < n_acc) if spark.accepted_only else (lvl <= n_acc)
    rows, lv = (on & (ctx_at >= 0)).nonzero(as_tuple=True)
    cidx, p = ctx_at[rows, lv], acc.targets[rows, lv]
    stopped = (lv == acc.n_accepted[rows]) & (not ctx.rejected_children)
    w = torch.where(stopped, spark.w_rejected, spark.w_path).float()
    if ctx.rejected_children and not spark.accepted_only:
        rb, nb = (acc.rejected & (ctx.node >= 0)).nonzero(as_tuple=True)
        rows, cidx = torch.cat([rows, rb]), torch.cat([cidx, ctx.node[rb, nb]])
        p = torch.cat([p, spark.target(logits_at(rb, nb))])
        w = torch.cat([w, torch.full((rb.numel(),), spark.w_rejected, device=w.device)])
    spark.feedback(rows, ctx.h[rows, cidx], ctx.z[rows, cidx], p, w)
