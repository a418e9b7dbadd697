"""The rollout engines side by side: sparkrl autoregressive, sparkrl speculative (--draft's drafter with the
budget), vLLM autoregressive, and vLLM with the same drafter exported to it (EAGLE3-style chains, or DFlash-style
blocks, of each --chains length in drafted tokens; beside each, sparkrl drafting the same greedy chain or block every
round, whose AAL vLLM's should match; with --spark, EAGLE3-style chains again with SPARK, whose AAL gain in vLLM
should match its gain in sparkrl), on the same policy,
prompts (GSM8K questions in the GRPO prompt format; with --heldout only those held out of draft pretraining),
sampling (temperature 1, top-p 0.95) and dtype, at 1, 8 and 64 responses (1 prompt x 1, 1 prompt x 8, 8 prompts
x 8). Every engine is started once (vLLM's in this process); after one untimed rollout of each, the systems
alternate within each repeat. Reported per setting and system: tokens/s over all repeats, its ratio to sparkrl's
autoregressive, AAL (tokens per verification round per response) and SPARK's share of the generation time. With
--grpo-step, one GRPO step of each engine too (`sparkrl train --steps 1`, generation and update times).

    .venv/bin/python bench/engines.py --draft-checkpoint DRAFTER --heldout 0.05 \\
        --data ../shared/data/gsm8k/train.jsonl --out bench/results/engines
    .venv/bin/python bench/engines.py --draft dflash --chains 15 --batches 8x8 --heldout 0.05 \\
        --data ../shared/data/gsm8k/train.jsonl --out bench/results/engines_dflash
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from default_rollouts import default_rollouts

from sparkrl.config import DraftConfig, RunConfig, SamplingConfig, SparkConfig, TreeShape, build
from sparkrl.engine.autoregressive import Autoregressive, response_generators
from sparkrl.engine.budget import FixedBudget
from sparkrl.engine.spark import Spark
from sparkrl.engine.speculative import NoAdaptation, Speculative
from sparkrl.train.drafting import make_spark
from sparkrl.train.trainer import train
from sparkrl.vllm.engine import VllmEngine, model_len
from sparkrl.vllm.spark import settings_of


def systems(args, lm, gen, longest: int) -> dict:
    """name -> generate(prompts, G, sampling, gens) -> (tokens, seconds, AAL or None, SPARK seconds): each engine,
    started once. gen: sparkrl's (`generation.Generation`); the vLLM engines, several in one process, are started
    here with the drafter it made."""
    policy, dtype = lm.model, lm.model.lm_head.weight.dtype
    d, sampler = gen.drafting, gen.policy.sampler
    out = {"sparkrl AR": lambda p, G, s, g: sparkrl_run(Autoregressive(), policy, p, G, s, g, lm, sampler)}
    if args.ar_only:
        eng = VllmEngine.serving(lm, None, dtype, 1, longest)
        return {**out, "vLLM AR": lambda p, G, s, g: vllm_run(eng, p, G, s, g, lm)}
    out["sparkrl spec (budget)"] = lambda p, G, s, g: sparkrl_run(gen.engine, policy, p, G, s, g, lm, sampler)
    sc = SparkConfig(spark=True)  # the paper's defaults; A from the drafter checkpoint, else the policy's head
    A = (
        make_spark(
            DraftConfig(draft=args.draft, draft_checkpoint=args.draft_checkpoint, spark_config=sc),
            policy,
            d.drafter,
            1.0,
        )[0].A
        if args.spark
        else None
    )
    adapters = {"": NoAdaptation}
    if args.spark:
        adapters[" +SPARK"] = lambda: Spark.from_config(sc, A, d.drafter.vocab_ids.numel(), 1.0)
    for k in args.chains:  # vLLM's drafting: the drafter's argmax chain (a one-branch tree) or block of k, every round
        for tag, adapter in adapters.items():
            shape = TreeShape(k, 1, k) if args.draft == "eagle3" else TreeShape.block(k)
            fixed = Speculative(gen.engine.drafter, shape, FixedBudget(shape), adapter())
            out[f"sparkrl greedy {drafted(args)} {k}{tag}"] = lambda p, G, s, g, e=fixed: sparkrl_run(
                e, policy, p, G, s, g, lm, sampler
            )
    engines = {"vLLM AR": VllmEngine.serving(lm, None, dtype, 1, longest)}
    for k in args.chains:
        engines[f"vLLM {args.draft} {drafted(args)} {k}"] = VllmEngine.serving(lm, d.drafter, dtype, k, longest)
        if args.spark:
            engines[f"vLLM eagle3 chain {k} +SPARK"] = VllmEngine.serving(
                lm, d.drafter, dtype, k, longest, spark=(A, settings_of(sc))
            )
    for name, eng in engines.items():
        out[name] = lambda p, G, s, g, eng=eng: vllm_run(eng, p, G, s, g, lm)
    return out


def drafted(args) -> str:
    """What a round drafts with --draft's drafter: a chain (EAGLE3-style) or a block (DFlash-style)."""
    return "chain" if args.draft == "eagle3" else "block"


