"""The speculative rollout engine (paper section 3.1): rounds of propose -> verify -> adapt -> commit.

Each round, for every active response: the drafter proposes a tree (EAGLE3-style), a sampled chain,
or a greedy block (DFlash-style) (`drafter.propose`) -> the policy verifies all of them in ONE
batched forward with tree attention -> exact acceptance (`verify.accept_tree` / `accept_chain`) ->
the drafter adapter sees the verified round (SPARK's feedback; nothing by default) -> the accepted
path is committed in the policy's cache, the drafter's tree is rolled back, and the policy's
features at the accepted tokens feed the drafter (its "catch-up" forward, which also yields the
next round's first draft level). No extra policy forward is spent on features: they are taps of the
verification forward. A budget may choose an autoregressive round instead (`autoregressive.decode_one_token`);
the drafter then catches up on that backlog at the next drafted round, and its prefill of the prompts waits for a
rollout's first drafted round too, so a rollout whose rounds the budget all declines never runs the drafter.

The steps, as gpt-fast keeps prefill / decode_one_token / speculative_decode apart:
`Speculation.start` (prefills, first token), `autoregressive_round`, `speculative_round`; each round
returns a `records.Round` record that `RoundStats` sums.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from sparkrl.config import SamplingConfig, TreeShape
from sparkrl.engine.autoregressive import Batch, decode_one_token, generate, prefill
from sparkrl.engine.budget import AR, FixedBudget, Timings, round_work
from sparkrl.engine.records import HIT, MISS, UNDRAFTED, Acceptance, DraftState, Proposal, Round, RoundStats
from sparkrl.engine.sampling import SAMPLER, Sampler
from sparkrl.engine.seams import DraftAdapter, DraftModel, RolloutEngine, RoundBudget
from sparkrl.engine.verify import PathLogits, accept_chain, accept_tree
from sparkrl.model.kvcache import KVCache
from sparkrl.model.transformer import Transformer, pad_right

PATH_ROWS = 6  # LM-head rows of one acceptance-walk call (`verify.PathLogits`): on a CPU a bfloat16 head product
# of up to 6-8 rows costs about what one row costs


class NoAdaptation(DraftAdapter):
    """The drafter adapter when nothing adapts the drafter during the rollout (SPARK off): proposals
    use the drafter's own logits."""

    needs_targets = False

    def begin(self, n_prompts: int, group_size: int) -> None:
        pass

    def select(self, responses) -> None:
        pass

    def correct(self, z: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return z

    def observe(self, proposal: Proposal, acc: Acceptance, logits_at) -> None:
        pass

    def end_round(self) -> None:
        pass

    def metrics(self) -> dict:
        return {"spark_s": 0.0}


class Backlog:
    """Drafter inputs of autoregressive rounds (the sampled token, the policy's features at its
    predecessor) that the drafter has not run yet: it runs them all at the next drafted round.

    Finished responses leave by an index, not a copy: the rounds added since the last drop share one map
    from today's rows to theirs, composed at each drop and applied once at `pop`. (Selecting every stored
    round's rows at every drop copied the whole backlog each time: at 64 responses, 221 KB of bfloat16
    features per round held, at each of dozens of drops.)"""

    @dataclasses.dataclass
    class Group:
        """Rounds added between two drops: their tokens and features, and the map from today's rows to theirs
        (None: the same rows)."""

        tokens: list = dataclasses.field(default_factory=list)
        feats: list = dataclasses.field(default_factory=list)
        rows: torch.Tensor | None = None

        def rounds(self, parts: list) -> torch.Tensor:
            x = torch.cat(parts, 1)
            return x if self.rows is None else x.index_select(0, self.rows)

    def __init__(self):
        self.groups: list[Backlog.Group] = []

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, tokens: torch.Tensor, feats) -> None:
        if not self.groups or self.groups[-1].rows is not None:
            self.groups.append(Backlog.Group())
        self.groups[-1].tokens.append(tokens)
        self.groups[-1].feats.append(feats)

    def keep(self, rows: torch.Tensor) -> None:
        for g in self.groups:
            g.rows = rows if g.rows is None else g.rows.index_select(0, rows)

    def pop(self):
        tokens = torch.cat([g.rounds(g.tokens) for g in self.groups], 1)
        feats = None if self.groups[0].feats[0] is None else torch.cat([g.rounds(g.feats) for g in self.groups], 1)
        self.groups = []
        n = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=tokens.device)
        return tokens, feats, n


