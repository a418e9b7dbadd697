"""sparkrl's exact speculative rollouts (with SPARK) as a TRL `GRPOTrainer` rollout function (DESIGN
"Integrations"; optional extra `sparkrl[trl]`, tested with trl 1.16.0).

    rollout = SparkRollout(TRLConfig(), args)       # refuses unsupported GRPOConfig settings here
    trainer = GRPOTrainer(model=model, args=args, reward_funcs=..., train_dataset=..., rollout_func=rollout)

TRL calls `rollout(prompts, trainer)` once per generation batch with this process's prompts, each
repeated G times in a row (a group may be split across processes: each part is then its own group,
with its own SPARK correction B_g). Per call:

  1. First call: the trainer-level checks (`check_trainer`), then the engine is built from the model
     TRL trains: a sparkrl `Transformer` with the same Hugging Face parameter names, then what makes its
     rollouts (`generation.build_generation`: its inference copy, the drafter shipped for the default model,
     a checkpoint or a fresh one, SPARK and the budget).
  2. Weight sync: when the trained model changed since the last call (TRL's global step or the
     parameters' in-place version counters moved), its parameters are copied in place into the
     engine's copy (no reallocation), and its inference copy refreshed.
  3. Consecutive identical prompts form a group; prompts are tokenized as TRL's own generation does
     (strings as they are, conversations with the trainer's chat template).
  4. Exact speculative sampling (`speculative.generate_speculative`; autoregressive with draft 'none')
     with TRL's temperature, top-p and max_completion_length, one engine call per distinct group size.
     The returned `logprobs` are the rollout model's log softmax(logits / temperature) of each
     committed token, as the engine records them while sampling (`Rollout.logp`).
  5. Online draft training (training mode only), as `sparkrl train` does after every rollout: the
     drafter's loss on the policy's features at the response positions, then one draft optimizer step
     that also applies SPARK's A gradient. Features: TRL's loss forward is out of reach, so they come
     from one extra no-grad forward of the engine's copy of the policy (the weights that sampled) over
     the prompt + completion sequences, in micro-batches. Cost: about a third of TRL's policy
     forward + backward on the same batch (as much as its reference-model forward when beta > 0), plus
     the drafter's own forward and backward; logged as `sparkrl/draft_train_s`. Paused while the budget
     declines drafting (under 2% of the call's rounds drafted), but for every 8th call; logged as
     `sparkrl/draft_paused`.
  6. AAL, rounds and time split go to TRL's logs through the trainer's metric hook (`_log_metric`, what
     TRL 1.16 hands reward functions as `log_metric`): averaged over processes and the logging window,
     logged beside `kl` and `reward` under `sparkrl/...`.

Several processes (accelerate / torchrun): each process samples its own prompts with its own engine;
the drafter's gradients and SPARK's A gradient are summed over the processes (`distributed.World`), so
every process keeps the same drafter.
"""

from __future__ import annotations

import itertools
import time

import torch

from sparkrl.config import SamplingConfig, TRLConfig
from sparkrl.engine.autoregressive import response_generators
from sparkrl.engine.records import Rollout, RoundStats
from sparkrl.errors import UserError
from sparkrl.model.transformer import ModelArgs, Transformer
from sparkrl.train.data import Problem
from sparkrl.train.distributed import SINGLE, World
from sparkrl.train.draft_train import row_generators
from sparkrl.train.drafting import NoDrafting, OnlineDrafting
from sparkrl.train.generation import Generation, RolloutPlan, build_generation
from sparkrl.train.pretrain import prompt_text
from sparkrl.train.rewards import Grader
from sparkrl.train.update import at_positions, response_batch

# --- refusals: one line each, before any model work ------------------------------------------------