def sparkrl_run(engine, policy, prompts, G, sampling, gens, lm, sampler):
    r = engine.generate(policy, prompts, sampling, lm.eos_ids, gens, G, sampler=sampler)
    return r.num_tokens, r.gen_s, (r.stats.aal if r.stats.depth else None), r.stats.adapter.get("spark_s", 0.0)


def vllm_run(eng, prompts, G, sampling, gens, lm):
    r = eng.generate(prompts, sampling, lm.eos_ids, G, gens[0].initial_seed() % (1 << 31))
    return r.num_tokens, r.gen_s, (r.aal if r.drafted.get("drafts") else None), r.adapter["spark_s"]


def measure(args, run: dict, prompts) -> list[dict]:
    """Interleaved repeats of every system at every setting; one untimed rollout of each first."""
    sampling = SamplingConfig(1.0, 0.95, args.max_new_tokens)
    rows = []
    for setting in args.batches.split(","):
        P, G = map(int, setting.split("x"))
        got = {name: [0, 0.0, [], 0.0] for name in run}
        for rep in range(args.repeats + 1):
            ps = prompts[rep * P : (rep + 1) * P]
            gens = response_generators(rep, P, G)
            for name, fn in run.items():
                n, s, aal, spark_s = fn(
                    ps, G, sampling, [torch.Generator().manual_seed(g.initial_seed()) for g in gens]
                )
                if rep:
                    got[name][0] += n
                    got[name][1] += s
                    got[name][2] += [aal] if aal is not None else []
                    got[name][3] += spark_s
                print(
                    f"{setting} rep {rep} {name}: {n} tokens {s:.2f}s" + (f" aal {aal:.2f}" if aal else ""), flush=True
                )
        base = got["sparkrl AR"][0] / got["sparkrl AR"][1]
        for name, (n, s, aals, spark_s) in got.items():
            rows.append(
                {
                    "responses": P * G,
                    "system": name,
                    "tokens": n,
                    "seconds": s,
                    "tok_per_s": n / s,
                    "vs_sparkrl_ar": n / s / base,
                    "aal": sum(aals) / len(aals) if aals else None,
                    "aal_per_rollout": aals,
                    "spark_share": spark_s / s if "SPARK" in name else None,
                }
            )
    return rows


def per_rollout(rows, system: str) -> list[float]:
    """A system's AAL of every timed rollout, in the same (setting, repeat) order for every system."""
    return [a for r in rows if r["system"] == system for a in r["aal_per_rollout"]]


def bootstrap(pairs: torch.Tensor, stat) -> tuple[float, list[float]]:
    """stat(pairs (n, c)) -> float, and its 95% bootstrap interval over the n paired rollouts."""
    idx = torch.randint(0, len(pairs), (2000, len(pairs)), generator=torch.Generator().manual_seed(0))
    boot = torch.tensor([stat(pairs[i]) for i in idx]).sort().values
    return stat(pairs), [float(boot[49]), float(boot[1949])]


