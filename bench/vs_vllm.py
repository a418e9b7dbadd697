"""sparkrl's autoregressive rollouts against vLLM-CPU's, each engine in its own process, alternating.

A vLLM engine in sparkrl's process changes the process it lives in (BENCHMARKS row 25), so here no process holds
both: each round starts one process per engine, which loads the default policy in --dtype (by default the dtype each
engine picks itself on this machine, `--rollout-dtype auto`), runs every setting once untimed (16 tokens: vLLM
compiles and warms up per shape) and then once timed, and prints one line `RESULT {json}`. A setting is
PROMPTSxGROUP responses, each generating exactly --tokens new tokens (no EOS ends a response in either engine, so
both do the same work), at temperature 1, top-p 0.95, from held-out GSM8K-style prompts (the same in both; round r
takes the r-th prompts). The engines alternate in the order of each round, --rounds times; tokens/s per setting is
the median over the rounds, and the ratio sparkrl / vLLM is reported per setting. vLLM's start-up (engine
construction) is reported apart. Writes vs_vllm.json and .png into --out; nothing else may run while it measures.
Needs vLLM (`scripts/setup.sh` installs it).

    .venv/bin/python bench/vs_vllm.py --data ../shared/data/gsm8k/train.jsonl --heldout 0.05 \\
        --out bench/results/vs_vllm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from child_process import report, result_of

ENGINES = ("sparkrl", "vLLM")
WARM_TOKENS = 16


def child(engine: str, settings: dict) -> None:
    """One engine's process: every (batch, tokens) setting once untimed (short), then once timed."""
    import torch
    from default_rollouts import default_prompts

    from sparkrl.config import DraftConfig, SamplingConfig
    from sparkrl.engine.autoregressive import generate, response_generators
    from sparkrl.model.weights import load_model
    from sparkrl.train.generation import RolloutPlan, build_generation

    auto = settings["dtype"] == "auto"
    lm = load_model("default", dtype="float32" if auto else settings["dtype"])
    prompts = default_prompts(lm.tokenizer, settings["data"], settings["heldout"], 64 * settings["rounds"])
    batches = [tuple(map(int, b.split("x"))) for b in settings["batches"]]
    rep, tokens = settings["round"], settings["tokens"]
    t = time.perf_counter()
    if engine == "sparkrl":
        plan = RolloutPlan.settle(lm.model, "auto" if auto else "model", "auto", DraftConfig())
        policy = build_generation(plan, DraftConfig(), lm.model, 1.0, trains=False).policy
        dtype = policy.model.lm_head.weight.dtype
        run = lambda ps, G, n: generate(
            policy.model, ps, SamplingConfig(1.0, 0.95, n), (), response_generators(rep, len(ps), G), G,
            sampler=policy.sampler,
        ).num_tokens  # fmt: skip
    else:
        from sparkrl.train.precision import rollout_dtype
        from sparkrl.vllm.engine import VllmEngine, model_len

        dtype = rollout_dtype("auto", lm.model, "vllm") if auto else lm.model.lm_head.weight.dtype
        eng = VllmEngine.serving(lm, None, dtype, 1, model_len(prompts, max(tokens), 0))
        run = lambda ps, G, n: eng.generate(ps, SamplingConfig(1.0, 0.95, n), (), G, rep).num_tokens
    startup_s = time.perf_counter() - t
    out = {"engine": engine, "dtype": str(dtype).removeprefix("torch."), "startup_s": startup_s,
           "threads": torch.get_num_threads(), "settings": {}}  # fmt: skip
    for n in tokens:
        for P, G in batches:
            ps = prompts[rep * P : (rep + 1) * P]
            run(ps, G, WARM_TOKENS)
            t = time.perf_counter()
            got = run(ps, G, n)
            s = time.perf_counter() - t
            assert got == P * G * n, f"{engine} generated {got} tokens, not {P * G * n}"
            out["settings"][f"{P}x{G}x{n}"] = {"tokens": got, "seconds": s}
            print(f"{engine} {P}x{G}, {n} tokens: {got / s:.1f} tok/s", file=sys.stderr, flush=True)
    report(out)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        return child(sys.argv[2], json.loads(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1x1,1x8,8x8", help="PROMPTSxGROUP per setting")
    ap.add_argument("--tokens", default="128,1024", help="new tokens per response, per setting")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="both engines' weights; auto: what each picks on this machine (`--rollout-dtype auto`)",
    )
    ap.add_argument("--data", default="default")
    ap.add_argument("--heldout", type=float, default=0.0, help="only problems held out of draft pretraining")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/vs_vllm")
    a = ap.parse_args()
    data = str(Path(a.data).resolve()) if a.data != "default" else a.data
    base = {"batches": a.batches.split(","), "tokens": [int(t) for t in a.tokens.split(",")], "dtype": a.dtype,
            "data": data, "heldout": a.heldout, "rounds": a.rounds}  # fmt: skip
    results = {e: [] for e in ENGINES}
    for r in range(a.rounds):
        for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine, json.dumps({**base, "round": r})]
            results[engine].append(result_of(cmd, f"the {engine} process", cwd=Path(__file__).parent))
            print(f"round {r + 1}/{a.rounds}: {engine} done", file=sys.stderr, flush=True)
    rows = []
    for key in results["sparkrl"][0]["settings"]:
        P, G, n = map(int, key.split("x"))
        tok_s = {
            e: statistics.median(x["settings"][key]["tokens"] / x["settings"][key]["seconds"] for x in rs)
            for e, rs in results.items()
        }
        rows.append({"responses": P * G, "batch": f"{P}x{G}", "tokens": n, "tok_per_s": tok_s,
                     "sparkrl_over_vllm": tok_s["sparkrl"] / tok_s["vLLM"]})  # fmt: skip
        print(f"{P * G} responses x {n} tokens: sparkrl {tok_s['sparkrl']:.1f}, vLLM {tok_s['vLLM']:.1f} tok/s: "
              f"{rows[-1]['sparkrl_over_vllm']:.2f}x")  # fmt: skip
    import vllm

    from sparkrl.commands.bench import machine

    result = {
        "command": "python bench/vs_vllm.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
        "machine": machine() | {"load_after": os.getloadavg(), "vllm": vllm.__version__},
        "startup_s": {e: [x["startup_s"] for x in rs] for e, rs in results.items()},
        "threads": {e: rs[0]["threads"] for e, rs in results.items()},
        "per_round": {e: [x["settings"] for x in rs] for e, rs in results.items()},
        "dtypes": {e: rs[0]["dtype"] for e, rs in results.items()},
        "rows": rows,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_vllm.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "vs_vllm.png", result["dtypes"])


def plot(rows: list[dict], path: Path, dtypes: dict) -> None:
    """Tokens/s of each engine per setting, sparkrl's ratio over vLLM above its bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, engine in enumerate(ENGINES):
        xs = [x + (i - 0.5) * 0.4 for x in range(len(rows))]
        ys = [r["tok_per_s"][engine] for r in rows]
        ax.bar(xs, ys, 0.4, label=f"{engine} ({dtypes[engine]})")
        if engine == "sparkrl":
            for x, y, r in zip(xs, ys, rows):
                ax.text(x, y * 1.02, f"{r['sparkrl_over_vllm']:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(range(len(rows)), [f"{r['responses']} x {r['tokens']}" for r in rows])
    ax.set_xlabel("responses x new tokens each")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("Autoregressive rollouts, each engine in its own process (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
