"""The GRPO loop: rollout -> rewards -> advantages -> policy step, with metrics and checkpoints.

One step samples G responses for each of P prompts, scores them, and makes one policy update (the
rollout policy is the current policy, so pi_old = pi detached and the clipped ratio is 1 at the
start of the update; clipping matters once more updates per rollout are added).

Under torchrun the step is data-parallel: each rank rolls out whole prompt groups of the step's batch
(`distributed.World.shard`), and the ranks sum their gradients, each already divided by the whole
batch's token count, so every rank makes the update one process would make on the whole batch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sparkrl import __version__
from sparkrl.train.assemble import make_drafting
from sparkrl.train.checkpoint import (checkpoints_at, list_checkpoints, load_checkpoint, load_latest, remove_stale,
                                save_checkpoint, set_rng_state)
from sparkrl.config import RunConfig, to_dict
from sparkrl.train.data import build_prompts, load_problems
from sparkrl.train.distributed import SINGLE, World
from sparkrl.train.draft_train import DraftTrainer, row_generators
from sparkrl.errors import UserError, enough_space, writable_dir
from sparkrl.model.export import export_model
from sparkrl.train.grpo import grpo_loss, group_advantages, mismatch
from sparkrl.cpu.accelerate import accelerate
from sparkrl.cpu.tuning import float32_attention
from sparkrl.machine import RateWatch, set_threads
from sparkrl.model.transformer import Transformer, pad_right
from sparkrl.train.precision import rollout_copy, rollout_dtype
from sparkrl.train.rewards import Grader
from sparkrl.engine.rollout import response_generators
from sparkrl.engine.records import Rollout, RoundStats
from sparkrl.train.sharding import sharding
from sparkrl.model.weights import load_model, resolve_model_path

# Settings that may change between a run and its resumption (they do not change the maths).
# A checkpoint holds whole tensors whatever --shard-policy wrote it.
_RESUMABLE = {"steps", "resume", "checkpoint_every", "keep_checkpoints", "threads", "out", "shard_policy"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def prepare_out_dir(cfg: RunConfig) -> dict:
    """Refuse to mix runs: an out dir with checkpoints needs --resume and the same settings. Returns
    what the resumed run resolved at its start ({} for a new run): e.g. the measured rollout dtype."""
    out = writable_dir(cfg.out)
    for p in remove_stale(out):
        print(f"sparkrl: removed {p}, left by an interrupted checkpoint write", file=sys.stderr)
    if any((out / "checkpoints").glob("step-*.pt")):
        raise UserError(f"{out}/checkpoints holds step-N.pt files of an older sparkrl, which this one does not read; "
                        "continue that run with the sparkrl that wrote it, or choose a new --out")
    has_ckpt = bool(list_checkpoints(out))
    if has_ckpt and not cfg.resume:
        raise UserError(f"{out} already holds checkpoints of a run; pass --resume to continue it, or choose a new --out")
    saved = out / "config.json"
    resolved = {}
    if cfg.resume and has_ckpt and saved.exists():
        before = json.loads(saved.read_text())
        resolved = before.get("resolved", {})
        old = _flat(before["config"])
        new = _flat(to_dict(cfg))
        diff = [k for k in new if k.split(".")[-1] not in _RESUMABLE and old.get(k) != new[k]]
        if diff:
            k = diff[0]
            raise UserError(f"--resume with different settings than the run in {out}: {k} was {old.get(k)!r}, "
                            f"now {new[k]!r} ({len(diff)} differ); use the run's settings or a new --out")
    out.mkdir(parents=True, exist_ok=True)
    write_run_config(cfg, resolved)
    return resolved


def write_run_config(cfg: RunConfig, resolved: dict) -> None:
    """DIR/config.json: the settings, what was resolved from them at the start (`resolved`), versions."""
    (Path(cfg.out) / "config.json").write_text(json.dumps({"config": to_dict(cfg), "resolved": resolved,
                                                           "sparkrl": __version__, "torch": torch.__version__}, indent=2))


class DataOrder:
    """Prompt indices of each step: an epoch-wise seeded permutation, derived from (seed, step)."""

    def __init__(self, n: int, per_step: int, seed: int):
        self.n, self.per_step, self.seed = n, per_step, seed

    def batch(self, step: int) -> list[int]:
        out = []
        for pos in range(step * self.per_step, (step + 1) * self.per_step):
            epoch, i = divmod(pos, self.n)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            out.append(int(torch.randperm(self.n, generator=g)[i]))
        return out


@contextmanager
def deferred_sigint():
    """Hold Ctrl-C while the policy changes, so a checkpoint never sees half an update. A process
    started with SIGINT ignored (a shell's background job) keeps ignoring it here too."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    pending = []
    old = signal.signal(signal.SIGINT, lambda *a: pending.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if pending:
            raise KeyboardInterrupt


def response_batch(rollout: Rollout, rows: list[int], device) -> tuple[torch.Tensor, ...]:
    """Responses `rows` of a rollout as one right-padded forward: tokens (b, L) prompt + response;
    pos (b, R+1) the positions whose hidden states predict the R response tokens, plus one (the
    drafter's last target); mask (b, R+1) which of them are real; targets (b, R) the response tokens."""
    toks, _ = pad_right([rollout.prompt_of(r) + rollout.tokens[r] for r in rows])
    L = toks.shape[1]
    R = max(len(rollout.tokens[r]) for r in rows)
    start = torch.tensor([len(rollout.prompt_of(r)) - 1 for r in rows])  # predicts the first response token
    pos = (start[:, None] + torch.arange(R + 1)).clamp(max=L - 1)  # (b, R+1)
    mask = torch.arange(R + 1)[None, :] < torch.tensor([len(rollout.tokens[r]) for r in rows])[:, None]
    targets = toks.gather(1, (pos[:, :R] + 1).clamp(max=L - 1))
    return toks.to(device), pos.to(device), mask.to(device), targets.to(device)


def at_positions(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """t (b, L, d) at positions pos (b, K) -> (b, K, d)."""
    return t.gather(1, pos[..., None].expand(-1, -1, t.shape[-1]))


def policy_update(policy: Transformer, ref: Transformer | None, opt, rollout: Rollout, adv: torch.Tensor,
                  cfg: RunConfig, draft_trainer: DraftTrainer | None = None, total: int | None = None,
                  draft_generators: list[torch.Generator] | None = None) -> dict:
    """Gradients of one GRPO update on a rollout, accumulated over micro-batches; `apply_update`
    then steps the optimizer (the policy does not change here).

    With a draft trainer, each micro-batch's policy features (taps of this same forward, taken
    before the policy changes) also feed the drafter's online loss: no extra policy forward.

    total: the response tokens of the whole step's batch, the divisor of the token-level mean (default:
    this rollout's; a data-parallel rank passes the sum over all ranks, so its gradient and figures
    are its share of the whole batch's). draft_generators: one per response, for the drafter loss's
    randomness (`draft_train.row_generators`).
    """
    g = cfg.grpo
    device = policy.lm_head.weight.device
    rows = [r for r in range(len(rollout.tokens)) if rollout.tokens[r]]
    total = sum(len(rollout.tokens[r]) for r in rows) if total is None else total
    opt.zero_grad(set_to_none=True)
    kl = clipped = 0.0
    loss_sum = 0.0
    gap = {"abs_sum": 0.0, "abs_max": 0.0, "kl_sum": 0.0}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=g.train_dtype == "bfloat16")
    for i in range(0, len(rows), g.micro_batch):
        mb = rows[i:i + g.micro_batch]
        toks, pos, mask, targets = response_batch(rollout, mb, device)
        R = targets.shape[1]
        rollout_logp = torch.tensor([rollout.logp[r] + [0.0] * (R - len(rollout.logp[r])) for r in mb])  # (b, R)
        rollout_logp = rollout_logp.to(device)
        taps = tuple(draft_trainer.drafter.feature_layers) if draft_trainer else ()

        def forward(model, taps=()):
            with autocast:
                out = model(toks, taps=taps)
            h = at_positions(out.hidden, pos)  # (b, R+1, d)
            if not taps:
                return model.token_logprobs(h[:, :R], targets, cfg.sampling.temperature)[0], h, None, {}
            # the drafter's loss reads the policy's logits at all R+1 positions (the last one's target is a dummy)
            logp, logits = model.token_logprobs(h, F.pad(targets, (0, 1)), cfg.sampling.temperature, keep_logits=True)
            return logp[:, :R], h, logits, {i: at_positions(t, pos) for i, t in out.taps.items()}

        ref_logp = None
        if ref is not None:
            with torch.no_grad():
                ref_logp = forward(ref)[0]
        logp, h, logits, tapped = forward(policy, taps)
        mask_r = mask[:, :R]
        if draft_trainer is not None:
            draft_trainer.observe(toks.gather(1, pos), tapped, h, logits, mask, float(mask_r.sum()) / total,
                                  [draft_generators[r] for r in mb] if draft_generators else None)
        parts = grpo_loss(logp, logp.detach(), ref_logp, adv[mb].to(device), mask_r, g.clip_eps, g.kl_beta, total,
                          rollout_logp, g.tis_cap)
        parts.loss.backward()
        loss_sum += parts.loss.item()
        kl += parts.kl_sum
        clipped += parts.clipped
        m = mismatch(logp, rollout_logp, mask_r)
        gap = {"abs_sum": gap["abs_sum"] + m["abs_sum"], "abs_max": max(gap["abs_max"], m["abs_max"]),
               "kl_sum": gap["kl_sum"] + m["kl_sum"]}
    n = max(total, 1)
    return {"loss": loss_sum, "kl": kl / n, "clip_frac": clipped / n, "rollout_logp_abs_mean": gap["abs_sum"] / n,
            "rollout_logp_abs_max": gap["abs_max"], "rollout_kl": gap["kl_sum"] / n}


def apply_update(policy: Transformer, opt, max_grad_norm: float) -> dict:
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"grad_norm": float(grad_norm)}


def settled(world: World, resolved: dict, decisions: dict) -> dict:
    """Each named choice of a run (its rollout dtype and kernels): the one the run recorded (a resumed run
    keeps what its start measured, whatever this machine would), else rank 0's `decisions[name]()`; every
    rank gets rank 0's."""
    got = {name: resolved.get(name) for name in decisions}
    if world.is_main:
        got = {name: decide() if got[name] is None else got[name] for name, decide in decisions.items()}
    return dict(zip(got, world.broadcast(tuple(got.values()))))


class GRPORun:
    """One GRPO run's state (policy, reference, optimizers, drafter, SPARK, data order); `step`
    makes one policy update. `train` drives it; `sparkrl bench` interleaves several.

    world: the data-parallel ranks (`distributed.World`); each rolls out its share of every step's
    prompts and all make the same update. Rank 0 alone writes the out dir. `shards` (`sharding`):
    how the policy and the reference live on the ranks (whole on each, or FSDP2 shards)."""

    def __init__(self, cfg: RunConfig, grader: Grader | None = None, world: World = SINGLE):
        self.shards = shards = sharding(cfg.grpo.shard_policy, world)
        if world.size > 1:
            check_data_parallel(cfg)
        resolved = world.broadcast(prepare_out_dir(cfg) if world.is_main else None)
        resolve_model_path(cfg.model.model)  # a bad model path fails here, before data work
        self.cfg, self.world = cfg, world
        problems = load_problems(cfg.data.data, cfg.data.default_size, cfg.seed)
        set_threads(cfg.model.threads)  # after the inputs are checked: a bad one fails with one line
        self.lm = lm = load_model(cfg.model.model, cfg.model.device, cfg.model.dtype)
        self.prompts = build_prompts(lm.tokenizer, problems.problems, cfg.data.max_prompt_tokens,
                                     cfg.data.prompt_overflow)
        note = (f"; prompts over {cfg.data.max_prompt_tokens} tokens: {self.prompts.skipped} skipped, "
                f"{self.prompts.truncated} truncated")
        if not self.prompts.problems:
            raise UserError(f"no prompt fits --max-prompt-tokens {cfg.data.max_prompt_tokens} ({problems.summary()}"
                            f"{note}); raise it or use --prompt-overflow truncate")
        if world.is_main:
            print(f"sparkrl: {problems.summary()}{note}", file=sys.stderr)
        self.policy = policy = lm.model
        if world.is_main:  # before any rollout: a checkpoint (weights and AdamW's two moments) and the final export
            enough_space(cfg.out, 4 * 4 * sum(p.numel() for p in policy.parameters()), "a checkpoint and the exported model")
        self.ref = None if cfg.grpo.kl_beta == 0 else shards.wrap(copy.deepcopy(policy).requires_grad_(False),
                                                                  frozen=True)
        # what samples, on which kernels: measured once by rank 0 (a resumed run keeps what its start chose)
        k = cfg.model.cpu_kernels
        dt = settled(world, resolved, {"rollout_dtype": lambda: str(rollout_dtype(cfg.model.rollout_dtype, policy))
                                       .removeprefix("torch.")})["rollout_dtype"]
        attention = settled(world, resolved, {"float32_attention": lambda: float32_attention(
            k, getattr(torch, dt), policy.lm_head.weight.device, policy.args)})
        self.rollout = rollout_copy(policy, getattr(torch, dt), k, cfg.model.rollout_head == "float32",
                                    separate=shards.sharded, attention32=attention["float32_attention"])  # unsharded
        packed = self.rollout.kernels["packed"]
        if self.ref is not None and packed and not shards.sharded and self.ref.lm_head.weight.dtype == getattr(torch, dt):
            accelerate(self.ref, "packed")  # no-grad forwards, as the rollout's; weights fixed: packed once
        kernels = {"packed_kernels": packed, "weight_major_kernels": self.rollout.kernels["weight_major"],
                   "compiled_kernels": "native" in self.rollout.kernels}  # compiled: where they could be built
        if world.is_main:
            write_run_config(cfg, {**resolved, "rollout_dtype": dt, **attention, **kernels})
        with world.main_first():  # rank 0 times the machine for the budget (cached), the others read its timing
            d = make_drafting(cfg.draft, policy, self.rollout, cfg.sampling.temperature, cfg.seed)
        shards.wrap(policy)  # after the rollout copy and the drafter were made from the whole policy
        self.opt = torch.optim.AdamW(policy.parameters(), lr=cfg.grpo.lr, weight_decay=cfg.grpo.weight_decay)
        self.drafter, self.draft_rollout, self.spark, self.budget = d.drafter, d.rollout, d.spark, d.budget
        self.engine = d.engine
        self.drafting = d.trainer(cfg.draft)
        self.order = DataOrder(len(self.prompts.problems), cfg.grpo.prompts_per_step, cfg.seed)
        self.grader = grader or Grader()

    def resume(self) -> int:
        """Load the latest checkpoint when resuming; returns the number of steps already done."""
        start = 0
        if self.cfg.resume and (ck := load_latest(self.cfg.out)) is not None:
            missing, unexpected = self.shards.load_weights(self.policy, ck["policy"])
            if missing or unexpected:
                raise UserError(f"the checkpoint in {self.cfg.out} does not fit this model (missing {missing[:3]}, "
                                f"unexpected {unexpected[:3]}); resume with the run's --model")
            self.shards.load_optimizer_state(self.opt, ck["optimizer"])
            if self.drafting is not None:
                self.drafting.load_state_dict(ck["draft"])
            if self.spark is not None and "spark_carry" in ck:
                self.spark.load_state_dict(ck["spark_carry"])
            if self.budget is not None and "budget" in ck:  # each rank's own, when the run had as many ranks
                ranks = ck.get("budget_of_ranks", [])
                self.budget.load_state_dict(ranks[self.world.rank] if len(ranks) == self.world.size else ck["budget"])
            set_rng_state(ck["rng"])
            start = ck["step"]
            self.rollout.refresh()
            if self.draft_rollout is not None:
                self.draft_rollout.refresh()
        if self.world.is_main:  # lines past the checkpoint will be written again
            _truncate_steps(Path(self.cfg.out) / "metrics.jsonl", start)
            if self.cfg.draft.round_log:
                _truncate_steps(Path(self.cfg.draft.round_log), start)
        return start

    def state(self, budgets: list[dict] | None = None) -> dict:
        """What a checkpoint holds (whole tensors; called on every rank, complete on rank 0). budgets:
        every rank's budget state (data-parallel: each rank's budget learns from its own rollouts);
        rank 0's alone when not given."""
        return {"policy": self.shards.weights(self.policy), "optimizer": self.shards.optimizer_state(self.opt),
                "config": to_dict(self.cfg),
                **({"draft": self.drafting.state_dict()} if self.drafting is not None else {}),
                **({"spark_carry": self.spark.state_dict()} if self.spark is not None and self.spark.carry else {}),
                **({"budget": self.budget.state_dict()} if self.budget is not None else {}),
                **({"budget_of_ranks": budgets} if budgets and len(budgets) > 1 else {})}

    def checkpoint_if_due(self, m: dict) -> bool:
        """Write a checkpoint after the step whose metrics are m when the run's rule says so (rank 0
        writes it; every rank waits for it, and every rank resumes from it)."""
        if not self.cfg.checkpoint_due(m["step"]):
            return False
        budgets = self.world.gather(self.budget.state_dict()) if self.budget is not None else None
        state = self.state(budgets)  # a sharded policy's tensors are gathered from every rank
        if self.world.is_main:
            save_checkpoint(self.cfg.out, m["step"], state, self.cfg.keep_checkpoints)
        self.world.barrier()
        return True

    def step(self, step: int, progress=None, on_commit=None) -> dict:
        """GRPO step `step` (0-based): rollout, rewards, one policy update (and the draft step).

        The optimizer steps, the metrics line and `on_commit(metrics)` (e.g. a checkpoint) land in
        one block that Ctrl-C waits for, so an interrupted run's last checkpoint matches its metrics."""
        cfg, G, world = self.cfg, self.cfg.grpo.group_size, self.world
        mine = world.shard(cfg.grpo.prompts_per_step)  # this rank's prompts of the step (all of them in one process)
        idx = self.order.batch(step)[mine.start:mine.stop]
        gens = response_generators(cfg.seed, len(idx), G, offset=step * cfg.grpo.prompts_per_step + mine.start)
        batch_prompts = [self.prompts.prompt_ids[i] for i in idx]
        policy = self.rollout.model
        rollout = self.engine.generate(policy, batch_prompts, cfg.sampling, self.lm.eos_ids, gens, G, progress,
                                       self.rollout.sampler)
        if self.drafter is not None:  # the trained drafter's head follows the policy it learns from (before the update)
            self.drafter.bind(self.rollout.model if self.shards.sharded else self.policy)  # whole, not sharded
        texts = self.lm.tokenizer.batch_decode(rollout.tokens, skip_special_tokens=True)
        scores = [self.grader.score(t, self.prompts.problems[idx[r // G]].answer) for r, t in enumerate(texts)]
        rewards = torch.tensor([s.reward for s in scores])
        t0 = time.perf_counter()
        total = int(world.sum(torch.tensor(rollout.num_tokens)))  # the loss is a token mean over the whole step's batch
        draft_gens = row_generators(cfg.seed, step, range(mine.start * G, mine.stop * G)) if self.drafting else None
        upd = policy_update(self.policy, self.ref, self.opt, rollout, group_advantages(rewards, G), cfg, self.drafting,
                            total, draft_gens)
        with deferred_sigint():
            self.shards.reduce_grads(self.policy)  # every rank's share of the batch: the whole batch's gradient
            upd.update(apply_update(self.policy, self.opt, cfg.grpo.max_grad_norm))
            self.rollout.refresh()  # the rollout copy follows the master weights
            if self.drafting is not None:
                upd.update(self.drafting.step(self.spark.take_grad(world.sum) if self.spark is not None else None, world))
                self.draft_rollout.refresh()
            upd["train_s"] = time.perf_counter() - t0 - upd.get("draft_train_s", 0.0)
            if self.budget is not None:
                upd["gen_ar_estimate_s"] = self.budget.autoregressive_estimate(rollout.stats)
            rollout, scores, upd = gather_step(world, rollout, scores, upd)  # the whole batch's, on every rank
            rewards = torch.tensor([s.reward for s in scores])
            ar_estimate = upd.pop("gen_ar_estimate_s", None)
            m = {
                "step": step + 1,
                "reward_mean": float(rewards.mean()),
                "reward_std": float(rewards.std()),
                "accuracy": sum(s.accuracy for s in scores) / len(scores),
                "format": sum(s.format for s in scores) / len(scores),
                "gen_s": rollout.gen_s,
                "train_s": upd.pop("train_s"),
                "draft_train_s": upd.pop("draft_train_s", 0.0),
                "gen_tokens": rollout.num_tokens,
                "gen_tok_per_s": rollout.num_tokens / max(rollout.gen_s, 1e-9),
                "response_len_mean": rollout.num_tokens / len(rollout.tokens),
                "truncated_frac": rollout.finish_reason.count("length") / len(rollout.tokens),
                **upd,
                **rollout.stats.to_metrics(),
                **({"gen_ar_estimate_s": ar_estimate} if ar_estimate is not None else {}),
            }
            if world.is_main:
                _append_metrics(cfg.out, m)
                if cfg.draft.round_log:
                    rollout.append_round_log(cfg.draft.round_log, step=step + 1, spark=self.spark is not None)
            if on_commit is not None:
                on_commit(m)
        self.last_rollout = rollout
        return m


def train(cfg: RunConfig, grader: Grader | None = None) -> dict:
    """Run GRPO per `cfg`; returns a summary. Resumable, interruptible with Ctrl-C. At the end the
    policy is exported as a Hugging Face folder, DIR/model.

    grader: scores responses (default: `Grader()`, the paper's R_acc + 0.2 R_fmt).

    Started by torchrun, the run is data-parallel over its ranks (`distributed`); rank 0 writes.
    """
    world = World.from_env(cfg.model.device, cfg.grpo.prompts_per_step)  # SINGLE outside torchrun
    try:
        return _train(GRPORun(cfg, grader, world))
    finally:
        world.close()


def _train(run: GRPORun) -> dict:
    cfg, main = run.cfg, run.world.is_main
    start = saved_step = run.resume()
    if cfg.resume and main:
        print(f"sparkrl: resuming {cfg.out} from step {start}" if start else
              f"sparkrl: --resume: no checkpoint in {cfg.out}/checkpoints yet; starting from step 0", file=sys.stderr)
    totals = {"steps": 0, **{k: 0.0 for k in SUMMED}}
    first = last = None
    watch = RateWatch()
    bar = tqdm(total=cfg.steps, initial=start, unit="step", desc="grpo", dynamic_ncols=True, file=sys.stderr,
               disable=not main)

    def checkpoint(m):
        nonlocal saved_step
        if run.checkpoint_if_due(m):
            saved_step = m["step"]

    try:
        for step in range(start, cfg.steps):
            made = [0]

            def progress(n, made=made):
                made[0] += n
                bar.set_postfix_str(f"generating: {made[0]} tokens", refresh=False)
                bar.refresh() if made[0] % 256 < n else None

            m = run.step(step, progress, checkpoint)
            first, last = first or m, m
            totals["steps"] += 1
            watch.observe(m["gen_tok_per_s"])
            for k in SUMMED:
                totals[k] += m.get(k, 0.0)
            bar.update(1)
            drafting = {"tok_per_round": f"{m['aal']:.2f}", "drafted": f"{m['tree_rounds']}/{m['rounds']}"} \
                if "aal" in m else {}
            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", acc=f"{m['accuracy']:.2f}",
                            tok_s=f"{m['gen_tok_per_s']:.0f}", **drafting, refresh=True)
    except KeyboardInterrupt:
        bar.close()
        done = last["step"] if last else start
        if main:  # other ranks may be gone: no collective here, rank 0's budget estimates only
            if done > saved_step and not run.shards.sharded:  # a sharded policy needs every rank: its last one stands
                save_checkpoint(cfg.out, done, run.state(), cfg.keep_checkpoints)
                saved_step = done
            print(f"sparkrl: interrupted; checkpoint at step {saved_step} in {cfg.out}/checkpoints; continue with "
                  "--resume", file=sys.stderr)
        raise SystemExit(130)
    finally:
        run.grader.close()
    bar.close()
    if main and run.shards.sharded:  # the last step's checkpoint holds the whole policy
        export_run(cfg.out, str(Path(cfg.out) / "model"))
    elif main:
        export_model(run.policy, run.lm.path, Path(cfg.out) / "model")
    return _summary(cfg, totals, first, last, main)


SUMMED = ("gen_s", "train_s", "draft_train_s", "gen_tokens", "rounds", "tree_rounds", "committed",
          "row_rounds", "gen_ar_estimate_s")


def check_data_parallel(cfg: RunConfig) -> None:
    """Settings whose maths the ranks cannot share: a data-parallel run must make one process's update."""
    sc = cfg.draft.spark_config
    if sc.spark and sc.spark_scope == "batch":
        raise UserError("--spark-scope batch shares one correction across the whole batch, which the data-parallel "
                        "ranks split; use --spark-scope group or response, or one process")
    if sc.spark and sc.spark_carry:
        raise UserError("--spark-carry carries each rank's corrections by batch position, which differs from one "
                        "process's; run that ablation in one process")


# How the ranks' update figures combine: each rank's share of a whole-batch token mean (policy_update
# divides by the whole batch's tokens) is summed; maxima and times take the largest; the rest (the
# gradient norm, the drafter's statistics) are the same on every rank.
_SHARES = {"loss", "kl", "clip_frac", "rollout_logp_abs_mean", "rollout_kl"}
_LARGEST = {"rollout_logp_abs_max", "train_s", "draft_train_s", "gen_ar_estimate_s"}


def gather_step(world: World, rollout: Rollout, scores: list, upd: dict) -> tuple[Rollout, list, dict]:
    """A step's rollout, scores and update figures over all ranks, in the whole batch's response order,
    on every rank: what one process would have had, but for the rounds (each rank's engine ran its own,
    so they add up) and the times (the slowest rank's). In one process, the arguments themselves."""
    if world.size == 1:
        return rollout, scores, upd
    parts = world.gather((dataclasses.replace(rollout, logp=[]), scores, upd))  # no figure needs the log-probs
    rollouts, scores, upds = zip(*parts)
    upd = {k: _combine(k, [u[k] for u in upds]) for k in upds[0]}
    return merge_rollouts(rollouts), [s for part in scores for s in part], upd


def _combine(key: str, values: list[float]) -> float:
    return sum(values) if key in _SHARES else max(values) if key in _LARGEST else values[0]


def merge_rollouts(parts: list[Rollout]) -> Rollout:
    """The ranks' rollouts of a step as one (rank order is the batch's order); see `gather_step`."""
    cat = lambda name: [x for p in parts for x in getattr(p, name)]
    stats = RoundStats.merge([p.stats for p in parts], concurrent=True)
    return Rollout(cat("prompt_ids"), parts[0].group_size, cat("tokens"), cat("finish_reason"),
                   max(p.gen_s for p in parts), stats, cat("outcome"), cat("round_of"), cat("logp"))


def export_run(run_dir: str, out: str) -> tuple[int, Path]:
    """Export a run's latest checkpoint (or the checkpoints/step-N folder given) as a Hugging Face folder;
    returns (its step, the folder)."""
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a folder; pass a folder (new or existing)")
    writable_dir(Path(out).absolute().parent, "the folder of --out")  # the export is written beside it, then renamed
    steps = checkpoints_at(run_dir)
    if not steps:
        raise UserError(f"{run_dir} holds no checkpoint: pass a `sparkrl train --out` folder or one of its "
                        "checkpoints/step-N folders")
    ck = load_checkpoint(steps[-1])
    lm = load_model(ck["config"]["model"]["model"], with_tokenizer=False)
    lm.model.to(next(iter(ck["policy"].values())).dtype)
    missing, unexpected = lm.model.load_weights(ck["policy"])
    if missing or unexpected:
        raise UserError(f"{steps[-1]} does not fit {ck['config']['model']['model']} (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")
    return ck["step"], export_model(lm.model, lm.path, Path(out))


def _append_metrics(out: str, m: dict) -> None:
    with open(Path(out) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(m) + "\n")


def _truncate_steps(path: Path, step: int) -> None:
    """Drop the JSONL records (metrics, round log) of steps past `step`, atomically."""
    if not path.exists():
        return
    keep = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(l + "\n" for l in keep))
    os.replace(tmp, path)


def _summary(cfg: RunConfig, totals: dict, first: dict | None, last: dict | None, main: bool) -> dict:
    s = {"out": cfg.out, "main": main, "steps_run": int(totals["steps"]), **{k: totals[k] for k in SUMMED}}
    s["gen_tokens"] = int(s["gen_tokens"])
    if first:
        s.update(reward_first=first["reward_mean"], reward_last=last["reward_mean"],
                 accuracy_last=last["accuracy"], gen_tok_per_s=totals["gen_tokens"] / max(totals["gen_s"], 1e-9))
    return s
