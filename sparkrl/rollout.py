"""The rollout engine: batched generation of G responses for each of P prompts.

Both modes share the bookkeeping:
  * each distinct prompt is prefilled once and its KV cache rows are copied to its G responses;
  * a response that commits an EOS id or reaches max_new_tokens leaves the batch (its cache rows are
    dropped), so the work shrinks as the batch finishes;
  * response i draws its randomness only from its own `torch.Generator`, a fixed amount per step, so
    its tokens do not depend on which other responses share the batch.

Autoregressive mode (`generate`): one policy forward per token.

Speculative mode (`generate_speculative`, paper section 3.1): rounds of
  draft a tree (EAGLE3-style), a sampled chain, or a greedy block (DFlash-style) per active response
  (`drafters.propose`) -> verify all of them in ONE batched policy forward with tree attention ->
  exact acceptance (`verify.accept_tree`) -> commit the accepted path in the
  policy's cache, roll the drafter's tree back -> feed the policy's features at the accepted tokens
  to the drafter (its "catch-up" forward, which also yields the next round's first draft level).
No extra policy forward is spent on features: they are taps of the verification forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sparkrl.config import SamplingConfig
from sparkrl.model import KVCache, Transformer
from sparkrl.sampling import sample
from sparkrl.verify import accept_chain, accept_tree, uniforms_per_round


@dataclass
class Rollout:
    """Responses of one rollout, in prompt-major order (response r belongs to prompt r // G)."""

    prompt_ids: list[list[int]]  # (P,) distinct prompts
    group_size: int
    tokens: list[list[int]]  # (P*G,) generated ids, EOS included when it ended the response
    finish_reason: list[str]  # "stop" (EOS) or "length"
    gen_s: float = 0.0
    stats: dict = field(default_factory=dict)
    outcome: list[list[int]] = field(default_factory=list)  # per token: HIT, MISS or UNDRAFTED (speculative)
    round_of: list[list[int]] = field(default_factory=list)  # per token: the round that committed it

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def prompt_of(self, r: int) -> list[int]:
        return self.prompt_ids[r // self.group_size]


HIT, MISS, UNDRAFTED = 1, 0, -1
"""Per-token drafting outcome: an accepted draft; the target's token where the drafter proposed other
tokens (a miss, paper section 2); no proposal at that position (autoregressive step, first token, or
the token after a fully accepted branch)."""


def response_generators(seed: int, n_prompts: int, group_size: int, offset: int = 0) -> list[torch.Generator]:
    """One generator per response; response j of prompt i gets a seed derived from (seed, offset + i, j)."""
    gens = []
    for i in range(n_prompts):
        for j in range(group_size):
            g = torch.Generator()
            g.manual_seed(hash((seed, offset + i, j)) & 0x7FFF_FFFF_FFFF_FFFF)
            gens.append(g)
    return gens


class _Batch:
    """Which responses are still running, what each has committed, and why each stopped."""

    def __init__(self, n: int, eos_ids: tuple[int, ...], max_new_tokens: int):
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.outcome: list[list[int]] = [[] for _ in range(n)]
        self.round_of: list[list[int]] = [[] for _ in range(n)]
        self.reason = ["length"] * n
        self.active = list(range(n))  # response index of each batch row
        self.eos, self.max_new = set(eos_ids), max_new_tokens

    def commit(self, new: list[list[int]], outcome: list[list[int]] | None = None, round_: int = 0) -> list[bool]:
        """Append each active row's new tokens (cut after an EOS or at the length limit), with their
        drafting outcomes (default UNDRAFTED) and round.

        Returns, per row, whether the response has finished."""
        done = []
        for i, (r, toks) in enumerate(zip(self.active, new)):
            out = self.tokens[r]
            for j, t in enumerate(toks):
                if len(out) >= self.max_new:
                    break
                out.append(t)
                self.outcome[r].append(outcome[i][j] if outcome else UNDRAFTED)
                self.round_of[r].append(round_)
                if t in self.eos:
                    self.reason[r] = "stop"
                    break
            done.append(self.reason[r] == "stop" or len(out) >= self.max_new)
        return done

    def drop(self, done: list[bool]) -> torch.Tensor | None:
        """Remove finished rows; returns the kept row indices (None when every row stays)."""
        if not any(done):
            return None
        keep = [i for i, d in enumerate(done) if not d]
        self.active = [self.active[i] for i in keep]
        return torch.tensor(keep, dtype=torch.long)


def _pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(p) for p in prompts], device=device)
    toks = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return toks, lens


