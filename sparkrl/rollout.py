"""The rollout engine: batched generation of G responses for each of P prompts.

Autoregressive mode (the baseline every speculative mode is compared against):
  * each distinct prompt is prefilled once and its KV cache rows are copied to its G responses;
  * every step runs one token per *active* response; a response that samples an EOS id or reaches
    max_new_tokens leaves the batch (its cache rows are dropped), so the work shrinks as the batch
    finishes;
  * response i draws its randomness only from its own `torch.Generator`, so its tokens do not depend
    on which other responses share the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sparkrl.config import SamplingConfig
from sparkrl.model import Transformer
from sparkrl.sampling import sample


@dataclass
class Rollout:
    """Responses of one rollout, in prompt-major order (response r belongs to prompt r // G)."""

    prompt_ids: list[list[int]]  # (P,) distinct prompts
    group_size: int
    tokens: list[list[int]]  # (P*G,) generated ids, EOS included when it ended the response
    finish_reason: list[str]  # "stop" (EOS) or "length"
    gen_s: float = 0.0
    stats: dict = field(default_factory=dict)

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


def _prefill(model: Transformer, prompts: list[list[int]], capacity: int):
    """Run the prompts into a fresh cache; returns (cache, last-position logits (P, V))."""
    device = model.lm_head.weight.device
    P = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lens.max())
    toks = torch.zeros(P, T, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    cache = model.new_cache(P, capacity)
    out = model(toks, cache)
    cache.commit(n_keep=lens)
    last = out.hidden[torch.arange(P, device=device), lens - 1]  # (P, d)
    return cache, model.logits(last)


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    eos_ids: tuple[int, ...],
    generators: list[torch.Generator],
    group_size: int = 1,
    progress=None,
) -> Rollout:
    """Autoregressive sampling of `group_size` responses per prompt, all in one shrinking batch.

    generators: one per response (len(prompts) * group_size), e.g. from `response_generators`.
    progress: optional callable(n_new_tokens) for a progress bar.
    """
    t0 = time.perf_counter()
    G, P = group_size, len(prompts)
    N = P * G
    assert len(generators) == N, "one generator per response"
    device = model.lm_head.weight.device
    capacity = max(len(p) for p in prompts) + sampling.max_new_tokens
    cache, logits = _prefill(model, prompts, capacity)
    rows = torch.arange(P, device=device).repeat_interleave(G)
    cache.keep_rows(rows)
    logits = logits.index_select(0, rows)

    eos = torch.tensor(eos_ids or (-1,), device=device)
    tokens: list[list[int]] = [[] for _ in range(N)]
    reason = ["length"] * N
    active = list(range(N))  # response index of each batch row
    steps = 0
    while active:
        nxt = sample(logits, sampling.temperature, sampling.top_p, [generators[r] for r in active])  # (B,)
        done = torch.isin(nxt, eos)
        ids = nxt.tolist()  # host sync: tokens are appended to Python lists
        for r, t in zip(active, ids):
            tokens[r].append(t)
        steps += 1
        stop = done.tolist()  # host sync: which rows leave
        if steps >= sampling.max_new_tokens:
            stop = [True] * len(active)
        for r, s, is_eos in zip(active, stop, done.tolist()):
            if is_eos:
                reason[r] = "stop"
        if progress is not None:
            progress(len(active))
        if any(stop):
            keep = [i for i, s in enumerate(stop) if not s]
            active = [active[i] for i in keep]
            if not active:
                break
            keep_t = torch.tensor(keep, device=device)
            cache.keep_rows(keep_t)
            nxt = nxt.index_select(0, keep_t)
        out = model(nxt[:, None], cache)
        cache.commit(n_keep=torch.ones(len(active), dtype=torch.long, device=device))
        logits = model.logits(out.hidden[:, -1])
    r = Rollout([list(p) for p in prompts], G, tokens, reason)
    r.gen_s = time.perf_counter() - t0
    r.stats = {"decode_steps": steps}
    return r
