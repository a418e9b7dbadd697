"""`sparkrl bench`: the paper's Table 1 (and, with --ablations, Table 2 and appendix C) measured here.

Every method is a full GRPO run (`trainer.GRPORun`) from the same policy and drafter checkpoint, with
the same prompts, per-response seeds and number of policy updates. The runs are interleaved step by
step (the order alternating), so machine drift hits every method alike. Each run keeps its own
folder (config.json, metrics.jsonl, checkpoints/, rounds.jsonl of per-round AAL, round_log.jsonl of
every drafted token's outcome for `sparkrl analyze`), which is also what
--resume continues from. Reported, per dataset (paper section 4.1):

* Gen.: autoregressive generation time per generated token / the method's;
* E2E: autoregressive GRPO time / the method's at the same number of updates (generation, online
  draft training and the policy update);
* AAL: tokens committed per verification round per response.

Ablations run in chunks of [ar, full SPARK, up to three variants] (memory: every live run holds a
policy, its optimizer and a drafter), each variant's E2E relative to the AR run of its chunk.

`bench_report` makes the measures and their intervals, bench.md's tables (beside the paper's numbers) and
bench.png from the runs' folders.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from sparkrl import __version__
from sparkrl.commands.bench_report import ablation_table, gains, method_tables, plot, summarize
from sparkrl.config import (
    BudgetKind,
    Checked,
    DataConfig,
    DraftConfig,
    GRPOConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    SparkConfig,
    above,
    at_least,
    block_size,
    existing_checkpoint,
    option,
    require,
    to_dict,
)
from sparkrl.errors import UserError
from sparkrl.model.weights import resolve_model_path
from sparkrl.train.data import load_problems
from sparkrl.train.trainer import GRPORun

BENCH_METHODS = ("ar", "eagle3", "eagle3+spark", "dflash", "dflash+spark")


@dataclass(frozen=True)
class BenchConfig(Checked):
    out: str = option("", required=True)
    """Output directory: bench.json, bench.md, PNG plots, and one GRPO run folder per dataset and method."""
    datasets: str = "default"
    """Datasets, comma-separated (each as for --data: default, a local file such as
    ../shared/data/gsm8k/train.jsonl, or a hub id)."""
    preset: Literal["quick", "paper"] = "quick"
    """Sizes: quick (minutes on a CPU) or paper (G = 8, 2,048-token responses; as long as it takes)."""
    methods: str = "ar,eagle3,eagle3+spark"
    """Methods, comma-separated, from: ar, eagle3, eagle3+spark, dflash, dflash+spark."""
    draft_checkpoint: str = ""
    """The pretrained EAGLE3-style drafter the eagle3 methods start from (as --draft-checkpoint: empty is the
    shipped one for the default model, else a freshly initialised one)."""
    dflash_checkpoint: str = ""
    """The pretrained DFlash-style drafter the dflash methods start from (as --draft-checkpoint)."""
    block_size: int = block_size()
    """Block size of the dflash methods."""
    budget: BudgetKind = "fixed"
    """Drafting budget of the drafting methods (fixed: the paper's; auto: the cost-model fallback)."""
    ablations: bool = False
    """Run the paper's Table 2 rows and the rank / k sweeps (appendix C) instead of the main table."""
    variants: str = ""
    """With --ablations: the rows to run, comma-separated Table 2 / appendix C names such as 'carry correction
    across rollouts,frozen projection A' (empty: all of them)."""
    steps: int = at_least(0, 0, "0: the preset's")
    """GRPO steps (policy updates) per method (0: the preset's)."""
    prompts_per_step: int = at_least(0, 0, "0: the preset's")
    """Prompts per step (0: the preset's)."""
    group_size: int = at_least(0, 0, "0: the preset's")
    """Responses per prompt (0: the preset's)."""
    max_new_tokens: int = at_least(0, 0, "0: the preset's")
    """Longest response (0: the preset's)."""
    seed: int = 0
    """Seed of every method's run (same prompts and per-response seeds for all)."""
    lr: float = above(0, GRPOConfig.lr)
    """Policy learning rate of every method's run (the paper's 1e-6 barely moves a 135M model in a few
    steps; a larger one makes the policy drift away from the drafter, the regime SPARK targets)."""
    spark_lr: float = above(0, SparkConfig.spark_lr)
    """Learning rate of SPARK's projection A in the +spark methods (as train's --spark-lr)."""
    temperature: float = above(0, SamplingConfig.temperature)
    """Sampling temperature of every method's rollouts (GRPO's usual 1; lower makes the policy sharper)."""
    resume: bool = False
    """Continue an interrupted bench in --out (every method resumes from its last checkpoint)."""
    model: ModelConfig = ModelConfig()

    def validate(self):
        require(bool(self.out), "--out is required: the directory for the bench results")
        for m in self.methods.split(","):
            require(m in BENCH_METHODS, f"--methods: unknown method {m!r}; choose from {', '.join(BENCH_METHODS)}")
        existing_checkpoint("--draft-checkpoint", self.draft_checkpoint)
        existing_checkpoint("--dflash-checkpoint", self.dflash_checkpoint)
        require(self.group_size != 1, "--group-size must be >= 2 (advantages are relative to the group), or 0")
        require(not self.variants or self.ablations, "--variants chooses rows of --ablations; pass --ablations too")


PRESETS = {  # GRPO sizes: (steps, prompts per step, group size, response limit)
    "quick": dict(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=96),
    "paper": dict(steps=20, prompts_per_step=4, group_size=8, max_new_tokens=2048),
}

ABLATIONS = {  # paper Table 2 rows and the appendix C sweeps: changes to full SPARK
    "update every 5 rounds": {"spark_every": 5},
    "update every 10 rounds": {"spark_every": 10},
    "update every 15 rounds": {"spark_every": 15},
    "per-response correction": {"spark_scope": "response"},
    "batch-wide correction": {"spark_scope": "batch"},
    "carry correction across rollouts": {"spark_carry": True},
    "accepted feedback only": {"spark_feedback": "accepted"},
    "frozen projection A": {"spark_frozen_a": True},
    "rank 4": {"spark_rank": 4},
    "rank 16": {"spark_rank": 16},
    "rank 32": {"spark_rank": 32},
    "k 8": {"spark_k": 8},
    "k 32": {"spark_k": 32},
    "k 64": {"spark_k": 64},
}


def sizes(cfg: BenchConfig) -> dict:
    out = dict(PRESETS[cfg.preset])
    for k in out:
        if getattr(cfg, k):
            out[k] = getattr(cfg, k)
    return out


def dataset_name(data: str) -> str:
    p = Path(data)
    if p.suffix in (".jsonl", ".parquet", ".json"):
        return p.parent.name if p.stem in ("train", "test") else p.stem
    return p.name or data


def run_config(cfg: BenchConfig, data: str, method: str, folder: str, spark: dict | None = None) -> RunConfig:
    """The GRPO run of one method on one dataset."""
    sz = sizes(cfg)
    draft = DraftConfig()
    if method != "ar":
        kind = method.split("+")[0]
        draft = DraftConfig(
            draft=kind,
            draft_checkpoint=cfg.dflash_checkpoint if kind == "dflash" else cfg.draft_checkpoint,
            block_size=cfg.block_size,
            budget=cfg.budget,
            spark_config=SparkConfig(spark=True, **{"spark_lr": cfg.spark_lr, **(spark or {})})
            if "spark" in method
            else SparkConfig(),
            round_log=str(Path(folder) / "round_log.jsonl"),
        )  # for `sparkrl analyze` at any stage
    return RunConfig(
        out=folder,
        steps=sz["steps"],
        seed=cfg.seed,
        resume=cfg.resume,
        checkpoint_every=1,
        keep_checkpoints=1,
        model=cfg.model,
        sampling=SamplingConfig(cfg.temperature, max_new_tokens=sz["max_new_tokens"]),
        data=DataConfig(data=data),
        grpo=GRPOConfig(group_size=sz["group_size"], prompts_per_step=sz["prompts_per_step"], lr=cfg.lr),
        draft=draft,
    )


def interleave(configs: dict[str, RunConfig], grader=None, log=print) -> None:
    """Run the GRPO runs step by step, alternating their order; each resumes from its own checkpoint."""
    runs = {name: GRPORun(c, grader) for name, c in configs.items()}
    start = {name: r.resume() for name, r in runs.items()}
    steps = max(c.steps for c in configs.values())
    try:
        for step in range(min(start.values()), steps):
            names = list(runs) if step % 2 == 0 else list(runs)[::-1]
            for name in names:
                run, c = runs[name], configs[name]
                if step < start[name]:
                    continue

                m = run.step(step, on_commit=run.checkpoint_if_due)
                trace = run.last_rollout.stats.active_aal
                with open(Path(c.out) / "rounds.jsonl", "a") as f:
                    f.write(json.dumps({"step": step + 1, "active_aal": trace}) + "\n")
                log(
                    f"sparkrl bench: step {step + 1}/{steps} {name}: gen {m['gen_s']:.1f}s, train "
                    f"{m['train_s'] + m['draft_train_s']:.1f}s" + (f", AAL {m['aal']:.2f}" if "aal" in m else "")
                )
    finally:
        for r in runs.values():
            r.grader.close()


def machine() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "sparkrl": __version__,
        "commit": commit,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def bench(cfg: BenchConfig, grader=None, log=print) -> dict:
    """Run the bench per `cfg` (resumable); writes and returns the results."""
    resolve_model_path(cfg.model.model)  # bad input fails before any run starts
    variant_names(cfg)
    datasets = cfg.datasets.split(",")
    for d in datasets:
        load_problems(d, 20)
    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()) and not cfg.resume:
        raise UserError(f"{out} already holds a bench; pass --resume to continue it, or choose a new --out")
    out.mkdir(parents=True, exist_ok=True)
    methods = cfg.methods.split(",")
    if "ar" not in methods:
        methods = ["ar"] + methods  # speedups are relative to autoregressive GRPO
    results = {"config": to_dict(cfg), "sizes": sizes(cfg), "machine": machine(), "datasets": {}}
    t0 = time.perf_counter()
    for data in datasets:
        name = dataset_name(data)
        folder = lambda m: str(out / name / m.replace("+", "_").replace(" ", "_"))
        if not cfg.ablations:
            interleave({m: run_config(cfg, data, m, folder(m)) for m in methods}, grader, log)
            steps = sizes(cfg)["steps"]
            res = {m: summarize(folder(m), folder("ar") if m != "ar" else None, steps) for m in methods}
            results["datasets"][name] = {
                "spark_gain": {
                    f: gains(folder(f), folder(f + "+spark"), steps)
                    for f in ("eagle3", "dflash")
                    if f in methods and f + "+spark" in methods
                }
            }
        else:
            names = variant_names(cfg)
            res = {}
            for i in range(0, len(names), 3):
                chunk = names[i : i + 3]
                tag = f"chunk{i // 3}"
                cfgs = {
                    "ar": run_config(cfg, data, "ar", folder(f"{tag}/ar")),
                    "full SPARK": run_config(cfg, data, "eagle3+spark", folder(f"{tag}/full")),
                }
                cfgs.update(
                    {v: run_config(cfg, data, "eagle3+spark", folder(f"{tag}/{v}"), ABLATIONS[v]) for v in chunk}
                )
                interleave(cfgs, grader, log)
                for v, c in cfgs.items():
                    if v == "ar":
                        continue
                    s = summarize(c.out, cfgs["ar"].out, sizes(cfg)["steps"])
                    if v != "full SPARK":  # against the full SPARK run of its own chunk, with intervals
                        s["vs_full"] = gains(cfgs["full SPARK"].out, c.out, sizes(cfg)["steps"])
                    res.setdefault(v, []).append(s)
            res = {v: _merge(ss) for v, ss in res.items()}
        results["datasets"].setdefault(name, {}).update(data=data, methods=res)
    results["wall_s"] = time.perf_counter() - t0
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "bench.md").write_text(markdown(results, cfg))
    plot(results, out)
    return results