def catch_up(drafter, cache: KVCache, tokens: torch.Tensor, feats, n: torch.Tensor) -> DraftState:
    """Drafter forward over newly committed positions: tokens (B, T) are the tokens after each
    position, feats (B, T, d) the policy's features there, n (B,) how many are real (>= 1). The draft
    logits only at each row's last real position, the root the next round drafts from (a block
    drafter needs none)."""
    step = drafter(tokens, feats, cache, head=False)
    cache.commit(n_keep=n)
    last = (n - 1)[:, None, None]
    pick = lambda t: t.gather(1, last.expand(-1, 1, t.shape[-1]))[:, 0]
    h = pick(step.h)
    z = drafter.logits(h) if drafter.root_logits else None
    return DraftState(tokens.gather(1, (n - 1)[:, None])[:, 0], z, pick(step.a), h)


@dataclasses.dataclass
class Prefill:
    """The drafter's prefill of a rollout's prompts, waiting for its first drafted round: tokens (P, T) padded
    right, their lengths (P,), the policy's features there (None for a drafter that reads none), the prompt row of
    every active response (N,) and the cache's capacity."""

    tokens: torch.Tensor
    lens: torch.Tensor
    feats: torch.Tensor | None
    rows: torch.Tensor
    capacity: int


class Speculation:
    """One speculative rollout in progress: the policy's and the drafter's caches, the drafter's state
    at every active row's root, and the batch bookkeeping."""

    def __init__(
        self,
        policy: Transformer,
        drafter,
        sampling: SamplingConfig,
        shape: TreeShape,
        generators: list[torch.Generator],
        adapter,
        sampler: Sampler = SAMPLER,
    ):
        self.policy, self.drafter, self.sampling, self.shape = policy, drafter, sampling, shape
        self.generators, self.adapter, self.sampler = generators, adapter, sampler
        self.taps = tuple(drafter.feature_layers)
        self.chain = shape.mode == "chain"
        self.vocab = drafter.vocab_ids if adapter.needs_targets else None  # targets for the adapter
        self.backlog = Backlog()

    def start(self, prompts: list[list[int]], group_size: int, eos_ids: tuple[int, ...]) -> None:
        """Prefill the policy and the drafter once per prompt, sample every response's first token, run
        the drafter on it."""
        policy, drafter, G = self.policy, self.drafter, group_size
        capacity = max(map(len, prompts)) + self.sampling.max_new_tokens + self.shape.draft_region + 2
        self.pcache, logits, out = prefill(policy, prompts, capacity, G, self.taps)
        device = logits.device
        toks, lens = pad_right(prompts, device)
        feats = drafter.features(out.taps)
        rows = torch.arange(len(prompts), device=device).repeat_interleave(G)
        self.pending = Prefill(toks, lens, feats, rows, capacity)  # the drafter's, at its first drafted round
        self.batch = Batch(self.generators, eos_ids, self.sampling.max_new_tokens)
        root, logp = self.sampler.token(
            logits, self.sampling.temperature, self.sampling.top_p, self.batch.uniforms()[:, 0]
        )  # (N,)
        self.batch.commit([[t] for t in root.tolist()], [[x] for x in logp.tolist()])  # host sync
        last_feat = None if feats is None else feats[rows, lens[rows] - 1][:, None]  # (N, 1, d)
        self.backlog.add(root[:, None], last_feat)
        self.state = DraftState(root, None, None, None)  # the drafter's outputs at the root come with its catch-up
        self.adapter.begin(len(prompts), G)

    def catch_up(self) -> None:
        """The drafter runs what it has not run yet, in one forward each, before a drafted round: the prompts'
        prefill (at the rollout's first drafted round; one the budget never drafts never runs it), copied to their
        responses' rows, then the backlog of committed tokens (`Backlog`), which sets the state at every root."""
        if (p := self.pending) is not None:
            self.dcache = self.drafter.new_cache(len(p.lens), p.capacity)
            self.drafter.prefill(p.tokens, p.lens, p.feats, self.dcache)
            self.dcache.keep_rows(p.rows)
            self.pending = None
        if self.backlog:
            self.state = catch_up(self.drafter, self.dcache, *self.backlog.pop())

    def drop_finished(self) -> bool:
        """Remove finished responses from every per-row structure; False when none is left."""
        keep = self.batch.drop_finished()
        if keep is not None and self.batch.active:
            keep = keep.to(self.state.root.device)
            self.pcache.keep_rows(keep)
            if self.pending is not None:  # the prompt row of each response still active
                self.pending.rows = self.pending.rows.index_select(0, keep)
            else:
                self.dcache.keep_rows(keep)
            self.state.keep(keep)
            self.backlog.keep(keep)
        return bool(self.batch.active)

    def autoregressive_round(self) -> Round:
        """A plain sampling step; the drafter catches up on it at the next drafted round."""
        t0 = time.perf_counter()
        nxt, logp, out = decode_one_token(
            self.policy,
            self.pcache,
            self.state.root,
            self.sampling,
            self.batch.uniforms()[:, 0],
            self.taps,
            self.sampler,
        )
        self.batch.commit([[t] for t in nxt.tolist()], [[x] for x in logp.tolist()])  # host sync: tokens to lists
        self.backlog.add(nxt[:, None], self.drafter.features(out.taps))
        self.state.root = nxt
        return Round([1] * len(nxt), drafted=False, verify_s=time.perf_counter() - t0)

    def speculative_round(self, nodes: int, depth: int | None = None) -> tuple[Round, Proposal, Acceptance]:
        """Draft `nodes` nodes per active row (a tree at most `depth` deep, default the shape's), verify them
        in one policy forward, accept exactly, commit."""
        policy, drafter, shape = self.policy, self.drafter, self.shape
        t1 = time.perf_counter()
        self.catch_up()
        u = self._uniforms()
        self.adapter.select(self.batch.active)
        drafted = shape if depth in (None, shape.depth) else dataclasses.replace(shape, depth=depth)
        prop = drafter.propose(
            self.dcache,
            self.state,
            drafted,
            nodes,
            self.sampling.temperature,
            u[:, shape.depth + 1 :] if self.chain else None,
            self.adapter.correct,
        )
        tree = prop.tree
        B = tree.tokens.shape[0]
        self.dcache.commit(n_keep=torch.zeros(B, dtype=torch.long, device=tree.tokens.device))  # roll back
        t2 = time.perf_counter()
        ancestors = tree.ancestor_mask()
        out = policy(tree.tokens, self.pcache, tree_mask=ancestors, depth=tree.depth, taps=self.taps)
        t3 = time.perf_counter()
        acc = self._accept(prop, out, ancestors, u)
        n_acc = acc.n_accepted
        kept = torch.cat([torch.zeros_like(acc.path[:, :1]), acc.path.clamp(min=0)], 1)  # (B, 1+D) root + path
        self.pcache.commit(kept, n_acc + 1)
        new = tree.tokens.gather(1, kept)[:, 1:]  # (B, D) accepted tokens (then padding)
        new = torch.cat([new, new[:, :1]], 1).scatter(1, n_acc[:, None], acc.bonus[:, None])  # (B, 1+D) + bonus
        counts = self._commit(tree, acc, new)
        t_accept = time.perf_counter() - t3
        self.adapter.observe(prop, acc, lambda r, n: drafter.logits(out.hidden[r, n]))
        self.adapter.end_round()  # the feedback of this round serves the next round's proposals
        t4 = time.perf_counter()  # the adapter times itself (spark_s)
        feats = {i: t.gather(1, kept[..., None].expand(-1, -1, t.shape[-1])) for i, t in out.taps.items()}
        self.state = catch_up(drafter, self.dcache, new, drafter.features(feats), n_acc + 1)
        t5 = time.perf_counter()
        return Round(counts, True, (t2 - t1) + (t5 - t4), t3 - t2, t_accept, (nodes, drafted.depth)), prop, acc

    def _uniforms(self) -> torch.Tensor:
        """A drafted round's uniforms: for a chain (B, 2D + 1) from the generators, one per test, one for the
        residual, one per draft token; else (B, 1 + D), keyed by the positions the round may commit."""
        shape, dev = self.shape, self.state.root.device
        if self.chain:
            return torch.stack(
                [
                    torch.rand(2 * shape.depth + 1, generator=self.generators[r], dtype=torch.float64)
                    for r in self.batch.active
                ]
            ).to(dev)  # (B, 2D + 1)
        return self.batch.uniforms(shape.depth + 1, dev)  # (B, 1 + D)

    def _accept(self, prop: Proposal, out, ancestors: torch.Tensor, u: torch.Tensor) -> Acceptance:
        """Exact acceptance of the proposal against the verify forward `out` (ancestors: the tree's mask in it)."""
        policy, shape, sampling, tree = self.policy, self.shape, self.sampling, prop.tree
        if self.chain:  # every chain node's target is needed; q over the policy's vocabulary
            node_logits = policy.logits(out.hidden)  # (B, 1+D, V)
            q = torch.zeros(*prop.q.shape[:2], node_logits.shape[-1], device=node_logits.device)
            q.index_copy_(2, self.drafter.vocab_ids, prop.q)
            return accept_chain(
                tree.tokens[:, 1:],
                q,
                node_logits,
                sampling.temperature,
                sampling.top_p,
                u[:, : shape.depth + 1],
                self.vocab,
            )
        # the LM head runs on the nodes the acceptance walk visits, and the drafter's best below them
        return accept_tree(
            tree,
            PathLogits(policy.logits, out.hidden, tree, PATH_ROWS, ancestors),
            sampling.temperature,
            sampling.top_p,
            u,
            shape.depth,
            self.vocab,
            self.sampler,
        )

    def _commit(self, tree, acc: Acceptance, new: torch.Tensor) -> list[int]:
        """Each row's accepted tokens and bonus token (new (B, 1+D)) into the batch, tagged HIT (an
        accepted draft), MISS (the drafter proposed other tokens there) or UNDRAFTED."""
        missed = (tree.child_counts() > 0).gather(1, acc.last[:, None])[:, 0]
        counts = (acc.n_accepted + 1).tolist()  # host sync: tokens go to Python lists
        tags = [[HIT] * (c - 1) + [MISS if m else UNDRAFTED] for c, m in zip(counts, missed.tolist())]
        logp = acc.logp.tolist()  # (B, L) the committed tokens' log-probabilities, level by level
        self.batch.commit([r[:c] for r, c in zip(new.tolist(), counts)], [lp[:c] for lp, c in zip(logp, counts)], tags)
        return counts