def aal_agreement(rows, chains, draft: str = "eagle3") -> list[dict]:
    """Per chain length (block size less one) k: vLLM's AAL over sparkrl's with the same greedy chain (block), over
    every timed rollout (paired by setting and repeat: the same prompts), with a 95% bootstrap interval over those
    pairs."""
    out = []
    what = "chain" if draft == "eagle3" else "block"
    for k in chains:
        pairs = torch.tensor(
            list(zip(per_rollout(rows, f"vLLM {draft} {what} {k}"), per_rollout(rows, f"sparkrl greedy {what} {k}"))),
            dtype=torch.float64,
        )
        ratio, ci = bootstrap(pairs, lambda x: float(x[:, 0].mean() / x[:, 1].mean()))
        out.append({what: k, "ratio": ratio, "rollouts": len(pairs), "ci": ci})
    return out


def spark_gain(rows, chains) -> list[dict]:
    """Per chain length k: SPARK's AAL gain (AAL with SPARK over without, paired rollouts) in vLLM and in sparkrl's
    engine drafting the same greedy chain, and their difference, each with a 95% bootstrap interval."""
    out = []
    for k in chains:
        names = [
            f"vLLM eagle3 chain {k} +SPARK",
            f"vLLM eagle3 chain {k}",
            f"sparkrl greedy chain {k} +SPARK",
            f"sparkrl greedy chain {k}",
        ]
        pairs = torch.tensor(list(zip(*(per_rollout(rows, n) for n in names))), dtype=torch.float64)  # (n, 4)
        gain = lambda x, j: float(x[:, j].mean() / x[:, j + 1].mean())
        v, vci = bootstrap(pairs, lambda x: gain(x, 0))
        s, sci = bootstrap(pairs, lambda x: gain(x, 2))
        d, dci = bootstrap(pairs, lambda x: gain(x, 0) - gain(x, 2))
        out.append(
            {
                "chain": k,
                "vllm": v,
                "vllm_ci": vci,
                "sparkrl": s,
                "sparkrl_ci": sci,
                "difference": d,
                "difference_ci": dci,
                "rollouts": len(pairs),
            }
        )
    return out


def grpo_steps(args) -> list[dict]:
    """One GRPO step of each engine (`sparkrl train --steps 1`), its generation and update times."""
    common = dict(
        model="default",
        data=args.data,
        steps=1,
        prompts_per_step=8,
        group_size=8,
        max_new_tokens=args.max_new_tokens,
        rollout_dtype=args.dtype,
        checkpoint_every=1000,
    )
    runs = {
        "sparkrl AR": dict(draft="none"),
        "sparkrl spec (budget)": dict(draft=args.draft, draft_checkpoint=args.draft_checkpoint),
        "vLLM AR": dict(draft="none", engine="vllm"),
    }
    runs.update(
        {
            f"vLLM {args.draft} {drafted(args)} {k}": dict(
                draft=args.draft,
                draft_checkpoint=args.draft_checkpoint,
                engine="vllm",
                draft_mode="chain",
                budget="fixed",
                tree_depth=k,
                block_size=k + 1,
            )
            for k in args.chains
        }
    )
    out = []
    for name, kw in runs.items():
        with tempfile.TemporaryDirectory() as tmp:
            train(build(RunConfig, {**common, **kw, "out": tmp}))
            m = json.loads((Path(tmp) / "metrics.jsonl").read_text().splitlines()[0])
        out.append(
            {
                "system": name,
                "gen_s": m["gen_s"],
                "train_s": m["train_s"],
                "draft_train_s": m["draft_train_s"],
                "step_s": m["gen_s"] + m["train_s"] + m["draft_train_s"],
                "aal": m.get("aal"),
            }
        )
        print(f"GRPO step {name}: {out[-1]}", flush=True)
    return out


