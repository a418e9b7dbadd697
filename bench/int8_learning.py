"""Does a policy learn from int8 rollouts as it learns from bfloat16 ones? Paired GRPO runs of the quick-start task
(the default policy and data, 4 prompts x 4 responses, 96 tokens, the README's demonstration learning rate), one
per seed and --rollout-dtype, TIS on at its default cap: the same seed gives both dtypes the same problems in the
same order. Runs go one after another (seed 0 bf16, seed 0 int8, seed 1 ...), each in its own folder under
--runs, and resume where they stopped: rerun the same command after a kill. Writes int8_learning.json (per run:
the curves, the final values as the mean of the last --tail steps, the rollout gap against the float32 master;
per dtype: the mean and spread of the finals over seeds) and int8_learning.png (reward, accuracy and format rate
per step, every run, both dtypes on one picture) into --out.

    nohup .venv/bin/python bench/int8_learning.py --out bench/results/int8_learning > /tmp/int8_learning.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CURVES = {"reward_mean": "reward", "accuracy": "accuracy", "format": "format rate"}
GAP = ("rollout_kl", "rollout_logp_abs_mean", "rollout_logp_abs_max")


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def train(run: Path, seed: int, dtype: str, a: argparse.Namespace) -> None:
    """One run to --steps, resumed from its newest checkpoint when it has one (a folder with no checkpoint is
    started again: nothing finished is lost, a run writes its first checkpoint after --checkpoint-every steps)."""
    if len(read_metrics(run)) >= a.steps:
        return
    resume = any((run / "checkpoints").glob("step-*")) if (run / "checkpoints").exists() else False
    if run.exists() and not resume:
        shutil.rmtree(run)
    cmd = [sys.executable, "-m", "sparkrl", "train", "--model", "default", "--data", "default", "--out", str(run),
           "--steps", str(a.steps), "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "96",
           "--lr", "3e-5", "--seed", str(seed), "--rollout-dtype", dtype, "--checkpoint-every", "5"]  # fmt: skip
    print(f"{time.strftime('%H:%M:%S')} {run.name}: " + ("resuming" if resume else "starting"), flush=True)
    subprocess.run(cmd + (["--resume"] if resume else []), check=True, stdout=subprocess.DEVNULL)


def summarize(runs: dict[tuple[int, str], Path], a: argparse.Namespace) -> dict:
    out = {"runs": [], "finals": {}}
    for (seed, dtype), run in runs.items():
        rows = read_metrics(run)[: a.steps]
        tail = rows[-a.tail :]
        out["runs"].append({
            "seed": seed, "rollout_dtype": dtype, "steps": len(rows),
            "curves": {k: [r[k] for r in rows] for k in CURVES},
            "final": {k: statistics.fmean(r[k] for r in tail) for k in CURVES} if tail else {},
            "gap": {k: statistics.fmean(r[k] for r in rows if k in r) for k in GAP if any(k in r for r in rows)},
        })  # fmt: skip
    for dtype in a.dtypes.split(","):
        finals = [r["final"] for r in out["runs"] if r["rollout_dtype"] == dtype and r["steps"] == a.steps]
        if finals:
            out["finals"][dtype] = {k: {"mean": statistics.fmean(f[k] for f in finals),
                                        "min": min(f[k] for f in finals), "max": max(f[k] for f in finals)}
                                    for k in CURVES} | {"seeds": len(finals)}  # fmt: skip
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"bfloat16": "tab:blue", "int8": "tab:orange", "float32": "tab:green"}
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.4))
    for ax, (key, title) in zip(axes, CURVES.items()):
        for r in result["runs"]:
            y = r["curves"][key]
            ax.plot(range(1, len(y) + 1), y, color=colors.get(r["rollout_dtype"], "gray"), alpha=0.75,
                    ls=["-", "--", ":"][r["seed"] % 3], label=f"{r['rollout_dtype']} seed {r['seed']}")  # fmt: skip
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("GRPO on the quick-start task: bfloat16 against int8 rollouts (TIS on), paired by seed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/int8_learning")
    ap.add_argument("--runs", default="runs/int8_learning", help="the runs' folders (1.6 GB each)")
    ap.add_argument("--dtypes", default="bfloat16,int8")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tail", type=int, default=5, help="a run's final value: the mean of its last TAIL steps")
    ap.add_argument("--no-train", action="store_true", help="only summarize and plot the runs as they stand")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {(int(s), d): Path(a.runs) / f"seed{s}-{d}" for s in a.seeds.split(",") for d in a.dtypes.split(",")}
    for (seed, dtype), run in runs.items():
        if not a.no_train:
            train(run, seed, dtype, a)
        result = {"command": "python bench/int8_learning.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items())}
        result |= summarize(runs, a)
        (out / "int8_learning.json").write_text(json.dumps(result, indent=1))
        plot(result, out / "int8_learning.png")
    for dtype, f in result["finals"].items():
        shown = [f"{CURVES[k]} {v['mean']:.3f} [{v['min']:.3f}, {v['max']:.3f}]" for k, v in f.items() if k in CURVES]
        print(f"{dtype} ({f['seeds']} seeds): " + ", ".join(shown))


if __name__ == "__main__":
    main()
