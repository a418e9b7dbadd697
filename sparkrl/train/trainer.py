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
import hashlib
import json
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from sparkrl.config import RunConfig, to_dict
from sparkrl.cpu.accelerate import accelerate
from sparkrl.engine.autoregressive import response_generators
from sparkrl.engine.records import Rollout
from sparkrl.errors import UserError, enough_space
from sparkrl.machine import RateWatch, set_threads
from sparkrl.model.export import export_model
from sparkrl.model.weights import load_model, resolve_model_path
from sparkrl.train.checkpoint import POLICY, disk_full, list_checkpoints, load_latest, save_checkpoint, set_rng_state
from sparkrl.train.data import build_prompts, load_problems
from sparkrl.train.distributed import SINGLE, World, gather_step
from sparkrl.train.draft_train import row_generators
from sparkrl.train.drafting import NoDrafting
from sparkrl.train.generation import Generation, RolloutPlan, build_generation
from sparkrl.train.grpo import group_advantages
from sparkrl.train.rewards import Grader
from sparkrl.train.rundir import (
    append_metrics,
    export_run,
    kept_as_found,
    plot_metrics,
    prepare_out_dir,
    truncate_steps,
    write_run_config,
)
from sparkrl.train.sharding import sharding
from sparkrl.train.update import apply_update, policy_update
from sparkrl.vllm.engine import model_len

DIVERGING = 3  # refused (non-finite) updates in a row that stop a run


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