def sampling_config(args) -> SamplingConfig:
    """sparkrl's sampling settings from TRL's GRPOConfig; refuses what the engine does not sample."""
    if getattr(args, "use_vllm", False):
        raise UserError("use_vllm=True: sparkrl's rollout function generates in-process; set use_vllm=False")
    if args.top_k not in (None, 0):
        raise UserError(
            f"top_k={args.top_k} is not supported by sparkrl's sampler (temperature and top-p only); set top_k=0"
        )
    if args.min_p is not None:
        raise UserError(
            f"min_p={args.min_p} is not supported by sparkrl's sampler (temperature and top-p only); set min_p=None"
        )
    if args.repetition_penalty != 1.0:
        raise UserError(
            f"repetition_penalty={args.repetition_penalty} would make the sampled distribution differ from "
            "the policy's; set repetition_penalty=1.0"
        )
    extra = dict(args.generation_kwargs or {})
    greedy = extra.pop("do_sample", True) is False
    if extra:
        raise UserError(
            f"generation_kwargs {sorted(extra)} are not supported by sparkrl's rollout function (only "
            "do_sample); use temperature, top_p and max_completion_length"
        )
    if greedy and args.temperature != 1.0:
        raise UserError(
            "greedy rollouts (do_sample=False) return the unscaled model's log-probabilities: set temperature=1.0"
        )
    if not args.max_completion_length:
        raise UserError("max_completion_length must be set: sparkrl's engine sizes its caches from it")
    return SamplingConfig(
        temperature=0.0 if greedy else args.temperature, top_p=args.top_p, max_new_tokens=args.max_completion_length
    )


def check_trainer(trainer) -> None:
    """What the rollout function cannot serve in this trainer (besides `sampling_config`'s settings)."""
    sampling_config(trainer.args)
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        raise UserError(
            "tools / environment_factory are not supported by sparkrl's rollout function (single-turn "
            "text completions only)"
        )
    if getattr(trainer, "_is_vlm", False):
        raise UserError(
            "vision-language processors are not supported by sparkrl's rollout function (text-only "
            "Llama / Qwen2 / Qwen3 policies)"
        )
    if getattr(trainer, "is_fsdp_enabled", False) or _zero3(trainer):
        raise UserError(
            "FSDP / DeepSpeed ZeRO-3 shard the parameters, which sparkrl's in-process weight sync "
            "copies whole; use DDP (or one process)"
        )
    if not hasattr(trainer, "_log_metric"):
        raise UserError(
            "this TRL has no GRPOTrainer._log_metric; install the tested version: pip install "
            "'sparkrl[trl]' (trl==1.16.0)"
        )


def _zero3(trainer) -> bool:
    plugin = getattr(getattr(trainer, "accelerator", None), "state", None)
    ds = getattr(plugin, "deepspeed_plugin", None)
    return ds is not None and getattr(ds, "zero_stage", 0) == 3


