"""sparkrl's autoregressive decode at one response against llama.cpp's, each in its own process, alternating.

The same model at every weight precision llama.cpp offers for it: the default policy's GGUF as shipped (Q4_1), and
that file requantized by llama.cpp itself (`llama_model_quantize`, dequantizing Q4_1) to Q8_0, BF16, F16 and F32.
sparkrl runs the same dequantized weights in its rollout copy (bfloat16 here, the default), in float32 and with
8-bit products (`--rollout-dtype int8`: weights and activations in 8 bits, head and attention in bfloat16; beside
llama.cpp's Q8_0, 8-bit weights and activations too). Each process loads its model, reads a prompt of --context
tokens of the default problems' text (the same token ids in both: the GGUF carries SmolLM2's tokenizer) and times
--steps decode steps after 2 untimed ones, sampling at T 1, top-p 0.95, 2 threads (llama.cpp: `Llama.eval` and its
sampler per token; sparkrl: `decode_child.py`). The systems alternate, --rounds times, in rotating order; each
figure is the median over the rounds. Writes vs_llamacpp.json and .png into --out; nothing else may run while it
measures. Needs the bench extra (`pip install -e .[bench]`:
llama-cpp-python, built from source on install).

    .venv/bin/python bench/vs_llamacpp.py --out bench/results/vs_llamacpp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from child_process import report, result_of

HERE = Path(__file__).resolve().parent
PRECISIONS = {"Q4_1": None, "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
              "F16": "LLAMA_FTYPE_MOSTLY_F16", "F32": "LLAMA_FTYPE_ALL_F32"}  # fmt: skip
SPARKRL = {"sparkrl auto": "auto", "sparkrl int8": "int8", "sparkrl float32": "float32"}  # --rollout-dtype


def variants(folder: Path) -> dict[str, Path]:
    """The default GGUF at every precision (made once into folder by llama.cpp's own quantizer)."""
    import llama_cpp

    from sparkrl.model.weights import default_gguf

    src, out = default_gguf(), {}
    folder.mkdir(parents=True, exist_ok=True)
    for name, ftype in PRECISIONS.items():
        out[name] = dst = src if ftype is None else folder / f"{src.stem.rsplit('.', 1)[0]}.{name}.gguf"
        if not dst.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.allow_requantize, params.nthread = getattr(llama_cpp, ftype), True, 2
            tmp = dst.with_suffix(".tmp")
            if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
                raise SystemExit(f"llama.cpp could not write {dst}")
            tmp.rename(dst)
    return out


def llama_child(path: str, settings: str) -> None:
    """One llama.cpp process: the decode steps' seconds per token after the prompt (`decode_child.py`'s shape)."""
    import time

    from decode_child import context_ids
    from llama_cpp import Llama

    from sparkrl.model.weights import load_model

    s = json.loads(settings)
    n = s["steps"]
    tokenizer = load_model("default").tokenizer
    out = {}
    for ctx in s["contexts"]:
        llm = Llama(model_path=path, n_threads=2, n_threads_batch=2, n_ctx=ctx + n + 8, n_batch=512, seed=0,
                    verbose=False)  # fmt: skip
        llm.eval(context_ids(tokenizer, 1, ctx)[0])
        for _ in range(2):
            llm.eval([llm.sample(temp=1.0, top_p=0.95, top_k=0, min_p=0.0)])
        t0 = time.perf_counter()
        for _ in range(n):
            llm.eval([llm.sample(temp=1.0, top_p=0.95, top_k=0, min_p=0.0)])
        out[f"1x{ctx}"] = {"step_s": (time.perf_counter() - t0) / n}
        llm.close()
    report(out)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--llama-child":
        return llama_child(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/vs_llamacpp")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per setting (after 2 untimed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gguf-dir", default=None, help="where the requantized GGUFs are kept (default: sparkrl's cache)")
    a = ap.parse_args()
    out = Path(a.out)
    from sparkrl.machine import cache_dir

    paths = variants(Path(a.gguf_dir) if a.gguf_dir else cache_dir() / "models" / "gguf")
    contexts = [int(c) for c in a.contexts.split(",")]
    settings = json.dumps({"responses": [1], "contexts": contexts, "steps": a.steps})
    cmds = {f"llama.cpp {k}": [sys.executable, __file__, "--llama-child", str(v), settings] for k, v in paths.items()}
    for name, dtype in SPARKRL.items():
        cmds[name] = [
            sys.executable,
            str(HERE / "decode_child.py"),
            json.dumps({**json.loads(settings), "dtype": dtype}),
        ]
    names, results = list(cmds), {k: [] for k in cmds}
    for r in range(a.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            env = dict(os.environ, OMP_NUM_THREADS="2")
            results[name].append(result_of(cmds[name], name, env=env, stderr=subprocess.PIPE))
            print(f"round {r + 1}/{a.rounds}: {name}", file=sys.stderr, flush=True)
    rows = []
    for ctx in contexts:
        key = f"1x{ctx}"
        tok_s = {name: 1 / statistics.median(r[key]["step_s"] for r in rs) for name, rs in results.items()}
        rows.append({"context": ctx, "tok_per_s": tok_s})
        print(f"1 response, {ctx}-token context: " + ", ".join(f"{k} {v:.1f}" for k, v in tok_s.items()) + " tok/s")
    dtypes = {name: results[name][0]["dtype"] for name in SPARKRL}
    import llama_cpp

    from sparkrl.commands.bench import machine

    result = {"command": "python bench/vs_llamacpp.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()
                                                                   if k != "gguf_dir"),
              "machine": machine() | {"load_after": os.getloadavg(), "llama_cpp_python": llama_cpp.__version__},
              "sparkrl_dtypes": dtypes, "gguf": {k: v.name for k, v in paths.items()}, "rows": rows}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_llamacpp.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "vs_llamacpp.png", dtypes)


def plot(rows: list[dict], path: Path, dtypes: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        names = list(row["tok_per_s"])
        labels = [n.replace("sparkrl auto", f"sparkrl {dtypes['sparkrl auto']}") for n in names]
        colors = ["tab:orange" if n.startswith("sparkrl") else "tab:blue" for n in names]
        ax.barh(labels, [row["tok_per_s"][n] for n in names], color=colors)
        ax.set_xlabel("tokens/s, 1 response, 2 threads")
        ax.set_title(f"{row['context']}-token context")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