def _prefill(model: Transformer, prompts: list[list[int]], capacity: int, taps: tuple[int, ...] = ()):
    """Run the prompts into a fresh cache; returns (cache, last-position logits (P, V), output)."""
    toks, lens = _pad(prompts, model.lm_head.weight.device)
    cache = model.new_cache(len(prompts), capacity)
    out = model(toks, cache, taps=taps)
    cache.commit(n_keep=lens)
    last = out.hidden[torch.arange(len(prompts), device=toks.device), lens - 1]  # (P, d)
    return cache, model.logits(last), out


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
    assert len(generators) == P * G, "one generator per response"
    device = model.lm_head.weight.device
    cache, logits, _ = _prefill(model, prompts, max(len(p) for p in prompts) + sampling.max_new_tokens)
    rows = torch.arange(P, device=device).repeat_interleave(G)
    cache.keep_rows(rows)
    logits = logits.index_select(0, rows)
    batch = _Batch(P * G, eos_ids, sampling.max_new_tokens)
    steps = 0
    while batch.active:
        nxt = sample(logits, sampling.temperature, sampling.top_p, [generators[r] for r in batch.active])  # (B,)
        done = batch.commit([[t] for t in nxt.tolist()])  # host sync: tokens go to Python lists
        steps += 1
        if progress is not None:
            progress(len(done))
        keep = batch.drop(done)
        if not batch.active:
            break
        if keep is not None:
            keep = keep.to(device)
            cache.keep_rows(keep)
            nxt = nxt.index_select(0, keep)
        out = model(nxt[:, None], cache)
        cache.commit(n_keep=torch.ones(len(batch.active), dtype=torch.long, device=device))
        logits = model.logits(out.hidden[:, -1])
    return Rollout([list(p) for p in prompts], G, batch.tokens, batch.reason, time.perf_counter() - t0,
                   {"decode_steps": steps, "policy_forwards": steps})


@dataclass
class _DraftState:
    """Per active row: the root (last committed token, not yet run by the policy) and the drafter's
    output at the root's position (logits of the first draft level, feature of its nodes)."""

    root: torch.Tensor  # (B,)
    z: torch.Tensor | None  # (B, Vd) (None for a block drafter, which drafts from the root in one forward)
    a: torch.Tensor  # (B, d)
    h: torch.Tensor  # (B, d) the head feature behind z (SPARK corrects z with it)

    def keep(self, rows: torch.Tensor) -> None:
        self.root, self.a, self.h = self.root[rows], self.a[rows], self.h[rows]
        self.z = None if self.z is None else self.z[rows]


def _catch_up(drafter, cache: KVCache, tokens: torch.Tensor, feats, n: torch.Tensor) -> _DraftState:
    """Drafter forward over newly committed positions: tokens (B, T) are the tokens after each
    position, feats (B, T, d) the policy's features there, n (B,) how many are real (>= 1)."""
    step = drafter(tokens, feats, cache)
    cache.commit(n_keep=n)
    last = (n - 1)[:, None, None]
    pick = lambda t: t.gather(1, last.expand(-1, 1, t.shape[-1]))[:, 0]
    z = None if step.z is None else pick(step.z)  # a block drafter computes no logits on its context
    return _DraftState(tokens.gather(1, (n - 1)[:, None])[:, 0], z, pick(step.a), pick(step.h))


class _Backlog:
    """Drafter inputs of autoregressive rounds (the sampled token, the policy's features at its
    predecessor) that the drafter has not run yet: it runs them all at the next tree round."""

    def __init__(self):
        self.tokens, self.feats = [], []

    def add(self, tokens: torch.Tensor, feats) -> None:
        self.tokens.append(tokens)
        self.feats.append(feats)

    def keep(self, rows: torch.Tensor) -> None:
        self.tokens = [t[rows] for t in self.tokens]
        self.feats = [None if f is None else f[rows] for f in self.feats]

    def pop(self):
        tokens = torch.cat(self.tokens, 1)
        feats = None if self.feats[0] is None else torch.cat(self.feats, 1)
        self.tokens, self.feats = [], []
        n = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=tokens.device)
        return tokens, feats, n


def _gather_feats(drafter, taps: dict, idx: torch.Tensor):
    """Fused drafter features at node indices idx (B, K) of a policy forward's taps."""
    sel = {i: t.gather(1, idx[..., None].expand(-1, -1, t.shape[-1])) for i, t in taps.items()}
    return drafter.features(sel)