@torch.no_grad()
def own_text(policy: Transformer, context: int, sampler: Sampler = SAMPLER, progress=None) -> list[int]:
    """`context` tokens the policy samples itself from token 0 (T 1, top-p 0.95, a fixed generator)."""
    own = generate(
        policy,
        [[0]],
        SamplingConfig(1.0, 0.95, context - 1),
        (),
        [torch.Generator().manual_seed(0)],
        progress=progress,
        sampler=sampler,
    )
    return [0] + own.tokens[0]


@torch.no_grad()
def time_rounds(
    policy: Transformer,
    drafter,
    shape: TreeShape,
    rows,
    sizes,
    context: int,
    repeats: int | dict,
    progress=lambda n: None,
    text: list[int] | None = None,
    sampler: Sampler = SAMPLER,
) -> Timings:
    """Whole engine rounds timed for the budget's cost model (`budget.CostModel.measure`): for each row
    count B in `rows`, one prefill of a `context`-token text the policy sampled itself (`own_text`, or `text`)
    copied to B rows, one untimed autoregressive round (the first round over a new row count pays one-off costs;
    later ones time as the rest, measured), then `repeats` (or `repeats[B]`) timed rounds of every size
    (nodes, depth) in `sizes` (`budget.AR`: an autoregressive round), sizes in turn, each as (seconds, drafts it
    accepted per row); after each autoregressive round the drafter catches up untimed, as a run of them would
    once at its end (timed, the tree round after it would pay for it); also what one more accepted level costs
    (LM head + the nucleus and a sample on B rows of the policy's hidden states in that text). Sampling at
    temperature 1, top-p 0.95; random numbers from fixed generators (the global RNG is left alone).
    progress(work) as the text is sampled and after every round and level, in `round_work` units
    (`timing_work` in all).

    The text is the policy's own, not random tokens: sampling's cost depends on how wide the nucleus
    is (top-p within 256 candidates, else 4096, else a full sort), and random tokens make the default
    model's nucleus thousands of tokens wide where its own text's is a few dozen."""
    dev = policy.lm_head.weight.device
    reps = {B: repeats[B] if isinstance(repeats, dict) else repeats for B in rows}
    text = text or own_text(policy, context, sampler, lambda n: progress(n * round_work(1, AR)))
    hidden = policy(torch.tensor([text], device=dev)).hidden[0]  # (context, d) the policy's states in its text
    room = (max(reps.values()) + 1) * len(sizes) * (shape.depth + 1) + 2  # a timed round commits at most depth + 1
    sampling = SamplingConfig(1.0, 0.95, room)
    out = Timings({size: [] for size in sizes}, [])
    for B in rows:
        gens = [torch.Generator().manual_seed(1000 + i) for i in range(B)]
        eng = Speculation(policy, drafter.bind(policy), sampling, shape, gens, NoAdaptation(), sampler)
        eng.start([text], B, ())  # one prefill, copied to the B rows (as a group's prompt is)
        timed = {size: [] for size in [AR] + list(sizes)}
        for size in [AR] + [s for _ in range(reps[B]) for s in sizes]:  # sizes interleaved, so a machine
            n, d = size  # that changes speed skews no size; the first round warms up
            t = time.perf_counter()
            if n == 0:
                eng.autoregressive_round()
                a = 0.0
            else:
                a = eng.speculative_round(n, d)[2].n_accepted.double().mean().item()  # host sync
            timed[size].append((time.perf_counter() - t, a))
            progress(round_work(B, size))
            if n == 0:  # the drafter's catch-up on the AR token, untimed: a run of AR rounds pays it once at
                eng.catch_up()  # its end, not per tree round (the first one also runs the drafter's prefill)
        for size in sizes:
            out.rounds[size].append(timed[size][1:] if size == AR else timed[size])  # AR's first warmed up
        h = hidden[torch.arange(context - B, context) % context]  # (B, d) the text's last B positions
        out.level.append(_time_level(policy, h, sampling, sampler, reps[B], progress))
    return out