def variant_names(cfg: BenchConfig) -> list[str]:
    """The ablation rows `--variants` chooses (all by default), in the table's order."""
    if not cfg.variants:
        return list(ABLATIONS)
    known = {v.lower(): v for v in ABLATIONS}
    chosen = [v.strip().lower() for v in cfg.variants.split(",")]
    for v in chosen:
        if v not in known:
            raise UserError(f"--variants: unknown row {v!r}; choose from: {', '.join(ABLATIONS)}")
    return [known[v] for v in known if v in chosen]


def _merge(ss: list[dict]) -> dict:
    """An ablation variant measured in several chunks (full SPARK is in every chunk): means."""
    keys = ("aal", "gen_speedup", "e2e_speedup")
    out = {
        **ss[0],
        **{k: statistics.mean(s[k] for s in ss if k in s) for k in keys if any(k in s for s in ss)},
        "chunks": len(ss),
    }
    if "vs_full" in ss[0]:
        out["vs_full"] = [s["vs_full"] for s in ss]  # one comparison per chunk
    return out


def markdown(results: dict, cfg: BenchConfig) -> str:
    """bench.md: the sizes and drafters, then Table 2's rows (--ablations) or Table 1's, beside the paper's."""
    lines = [
        f"sizes: {results['sizes']}, budget {cfg.budget}, drafters: {cfg.draft_checkpoint or '(shipped or fresh)'} "
        f"(EAGLE3-style), "
        f"{cfg.dflash_checkpoint or '(shipped or fresh)'} (DFlash-style, block {cfg.block_size})",
        "",
    ]
    lines += ablation_table(results) if cfg.ablations else method_tables(results)
    return "\n".join(lines) + "\n"