def policy_args(model) -> ModelArgs:
    """sparkrl's architecture of a transformers causal LM (one line when it is not a supported one)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "named_parameters"):
        raise UserError(f"{type(model).__name__} is not a transformers causal LM; pass a Llama / Qwen2 / Qwen3 model")
    try:
        return ModelArgs.from_hf(config.to_dict())
    except (ValueError, KeyError) as e:
        raise UserError(f"sparkrl's rollout function cannot run this model: {e}") from None


# --- prompts -----------------------------------------------------------------------------------


def consecutive_groups(prompts: list) -> list[tuple[object, int]]:
    """[(prompt, how many times in a row)] for runs of identical consecutive prompts."""
    runs: list[list] = []
    for p in prompts:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [(p, n) for p, n in runs]


def _conversational(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt) and bool(prompt)


def tokenize(trainer, prompts: list) -> list[list[int]]:
    """Prompt token ids as TRL's own generation makes them: strings tokenized as they are (the
    tokenizer's special tokens), conversations through the trainer's chat template."""
    tok, prompts = trainer.processing_class, list(prompts)
    if all(isinstance(p, str) for p in prompts):
        return [list(ids) for ids in tok(text=prompts)["input_ids"]]
    if not all(_conversational(p) for p in prompts):
        raise UserError(
            "sparkrl's rollout function takes prompts as strings or lists of chat messages "
            f"({{'role', 'content'}}), got {type(prompts[0]).__name__}"
        )
    for p in prompts:
        for m in p:
            if isinstance(m.get("content"), list) and any(part.get("type") != "text" for part in m["content"]):
                raise UserError(
                    "sparkrl's rollout function takes text-only messages (an image or other non-text "
                    "content part was given)"
                )
    out = tok.apply_chat_template(
        conversation=prompts,
        chat_template=getattr(trainer, "chat_template", None),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **getattr(trainer, "chat_template_kwargs", {}),
    )
    return [list(ids) for ids in out["input_ids"]]


# --- the rollout function ----------------------------------------------------------------------


class SparkRollout:
    """`rollout_func` for TRL's GRPOTrainer (see the module doc). cfg: drafter, SPARK, budget and
    rollout dtype; args: TRL's GRPOConfig, checked now when given (else at the first call)."""

    def __init__(self, cfg: TRLConfig = TRLConfig(), args=None):
        self.cfg = cfg
        if args is not None:
            sampling_config(args)
        self.policy: Transformer | None = None  # the engine's copy of the trained model (built at the first call)
        self.generation: Generation | None = None  # what makes its rollouts (built at the first call)
        self.drafting: OnlineDrafting = NoDrafting()  # the drafter and its training (the generation's)
        self.world = SINGLE
        self.calls = self.prompts_seen = 0
        self.synced: tuple | None = None  # (model, global step, parameter versions) last copied

    def build(self, trainer) -> None:
        """The engine for the model `trainer` trains (first call; `check_trainer` has passed)."""
        hf = trainer.accelerator.unwrap_model(trainer.model)
        args = policy_args(hf)
        w = next(hf.parameters())
        policy = Transformer(args).to(device=w.device, dtype=w.dtype).requires_grad_(False).eval()
        names = {n for n, _ in policy.named_parameters()}
        theirs = {n for n, _ in hf.named_parameters()}
        if not names <= theirs:
            missing = sorted(names - theirs)
            raise UserError(
                f"the trained model's parameters do not match sparkrl's {args.arch} model (no {missing[0]} "
                f"among {len(theirs)}; PEFT adapters: merge them first)"
            )
        self.policy = policy
        self.sync(trainer)
        plan = RolloutPlan.settle(policy, self.cfg.rollout_dtype, self.cfg.cpu_kernels, self.cfg.draft)
        temperature = sampling_config(trainer.args).temperature
        self.generation = build_generation(plan, self.cfg.draft, policy, temperature, self.cfg.seed)
        self.drafting = self.generation.drafting
        acc = trainer.accelerator
        if acc.num_processes > 1:
            self.world = World(acc.process_index, acc.num_processes, acc.device)

    @torch.no_grad()
    def sync(self, trainer) -> bool:
        """Copy the trained model's weights into the engine in place when they changed since the last
        copy (another model, TRL's global step, or any parameter's in-place version counter); True when
        copied."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        hf = dict(model.named_parameters())
        mine = list(self.policy.named_parameters())
        key = (id(model), trainer.state.global_step, tuple(hf[n]._version for n, _ in mine))
        if key == self.synced:
            return False
        for n, p in mine:
            p.copy_(hf[n])
        if self.generation is not None:
            self.generation.refresh()
        self.synced = key
        return True

    def __call__(self, prompts: list, trainer) -> dict:
        if self.policy is None:
            check_trainer(trainer)
            self.build(trainer)
        sampling = sampling_config(trainer.args)
        t0 = time.perf_counter()
        self.sync(trainer)
        sync_s = time.perf_counter() - t0
        groups = consecutive_groups(prompts)
        ids = tokenize(trainer, [p for p, _ in groups])
        eos = tuple(trainer.eos_token_ids)
        rows: list[tuple[list[int], list[int], list[float]] | None] = [None] * len(prompts)
        first = list(itertools.accumulate((n for _, n in groups[:-1]), initial=0))  # each group's first row
        parts = []
        for size in sorted({n for _, n in groups}):  # the engine takes one group size per call
            members = [g for g, (_, n) in enumerate(groups) if n == size]
            r = self.generate([ids[g] for g in members], members, size, sampling, eos)
            for k, g in enumerate(members):
                for j in range(size):
                    i = k * size + j
                    rows[first[g] + j] = (ids[g], r.tokens[i], r.logp[i])
            parts.append(r)
        self.prompts_seen += len(groups)
        draft = self.train_drafter(parts) if trainer.model.training else self.discard_adaptation()
        self.log(trainer, parts, {"sync_s": sync_s, **draft})
        self.calls += 1
        return {
            "prompt_ids": [r[0] for r in rows],
            "completion_ids": [r[1] for r in rows],
            "logprobs": [r[2] for r in rows],
        }

    def generate(
        self, prompt_ids: list[list[int]], groups: list[int], group_size: int, sampling: SamplingConfig, eos
    ) -> Rollout:
        """One engine call: `group_size` responses to each prompt; response j of the call's group g
        samples with its own generator, from (seed, process, call, g, j)."""
        seed = hash((self.cfg.seed, self.world.rank, self.calls)) & 0x7FFF_FFFF_FFFF_FFFF
        gens = [x for g in groups for x in response_generators(seed, 1, group_size, offset=self.prompts_seen + g)]
        return self.generation.generate(prompt_ids, sampling, eos, gens, group_size)

    def train_drafter(self, parts: list[Rollout]) -> dict:
        """The drafter's online step on this call's responses (see the module doc, step 5; nothing without a
        drafter, whose `learn` never reads `draft_batches`), paused while the budget declines drafting
        (`Drafting.learns`; logged as `sparkrl/draft_paused`)."""
        if not self.drafting.trains:
            return {}
        stats = RoundStats.merge([r.stats for r in parts], concurrent=False)
        if not self.drafting.learns(stats, self.calls, self.world):
            return self.discard_adaptation() | {"draft_paused": 1}
        return self.drafting.learn(self.draft_batches(parts), self.world) | {"draft_paused": 0}

    def draft_batches(self, parts: list[Rollout]):
        """The drafter loss's micro-batches of this call's responses (`Drafting.observe`'s arguments), each from
        a no-grad forward of the engine's copy of the policy, made as they are read."""
        policy, d = self.policy, self.drafting
        d.bind(policy)
        taps = d.feature_layers
        total = int(self.world.sum(torch.tensor(sum(r.num_tokens for r in parts))))
        mb, seen = self.cfg.micro_batch, 0
        for r in parts:
            rows = [i for i in range(len(r.tokens)) if r.tokens[i]]
            gens = row_generators(self.cfg.seed, self.calls, range(seen, seen + len(r.tokens)))
            seen += len(r.tokens)
            for i in range(0, len(rows), mb):
                chunk = rows[i : i + mb]
                toks, pos, mask, _ = response_batch(r, chunk, policy.lm_head.weight.device)
                with torch.no_grad():
                    out = policy(toks, taps=taps)
                h = at_positions(out.hidden, pos)  # (b, R+1, d)
                yield (
                    toks.gather(1, pos),
                    {k: at_positions(v, pos) for k, v in out.taps.items()},
                    h,
                    policy.logits(h),
                    mask,
                    float(mask.sum()) / max(total, 1),
                    [gens[j] for j in chunk],
                )

    def discard_adaptation(self) -> dict:
        """Evaluation rollouts train nothing: SPARK's A gradient of the rollout is dropped."""
        self.drafting.drop_adaptation(self.world)
        return {}

    def log(self, trainer, parts: list[Rollout], extra: dict) -> None:
        """This call's figures into TRL's logs (`sparkrl/...`, averaged over processes and logging steps)."""
        st = RoundStats.merge([r.stats for r in parts], concurrent=False)  # one engine call after another
        gen_s = sum(r.gen_s for r in parts)
        tokens = sum(r.num_tokens for r in parts)
        m = {"gen_s": gen_s, "gen_tok_per_s": tokens / max(gen_s, 1e-9), **extra}
        if st.depth:  # speculative rollouts
            m.update(
                aal=st.aal,
                rounds=st.rounds,
                drafted_frac=st.tree_rounds / max(st.rounds, 1),
                draft_s=st.draft_s,
                verify_s=st.verify_s,
                accept_s=st.accept_s,
                spark_s=st.adapter.get("spark_s", 0.0),
            )
        for k, v in m.items():
            trainer._log_metric(f"sparkrl/{k}", float(v))


# --- sparkrl's problems and reward for TRL ---------------------------------------------------------


def problem_dataset(problems: list[Problem]):
    """A TRL dataset of sparkrl's problems: `prompt` (sparkrl's GRPO prompt as one user message) and
    `answer` (what the reward checks)."""
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": prompt_text(p)}] for p in problems],
            "answer": [p.answer for p in problems],
        }
    )


def math_reward(grader: Grader):
    """sparkrl's reward (accuracy + 0.2 format, `rewards.Grader`) as a TRL reward function of
    conversational completions and the dataset's `answer` column."""

    def reward(completions, answer, **_):
        return [grader.score(c[-1]["content"], a).reward for c, a in zip(completions, answer)]

    return reward
