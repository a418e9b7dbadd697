"""Rollouts through vLLM's offline engine (`--engine vllm`): one `vllm.LLM` per run, started once, a prompt's
group one request with n = G, and a drafter exported to it (`drafters.vllm_export.export_draft`): an EAGLE3-style
one drafting chains of a fixed length (vLLM's `eagle3` method) or a DFlash-style one drafting blocks of a fixed size
(its `dflash` method). Returns the tokens, each sampled token's log-probability under the
policy as vLLM computed it, and the drafting figures vLLM counts (drafts, drafted and accepted tokens, accepted
per chain position).

On a CPU, vLLM-CPU's own settings would reserve one core for its scheduler and 20 GiB for the KV cache; `ENV`
lets it use every core and a smaller cache unless the user set them. vLLM starts in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that sparkrl reaches the model it serves. Start-up is long (tens of
seconds for the default model on a CPU), which is why an engine lives as long as its run.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparkrl.config import SamplingConfig
from sparkrl.drafters.vllm_export import export_draft, method
from sparkrl.engine.records import Rollout, RoundStats
from sparkrl.engine.seams import RolloutEngine
from sparkrl.errors import UserError
from sparkrl.machine import memory_policy_kept
from sparkrl.model.export import ARCHITECTURES
from sparkrl.model.transformer import ModelArgs
from sparkrl.vllm.spark import FILE as SPARK_FILE
from sparkrl.vllm.spark import write_projection

ENV = {
    # vLLM logs to stdout at INFO by default: stdout is sparkrl's output (generate --json pipes it), so vLLM's
    # lines go to stderr, warnings and errors only (set VLLM_LOGGING_LEVEL=INFO to see its start-up)
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")  # drafting counts (`plugin.Drafted`)


@dataclass
class VllmRollout:
    """What one `VllmEngine.generate` made: per response (prompt-major, then its n), its tokens, their
    log-probabilities and why it ended; and the drafting vLLM counted over the call."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reason: list[str]
    gen_s: float
    drafted: dict = field(default_factory=dict)  # drafts, draft_tokens, accepted_tokens, per_position (accepted)
    adapter: dict = field(default_factory=lambda: {"spark_s": 0.0})  # SPARK's figures (`VllmSpark.metrics`)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def aal(self) -> float:
        """Tokens committed per verification round per response: 1 + accepted drafts per chain (1.0: none)."""
        return 1.0 + self.drafted["accepted_tokens"] / max(self.drafted["drafts"], 1) if self.drafted else 1.0

    def acceptance(self) -> list[float]:
        """Share of chains whose drafted token at each position was accepted."""
        n = max(self.drafted.get("drafts", 0), 1)
        return [a / n for a in self.drafted.get("per_position", [])]


class KnownNoise(logging.Filter):
    """Drops the warnings vLLM gives for what sparkrl does on purpose: the chat-template warm-up's traceback
    (sparkrl tokenizes itself, so the engine starts without a tokenizer: skip_tokenizer_init); one line per weight
    read from a float32 model folder into a half-precision engine (a cast the engine is asked for); and, at every
    in-place weight update, one line per layer the update sends nothing to: the rotary embedding (no weights), an
    output head tied to the embedding (repacked by `load_policy`) and the drafter's embedding (the target's)."""

    MESSAGES = ("Chat template warmup failed", "Attempted to load weight %s with dtype %s into parameter")
    UNSENT = ("RotaryEmbedding", "ParallelLMHead", "VocabParallelEmbedding")
    LOGGERS = ("vllm.renderers.base", "vllm.model_executor.models.utils",
               "vllm.model_executor.model_loader.reload.layerwise")  # where vLLM 0.32 logs them  # fmt: skip

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights":
            return not (record.args and record.args[0] in self.UNSENT)
        return not str(record.msg).startswith(self.MESSAGES)