def _time_level(
    policy: Transformer, h: torch.Tensor, sampling: SamplingConfig, sampler: Sampler, repeats: int, progress
) -> float:
    """What one more accepted level costs on B rows (`time_rounds`): the LM head on the policy's states h (B, d),
    the nucleus and a sample, timed `repeats` + 1 times (the first warms up); the fastest, in seconds."""
    B = h.shape[0]
    level, u = [], torch.rand(B, generator=torch.Generator().manual_seed(B), dtype=torch.float64)
    for _ in range(repeats + 1):
        t = time.perf_counter()
        sampler.nucleus(policy.logits(h), sampling.temperature, sampling.top_p, u)
        level.append(time.perf_counter() - t)
        progress(round_work(B, AR))
    return min(level[1:])


@torch.no_grad()
def generate_speculative(
    policy: Transformer,
    drafter,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    eos_ids: tuple[int, ...],
    generators: list[torch.Generator],
    shape: TreeShape,
    group_size: int = 1,
    progress=None,
    budget=None,
    spark=None,
    sampler: Sampler = SAMPLER,
):
    """Exact speculative sampling; same contract and outputs as `autoregressive.generate`.

    shape: what the drafter proposes each round. budget: what chooses each round's tree size (nodes, depth), or
    an autoregressive step, from the number of active responses (`budget.Budget`; by default `FixedBudget`, the
    full shape every round). spark: the drafter adapter (`spark.Spark`, correcting the proposals from earlier
    rounds' feedback, its A gradient left for the caller; by default `NoAdaptation`).
    The committed tokens follow the policy's sampling distribution exactly, whatever the drafter
    proposes and whatever the budget chooses. With point-mass proposals (trees, blocks) they are the
    tokens `autoregressive.generate` gives with the same generators, up to float noise in the logits: the
    drafter, SPARK and the budget change how fast a rollout is made, not what it is. Sampled chains
    draw per-round uniforms from the generators, so their realisation depends on the proposals.
    """
    t0 = time.perf_counter()
    assert len(generators) == len(prompts) * group_size, "one generator per response"
    budget = budget or FixedBudget(shape)
    eng = Speculation(policy, drafter.bind(policy), sampling, shape, generators, spark or NoAdaptation(), sampler)
    eng.start(prompts, group_size, eos_ids)
    stats = RoundStats(depth=shape.depth)
    while eng.drop_finished():
        B = len(eng.batch.active)
        size = budget.choose(B)
        t = time.perf_counter()
        if size[0] == 0:
            r = eng.autoregressive_round()
        else:
            r, prop, acc = eng.speculative_round(*size)
        budget.observe_round(size, B, time.perf_counter() - t)
        if size[0]:
            budget.observe(size, prop.tree, acc)
        eng.batch.rounds += 1
        stats.add(r)
        if progress is not None:
            progress(sum(r.counts))
    stats.adapter = eng.adapter.metrics()
    return eng.batch.rollout(prompts, group_size, t0, stats)


@dataclasses.dataclass
class Speculative(RolloutEngine):
    """Speculative rollouts with a drafter (`generate_speculative`): the drafter, the shape it proposes, the
    budget choosing each round's size (`budget.Budget`, or `FixedBudget`: the full shape) and the adapter
    correcting its proposals (`spark.Spark`, or `NoAdaptation`)."""

    drafter: DraftModel
    shape: TreeShape
    budget: RoundBudget
    adapter: DraftAdapter

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
    ):
        return generate_speculative(
            policy,
            self.drafter,
            prompts,
            sampling,
            eos_ids,
            generators,
            self.shape,
            group_size,
            progress,
            self.budget,
            self.adapter,
            sampler,
        )