@torch.no_grad()
def generate_speculative(
    policy: Transformer,
    drafter,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    eos_ids: tuple[int, ...],
    generators: list[torch.Generator],
    shape,
    group_size: int = 1,
    progress=None,
    budget=None,
    spark=None,
) -> Rollout:
    """Exact speculative sampling with draft trees; same contract and outputs as `generate`.

    shape: `drafters.tree.TreeShape`. budget: optional `budget.Budget` choosing each round's tree
    size, or an autoregressive step, from the number of active responses. spark: optional
    `spark.Spark` correcting the proposals from the feedback of earlier rounds (its `begin` is
    called here; the A gradient it accumulates is left for the caller).
    The committed tokens follow the policy's sampling distribution exactly, whatever the drafter
    proposes and whatever the budget chooses (which round is speculative may then depend on the
    batch, so with a budget a response's exact realisation can depend on its batch; its
    distribution does not).
    """
    from sparkrl.drafters import propose
    from sparkrl.spark import chain_feedback, tree_feedback

    t0 = time.perf_counter()
    G, P = group_size, len(prompts)
    N = P * G
    assert len(generators) == N, "one generator per response"
    device = policy.lm_head.weight.device
    drafter.bind(policy)
    taps = tuple(drafter.feature_layers)
    spec = max(shape.nodes, shape.depth * shape.branch)  # speculative region of either cache
    capacity = max(len(p) for p in prompts) + sampling.max_new_tokens + spec + 2
    pcache, logits, out = _prefill(policy, prompts, capacity, taps)
    toks, lens = _pad(prompts, device)
    dcache = drafter.new_cache(P, capacity)
    feats = drafter.features(out.taps)
    drafter.prefill(toks, lens, feats, dcache)
    rows = torch.arange(P, device=device).repeat_interleave(G)
    pcache.keep_rows(rows)
    dcache.keep_rows(rows)
    logits = logits.index_select(0, rows)
    root = sample(logits, sampling.temperature, sampling.top_p, generators)  # (N,)
    batch = _Batch(N, eos_ids, sampling.max_new_tokens)
    done = batch.commit([[t] for t in root.tolist()])  # host sync
    if spark is not None:
        spark.begin(P, G)
    last_feat = None
    if feats is not None:
        last_feat = feats[torch.arange(P, device=device), lens - 1].index_select(0, rows)[:, None]  # (N, 1, d)
    state = _catch_up(drafter, dcache, root[:, None], last_feat, torch.ones(N, dtype=torch.long, device=device))
    stats = {"rounds": 0, "row_rounds": 0, "committed": 0, "policy_forwards": 1, "draft_s": 0.0, "verify_s": 0.0,
             "accept_s": 0.0, "accepted_at_depth": [0] * shape.depth, "tree_rounds": 0, "tree_row_rounds": 0,
             "spark_s": 0.0, "tree_rounds_aal": []}
    chain = shape.mode == "chain"
    M = 2 * shape.depth + 1 if chain else uniforms_per_round(shape.depth, shape.max_children)
    backlog = _Backlog()
    while True:
        keep = batch.drop(done)
        if not batch.active:
            break
        if keep is not None:
            keep = keep.to(device)
            pcache.keep_rows(keep)
            dcache.keep_rows(keep)
            state.keep(keep)
            backlog.keep(keep)
        B = len(batch.active)
        t1 = time.perf_counter()
        nodes = shape.nodes if budget is None else budget.choose(B)
        if nodes == 0:  # an autoregressive step; the drafter catches up later, in one forward
            out = policy(state.root[:, None], pcache, taps=taps)
            pcache.commit(n_keep=torch.ones(B, dtype=torch.long, device=device))
            nxt = sample(policy.logits(out.hidden[:, -1]), sampling.temperature, sampling.top_p,
                         [generators[r] for r in batch.active])
            done = batch.commit([[t] for t in nxt.tolist()], None, stats["rounds"])  # host sync: tokens to lists
            backlog.add(nxt[:, None], drafter.features(out.taps))
            state.root = nxt
            stats["verify_s"] += time.perf_counter() - t1
            stats["rounds"] += 1
            stats["row_rounds"] += B
            stats["policy_forwards"] += 1
            stats["committed"] += B
            if progress is not None:
                progress(B)
            continue
        if backlog.tokens:
            state = _catch_up(drafter, dcache, *backlog.pop())
        u = torch.stack([torch.rand(M, generator=generators[r], dtype=torch.float64) for r in batch.active]).to(device)
        if spark is not None:
            ts = time.perf_counter()
            spark.select(torch.tensor(batch.active, device=device))
            stats["spark_s"] += time.perf_counter() - ts
        tree, q, ctx = propose(drafter, dcache, state, shape, nodes, sampling.temperature, u[:, shape.depth + 1:],
                               spark)
        dcache.commit(n_keep=torch.zeros(B, dtype=torch.long, device=device))  # roll the draft back
        t2 = time.perf_counter()
        out = policy(tree.tokens, pcache, tree_mask=tree.ancestor_mask(), depth=tree.depth, taps=taps)
        t3 = time.perf_counter()
        if chain:
            node_logits = policy.logits(out.hidden)  # (B, 1+D, V): every chain node is needed
            q_full = torch.zeros(*q.shape[:2], node_logits.shape[-1], device=device).index_copy_(
                2, drafter.vocab_ids, q)  # (B, D, V): q over the policy's vocabulary
            seen = None if spark is None else (lambda p: levels.append(p[..., drafter.vocab_ids].float()))
            levels = []  # SPARK: the target at every chain position, on the draft vocabulary
            acc = accept_chain(tree.tokens[:, 1:], q_full, node_logits, sampling.temperature, sampling.top_p,
                               u[:, :shape.depth + 1], seen)
        else:  # the LM head runs only on the nodes the acceptance walk visits
            rows_b = torch.arange(B, device=device)
            levels = []  # SPARK: (current node, target on the draft vocabulary) per level of the walk
            seen = None if spark is None else (lambda cur, p: levels.append((cur, p[:, drafter.vocab_ids].float())))
            acc = accept_tree(tree, lambda nodes: policy.logits(out.hidden[rows_b, nodes]), sampling.temperature,
                              sampling.top_p, u, shape.depth, shape.max_children, seen)
        n_acc = acc.n_accepted
        kept = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), acc.path.clamp(min=0)], 1)  # (B, 1+D)
        pcache.commit(kept, n_acc + 1)
        new = tree.tokens.gather(1, kept)[:, 1:]  # (B, D) accepted tokens (then padding)
        new = torch.cat([new, new[:, :1]], 1).scatter(1, n_acc[:, None], acc.bonus[:, None])  # (B, 1+D) + bonus
        counts = (n_acc + 1).tolist()  # host sync: tokens go to Python lists
        rows_new = new.tolist()
        missed = (n_acc < shape.depth) if chain else (tree.child_counts() > 0).gather(1, acc.last[:, None])[:, 0]
        tags = [[HIT] * (c - 1) + [MISS if m else UNDRAFTED] for c, m in zip(counts, missed.tolist())]
        done = batch.commit([r[:c] for r, c in zip(rows_new, counts)], tags, stats["rounds"])
        t4 = time.perf_counter()
        if spark is not None:  # feedback of this round, for the next round's proposals
            if chain:
                chain_feedback(spark, acc, ctx, levels[0])
            elif shape.mode == "block":  # the accepted prefix and the first rejected position
                chain_feedback(spark, acc, ctx, torch.stack([p for _, p in levels], 1))
            else:  # rejected children: the target from the verification forward's hidden states there
                target = lambda rows, nodes: spark.target(drafter.logits(out.hidden[rows, nodes]))
                tree_feedback(spark, tree, acc, ctx, levels, target, shape.max_children)
            spark.end_round()
            stats["spark_s"] += time.perf_counter() - t4
            t4 = time.perf_counter()
        state = _catch_up(drafter, dcache, new, _gather_feats(drafter, out.taps, kept), n_acc + 1)
        t5 = time.perf_counter()
        stats["rounds"] += 1
        stats["row_rounds"] += B
        stats["policy_forwards"] += 1
        stats["committed"] += sum(counts)
        stats["tree_rounds"] += 1
        stats["tree_row_rounds"] += B
        stats["tree_rounds_aal"].append((B, sum(counts) / B))  # (active responses, AAL) per round, paper Fig. 5
        for d in range(shape.depth):
            stats["accepted_at_depth"][d] += sum(c > d + 1 for c in counts)
        if budget is not None:
            rank = tree.rank if tree.rank is not None else torch.arange(tree.size, device=device).expand(B, -1)
            path_rank = torch.where(acc.path >= 0, rank.gather(1, acc.path.clamp(min=0)), tree.size + 1)
            budget.observe(nodes, path_rank)
        stats["draft_s"] += (t2 - t1) + (t5 - t4)
        stats["verify_s"] += t3 - t2
        stats["accept_s"] += t4 - t3
        if progress is not None:
            progress(sum(counts))
    stats["aal"] = stats["committed"] / max(stats["row_rounds"], 1)
    if spark is not None:  # SPARK's time: its corrections inside drafting, plus select and feedback here
        stats.update(spark.stats, spark_rows=len(spark.store))
        stats["spark_s"] += stats.pop("spark_correct_s")
    return Rollout([list(p) for p in prompts], G, batch.tokens, batch.reason, time.perf_counter() - t0, stats,
                   batch.outcome, batch.round_of)
