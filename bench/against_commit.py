"""This tree's autoregressive decode step against another commit's, in alternating processes.

A change to the engine's kernels is measured against the code it replaces, not against a figure from another day:
each round starts one process on a git worktree of --base and one on this tree (in alternating order), each timing
the default policy's decode step (`decode_child.py`: `decode_one_token` as a rollout runs it, in the rollout dtype
and kernels the default picks) at every --responses x --contexts setting and reporting the tokens it sampled. Each
tree builds its compiled kernels into its own folder. Per setting: the median step time of each tree over the rounds
and the median of the rounds' ratios; the two trees must sample the same tokens from the same uniforms (a change that
alters any output bit fails here). Writes against_commit.json and .png into --out; nothing else may run while it
measures.

    .venv/bin/python bench/against_commit.py --base 16a1bd8 --out bench/results/against_commit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from decode_child import run_child

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against (a commit, tag or branch)")
    ap.add_argument("--out", default="bench/results/against_commit")
    ap.add_argument("--responses", default="1,8,64")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per setting (after 2 untimed)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per tree, alternating")
    a = ap.parse_args()
    git = lambda *args: subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    base_commit, this_commit = git("rev-parse", "--short", a.base).strip(), git("rev-parse", "--short", "HEAD").strip()
    dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    settings = {"responses": [int(b) for b in a.responses.split(",")], "steps": a.steps,
                "contexts": [int(c) for c in a.contexts.split(",")]}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sparkrl-base-") as tmp:
        base = Path(tmp) / "tree"
        git("worktree", "add", "--detach", str(base), base_commit)
        try:
            trees = {"base": (base, Path(tmp) / "ext"), "this": (ROOT, Path(tmp) / "ext-this")}
            results = {"base": [], "this": []}
            for r in range(a.rounds):
                for name in ("base", "this") if r % 2 == 0 else ("this", "base"):
                    results[name].append(run_child(settings, *trees[name]))
                    print(f"round {r + 1}/{a.rounds}: {name} done", file=sys.stderr, flush=True)
        finally:
            git("worktree", "remove", "--force", str(base))
    rows = []
    for key in [k for k in results["base"][0] if "x" in k]:
        same = all(b[key]["tokens"] == t[key]["tokens"] for b, t in zip(results["base"], results["this"]))
        base_s = [b[key]["step_s"] for b in results["base"]]
        this_s = [t[key]["step_s"] for t in results["this"]]
        ratios = [b / t for b, t in zip(base_s, this_s)]
        B, ctx = map(int, key.split("x"))
        row = {"responses": B, "context": ctx, "base_ms": statistics.median(base_s) * 1e3,
               "this_ms": statistics.median(this_s) * 1e3, "speedup": statistics.median(ratios),
               "speedup_rounds": ratios, "same_tokens": same}  # fmt: skip
        row["this_tok_per_s"] = B / row["this_ms"] * 1e3
        rows.append(row)
        print(f"{B:3d} x {ctx:5d}: base {row['base_ms']:7.2f} ms, this {row['this_ms']:7.2f} ms: {row['speedup']:.2f}x "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f}), same tokens: {same}", flush=True)  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python bench/against_commit.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items())
    result = {"command": command, "base": base_commit, "this": this_commit + ("+changes" if dirty else ""),
              "load_after": os.getloadavg(), "rows": rows}  # fmt: skip
    (out / "against_commit.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "against_commit.png", result["base"], result["this"])
    if not all(r["same_tokens"] for r in rows):
        raise SystemExit("the two trees sampled different tokens from the same uniforms")


def plot(rows: list[dict], path: Path, base: str, this: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(rows))
    ax.bar([j - 0.2 for j in x], [r["responses"] / r["base_ms"] * 1e3 for r in rows], 0.4, label=f"base {base}")
    ax.bar([j + 0.2 for j in x], [r["this_tok_per_s"] for r in rows], 0.4, label=f"this {this}")
    for j, r in enumerate(rows):
        ax.text(j + 0.2, r["this_tok_per_s"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"{r['responses']} x {r['context']}" for r in rows], fontsize=8)
    ax.set_xlabel("responses x context tokens")
    ax.set_ylabel("tokens/s (decode step)")
    ax.set_yscale("log")
    ax.set_title("Autoregressive decode step: this tree against the base commit")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
