"""Command line: builds a config from flags and calls the library. The library never parses argv.

Flags are generated from the config dataclasses (`config.py`): field `max_new_tokens` becomes
`--max-new-tokens`, its docstring the help text, booleans get `--x / --no-x`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from sparkrl.config import AnalyzeConfig, BenchConfig, GenerateConfig, PretrainConfig, RunConfig, build, field_docs, leaf_fields
from sparkrl.errors import UserError

COMMANDS = {
    "train": (RunConfig, "GRPO training (rollouts, rewards, policy updates, checkpoints)"),
    "generate": (GenerateConfig, "sample responses from a model"),
    "pretrain-draft": (PretrainConfig, "pretrain a drafter on text the policy generates (and an optional corpus)"),
    "bench": (BenchConfig, "reproduce the paper's Table 1 (or, with --ablations, Table 2) on this machine"),
    "analyze": (AnalyzeConfig, "paper section-2 miss statistics (Fig. 2, Fig. 4) of round logs from --round-log"),
}


def _add_flags(parser: argparse.ArgumentParser, cls) -> None:
    for path, f, owner in leaf_fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kw = {"dest": f.name, "default": argparse.SUPPRESS, "help": field_docs(owner).get(f.name, "")}
        kw["help"] += f" (default: {f.default!r})" if f.default != "" else ""
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            parser.add_argument(flag, type=typ, choices=f.metadata.get("choices"), metavar=f.name.upper(), **kw)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UserError(f"{message} (see {self.prog} --help)")


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sparkrl", description="Fast GRPO with exact speculative rollouts.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (cls, help_) in COMMANDS.items():
        _add_flags(sub.add_parser(name, help=help_, description=help_), cls)
    return p


def parse(argv: list[str]):
    ns = vars(make_parser().parse_args(argv))
    cmd = ns.pop("command")
    return cmd, build(COMMANDS[cmd][0], ns)


def run_generate(cfg: GenerateConfig) -> None:
    import torch

    from sparkrl.data import chat_prompt_ids
    from sparkrl.drafters import make_budget, make_drafter
    from sparkrl.rollout import generate, generate_speculative, response_generators
    from sparkrl.spark import make_spark
    from sparkrl.weights import load_model

    if cfg.prompts_file:
        if not os.path.exists(cfg.prompts_file):
            raise UserError(f"--prompts-file {cfg.prompts_file} does not exist")
        with open(cfg.prompts_file, encoding="utf-8", errors="replace") as f:
            lines = [l.rstrip("\n") for l in f if l.strip()]
        texts = [json.loads(l)["prompt"] if cfg.prompts_file.endswith(".jsonl") else l for l in lines]
        if not texts:
            raise UserError(f"--prompts-file {cfg.prompts_file} has no prompts")
    else:
        texts = [cfg.prompt]
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    lm = load_model(cfg.model.model, cfg.model.device, cfg.model.dtype)
    tok = lm.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] if cfg.raw else chat_prompt_ids(tok, t) for t in texts]
    if any(not p for p in prompts):
        raise UserError("a prompt is empty after tokenization")
    gens = response_generators(cfg.seed, len(prompts), cfg.n)
    drafter = make_drafter(cfg.draft, lm.model, cfg.seed)
    _, spark = make_spark(cfg.draft, lm.model, drafter, cfg.sampling.temperature)
    if drafter is None:
        r = generate(lm.model, prompts, cfg.sampling, lm.eos_ids, gens, group_size=cfg.n)
    else:
        r = generate_speculative(lm.model, drafter, prompts, cfg.sampling, lm.eos_ids, gens, cfg.draft.shape(),
                                 group_size=cfg.n, budget=make_budget(cfg.draft, lm.model, drafter), spark=spark)
        if cfg.draft.round_log:
            from sparkrl.analysis import append_round_log

            append_round_log(cfg.draft.round_log, r, spark=spark is not None, seed=cfg.seed)
    for i, toks in enumerate(r.tokens):
        text = tok.decode(toks, skip_special_tokens=True)
        if cfg.json:
            print(json.dumps({"prompt_index": i // cfg.n, "response_index": i % cfg.n,
                              "prompt_token_ids": r.prompt_of(i), "text": text, "token_ids": toks,
                              "finish_reason": r.finish_reason[i]}), flush=True)
        else:
            print(f"--- prompt {i // cfg.n} response {i % cfg.n} ({r.finish_reason[i]}) ---\n{text}", flush=True)
    print(f"sparkrl: {r.num_tokens} tokens in {r.gen_s:.2f}s ({r.num_tokens / max(r.gen_s, 1e-9):.1f} tok/s), "
          f"{r.stats['policy_forwards']} policy forwards", file=sys.stderr)
    if "aal" in r.stats:
        s = r.stats
        depth = " ".join(f"{n / max(s['tree_row_rounds'], 1):.2f}" for n in s["accepted_at_depth"])
        print(f"sparkrl: drafting: aal {s['aal']:.2f}, {s['rounds']} rounds ({s['tree_rounds']} with a tree), "
              f"acceptance per depth [{depth}], "
              f"draft {s['draft_s']:.2f}s verify {s['verify_s']:.2f}s accept+commit {s['accept_s']:.2f}s"
              + (f", SPARK {s['spark_s']:.2f}s ({s['spark_contexts']} feedback contexts, {s['spark_rows']} rows)"
                 if "spark_contexts" in s else ""), file=sys.stderr)


def run_train(cfg: RunConfig) -> None:
    from sparkrl.trainer import train

    s = train(cfg)
    lines = [f"sparkrl: trained {s['steps_run']} steps -> {s['out']}",
             f"  generation {s['gen_s']:.1f}s ({s['gen_tokens']} tokens), policy updates {s['train_s']:.1f}s"]
    if "reward_first" in s:
        lines.append(f"  reward {s['reward_first']:.3f} (first step) -> {s['reward_last']:.3f} (last), "
                     f"accuracy {s['accuracy_last']:.2f}, {s['gen_tok_per_s']:.1f} generated tok/s")
    lines.append(f"  metrics: {s['out']}/metrics.jsonl  checkpoints: {s['out']}/checkpoints/")
    print("\n".join(lines), file=sys.stderr)


def run_pretrain(cfg: PretrainConfig) -> None:
    from sparkrl.draft_train import pretrain

    s = pretrain(cfg)
    print(f"sparkrl: drafter trained on {s['sequences']} sequences ({s['tokens']} tokens), draft vocabulary "
          f"{s['draft_vocab']}, last top-1 agreement {s['last_top1']:.2f} -> {s['out']}/drafter.pt", file=sys.stderr)


def run_analyze(cfg: AnalyzeConfig) -> None:
    from sparkrl.analysis import run

    res = run(cfg.logs.split(","), [l for l in cfg.labels.split(",") if l], cfg.out)
    for lab, r in res.items():
        f = lambda x: "n/a" if x is None else f"{x:.2f}"
        ratios = ", ".join(f"{name} {f(r[k]['ratio'])} (token-matched {f(r[k]['matched_ratio'])})" for name, k in
                           (("in the response", "within_response"), ("in the previous rollout", "previous_rollout"),
                            ("in another response of the prompt", "within_prompt")))
        print(f"sparkrl: {lab}: {r['drafted_positions']} drafted positions, miss rate {f(r['miss_rate'])}; "
              f"miss-probability ratio after an earlier miss {ratios}; misses seen earlier in the response "
              f"{f(r['misses_seen_earlier_in_response'])}, in the prompt {f(r['misses_seen_earlier_in_prompt'])}",
              file=sys.stderr)
    print(f"sparkrl: {cfg.out}/analysis.json, {cfg.out}/analysis.png", file=sys.stderr)


def run_bench(cfg: BenchConfig) -> None:
    from sparkrl.bench import bench

    res = bench(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    print((Path(cfg.out) / "bench.md").read_text(), end="")
    print(f"sparkrl: bench finished in {res['wall_s']:.0f}s -> {cfg.out}/bench.json, bench.md, bench.png",
          file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        cmd, cfg = parse(sys.argv[1:] if argv is None else argv)
        {"train": run_train, "generate": run_generate, "pretrain-draft": run_pretrain, "analyze": run_analyze,
         "bench": run_bench}[cmd](cfg)
    except UserError as e:
        print(f"sparkrl: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
