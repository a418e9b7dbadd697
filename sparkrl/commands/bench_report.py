"""What `sparkrl bench` reports from its runs' folders: each run's totals and its speedups over the AR run
(`summarize`), one run against another with 95% bootstrap intervals over steps resampled in pairs (`gains`),
bench.md's tables beside the paper's numbers (`ablation_table`, `method_tables`) and bench.png (`plot`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from sparkrl.commands.analysis import interval95, resample_weights

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


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _change(x: float) -> str:
    return f"{'↑' if x >= 0 else '↓'}{abs(x) * 100:.1f}%"


def _gain_ci(g: dict, k: str) -> str:
    """A `gains` ratio as a change with its interval: ↑1.6% [↓1.1%, ↑4.7%]."""
    return f"{_change(g[k] - 1)} [{_change(g[k + '_ci'][0] - 1)}, {_change(g[k + '_ci'][1] - 1)}]"


def ablation_table(results: dict) -> list[str]:
    """bench.md's lines under --ablations: per dataset, each Table 2 / appendix C row, its ratios to full SPARK and
    the paper's numbers."""
    lines = [
        "| dataset | configuration | AAL | E2E (x) | vs full SPARK: AAL | E2E | paper AAL | paper E2E |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, d in results["datasets"].items():
        for v, s in d["methods"].items():
            pa, pe = PAPER_TABLE2.get(v, (None, None))
            vs = [_gain_ci(g, k) for k in ("aal", "e2e") for g in s.get("vs_full", [])[:1]] or ["", ""]
            lines.append(
                f"| {name} | {v} | {_num(s.get('aal'))} | {_num(s.get('e2e_speedup'))} | {vs[0]} | {vs[1]} "
                f"| {_num(pa)} | {_num(pe)} |"
            )
    lines += [
        "",
        "vs full SPARK: the variant's ratio to the full SPARK run of the same chunk (same prompts, seeds and "
        "updates), 95% interval over steps resampled in pairs; a variant run in several chunks shows its first.",
    ]
    return lines


def method_tables(results: dict) -> list[str]:
    """bench.md's lines of the main table: per drafter family, Gen., E2E and AAL of the original and +SPARK
    methods per dataset, their means beside the paper's, and +SPARK's gains with their intervals."""
    lines = []
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
                    row.append(_num(v))
                    if v is not None:
                        means[k][m].append(v)
            lines.append("| " + " | ".join(row) + " |")
        row = ["mean"]
        for k in cols:
            o, s_ = (statistics.mean(means[k][m]) if means[k][m] else None for m in pair)
            row += [_num(o), _num(s_) + (f" ({_change(s_ / o - 1)})" if o and s_ else "")]
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
    return lines


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
