"""Show that two revisions of sparkrl behave the same: bit-identical rollouts and identical GRPO metrics.

    git worktree add /tmp/sparkrl-before REV
    .venv/bin/python scripts/same_behaviour.py record /tmp/sparkrl-before /tmp/before.json
    .venv/bin/python scripts/same_behaviour.py record . /tmp/after.json
    .venv/bin/python scripts/same_behaviour.py compare /tmp/before.json /tmp/after.json

`record ROOT OUT` runs `python -m sparkrl` from ROOT (so ROOT's sparkrl is the one imported: under `-m` the
working directory precedes PYTHONPATH) on the default model, and writes what each case produced: the token
ids of `generate` (AR, EAGLE3-style and DFlash-style drafting, each with and without SPARK, in float32 and
bfloat16, at T 1 / top-p 0.95 with two responses per prompt, and greedy; `--budget fixed`, so that no round
depends on this machine's timings), the drafting line's AAL and round count, and the non-timing metrics of the first
two steps of the README's quick start. `compare A B` prints
each case as same or different and exits non-zero on any difference. Timings are not compared here (see
`scripts/same_speed.sh`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a short poem about the sea.",
]
FIXED = ["--budget", "fixed"]  # every round drafts: the rounds do not depend on this machine's timings
ARMS = {
    "ar": [],
    "eagle3": ["--draft", "eagle3", *FIXED],
    "eagle3+spark": ["--draft", "eagle3", "--spark", *FIXED],
    "dflash": ["--draft", "dflash", *FIXED],
    "dflash+spark": ["--draft", "dflash", "--spark", *FIXED],
}
SAMPLING = {"t1": ["--temperature", "1", "--top-p", "0.95", "--n", "2"], "greedy": ["--temperature", "0"]}
TIMING = re.compile(r"(_s|_seconds|tok_per_s|time|wall)$")  # metric names that hold timings


def cases() -> dict[str, list[str]]:
    out = {}
    for dtype in ("float32", "bfloat16"):
        for arm, flags in ARMS.items():
            for name, sampling in SAMPLING.items():
                if name == "greedy" and (dtype == "float32" or arm not in ("ar", "eagle3+spark")):
                    continue
                out[f"{arm} {dtype} {name}"] = flags + sampling + ["--rollout-dtype", dtype]
    return out


def sparkrl(root: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-m", "sparkrl", *args], cwd=root, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"same_behaviour: `sparkrl {' '.join(args)}` failed in {root}:\n{p.stderr[-3000:]}")
    return p


def record(root: Path, out: Path) -> None:
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        for name, flags in cases().items():
            p = sparkrl(
                root,
                [
                    "generate",
                    "--model",
                    "default",
                    "--prompts-file",
                    str(prompts),
                    "--json",
                    "--max-new-tokens",
                    "48",
                    "--seed",
                    "3",
                    *flags,
                ],
            )
            drafting = re.search(r"aal ([0-9.]+), (\d+) rounds", p.stderr)
            result[name] = {
                "token_ids": [json.loads(l)["token_ids"] for l in p.stdout.splitlines() if l.strip()],
                "aal_rounds": drafting.groups() if drafting else None,
            }
            print(
                f"{name}: {sum(map(len, result[name]['token_ids']))} tokens, drafting {result[name]['aal_rounds']}",
                file=sys.stderr,
                flush=True,
            )
        run = Path(tmp) / "run"
        sparkrl(
            root,
            [
                "train",
                "--model",
                "default",
                "--data",
                "default",
                "--out",
                str(run),
                "--steps",
                "2",
                "--prompts-per-step",
                "2",
                "--group-size",
                "4",
                "--max-new-tokens",
                "64",
            ],
        )
        steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
        result["quick start, 2 steps"] = [{k: v for k, v in s.items() if not TIMING.search(k)} for s in steps]
        print(f"quick start: {len(steps)} steps", file=sys.stderr)
    out.write_text(json.dumps(result, indent=1))


def compare(a: Path, b: Path) -> int:
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    bad = 0
    for name in sorted(set(x) | set(y)):
        same = x.get(name) == y.get(name)
        bad += not same
        print(f"{'same' if same else 'DIFFERENT'}: {name}")
    print(f"{len(set(x) | set(y)) - bad} of {len(set(x) | set(y))} cases the same")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("record", "compare"):
        sys.exit(__doc__)
    if sys.argv[1] == "record":
        record(Path(sys.argv[2]).resolve(), Path(sys.argv[3]))
    else:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