def vllm_module():
    """The vllm package, or a one-line error saying how to get it."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    try:
        import vllm
    except ImportError as e:
        raise UserError(f"--engine vllm needs vLLM ({e}); install sparkrl[vllm] (scripts/setup.sh does)") from None
    for name in KnownNoise.LOGGERS:  # a logger's own filter sees each record it makes, whatever handles it later
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownNoise) for f in logger.filters):
            logger.addFilter(KnownNoise())
    return vllm


def model_len(prompts: list[list[int]], max_new_tokens: int, spec_tokens: int) -> int:
    """The longest sequence an engine serving `prompts` holds: the longest prompt, its response and a round's
    drafts past it."""
    return max(map(len, prompts)) + max_new_tokens + spec_tokens + 2


def engine_options(
    policy_dir: Path,
    args: ModelArgs,
    dtype: str,
    draft_dir: Path | None,
    spec_tokens: int,
    max_model_len: int,
    seed: int,
    temperature: float,
    cuda: bool,
) -> dict:
    """`vllm.LLM`'s arguments for `VllmEngine`. CUDA graphs (enforce_eager off) on a GPU, the main reason vLLM is fast
    there, unless SPARK drafts inside vLLM: its hooks correct the drafter's logits between vLLM's steps and are not
    yet verified with captured graphs or with async scheduling (vLLM's GPU default for EAGLE methods, under which a
    draft can start before the last verification's outcome is read), so that engine runs eagerly and in order (and
    says so). The CPU build runs eagerly."""
    spark = draft_dir is not None and (Path(draft_dir) / SPARK_FILE).exists()
    eager = not cuda or spark
    if cuda and spark:
        print(
            "sparkrl: SPARK inside vLLM runs without CUDA graphs and without async scheduling (its hooks are "
            "verified with neither)",
            file=sys.stderr,
        )
    spec = (
        {"method": method(draft_dir), "model": str(draft_dir), "num_speculative_tokens": spec_tokens}
        if draft_dir
        else None
    )
    return dict(
        model=str(policy_dir),
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        skip_tokenizer_init=True,
        enforce_eager=eager,
        # whole prefills: vLLM-CPU 0.32 fails on a seeded request whose prefill is chunked (its
        # CPU generator has no offset to rewind: gpu_model_runner._bookkeeping_sync)
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(max_model_len, 16384),
        hf_overrides={"architectures": [ARCHITECTURES[args.arch]]},
        **({"speculative_config": spec} if spec else {}),
        # SPARK's update reads each verification's outcome before the next draft: scheduled steps in order
        **({"async_scheduling": False} if spark else {}),
        logprobs_mode="raw_logprobs" if temperature in (0, 1) else "processed_logprobs",
    )


class VllmEngine:
    """One vLLM engine serving the policy in `policy_dir` (a Hugging Face folder), with the drafter in `draft_dir`
    (an `export_draft` folder) drafting `spec_tokens` tokens a round, or none. The folder must stay while the engine
    lives: vLLM reads a DFlash-style drafter's mask embedding from it again at every in-place update."""

    def __init__(
        self,
        policy_dir: Path,
        args: ModelArgs,
        dtype: str,
        draft_dir: Path | None = None,
        spec_tokens: int = 3,
        max_model_len: int = 2048,
        seed: int = 0,
        temperature: float = 1.0,
    ):
        vllm = vllm_module()
        self.vllm, self.tied = vllm, args.tie_word_embeddings
        self.dtype = getattr(torch, dtype)
        cuda = torch.cuda.is_available()
        # vLLM-CPU's worker binds this whole process's memory to one NUMA node and replaces torch.set_num_threads,
        # for every caller in the process, with a function that only warns: both are given back after it starts
        # (or fails to)
        set_num_threads = torch.set_num_threads
        try:
            with memory_policy_kept():
                self.llm = vllm.LLM(**engine_options(policy_dir, args, dtype, draft_dir, spec_tokens, max_model_len,
                                                     seed, temperature, cuda))  # fmt: skip
        finally:
            torch.set_num_threads = set_num_threads
        self.warm_up()

    def warm_up(self) -> None:
        """One short request, untimed, at start-up: the first request that asks for log-probabilities compiles
        vLLM's sampler's rank count (torch.compile through inductor), about 2 s on a 2-core CPU with inductor's cache
        warm and more without it, which would otherwise land on the user's first request."""
        params = self.vllm.SamplingParams(max_tokens=4, temperature=1.0, logprobs=0, seed=0)
        self.llm.generate([{"prompt_token_ids": [0, 1, 2]}], params, use_tqdm=False)
        if (spark := self.spark()) is not None:
            spark.clear()

    @classmethod
    def serving(
        cls,
        lm,
        drafter,
        dtype: torch.dtype,
        spec_tokens: int,
        max_model_len: int,
        seed: int = 0,
        temperature: float = 1.0,
        spark: tuple[torch.Tensor, dict] | None = None,
    ) -> "VllmEngine":
        """An engine serving the loaded policy `lm` (`weights.LoadedModel`: its folder, config and weights) with
        `drafter` (None: none) exported to it through a temporary folder that lives as long as the engine;
        spark: SPARK's A and settings (`spark.write_projection`) exported with it (None: SPARK off)."""
        tmp = tempfile.TemporaryDirectory(prefix="sparkrl-vllm-")
        draft = (
            None
            if drafter is None
            else export_draft(
                drafter, lm.model, json.loads((lm.path / "config.json").read_text()), Path(tmp.name) / "draft", dtype
            )
        )
        if spark is not None:
            write_projection(draft, spark[0], **spark[1])
        engine = cls(
            lm.path,
            lm.model.args,
            str(dtype).removeprefix("torch."),
            draft,
            spec_tokens,
            max_model_len,
            seed,
            temperature,
        )
        engine.folder = tmp  # removed with the engine
        return engine

    def runner(self):
        """vLLM's model runner, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def load_policy(self, weights: dict) -> None:
        """The policy's new weights (Hugging Face names, `Transformer.weights()`) into the served model, in place:
        vLLM's layer-wise reload (its CPU layers keep repacked copies of their weights, which a plain load would
        leave stale); a head tied to the embedding is repacked too (the reload leaves it on the old weights)."""
        runner = self.runner()
        runner.reload_weights(weights_iterator=[(k, v.detach().to(self.dtype)) for k, v in weights.items()])
        model = runner.get_model()
        if self.tied:
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
        self.llm.reset_prefix_cache()  # cached prompt keys and values were the old policy's

    def spark(self):
        """SPARK's state in the served drafter (`spark.VllmSpark`), or None (no drafter, or its folder held no
        projection)."""
        return getattr(getattr(self.runner(), "drafter", None), "spark", None)

    def load_drafter(self, weights: dict, A: torch.Tensor | None = None) -> None:
        """The drafter's new weights (`vllm_export.served_weights`) into vLLM's drafter, in place; what vLLM shares
        with the target (an output head equal to the target's at load) follows the target and is not sent. A
        DFlash-style drafter's mask embedding and context projection follow (`context_projection`). A: SPARK's new
        projection (with SPARK on)."""
        if A is not None:
            self.spark().set_projection(A)
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        runner = self.runner()
        draft, model = runner.get_draft_model(), runner.get_model()
        shared = {"lm_head.weight"} if draft.lm_head is model.lm_head else set()
        kept = shared | {"t2d", "mask_embedding"}
        sent = [(k, v.detach().to(self.dtype)) for k, v in weights.items() if k not in kept]
        with set_current_vllm_config(runner.vllm_config):
            reload_weights(
                runner.vllm_config, draft, weights_iterator=sent, weights_path=None, is_checkpoint_format=True
            )
        if "mask_embedding" in weights:  # a DFlash-style drafter (vLLM's qwen3_dflash)
            context_projection(draft.model, weights, self.dtype)
        self.llm.reset_prefix_cache()

    def counters(self) -> dict:
        """The engine's cumulative drafting counts (`plugin.Drafted`; zeros without a drafter)."""
        drafted = getattr(self.runner(), "sparkrl_drafted", None)
        if drafted is None:
            if self.llm.llm_engine.vllm_config.speculative_config is not None:
                raise UserError(
                    "sparkrl's vLLM plugin is not active (vLLM loads it from the `vllm.general_plugins` "
                    "entry point): reinstall sparkrl in this environment, or use vLLM 0.32.0"
                )
            return {k: 0 for k in COUNTERS} | {"per_position": []}
        return drafted.counts()

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        eos_ids: tuple[int, ...],
        group_size: int = 1,
        seed: int = 0,
    ) -> VllmRollout:
        """group_size responses to each prompt (token ids), each ending at an EOS id or max_new_tokens (no eos_ids:
        every response runs to max_new_tokens, as in sparkrl's engine); prompt i's request is seeded with seed + i."""
        greedy = sampling.temperature == 0
        reqs = [{"prompt_token_ids": p} for p in prompts]
        params = [
            self.vllm.SamplingParams(
                n=group_size,
                temperature=sampling.temperature,
                top_p=1.0 if greedy else sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=list(eos_ids),
                ignore_eos=not eos_ids,  # vLLM stops at the model's own EOS unless told not to
                logprobs=0,
                seed=seed + i,
            )
            for i in range(len(prompts))
        ]
        before, spark = self.counters(), self.spark()
        t0 = time.perf_counter()
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        gen_s = time.perf_counter() - t0
        adapter = {"spark_s": 0.0}
        if spark is not None:  # every group is done: its B goes (vLLM reports the last finished ones a step late)
            adapter = spark.metrics()
            spark.clear()
        after = self.counters()
        drafted = {k: after[k] - before[k] for k in COUNTERS}
        drafted["per_position"] = [a - b for a, b in zip(after["per_position"], before["per_position"])]
        tokens, logps, reasons = [], [], []
        for out in outs:
            for o in sorted(out.outputs, key=lambda o: o.index):
                tokens.append(list(o.token_ids))
                logps.append([lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)])
                reasons.append("stop" if o.finish_reason == "stop" else "length")
        return VllmRollout(tokens, logps, reasons, gen_s, drafted, adapter)


