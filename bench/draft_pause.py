"""What a GRPO step pays for a drafter the budget does not use: GRPO steps of the default policy and data with
autoregressive rollouts, with the shipped EAGLE3-style drafter and the budget as shipped (its online training
paused on steps where the budget drafted under 2% of the rounds, but for every 8th step), and with that drafter
trained on every step, side by side in one process, in alternating order over --rounds. The same seed gives every
system the same problems and, rollouts being token-identical to AR's, the same responses and updates.

Per system: the median over rounds of the mean step time (generation, policy update, draft training) over steps 2
to --steps (step 1 trains the drafter in both drafting systems), its ratio to AR's, and the budget's drafted
rounds. Writes draft_pause.json and draft_pause.png into --out; nothing else may run while it measures.

    .venv/bin/python bench/draft_pause.py --out bench/results/draft_pause
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from sparkrl.commands.bench import machine
from sparkrl.config import RunConfig, build
from sparkrl.train import drafting
from sparkrl.train.trainer import train

PARTS = ("gen_s", "train_s", "draft_train_s")
SYSTEMS = ("autoregressive", "eagle3, paused as shipped", "eagle3, trained every step")


@contextlib.contextmanager
def always_learning(on: bool):
    """`Drafting.learns` answering yes on every step (the drafter trained after every rollout), while on."""
    learns = drafting.Drafting.learns
    if on:
        drafting.Drafting.learns = lambda self, stats, step, world=drafting.SINGLE: True
    try:
        yield
    finally:
        drafting.Drafting.learns = learns


def run(system: str, a: argparse.Namespace) -> list[dict]:
    """One run of --steps GRPO steps: its metrics lines."""
    draft = {} if system == "autoregressive" else {"draft": "eagle3", "draft_checkpoint": "default"}
    with tempfile.TemporaryDirectory() as d, always_learning(system.endswith("every step")):
        flat = {"out": d, "steps": a.steps, "prompts_per_step": a.prompts, "group_size": a.group_size}
        cfg = build(RunConfig, flat | {"max_new_tokens": a.max_new_tokens, "seed": a.seed, **draft})
        train(cfg)
        return [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/draft_pause")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    runs: dict[str, list[list[dict]]] = {s: [] for s in SYSTEMS}
    for r in range(a.rounds):
        for system in SYSTEMS if r % 2 == 0 else reversed(SYSTEMS):
            runs[system].append(run(system, a))
            print(f"round {r + 1}/{a.rounds}: {system} done", flush=True)
    hashes = {s: [[m["token_hash"] for m in ms] for ms in runs[s]] for s in SYSTEMS}
    same = all(h == hashes["autoregressive"][0] for hs in hashes.values() for h in hs)
    result = {"meta": {**vars(a), "machine": machine(), "same_tokens": same, "token_hashes": hashes}, "systems": {}}
    for s in SYSTEMS:
        later = [ms[1:] for ms in runs[s]]  # steps 2..: step 1 trains the drafter in both drafting systems
        part = {p: statistics.median(statistics.mean(m[p] for m in ms) for ms in later) for p in PARTS}
        result["systems"][s] = {
            **part,
            "step_s": sum(part.values()),
            "paused_steps": sum(m.get("draft_paused", 0) for m in runs[s][0]),
            "drafted_rounds": sum(m.get("tree_rounds", 0) for m in runs[s][0]),
            "rounds": sum(m.get("rounds", 0) for m in runs[s][0]),
            "per_round": [[{p: m[p] for p in PARTS} for m in ms] for ms in runs[s]],
        }
    ar = result["systems"]["autoregressive"]["step_s"]
    for s, x in result["systems"].items():
        x["vs_ar"] = ar / x["step_s"]
        print(
            f"{s:28s} step {x['step_s']:6.2f} s (generation {x['gen_s']:.2f}, update {x['train_s']:.2f}, "
            f"draft training {x['draft_train_s']:.2f}): {x['vs_ar']:.2f}x AR; drafted {x['drafted_rounds']} of "
            f"{x['rounds']} rounds, paused {x['paused_steps']} of {a.steps} steps",
            flush=True,
        )
    print("same tokens in every run:", same)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_pause.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "draft_pause.png")
    print(f"wrote {out / 'draft_pause.json'} and .png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(result["systems"])
    left = [0.0] * len(names)
    for p, label in zip(PARTS, ("generation", "policy update", "draft training")):
        v = [result["systems"][n][p] for n in names]
        ax.barh(names, v, left=left, label=label)
        left = [x + y for x, y in zip(left, v)]
    for i, n in enumerate(names):
        ax.text(left[i], i, f" {result['systems'][n]['vs_ar']:.2f}x AR", va="center", fontsize=8)
    ax.set_xlabel("seconds per GRPO step (steps 2 on, median over rounds)")
    ax.set_xlim(0, max(left) * 1.25)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
