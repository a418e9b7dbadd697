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
from sparkrl.commands.analysis import interval95, resample_weights
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
PAPER_TABLE2 = {
    "full SPARK": (3.28, 2.02),
    "update every 5 rounds": (3.11, 1.95),
    "update every 10 rounds": (3.01, 1.92),
    "update every 15 rounds": (2.85, 1.84),
    "per-response correction": (3.24, 1.96),
    "batch-wide correction": (3.12, 1.92),
    "carry correction across rollouts": (3.05, 1.85),
    "accepted feedback only": (3.02, 1.94),
    "frozen projection A": (2.88, 1.91),
    "rank 4": (3.20, None),
    "rank 32": (3.31, None),
    "k 8": (3.24, 1.99),
    "k 32": (3.29, 1.97),
}
PAPER_TABLE1_MEAN = {
    "eagle3": {"gen": 1.84, "e2e": 1.75, "aal": 2.52},
    "eagle3+spark": {"gen": 2.43, "e2e": 2.31, "aal": 3.47},
    "dflash": {"gen": 2.06, "e2e": 1.94, "aal": 2.46},
    "dflash+spark": {"gen": 2.30, "e2e": 2.11, "aal": 2.82},
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


def _read(folder: str, steps: int | None = None) -> tuple[list[dict], list[dict]]:
    """A run's metrics and round traces of its first `steps` steps (a killed bench may have run past them)."""
    f = Path(folder)
    metrics = [json.loads(l) for l in (f / "metrics.jsonl").read_text().splitlines() if l.strip()]
    metrics = [m for m in metrics if steps is None or m["step"] <= steps]
    done = {m["step"] for m in metrics}
    rounds = (
        [json.loads(l) for l in (f / "rounds.jsonl").read_text().splitlines() if l.strip()]
        if (f / "rounds.jsonl").exists()
        else []
    )
    rounds = list({r["step"]: r for r in rounds if r["step"] in done}.values())  # last write of each step
    return metrics, rounds


def summarize(folder: str, ar_folder: str | None, steps: int | None = None) -> dict:
    """Totals of one run and its speedups over the AR run."""
    m, rounds = _read(folder, steps)
    step_s = [x["gen_s"] + x["train_s"] + x["draft_train_s"] for x in m]
    out = {
        "steps": len(m),
        "gen_s": sum(x["gen_s"] for x in m),
        "gen_tokens": sum(x["gen_tokens"] for x in m),
        "train_s": sum(x["train_s"] for x in m),
        "draft_train_s": sum(x["draft_train_s"] for x in m),
        "step_s": step_s,
        "aal_per_step": [x.get("aal") for x in m],
        "gen_s_per_token": [x["gen_s"] / max(x["gen_tokens"], 1) for x in m],
        "spark_s": sum(x.get("spark_s", 0.0) for x in m),
        "reward_per_step": [x["reward_mean"] for x in m],
        "kl_per_step": [x.get("kl") for x in m],
    }
    if "row_rounds" in m[0]:
        out["aal"] = sum(x["committed"] for x in m) / max(sum(x["row_rounds"] for x in m), 1)
    out["rounds"] = rounds
    if ar_folder is not None:
        a, _ = _read(ar_folder, steps)
        step_a = [x["gen_s"] + x["train_s"] + x["draft_train_s"] for x in a]
        out["e2e_speedup_median_step"] = statistics.median([x / y for x, y in zip(step_a, step_s)])
        g = gains(ar_folder, folder, steps)
        out["gen_speedup"], out["e2e_speedup"] = g["gen"], g["e2e"]
        out["gen_speedup_ci"], out["e2e_speedup_ci"] = g["gen_ci"], g["e2e_ci"]
    return out


def gains(base: str, other: str, steps: int | None = None, bootstrap: int = 2000, seed: int = 0) -> dict:
    """Run `other` against run `base` over their common steps: AAL ratio, generation speedup (time per
    generated token) and E2E speedup (time per step), each with a 95% bootstrap interval over steps
    (the two runs' step s drew the same prompts and seeds, so steps are resampled in pairs)."""
    a, b = (_read(f, steps)[0] for f in (base, other))
    n = min(len(a), len(b))
    if n == 0:
        return {}
    col = lambda ms, k: torch.tensor([float(x.get(k, 0.0)) for x in ms[:n]], dtype=torch.float64)
    tot = lambda ms: col(ms, "gen_s") + col(ms, "train_s") + col(ms, "draft_train_s")
    w = torch.cat(
        [
            torch.ones(1, n, dtype=torch.float64),  # row 0: the runs themselves
            resample_weights(n, bootstrap, torch.Generator().manual_seed(seed)),
        ]
    )
    ratios = {
        "gen": (w @ col(a, "gen_s"))
        / (w @ col(a, "gen_tokens"))
        / ((w @ col(b, "gen_s")) / (w @ col(b, "gen_tokens"))),
        "e2e": (w @ tot(a)) / (w @ tot(b)),
    }
    if "row_rounds" in a[0] and "row_rounds" in b[0]:
        ratios["aal"] = (
            (w @ col(b, "committed"))
            / (w @ col(b, "row_rounds"))
            / ((w @ col(a, "committed")) / (w @ col(a, "row_rounds")))
        )
    return {
        "steps": n,
        **{k: float(r[0]) for k, r in ratios.items()},
        **{k + "_ci": [float(x) for x in interval95(r[1:])] for k, r in ratios.items()},
    }


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


def _change(x: float) -> str:
    return f"{'↑' if x >= 0 else '↓'}{abs(x) * 100:.1f}%"


def _gain_ci(g: dict, k: str) -> str:
    """A `gains` ratio as a change with its interval: ↑1.6% [↓1.1%, ↑4.7%]."""
    return f"{_change(g[k] - 1)} [{_change(g[k + '_ci'][0] - 1)}, {_change(g[k + '_ci'][1] - 1)}]"


def markdown(results: dict, cfg: BenchConfig) -> str:
    f = lambda x: "-" if x is None else f"{x:.2f}"
    lines = [
        f"sizes: {results['sizes']}, budget {cfg.budget}, drafters: {cfg.draft_checkpoint or '(shipped or fresh)'} "
        f"(EAGLE3-style), "
        f"{cfg.dflash_checkpoint or '(shipped or fresh)'} (DFlash-style, block {cfg.block_size})",
        "",
    ]
    if cfg.ablations:
        lines += [
            "| dataset | configuration | AAL | E2E (x) | vs full SPARK: AAL | E2E | paper AAL | paper E2E |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, d in results["datasets"].items():
            for v, s in d["methods"].items():
                pa, pe = PAPER_TABLE2.get(v, (None, None))
                vs = [_gain_ci(g, k) for k in ("aal", "e2e") for g in s.get("vs_full", [])[:1]] or ["", ""]
                lines.append(
                    f"| {name} | {v} | {f(s.get('aal'))} | {f(s.get('e2e_speedup'))} | {vs[0]} | {vs[1]} "
                    f"| {f(pa)} | {f(pe)} |"
                )
        lines += [
            "",
            "vs full SPARK: the variant's ratio to the full SPARK run of the same chunk (same prompts, seeds and "
            "updates), 95% interval over steps resampled in pairs; a variant run in several chunks shows its first.",
        ]
        return "\n".join(lines) + "\n"
    cols = {"Gen.": "gen_speedup", "E2E": "e2e_speedup", "AAL": "aal"}
    for fam, name_ in (("eagle3", "EAGLE3-style"), ("dflash", "DFlash-style")):
        pair = (fam, f"{fam}+spark")
        if not any(m in d["methods"] for d in results["datasets"].values() for m in pair):
            continue
        lines += [
            f"{name_}:",
            "",
            "| dataset | " + " | ".join(f"{c} {s}" for c in cols for s in ("Orig.", "+SPARK")) + " |",
            "| --- |" + " --- |" * 6,
        ]
        means = {k: {m: [] for m in pair} for k in cols}
        for name, d in results["datasets"].items():
            row = [name]
            for k, key in cols.items():
                for m in pair:
                    v = d["methods"].get(m, {}).get(key)
                    row.append(f(v))
                    if v is not None:
                        means[k][m].append(v)
            lines.append("| " + " | ".join(row) + " |")
        row = ["mean"]
        for k in cols:
            o, s_ = (statistics.mean(means[k][m]) if means[k][m] else None for m in pair)
            row += [f(o), f(s_) + (f" ({_change(s_ / o - 1)})" if o and s_ else "")]
        lines.append("| " + " | ".join(row) + " |")
        p, q = PAPER_TABLE1_MEAN[pair[0]], PAPER_TABLE1_MEAN[pair[1]]
        gain = lambda k: f" ({_change(q[k] / p[k] - 1)})"
        lines += [
            f"| paper mean (21 settings) | {p['gen']} | {q['gen']}{gain('gen')} | {p['e2e']} | {q['e2e']}{gain('e2e')} "
            f"| {p['aal']} | {q['aal']}{gain('aal')} |",
            "",
        ]
        for name, d in results["datasets"].items():
            sg = d.get("spark_gain", {}).get(fam)
            if sg:
                ci = lambda k: _gain_ci(sg, k)
                lines += [
                    f"{name}: +SPARK over {name_} (95% interval, steps resampled in pairs, {sg['steps']} steps): "
                    f"Gen. {ci('gen')}, E2E {ci('e2e')}, AAL {ci('aal')}",
                    "",
                ]
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> None:
    """bench.png: per dataset (a column), AAL per step, time per step, AAL over the last rollout's rounds, and
    reward with KL to the starting policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = results["datasets"]
    fig, axes = plt.subplots(4, len(data), figsize=(6 * len(data), 16), squeeze=False)
    for j, (name, d) in enumerate(data.items()):
        ms = {m: s for m, s in d["methods"].items() if isinstance(s, dict)}
        for row, panel in enumerate((_aal_panel, _time_panel, _rounds_panel, _reward_panel)):
            panel(axes[row][j], name, ms)
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=110)
    plt.close(fig)


def _aal_panel(ax, name: str, ms: dict) -> None:
    for m, s in ms.items():
        if any(a is not None for a in s["aal_per_step"]):
            ax.plot(range(1, len(s["aal_per_step"]) + 1), s["aal_per_step"], "o-", label=m)
    ax.set_title(f"{name}: AAL per GRPO step")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("AAL")
    ax.legend(fontsize=7)


def _time_panel(ax, name: str, ms: dict) -> None:
    names = list(ms)
    bottom = [0.0] * len(names)
    for part in ("gen_s", "draft_train_s", "train_s"):
        vals = [ms[m][part] / max(ms[m]["steps"], 1) for m in names]
        ax.bar(names, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title(f"{name}: time per GRPO step")
    ax.set_ylabel("seconds")
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    ax.legend(fontsize=7)


def _rounds_panel(ax, name: str, ms: dict) -> None:
    """AAL over the rounds of the last rollout (as in the paper's Fig. 5), over the active responses (bars)."""
    ax2 = ax.twinx()
    bars = False
    for m, s in ms.items():
        if not s.get("rounds"):
            continue
        tr = s["rounds"][-1]["active_aal"]
        if not tr:
            continue
        w = 8
        aal = [a for _, a in tr]
        ax.plot([statistics.mean(aal[max(0, i - w + 1) : i + 1]) for i in range(len(aal))], label=m)
        if not bars:  # the number of active responses of the first drafting method
            ax2.bar(range(len(tr)), [n for n, _ in tr], color="0.85", width=1.0)
            bars = True
    ax.set_zorder(ax2.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_title(f"{name}: AAL over rounds of the last rollout (moving average of 8)")
    ax.set_xlabel("verification round")
    ax2.set_ylabel("active responses (bars)")
    ax.legend(fontsize=7)


def _reward_panel(ax, name: str, ms: dict) -> None:
    """How far the policy moved: reward, and k3 KL to the starting policy (dashed)."""
    ax2 = ax.twinx()
    for m, s in ms.items():
        steps = range(1, len(s["reward_per_step"]) + 1)
        line = ax.plot(steps, s["reward_per_step"], "o-", ms=3, label=m)[0]
        if any(k is not None for k in s.get("kl_per_step", [])):
            ax2.plot(steps, s["kl_per_step"], "--", color=line.get_color())
    ax.set_title(f"{name}: reward (solid) and KL to the starting policy (dashed)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward")
    ax2.set_ylabel("KL (k3) to the start")
    ax.legend(fontsize=7)
