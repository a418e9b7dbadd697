"""The rollout engine's seams, declared: what it takes from a drafter (`DraftModel`), from the budget that sizes
each round (`RoundBudget`) and from the adapter that corrects proposals during a rollout (`DraftAdapter`), and
what an engine is to its callers (`RolloutEngine`).

The null objects (`speculative.NoAdaptation`, `budget.FixedBudget`, `autoregressive.Autoregressive`) and the real
ones (`spark.Spark`, `budget.Budget`, `speculative.Speculative`, the drafters of `sparkrl.drafters`, vLLM's
`vllm.engine.VllmGeneration`) declare the protocol they implement as a base class; tests/test_seams.py checks
that each provides every member.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from sparkrl.config import SamplingConfig, TreeShape
from sparkrl.engine.records import Acceptance, DraftState, DraftStep, Proposal, Rollout
from sparkrl.engine.sampling import Sampler
from sparkrl.model.kvcache import KVCache


@runtime_checkable
class DraftModel(Protocol):
    """A drafter as the engine runs it (see `drafters.base` for the meaning of each member)."""

    kind: str  # eagle3, dflash, self
    vocab_ids: torch.Tensor  # (Vd,) draft vocabulary -> policy token ids
    feature_layers: tuple[int, ...]  # the policy layers whose hidden states it reads
    root_logits: bool  # whether a round drafts from the logits at the root (trees, chains) or from its own forward

    def bind(self, policy) -> DraftModel:
        """Follow `policy` (its embedding and head); returns itself."""
        ...

    def features(self, taps: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """The policy's tapped hidden states -> the drafter's input feature (B, T, d)."""
        ...

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary at features h (..., d) -> (..., Vd)."""
        ...

    def new_cache(self, batch: int, capacity: int) -> KVCache: ...

    def prefill(self, prompts: torch.Tensor, lens: torch.Tensor, feats: torch.Tensor, cache: KVCache) -> None: ...

    def propose(
        self, cache: KVCache, state: DraftState, shape: TreeShape, nodes: int, temperature: float, u, correct
    ) -> Proposal:
        """A round's drafts after each response's root: a tree, a sampled chain or a block."""
        ...

    def __call__(self, tokens, feats, cache=None, *, tree_mask=None, depth=None, head: bool = True) -> DraftStep:
        """The drafter's forward over committed positions (its catch-up); head=False: without the logits."""
        ...


@runtime_checkable
class RoundBudget(Protocol):
    """What chooses each round's size, (nodes, depth) of its tree (`budget.AR`, (0, 0): an autoregressive step),
    and learns from the rounds it chose."""

    def choose(self, B: int) -> tuple[int, int]: ...

    def observe_round(self, size: tuple[int, int], B: int, seconds: float) -> None: ...

    def observe(self, size: tuple[int, int], tree, acc: Acceptance) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def figures(self, stats) -> dict:
        """A rollout's figures for metrics.jsonl ({}: none)."""
        ...


@runtime_checkable
class DraftAdapter(Protocol):
    """What corrects the drafter's logits during a rollout from the verifier's feedback (SPARK), or nothing."""

    needs_targets: bool  # whether `observe` reads the policy's logits at the drafted contexts

    def begin(self, n_prompts: int, group_size: int) -> None: ...

    def select(self, responses) -> None: ...

    def correct(self, z: torch.Tensor, h: torch.Tensor) -> torch.Tensor: ...

    def observe(self, proposal: Proposal, acc: Acceptance, logits_at) -> None: ...

    def end_round(self) -> None: ...

    def metrics(self) -> dict: ...


@runtime_checkable
class RolloutEngine(Protocol):
    """What generates a rollout: G responses to each prompt, from `policy` sampled with `sampler`."""

    def generate(
        self,
        policy,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        eos_ids: tuple[int, ...],
        generators: list[torch.Generator],
        group_size: int = 1,
        progress: Callable[[int], None] | None = None,
        sampler: Sampler | None = None,
    ) -> Rollout: ...