def context_projection(model, weights: dict, dtype: torch.dtype) -> None:
    """What vLLM's DFlash model (`qwen3_dflash.DFlashQwen3Model`) keeps of its weights besides the weights, made
    anew from a DFlash-style drafter's `weights` after an in-place reload: the mask embedding (its loader would read the
    one in the folder's file instead), and what its context projection reads (`_build_fused_kv_buffers`: views of the
    reloaded norms and RoPE table, and every layer's key and value weights in one matrix, made here from `weights`:
    a reload leaves the layers' own already repacked by vLLM-CPU's linear layers, which keep no plain copy)."""
    with torch.no_grad():
        model.mask_embedding.copy_(weights["mask_embedding"].reshape(-1))
        model._build_fused_kv_buffers()
        kv = [weights[f"layers.{i}.self_attn.{p}_proj.weight"] for i in range(len(model.layers)) for p in "kv"]
        model._fused_kv_weight = torch.cat(kv).to(dtype).contiguous()


class VllmGeneration(RolloutEngine):
    """`engine.speculative`'s `generate` contract on a `VllmEngine`, for the trainer: a `records.Rollout` whose
    log-probabilities are vLLM's and whose `RoundStats` hold vLLM's drafting counts (a round is one request's
    verification: `rounds` and `row_rounds` both count them). Request i is seeded from its group's first
    generator, so a run's rollouts are reproducible from its seed."""

    def __init__(self, engine: VllmEngine, depth: int):
        self.engine, self.depth = engine, depth

    def generate(
        self,
        model,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        eos_ids: tuple[int, ...],
        generators: list[torch.Generator],
        group_size: int = 1,
        progress=None,
        sampler=None,
    ) -> Rollout:
        seed = generators[0].initial_seed() % (1 << 31)
        r = self.engine.generate(prompts, sampling, eos_ids, group_size, seed)
        if progress is not None:
            progress(r.num_tokens)
        stats = RoundStats(depth=self.depth if r.drafted.get("drafts") else 0)
        if stats.depth:
            n = int(r.drafted["drafts"])
            stats.rounds = stats.row_rounds = stats.tree_rounds = stats.tree_row_rounds = n
            stats.committed = n + int(r.drafted["accepted_tokens"])
            stats.accepted_at_depth = [int(a) for a in r.drafted["per_position"][: self.depth]]
        stats.adapter = r.adapter
        return Rollout(
            [list(p) for p in prompts], group_size, r.tokens, r.finish_reason, r.gen_s, stats, logp=r.logprobs
        )
