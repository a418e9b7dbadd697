"""Autoregressive mode, and the batch bookkeeping both engines share.

Both modes (this file's `generate`, and `speculative.generate_speculative`) share the bookkeeping:
  * each distinct prompt is prefilled once and its KV cache rows are copied to its G responses;
  * a response that commits an EOS id or reaches max_new_tokens leaves the batch (its cache rows are
    dropped), so the work shrinks as the batch finishes;
  * the token at position t of response i is sampled at a uniform keyed by (i's generator seed, t)
    (`sampling.position_uniforms`), so its tokens depend neither on which other responses share the
    batch nor on how the engine reached position t: a speculative rollout of point-mass drafts commits
    the tokens autoregressive sampling would, whatever the drafter proposed.

Autoregressive mode: `prefill`, then `decode_one_token` (one policy forward per token) until every
response has finished (`generate`; `Autoregressive` is it behind the engines' one call). The speculative engine
takes the same step for its autoregressive rounds.
"""

from __future__ import annotations

import time

import torch

from sparkrl.config import SamplingConfig
from sparkrl.engine.records import UNDRAFTED, Rollout, RoundStats
from sparkrl.engine.sampling import SAMPLER, Sampler, position_uniforms, response_keys
from sparkrl.engine.seams import RolloutEngine
from sparkrl.model.kvcache import KVCache
from sparkrl.model.transformer import Output, Transformer, pad_right


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
        return Rollout(
            [list(p) for p in prompts],
            group_size,
            self.tokens,
            self.reason,
            time.perf_counter() - t0,
            stats,
            self.outcome,
            self.round_of,
            self.logp,
        )


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


def decode_one_token(
    model: Transformer,
    cache: KVCache,
    tokens: torch.Tensor,
    sampling: SamplingConfig,
    u: torch.Tensor,
    taps: tuple[int, ...] = (),
    sampler: Sampler = SAMPLER,
) -> tuple[torch.Tensor, torch.Tensor, Output]:
    """One autoregressive step: run tokens (B,) and commit them, sample the next (B,) at uniforms u (B,)
    (`Batch.uniforms`). Returns the next tokens, their log-probabilities (B,) and the forward's output (its taps
    feed a drafter)."""
    out = model(tokens[:, None], cache, taps=taps)
    cache.commit(n_keep=torch.ones(len(tokens), dtype=torch.long, device=tokens.device))
    nxt, logp = sampler.token(model.logits(out.hidden[:, -1]), sampling.temperature, sampling.top_p, u)
    return nxt, logp, out


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    eos_ids: tuple[int, ...],
    generators: list[torch.Generator],
    group_size: int = 1,
    progress=None,
    sampler: Sampler = SAMPLER,
) -> Rollout:
    """Autoregressive sampling of `group_size` responses per prompt, all in one shrinking batch.

    generators: one per response (len(prompts) * group_size), e.g. from `response_generators`.
    progress: optional callable(n_new_tokens) for a progress bar. sampler: how tokens are drawn from logits.
    """
    t0 = time.perf_counter()
    assert len(generators) == len(prompts) * group_size, "one generator per response"
    cache, logits, _ = prefill(model, prompts, max(map(len, prompts)) + sampling.max_new_tokens, group_size)
    batch = Batch(generators, eos_ids, sampling.max_new_tokens)
    stats = RoundStats()
    nxt, logp = sampler.token(logits, sampling.temperature, sampling.top_p, batch.uniforms()[:, 0])  # (B,)
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
        nxt, logp, _ = decode_one_token(model, cache, nxt, sampling, batch.uniforms()[:, 0], sampler=sampler)
        batch.commit([[t] for t in nxt.tolist()], [[x] for x in logp.tolist()])  # round r: round_of r
        batch.rounds += 1
        stats.policy_forwards += 1
    return batch.rollout(prompts, group_size, t0, stats)


class Autoregressive(RolloutEngine):
    """Rollouts without a drafter: `generate`, behind the same call as `speculative.Speculative`'s."""

    def generate(
        self,
        policy: Transformer,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        eos_ids: tuple[int, ...],
        generators: list[torch.Generator],
        group_size: int = 1,
        progress=None,
        sampler: Sampler = SAMPLER,
    ) -> Rollout:
        return generate(policy, prompts, sampling, eos_ids, generators, group_size, progress, sampler)
