"""One short request as a user makes it: `sparkrl generate --model default --prompt ... --json` with sparkrl's
engine and with vLLM's, the two commands alternating (--repeats each). Reported per engine: the generation time
`generate` states after start-up (its "N tokens in S s" line), the tokens, and the start-up (the command's wall time
less its generation). Writes single_request.json into --out; nothing else may run while it measures.

    .venv/bin/python bench/single_request.py --out bench/results/single_request
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sparkrl.commands.bench import machine

LINE = re.compile(r"sparkrl: (\d+) tokens in ([\d.]+)s")


def run(engine: str, prompt: str) -> dict:
    cmd = [sys.executable, "-m", "sparkrl", "generate", "--model", "default", "--prompt", prompt, "--json"]
    t0 = time.perf_counter()
    done = subprocess.run([*cmd, "--engine", engine], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    tokens, gen_s = LINE.search(done.stderr).groups()
    assert all(json.loads(line) for line in done.stdout.splitlines()), "stdout holds JSON lines only"
    return {"tokens": int(tokens), "gen_s": float(gen_s), "startup_s": wall - float(gen_s), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/single_request")
    ap.add_argument("--prompt", default="What is 12 + 7?")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    runs = {"sparkrl": [], "vllm": []}
    for i in range(a.repeats):
        for engine in ("sparkrl", "vllm") if i % 2 == 0 else ("vllm", "sparkrl"):
            r = run(engine, a.prompt)
            runs[engine].append(r)
            print(f"{engine:7s}: {r['tokens']} tokens in {r['gen_s']:.2f}s, start-up {r['startup_s']:.1f}s", flush=True)
    med = {e: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for e, rs in runs.items()}
    per_token = {e: sum(r["gen_s"] for r in rs) / sum(r["tokens"] for r in rs) for e, rs in runs.items()}
    ratio = {"generation": med["vllm"]["gen_s"] / med["sparkrl"]["gen_s"],
             "per token": per_token["vllm"] / per_token["sparkrl"]}  # fmt: skip
    print(f"vLLM / sparkrl generation time: {ratio['generation']:.2f}x ({ratio['per token']:.2f}x per token); "
          f"start-up {med['vllm']['startup_s']:.1f}s vs {med['sparkrl']['startup_s']:.1f}s")  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": "python bench/single_request.py " + " ".join(sys.argv[1:]), "machine": machine(),
              "load": os.getloadavg(), "median": med, "ratio": ratio, "runs": runs}  # fmt: skip
    (out / "single_request.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