def fitting_prompts(cfg: RunConfig, tokenizer, problems, main: bool):
    """The problems' prompts within --max-prompt-tokens (`data.build_prompts`); none fitting is a user error."""
    prompts = build_prompts(tokenizer, problems.problems, cfg.data.max_prompt_tokens, cfg.data.prompt_overflow)
    note = (
        f"; prompts over {cfg.data.max_prompt_tokens} tokens: {prompts.skipped} skipped, {prompts.truncated} truncated"
    )
    if not prompts.problems:
        raise UserError(
            f"no prompt fits --max-prompt-tokens {cfg.data.max_prompt_tokens} ({problems.summary()}"
            f"{note}); raise it or use --prompt-overflow truncate"
        )
    if main:
        print(f"sparkrl: {problems.summary()}{note}", file=sys.stderr)
    return prompts


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
        self.prompts = fitting_prompts(cfg, lm.tokenizer, problems, world.is_main)
        self.policy = policy = lm.model
        if world.is_main:  # before any rollout: a checkpoint (weights and AdamW's two moments) and the final export
            enough_space(
                cfg.out, 4 * 4 * sum(p.numel() for p in policy.parameters()), "a checkpoint and the exported model"
            )
        self.ref = (
            None if cfg.grpo.kl_beta == 0 else shards.wrap(copy.deepcopy(policy).requires_grad_(False), frozen=True)
        )
        self.generation = self.build_generation(resolved)  # from the whole policy, before it is sharded
        self.drafting = self.generation.drafting
        shards.wrap(policy)  # after the inference copy and the drafter were made from the whole policy
        self.opt = torch.optim.AdamW(policy.parameters(), lr=cfg.grpo.lr, weight_decay=cfg.grpo.weight_decay)
        self.order = DataOrder(len(self.prompts.problems), cfg.grpo.prompts_per_step, cfg.seed)
        self.grader = grader or Grader()
        self.diverged = 0  # steps in a row whose update was refused

    def build_generation(self, resolved: dict) -> Generation:
        """What makes this run's rollouts (`generation.build_generation`), on a plan measured once by rank 0 (a
        resumed run keeps what its start chose, `resolved`), recorded in config.json with the kernels it runs."""
        cfg, world, policy, m = self.cfg, self.world, self.policy, self.cfg.model
        plan = RolloutPlan.settle(
            policy, m.rollout_dtype, m.cpu_kernels, cfg.draft, m.rollout_head == "float32", world, resolved
        )
        vllm_len = model_len(self.prompts.prompt_ids, cfg.sampling.max_new_tokens, cfg.draft.shape().depth)
        with world.main_first():  # rank 0 times the machine for the budget (cached), the others read its timing
            gen = build_generation(
                plan,
                cfg.draft,
                policy,
                cfg.sampling.temperature,
                cfg.seed,
                separate=self.shards.sharded,
                lm=self.lm,
                max_len=vllm_len if plan.engine == "vllm" else 0,
            )
        k = gen.policy.kernels
        if (
            self.ref is not None
            and k.packed
            and not self.shards.sharded
            and self.ref.lm_head.weight.dtype == plan.dtype
        ):
            accelerate(self.ref, "packed")  # no-grad forwards, as the rollout's; weights fixed: packed once
        if world.is_main:  # compiled: where they could be built
            ran = {
                "packed_kernels": k.packed,
                "weight_major_kernels": k.weight_major,
                "compiled_kernels": bool(k.compiled),
            }
            write_run_config(cfg, {**resolved, **plan.record(), **ran})
        return gen

    def resume(self) -> int:
        """Load the latest checkpoint when resuming; returns the number of steps already done."""
        start = 0
        if self.cfg.resume and (ck := load_latest(self.cfg.out)) is not None:
            missing, unexpected = self.shards.load_weights(self.policy, ck["policy"])
            if missing or unexpected:
                raise UserError(
                    f"the checkpoint in {self.cfg.out} does not fit this model (missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]}); resume with the run's --model"
                )
            self.shards.load_optimizer_state(self.opt, ck["optimizer"])
            self.drafting.load_state_dict(ck, self.world)
            set_rng_state(ck["rng"])
            start = ck["step"]
            self.generation.refresh()
        if self.world.is_main:  # lines past the checkpoint will be written again
            truncate_steps(Path(self.cfg.out) / "metrics.jsonl", start)
            if self.cfg.draft.round_log:
                truncate_steps(Path(self.cfg.draft.round_log), start)
        return start

    def state(self, budgets: list[dict] | None = None) -> dict:
        """What a checkpoint holds (whole tensors; called on every rank, complete on rank 0). budgets:
        every rank's budget state (data-parallel: each rank's budget learns from its own rollouts);
        rank 0's alone when not given."""
        return {
            "policy": self.shards.weights(self.policy),
            "optimizer": self.shards.optimizer_state(self.opt),
            "config": to_dict(self.cfg),
            **self.drafting.state_dict(budgets),
        }

    def checkpoint_if_due(self, m: dict) -> bool:
        """Write a checkpoint after the step whose metrics are m when the run's rule says so (rank 0
        writes it; every rank waits for it, and every rank resumes from it)."""
        if not self.cfg.checkpoint_due(m["step"]):
            return False
        budgets = self.world.gather(self.drafting.budget_state())
        state = self.state(budgets)  # a sharded policy's tensors are gathered from every rank
        if self.world.is_main:
            if not all(torch.isfinite(t).all() for t in state["policy"].values()):  # never written, never exported
                raise UserError(f"step {m['step']}: the policy's weights are not finite; lower --lr and start again")
            save_checkpoint(self.cfg.out, m["step"], state, self.cfg.keep_checkpoints)
            plot_metrics(self.cfg.out)  # the picture of the steps the checkpoint holds
        self.world.barrier()
        return True

    def step(self, step: int, progress=None, on_commit=lambda m: None) -> dict:
        """GRPO step `step` (0-based): rollout, rewards, one policy update (and the draft step).

        The optimizer steps, the metrics line and `on_commit(metrics)` (e.g. a checkpoint) land in
        one block that Ctrl-C waits for, so an interrupted run's last checkpoint matches its metrics."""
        cfg, G, world = self.cfg, self.cfg.grpo.group_size, self.world
        mine = world.shard(cfg.grpo.prompts_per_step)  # this rank's prompts of the step (all of them in one process)
        idx = self.order.batch(step)[mine.start : mine.stop]
        gens = response_generators(cfg.seed, len(idx), G, offset=step * cfg.grpo.prompts_per_step + mine.start)
        batch_prompts = [self.prompts.prompt_ids[i] for i in idx]
        rollout = self.generation.generate(batch_prompts, cfg.sampling, self.lm.eos_ids, gens, G, progress)
        self.drafting.bind(self.generation.policy.model if self.shards.sharded else self.policy)  # whole, unsharded
        texts = self.lm.tokenizer.batch_decode(rollout.tokens, skip_special_tokens=True)
        timeouts = getattr(self.grader, "timeouts", 0)
        scores = [self.grader.score(t, self.prompts.problems[idx[r // G]].answer) for r, t in enumerate(texts)]
        timeouts = getattr(self.grader, "timeouts", 0) - timeouts  # responses whose check ran past its bound
        rewards = torch.tensor([s.reward for s in scores])
        t0 = time.perf_counter()
        total = int(world.sum(torch.tensor(rollout.num_tokens)))  # the loss is a token mean over the whole step's batch
        draft_gens = row_generators(cfg.seed, step, range(mine.start * G, mine.stop * G))
        learning = self.drafting.learns(rollout.stats, step, world)  # paused while the budget declines drafting
        upd = policy_update(
            self.policy,
            self.ref,
            self.opt,
            rollout,
            group_advantages(rewards, G),
            cfg,
            self.drafting if learning else NoDrafting(),
            total,
            draft_gens,
        )
        upd["reward_timeouts"] = timeouts
        if self.drafting.trains:
            upd["draft_paused"] = int(not learning)
        with deferred_sigint():
            self.shards.reduce_grads(self.policy)  # every rank's share of the batch: the whole batch's gradient
            upd.update(apply_update(self.policy, self.opt, cfg.grpo.max_grad_norm))
            self.generation.refresh()  # the inference copy follows the master weights
            if learning:
                upd.update(self.drafting.step(world))
            else:  # SPARK's A gradient of a rollout the drafter does not learn from
                self.drafting.drop_adaptation(world)
            upd["train_s"] = time.perf_counter() - t0 - upd.get("draft_train_s", 0.0)
            upd.update(self.drafting.figures(rollout.stats))
            rollout, scores, upd = gather_step(world, rollout, scores, upd)  # the whole batch's, on every rank
            m = step_metrics(step, rollout, scores, upd)
            if world.is_main:
                append_metrics(cfg.out, m)
                if cfg.draft.round_log:
                    rollout.append_round_log(cfg.draft.round_log, step=step + 1, spark=self.drafting.adapts)
            on_commit(m)
        self.last_rollout = rollout
        self.refuse_diverging(m)
        return m

    def refuse_diverging(self, m: dict) -> None:
        """One line for a refused (non-finite) update; a run refused DIVERGING steps in a row stops."""
        self.diverged = self.diverged + 1 if m.get("refused") else 0
        if not self.diverged:
            return
        lr, fix = self.cfg.grpo.lr, "lower --lr, or --max-grad-norm"
        if self.diverged >= DIVERGING:
            raise UserError(
                f"step {m['step']}: the policy update was not finite {self.diverged} steps in a row (gradient norm "
                f"{m['grad_norm']}) at --lr {lr:g}; the run stops, its checkpoints hold finite weights: {fix}"
            )
        if self.world.is_main:
            print(
                f"sparkrl: step {m['step']}: the policy update was not finite (gradient norm {m['grad_norm']}) and "
                f"was refused, the weights unchanged; if it goes on: {fix} (now {lr:g})",
                file=sys.stderr,
            )


def step_metrics(step: int, rollout: Rollout, scores: list, upd: dict) -> dict:
    """The metrics line of GRPO step `step` (0-based) from its whole batch's rollout, scores and update figures
    (`upd`, emptied here: the policy's and the drafter's update, their times, the budget's figures)."""
    rewards = torch.tensor([s.reward for s in scores])
    stats = rollout.stats.to_metrics()
    if "spark_contexts" in stats:  # SPARK's own time as a share of the step's generation time
        stats["spark_share"] = stats["spark_s"] / max(rollout.gen_s, 1e-9)
    return {
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
        "token_hash": hashlib.sha256(json.dumps(rollout.tokens).encode()).hexdigest()[:16],  # the step's responses
        **upd,
        **stats,
    }


@dataclass
class Summary:
    """What `train` returns (and `sparkrl train` prints): this process's totals over the steps it ran, and the
    rewards of the first and the last of them."""

    out: str  # the run's folder
    main: bool  # whether this process reports (rank 0 under torchrun)
    steps_run: int = 0
    gen_s: float = 0.0
    train_s: float = 0.0
    draft_train_s: float = 0.0
    gen_tokens: int = 0
    rounds: int = 0  # verification rounds (0: autoregressive rollouts)
    tree_rounds: int = 0  # rounds that drafted
    committed: int = 0  # tokens committed by them, over row_rounds rounds of a response
    row_rounds: int = 0
    gen_ar_estimate_s: float = 0.0  # the budget's estimate of autoregressive generation (0: none)
    draft_paused: int = 0  # steps whose drafter training paused (`Drafting.learns`)
    first: dict = field(default_factory=dict)  # the first step's mean reward, accuracy and format rate (`LEARNING`)
    last: dict = field(default_factory=dict)  # the last step's

    def add(self, m: dict) -> None:
        """A step's metrics line."""
        if not self.steps_run:
            self.first = {k: m[k] for k in LEARNING}
        self.steps_run += 1
        for k in SUMMED:
            setattr(self, k, getattr(self, k) + m.get(k, 0))
        self.last = {k: m[k] for k in LEARNING}

    @property
    def gen_tok_per_s(self) -> float:
        return self.gen_tokens / max(self.gen_s, 1e-9)


LEARNING = ("reward_mean", "accuracy", "format")  # what a `Summary` shows from its first step to its last
SUMMED = (
    "gen_s",
    "train_s",
    "draft_train_s",
    "gen_tokens",
    "rounds",
    "tree_rounds",
    "committed",
    "row_rounds",
    "gen_ar_estimate_s",
    "draft_paused",
)  # the metrics a `Summary` adds up


def train(cfg: RunConfig, grader: Grader | None = None) -> Summary:
    """Run GRPO per `cfg`; returns its `Summary`. Resumable, interruptible with Ctrl-C. At the end the
    policy is exported as a Hugging Face folder, DIR/model.

    grader: scores responses (default: `Grader()`, the paper's R_acc + 0.2 R_fmt).

    Started by torchrun, the run is data-parallel over its ranks (`distributed`); rank 0 writes.
    """
    world = World.from_env(cfg.model.device, cfg.grpo.prompts_per_step)  # SINGLE outside torchrun
    try:
        with kept_as_found(cfg.out, world.is_main):  # a start that fails leaves --out as it was
            run = GRPORun(cfg, grader, world)
            start = run.resume()
        return _train(run, start)
    except Exception as e:
        if not disk_full(e):
            raise
        raise UserError(
            f"no space left on the device of {cfg.out} ({e}): the checkpoints written before are intact (a "
            "checkpoint is renamed into place only once whole); free space, then --resume"
        ) from None
    finally:
        world.close()


def _train(run: GRPORun, start: int) -> Summary:
    cfg, main = run.cfg, run.world.is_main
    saved_step = start
    if cfg.resume and main:
        print(
            f"sparkrl: resuming {cfg.out} from step {start}"
            if start
            else f"sparkrl: --resume: no checkpoint in {cfg.out}/checkpoints yet; starting from step 0",
            file=sys.stderr,
        )
    summary = Summary(cfg.out, main)
    watch = RateWatch()
    bar = tqdm(
        total=cfg.steps, initial=start, unit="step", desc="grpo", dynamic_ncols=True, file=sys.stderr, disable=not main
    )

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
            summary.add(m)
            watch.observe(m["gen_tok_per_s"])
            bar.update(1)
            show(bar, m)
    except KeyboardInterrupt:
        bar.close()
        done = start + summary.steps_run
        if main:  # other ranks may be gone: no collective here, rank 0's budget estimates only
            if done > saved_step and not run.shards.sharded:  # a sharded policy needs every rank: its last one stands
                save_checkpoint(cfg.out, done, run.state(), cfg.keep_checkpoints)
                plot_metrics(cfg.out)
                saved_step = done
            print(
                f"sparkrl: interrupted; checkpoint at step {saved_step} in {cfg.out}/checkpoints; continue with "
                "--resume",
                file=sys.stderr,
            )
        raise SystemExit(130)
    finally:
        bar.close()  # an error's line then starts a line of its own
        run.grader.close()
    if main:
        plot_metrics(cfg.out)
        export_final(run, saved_step)
    return summary


def show(bar, m: dict) -> None:
    """A step's figures beside the progress bar."""
    drafting = (
        {"tok_per_round": f"{m['aal']:.2f}", "drafted": f"{m['tree_rounds']}/{m['rounds']}"} if "aal" in m else {}
    )
    if "spark_share" in m:
        drafting["spark"] = f"{m['spark_share']:.1%}"
    reward, acc, rate = f"{m['reward_mean']:.3f}", f"{m['accuracy']:.2f}", f"{m['gen_tok_per_s']:.0f}"
    bar.set_postfix(reward=reward, acc=acc, tok_s=rate, **drafting, refresh=True)


def export_final(run: GRPORun, saved_step: int) -> None:
    """The trained policy as a Hugging Face folder, OUT/model (rank 0)."""
    cfg = run.cfg
    if run.shards.sharded:  # the last step's checkpoint holds the whole policy
        export_run(cfg.out, str(Path(cfg.out) / "model"))
        return
    saved = list_checkpoints(cfg.out)  # the last checkpoint holds these very weights when it is of the last step:
    last = saved[-1] / POLICY if saved and saved_step == cfg.steps else None  # linked, not copied
    export_model(run.policy, run.lm.path, Path(cfg.out) / "model", same_as=last)


def check_data_parallel(cfg: RunConfig) -> None:
    """Settings whose maths the ranks cannot share: a data-parallel run must make one process's update."""
    sc = cfg.draft.spark_config
    if cfg.draft.engine == "vllm":
        raise UserError("--engine vllm runs in one process (one vLLM engine per run): start it without torchrun")
    if sc.spark and sc.spark_scope == "batch":
        raise UserError(
            "--spark-scope batch shares one correction across the whole batch, which the data-parallel "
            "ranks split; use --spark-scope group or response, or one process"
        )
    if sc.spark and sc.spark_carry:
        raise UserError(
            "--spark-carry carries each rank's corrections by batch position, which differs from one "
            "process's; run that ablation in one process"
        )