def report(args, rows, steps) -> str:
    lines = [
        "| responses | system | tokens/s | vs sparkrl AR | AAL | SPARK share of time |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['responses']} | {r['system']} | {r['tok_per_s']:.1f} | {r['vs_sparkrl_ar']:.2f}x | "
        f"{'' if r['aal'] is None else format(r['aal'], '.2f')} | "
        f"{'' if r.get('spark_share') is None else format(r['spark_share'], '.1%')} |"
        for r in rows
    ]
    ci = lambda c: f"[{c[0]:.3f}, {c[1]:.3f}]"
    if not args.ar_only:
        what = drafted(args)
        lines += [""] + [
            f"AAL, vLLM {what} {a[what]} over sparkrl's same greedy {what}: {a['ratio']:.3f} "
            f"{ci(a['ci'])} over {a['rollouts']} rollouts"
            for a in aal_agreement(rows, args.chains, args.draft)
        ]
    if args.spark:
        lines += [
            f"SPARK's AAL gain, chain {g['chain']}: vLLM {g['vllm']:.3f} {ci(g['vllm_ci'])}, sparkrl "
            f"{g['sparkrl']:.3f} {ci(g['sparkrl_ci'])}, difference {g['difference']:+.3f} "
            f"{ci(g['difference_ci'])} over {g['rollouts']} rollouts"
            for g in spark_gain(rows, args.chains)
        ]
    if steps:
        lines += [
            "",
            "| GRPO step (8 x 8) | generation s | update s | draft training s | step s | AAL |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {s['system']} | {s['gen_s']:.1f} | {s['train_s']:.1f} | {s['draft_train_s']:.1f} | "
            f"{s['step_s']:.1f} | {'' if s['aal'] is None else format(s['aal'], '.2f')} |"
            for s in steps
        ]
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["system"] for r in rows))
    settings = sorted({r["responses"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next(r["vs_sparkrl_ar"] for r in rows if r["system"] == name and r["responses"] == n) for n in settings]
        ax.bar([j + i * width for j in range(len(settings))], ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(settings))], [f"{n} responses" for n in settings])
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_ylabel("tokens/s vs sparkrl AR")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="eagle3", choices=("eagle3", "dflash"), help="the drafter's kind")
    ap.add_argument(
        "--draft-checkpoint", default="default", help="a drafter in EAGLE-3's layout or DFlash's (vLLM runs those)"
    )
    ap.add_argument("--ar-only", action="store_true", help="only the two autoregressive engines (no drafter)")
    ap.add_argument("--data", default="default")
    ap.add_argument("--heldout", type=float, default=0.0, help="only problems held out of draft pretraining")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batches", default="1x1,1x8,8x8", help="PROMPTSxGROUP per setting")
    ap.add_argument(
        "--chains",
        default="3,5",
        type=lambda s: [int(x) for x in s.split(",")],
        help="drafted tokens a round (vLLM's num_speculative_tokens): chain lengths, or block sizes less one",
    )
    ap.add_argument("--spark", action="store_true", help="each chain again with SPARK, in vLLM and in sparkrl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--grpo-step", action="store_true")
    ap.add_argument("--out", default="bench/results/engines")
    args = ap.parse_args()
    if args.spark and args.draft != "eagle3":
        ap.error("--spark: SPARK inside vLLM corrects EAGLE-3 chains; pass --draft eagle3")
    dcfg = (
        DraftConfig(draft="none")
        if args.ar_only
        else DraftConfig(draft=args.draft, draft_checkpoint=args.draft_checkpoint, block_size=max(args.chains) + 1)
    )
    lm, gen, prompts = default_rollouts(dcfg, args.dtype, args.data, args.heldout, count=8 * (args.repeats + 1))
    run = systems(args, lm, gen, model_len(prompts, args.max_new_tokens, max(args.chains)))
    rows = measure(args, run, prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save(args, rows, [], out)  # the table is kept should the GRPO steps after it be cut short
    if args.grpo_step and not args.ar_only:
        save(args, rows, grpo_steps(args), out)


def save(args, rows, steps, out: Path) -> None:
    (out / "engines.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "rows": rows,
                "grpo_steps": steps,
                "aal_agreement": [] if args.ar_only else aal_agreement(rows, args.chains, args.draft),
                "spark_gain": spark_gain(rows, args.chains) if args.spark else [],
                "cpu_threads": torch.get_num_threads(),
                "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM")},
                "date": time.strftime("%Y-%m-%d"),
            },
            indent=1,
        )
    )
    (out / "engines.md").write_text(report(args, rows, steps))
    plot(rows, out / "engines.png")
    print(report(args, rows, steps), flush=True)


if __name__ == "__main__":  # vLLM spawns workers: the guard keeps them from running the benchmark
    main()
