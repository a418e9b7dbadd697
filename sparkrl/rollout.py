"""Rollouts: the records every engine returns, the shared batch bookkeeping, and autoregressive mode.

Both modes (this file's `generate`, and `speculative.generate_speculative`) share the bookkeeping:
  * each distinct prompt is prefilled once and its KV cache rows are copied to its G responses;
  * a response that commits an EOS id or reaches max_new_tokens leaves the batch (its cache rows are
    dropped), so the work shrinks as the batch finishes;
  * the token at position t of response i is sampled at a uniform keyed by (i's generator seed, t)
    (`sampling.position_uniforms`), so its tokens depend neither on which other responses share the
    batch nor on how the engine reached position t: a speculative rollout of point-mass drafts commits
    the tokens autoregressive sampling would, whatever the drafter proposed.

Autoregressive mode: `prefill`, then `decode_one_token` (one policy forward per token) until every
response has finished. The speculative engine takes the same step for its autoregressive rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch

from sparkrl.config import SamplingConfig
from sparkrl.model import KVCache, Output, Transformer, pad_right
from sparkrl.sampling import logprob_of, position_uniforms, response_keys, sample, sample_nucleus

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
    active_aal: list[tuple[int, float]] = field(default_factory=list)  # (active responses, AAL) per drafted round (paper Fig. 5)
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
        return {"aal": self.aal, "rounds": self.rounds, "tree_rounds": self.tree_rounds, "committed": self.committed,
                "row_rounds": self.row_rounds, "policy_forwards": self.policy_forwards, "draft_s": self.draft_s,
                "verify_s": self.verify_s, "accept_s": self.accept_s, "accept_at_depth": self.accept_at_depth,
                "tree_sizes": self.sizes, **self.adapter}


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


def response_generators(seed: int, n_prompts: int, group_size: int, offset: int = 0) -> list[torch.Generator]:
    """One generator per response; response j of prompt i gets a seed derived from (seed, offset + i, j)."""
    gens = []
    for i in range(n_prompts):
        for j in range(group_size):
            g = torch.Generator()
            g.manual_seed(hash((seed, offset + i, j)) & 0x7FFF_FFFF_FFFF_FFFF)
            gens.append(g)
    return gens


class Batch:
    """Which responses are still running, what each has committed, and why each stopped."""

    def __init__(self, generators: list[torch.Generator], eos_ids: tuple[int, ...], max_new_tokens: int):
        n = len(generators)
        self.keys = response_keys(generators)  # (n,) what each response's uniforms are keyed by
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.outcome: list[list[int]] = [[] for _ in range(n)]
        self.round_of: list[list[int]] = [[] for _ in range(n)]
        self.logp: list[list[float]] = [[] for _ in range(n)]
        self.reason = ["length"] * n
        self.active = list(range(n))  # response index of each batch row
        self.eos, self.max_new = set(eos_ids), max_new_tokens
        self.done = [False] * n  # per active row, after the last commit
        self.rounds = 0

    def commit(self, new: list[list[int]], logp: list[list[float]], outcome: list[list[int]] | None = None) -> None:
        """Append each active row's new tokens (cut after an EOS or at the length limit), with their
        rollout log-probabilities, drafting outcomes (default UNDRAFTED) and the current round; marks the
        rows that finished."""
        done = []
        for i, (r, toks) in enumerate(zip(self.active, new)):
            out = self.tokens[r]
            for j, t in enumerate(toks):
                if len(out) >= self.max_new:
                    break
                out.append(t)
                self.logp[r].append(logp[i][j])
                self.outcome[r].append(outcome[i][j] if outcome else UNDRAFTED)
                self.round_of[r].append(self.rounds)
                if t in self.eos:
                    self.reason[r] = "stop"
                    break
            done.append(self.reason[r] == "stop" or len(out) >= self.max_new)
        self.done = done

    def uniforms(self, levels: int = 1, device=None) -> torch.Tensor:
        """(active rows, levels) float64: the uniforms of each active response's next `levels` token
        positions (`sampling.position_uniforms`)."""
        pos = torch.tensor([len(self.tokens[r]) for r in self.active], dtype=torch.long)[:, None] + torch.arange(levels)
        u = position_uniforms(self.keys[self.active], pos)
        return u.to(device) if device is not None else u

    def drop_finished(self) -> torch.Tensor | None:
        """Remove the rows that finished at the last commit; returns the kept row indices (None when
        every row stays)."""
        if not any(self.done):
            return None
        keep = [i for i, d in enumerate(self.done) if not d]
        self.active = [self.active[i] for i in keep]
        self.done = [False] * len(keep)
        return torch.tensor(keep, dtype=torch.long)

    def rollout(self, prompts: list[list[int]], group_size: int, t0: float, stats: RoundStats) -> Rollout:
        return Rollout([list(p) for p in prompts], group_size, self.tokens, self.reason, time.perf_counter() - t0,
                       stats, self.outcome, self.round_of, self.logp)


def prefill(model: Transformer, prompts: list[list[int]], capacity: int, group_size: int, taps: tuple[int, ...] = ()):
    """Run the distinct prompts into a fresh cache, then copy each prompt's rows to its `group_size`
    responses. Returns (cache, last-position logits (P*G, V), the forward's output over (P, L))."""
    device = model.lm_head.weight.device
    toks, lens = pad_right(prompts, device)
    cache = model.new_cache(len(prompts), capacity)
    out = model(toks, cache, taps=taps)
    cache.commit(n_keep=lens)
    rows = torch.arange(len(prompts), device=device).repeat_interleave(group_size)
    cache.keep_rows(rows)
    logits = model.logits(out.hidden[torch.arange(len(prompts), device=device), lens - 1])  # (P, V)
    return cache, logits.index_select(0, rows), out


def decode_one_token(model: Transformer, cache: KVCache, tokens: torch.Tensor, sampling: SamplingConfig,
                     u: torch.Tensor, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, Output]:
    """One autoregressive step: run tokens (B,) and commit them, sample the next (B,) at uniforms u (B,)
    (`Batch.uniforms`). Returns the next tokens, their log-probabilities (B,) and the forward's output (its taps
    feed a drafter)."""
    out = model(tokens[:, None], cache, taps=taps)
    cache.commit(n_keep=torch.ones(len(tokens), dtype=torch.long, device=tokens.device))
    nxt, logp = sample_with_logprob(model.logits(out.hidden[:, -1]), sampling, u, model.compiled_ops)
    return nxt, logp, out


def sample_with_logprob(logits: torch.Tensor, sampling: SamplingConfig, u: torch.Tensor, compiled: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens (N,) sampled from logits (N, V) at uniforms u (N,), and their log-probabilities (N,);
    compiled: on the compiled kernel where it serves (`sampling.sample_nucleus`)."""
    if compiled:
        return sample_nucleus(logits, sampling.temperature, sampling.top_p, u, compiled)[2:]
    nxt = sample(logits, sampling.temperature, sampling.top_p, u)  # (N,)
    return nxt, logprob_of(logits, nxt, sampling.temperature)


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], sampling: SamplingConfig, eos_ids: tuple[int, ...],
             generators: list[torch.Generator], group_size: int = 1, progress=None) -> Rollout:
    """Autoregressive sampling of `group_size` responses per prompt, all in one shrinking batch.

    generators: one per response (len(prompts) * group_size), e.g. from `response_generators`.
    progress: optional callable(n_new_tokens) for a progress bar.
    """
    t0 = time.perf_counter()
    assert len(generators) == len(prompts) * group_size, "one generator per response"
    cache, logits, _ = prefill(model, prompts, max(map(len, prompts)) + sampling.max_new_tokens, group_size)
    batch = Batch(generators, eos_ids, sampling.max_new_tokens)
    stats = RoundStats()
    nxt, logp = sample_with_logprob(logits, sampling, batch.uniforms()[:, 0], model.compiled_ops)  # (B,)
    batch.commit([[t] for t in nxt.tolist()], [[x] for x in logp.tolist()])  # host sync: tokens go to Python lists
    while True:
        if progress is not None:
            progress(len(batch.active))
        keep = batch.drop_finished()
        if not batch.active:
            break
        if keep is not None:
            keep = keep.to(nxt.device)
            cache.keep_rows(keep)
            nxt = nxt.index_select(0, keep)
        nxt, logp, _ = decode_one_token(model, cache, nxt, sampling, batch.uniforms()[:, 0])
        batch.commit([[t] for t in nxt.tolist()], [[x] for x in logp.tolist()])  # round r: round_of r
        batch.rounds += 1
        stats.policy_forwards += 1
    return batch.rollout(prompts, group_size, t0, stats)
