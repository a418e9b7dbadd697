"""Command line: builds a config from flags and calls the library. The library never parses argv.

Flags are generated from the config dataclasses (`sparkrl.config`, and here the settings of the commands only
the command line runs: generate, analyze, export): field `max_new_tokens` becomes `--max-new-tokens`, its
docstring the help text, booleans get `--x / --no-x`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from sparkrl.commands.analysis import run as run_analysis
from sparkrl.commands.bench import BenchConfig, bench
from sparkrl.config import (
    Checked,
    DraftConfig,
    ModelConfig,
    PretrainConfig,
    RunConfig,
    SamplingConfig,
    at_least,
    build,
    choices,
    existing_checkpoint,
    option,
    require,
)
from sparkrl.drafters.vllm_export import method
from sparkrl.engine.autoregressive import response_generators
from sparkrl.engine.records import Rollout
from sparkrl.errors import UserError, output_error
from sparkrl.machine import set_threads
from sparkrl.model.weights import load_model
from sparkrl.train.data import chat_prompt_ids, read_prompts_file
from sparkrl.train.generation import Generation, RolloutPlan, build_generation
from sparkrl.train.pretrain import pretrain
from sparkrl.train.rundir import export_drafter, export_run
from sparkrl.train.trainer import train
from sparkrl.vllm.engine import model_len


@dataclass(frozen=True)
class GenerateConfig(Checked):
    prompt: str = ""
    """One prompt text."""
    prompts_file: str = ""
    """A file with one prompt per line (or a .jsonl with a 'prompt' field per row)."""
    n: int = at_least(1, 1)
    """Responses per prompt."""
    seed: int = 0
    """Sampling seed; response j of prompt i uses its own generator derived from it."""
    raw: bool = False
    """Tokenize the prompt as is (no chat template, no special tokens)."""
    json: bool = False
    """Print one JSON object per response."""
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    draft: DraftConfig = DraftConfig()

    def validate(self):
        require(
            bool(self.prompt) != bool(self.prompts_file), "give exactly one of --prompt TEXT or --prompts-file FILE"
        )


@dataclass(frozen=True)
class AnalyzeConfig(Checked):
    logs: str = option("", required=True)
    """Round logs to analyse (from --round-log), comma-separated, e.g. a baseline and a SPARK run."""
    labels: str = ""
    """Names of the logs in the results, comma-separated (default: the file names)."""
    out: str = option("", required=True)
    """Output directory: analysis.json and analysis.png."""
    stages: int = at_least(1, 1)
    """Also analyse each log in this many consecutive parts by training step (3: the paper's early,
    middle and late stages; analysis_stages.png)."""
    bootstrap: int = at_least(0, 1000)
    """Bootstrap resamples of the prompt groups for the 95 percent intervals of each ratio (0: none)."""

    def validate(self):
        require(bool(self.logs), "--logs is required: one or more round logs written with --round-log")
        require(bool(self.out), "--out is required: the directory for analysis.json and the plots")


@dataclass(frozen=True)
class ExportConfig(Checked):
    run: str = option("", positional=True)
    """A `sparkrl train` output folder (its latest checkpoint is exported), or one of its checkpoints/step-N folders."""
    out: str = option("", required=True)
    """The Hugging Face model folder to write (config.json, model.safetensors, tokenizer files)."""

    def validate(self):
        require(bool(self.run), "give the run folder to export: sparkrl export RUN_DIR --out DIR")
        require(bool(self.out), "--out is required: the Hugging Face model folder to write")


@dataclass(frozen=True)
class ExportDraftConfig(Checked):
    drafter: str = option("", positional=True)
    """The drafter: a `sparkrl train --out` folder (its latest checkpoint's drafter) or one of its
    checkpoints/step-N folders, a `pretrain-draft` drafter file, or 'default' (the one of --draft's kind shipped for
    the default model)."""
    draft: Literal["eagle3", "dflash"] = "eagle3"
    """The kind 'default' names: the shipped EAGLE3-style drafter (for vLLM's eagle3 method) or the DFlash-style one
    (its dflash method). A file or a run holds its own kind."""
    model: str = ""
    """The policy the drafter serves, whose output head and config the export takes ('' : a run's own policy at
    that checkpoint, else 'default')."""
    out: str = option("", required=True)
    """The folder to write: config.json, model.safetensors (EAGLE-3's or DFlash's names), sparkrl_draft.json (and a
    DFlash-style drafter's mask_embedding.pt)."""
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """The weights' dtype (vLLM runs the drafter in the policy's)."""

    def validate(self):
        require(bool(self.drafter), "give the drafter to export: sparkrl export-draft RUN_DIR|FILE|default --out DIR")
        existing_checkpoint("export-draft", self.drafter)
        require(bool(self.out), "--out is required: the folder to write the vLLM drafter checkpoint to")


COMMANDS = {
    "train": (RunConfig, "GRPO training (rollouts, rewards, policy updates, checkpoints)"),
    "generate": (GenerateConfig, "sample responses from a model"),
    "pretrain-draft": (PretrainConfig, "pretrain a drafter on text the policy generates (and an optional corpus)"),
    "bench": (BenchConfig, "reproduce the paper's Table 1 (or, with --ablations, Table 2) on this machine"),
    "analyze": (AnalyzeConfig, "paper section-2 miss statistics (Fig. 2, Fig. 4) of round logs from --round-log"),
    "export": (ExportConfig, "write a trained policy as a Hugging Face model folder (transformers loads it)"),
    "export-draft": (ExportDraftConfig, "write an EAGLE3-style drafter as the checkpoint vLLM's eagle3 method loads"),
}


@cache
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass; a `same_as` field without
    one has its source field's."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(b.value.value.split())
    for f in dataclasses.fields(cls):
        if "same_as" in f.metadata and f.name not in docs:
            source, name = f.metadata["same_as"]
            docs[f.name] = field_docs(source)[name]
    return docs


def leaf_fields(cls, prefix: tuple = ()):
    """Yield (path, field, owner class) for every non-dataclass field, depth first."""
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default):
            yield from leaf_fields(type(f.default), prefix + (f.name,))
        else:
            yield prefix + (f.name,), f, cls


def _add_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per config field, grouped by component (model, sampling, data, grpo, draft, spark)."""
    groups = {}
    for path, f, owner in leaf_fields(cls):
        if f.metadata.get("train_only") and cls is GenerateConfig:
            continue
        title = owner.__name__.removesuffix("Config").lower() if owner is not cls else None
        group = (
            parser
            if title is None
            else groups.get(title) or groups.setdefault(title, parser.add_argument_group(f"{title} options"))
        )
        flag = "--" + f.name.replace("_", "-")
        kw = {"dest": f.name, "default": argparse.SUPPRESS, "help": field_docs(owner).get(f.name, "")}
        kw["help"] += (
            " (required)" if f.metadata.get("required") else f" (default: {f.default!r})" if f.default != "" else ""
        )
        if f.metadata.get("positional"):
            group.add_argument(f.name, nargs="?", metavar=f.name.upper(), default=argparse.SUPPRESS, help=kw["help"])
        elif f.type in ("bool", bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif f.name in choices(owner):
            group.add_argument(flag, choices=choices(owner)[f.name], **kw)
        else:
            typ = {"int": int, "float": float, "str": str}[f.type]
            trl = f.metadata.get("trl") if cls is RunConfig else None  # TRL GRPOConfig's name, beside ours
            group.add_argument(flag, *([f"--{trl}"] if trl else []), type=typ, metavar=f.name.upper(), **kw)


# A negative number in any notation (-3, -.5, -3e-5, -1E+2, -inf): argparse's own pattern misses the exponent forms,
# and then reads `--lr -3e-5` as a flag without its value instead of passing -3e-5 on to the flag's own check.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf(inity)?$", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER

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
    texts = read_prompts_file(cfg.prompts_file) if cfg.prompts_file else [cfg.prompt]
    set_threads(cfg.model.threads)
    lm = load_model(cfg.model.model, cfg.model.device, cfg.model.dtype)
    tok = lm.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] if cfg.raw else chat_prompt_ids(tok, t) for t in texts]
    if any(not p for p in prompts):
        raise UserError("a prompt is empty after tokenization")
    m, d = cfg.model, cfg.draft
    plan = RolloutPlan.settle(lm.model, m.rollout_dtype, m.cpu_kernels, d, m.rollout_head == "float32")
    longest = model_len(prompts, cfg.sampling.max_new_tokens, d.shape().depth) if plan.engine == "vllm" else 0
    gen = build_generation(
        plan, d, lm.model, cfg.sampling.temperature, cfg.seed, trains=False, lm=lm, max_len=longest
    )  # nothing trains here
    gens = response_generators(cfg.seed, len(prompts), cfg.n)
    r = gen.generate(prompts, cfg.sampling, lm.eos_ids, gens, group_size=cfg.n)
    if d.round_log and r.stats.depth:  # the outcomes of a speculative rollout
        r.append_round_log(d.round_log, spark=gen.drafting.adapts, seed=cfg.seed)
    print_responses(cfg, tok, prompts, r.tokens, r.finish_reason)
    print_figures(r, gen)


def print_figures(r: Rollout, gen: Generation) -> None:
    """The rollout's speed and drafting figures, on stderr."""
    s, vllm, depth = r.stats, gen.plan.engine == "vllm", gen.plan.draft != "none"
    how = "vLLM" if vllm else f"{s.policy_forwards} policy forwards"
    rate = r.num_tokens / max(r.gen_s, 1e-9)
    print(f"sparkrl: {r.num_tokens} tokens in {r.gen_s:.2f}s ({rate:.1f} tok/s), {how}", file=sys.stderr)
    if not (s.depth and depth):
        return
    accepted = " ".join(f"{a:.2f}" for a in s.accept_at_depth)
    spark = f", {SparkFigures.of(s.adapter).line()}" if gen.drafting.adapts else ""
    if vllm:
        print(
            f"sparkrl: drafting (vLLM, {'blocks' if gen.plan.draft == 'dflash' else 'chains'} of {s.depth}): aal "
            f"{s.aal:.2f}, {s.rounds} rounds, "
            f"acceptance per position [{accepted}]{spark}",
            file=sys.stderr,
        )
        return
    sizes = ", ".join(f"{k}: {v}" for k, v in s.sizes.items())
    print(
        f"sparkrl: drafting: aal {s.aal:.2f}, {s.rounds} rounds ({s.tree_rounds} with a tree, by nodes,depth "
        f"{{{sizes}}}), acceptance per depth [{accepted}], "
        f"draft {s.draft_s:.2f}s verify {s.verify_s:.2f}s accept+commit {s.accept_s:.2f}s{spark}",
        file=sys.stderr,
    )


def print_responses(cfg: GenerateConfig, tok, prompts, tokens, finish_reason) -> None:
    """The responses on stdout, as text or one JSON object each (--json)."""
    for i, toks in enumerate(tokens):
        text = tok.decode(toks, skip_special_tokens=True)
        if cfg.json:
            print(
                json.dumps(
                    {
                        "prompt_index": i // cfg.n,
                        "response_index": i % cfg.n,
                        "prompt_token_ids": prompts[i // cfg.n],
                        "text": text,
                        "token_ids": toks,
                        "finish_reason": finish_reason[i],
                    }
                ),
                flush=True,
            )
        else:
            print(f"--- prompt {i // cfg.n} response {i % cfg.n} ({finish_reason[i]}) ---\n{text}", flush=True)


@dataclass
class SparkFigures:
    """SPARK's figures of a rollout it adapted, read from `RoundStats.adapter` (`Spark.metrics`: a dict, as
    metrics.jsonl keeps it)."""

    seconds: float
    contexts: int  # feedback contexts
    rows: int  # rows of B the corrections tracked

    @classmethod
    def of(cls, adapter: dict) -> "SparkFigures":
        return cls(adapter["spark_s"], adapter["spark_contexts"], adapter["spark_rows"])

    def line(self) -> str:
        return f"SPARK {self.seconds:.2f}s ({self.contexts} feedback contexts, {plural(self.rows, 'row')} of B)"


def disk_use(path: Path) -> str:
    """The bytes under `path` as "1.6 GB", a file hard-linked twice counted once (the run's model folder shares
    its weights with the last checkpoint)."""
    seen, total = set(), 0
    for f in path.rglob("*") if path.is_dir() else []:
        st = f.lstat()
        if f.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return f"{total / 1e9:.2f} GB" if total >= 1e8 else f"{total / 1e6:.1f} MB"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def run_train(cfg: RunConfig) -> None:
    s = train(cfg)
    if not s.main:  # under torchrun: the summary once, from rank 0
        return
    lines = [
        f"sparkrl: trained {plural(s.steps_run, 'step')} -> {s.out}",
        f"  generation {s.gen_s:.1f}s ({plural(s.gen_tokens, 'token')}), policy updates {s.train_s:.1f}s"
        + (f", drafter training {s.draft_train_s:.1f}s" if s.rounds else "")
        + (
            f" (paused on {s.draft_paused} of {plural(s.steps_run, 'step')}: the budget declined drafting)"
            if s.draft_paused
            else ""
        ),
    ]
    if s.rounds:  # speculative rollouts
        est = s.gen_ar_estimate_s
        lines.append(
            f"  drafting: {s.committed / max(s.row_rounds, 1):.2f} tokens per verification round "
            f"(AAL), {s.tree_rounds / s.rounds:.0%} of {plural(s.rounds, 'round')} drafted"
            + (
                f"; generation {s.gen_s:.1f}s against an estimated {est:.1f}s autoregressive "
                f"({est / max(s.gen_s, 1e-9):.2f}x)"
                if est
                else ""
            )
        )
    if s.steps_run:
        a, b = s.first, s.last
        lines.append(
            f"  first step -> last: reward {a['reward_mean']:.3f} -> {b['reward_mean']:.3f}, accuracy "
            f"{a['accuracy']:.2f} -> {b['accuracy']:.2f}, format {a['format']:.2f} -> {b['format']:.2f}; "
            f"{s.gen_tok_per_s:.1f} generated tok/s"
        )
    out = Path(s.out)
    lines.append(
        f"  metrics: {out / 'metrics.jsonl'}  checkpoints: {out / 'checkpoints'}/ "
        f"({disk_use(out / 'checkpoints')})  model (Hugging Face): {out / 'model'}/ ({disk_use(out / 'model')}); "
        f"{disk_use(out)} in all"
    )
    print("\n".join(lines), file=sys.stderr)


def run_pretrain(cfg: PretrainConfig) -> None:
    s = pretrain(cfg)
    print(
        f"sparkrl: trained on {s['sequences']} sequences ({s['tokens']} tokens, {s['steps']} steps), draft vocabulary "
        f"{s['draft_vocab']}",
        file=sys.stderr,
    )
    for kind, d in s["drafters"].items():
        tree = "" if d["heldout_tree_expected_length"] is None else f" (trees {d['heldout_tree_expected_length']:.2f})"
        score = (
            ""
            if d["heldout_expected_length"] is None
            else f"held-out expected length {d['heldout_expected_length']:.2f}{tree}, top-1 {d['heldout_top1']:.2f}; "
        )
        print(f"sparkrl: {kind}: {score}use it with --draft {kind} --draft-checkpoint {d['path']}", file=sys.stderr)


def run_analyze(cfg: AnalyzeConfig) -> None:
    res = run_analysis(cfg.logs.split(","), [l for l in cfg.labels.split(",") if l], cfg.out, cfg.stages, cfg.bootstrap)
    for lab, r in res.items():
        f = lambda x: "n/a" if x is None else f"{x:.2f}"
        ratios = ", ".join(
            f"{name} {f(r[k]['ratio'])} (token-matched {f(r[k]['matched_ratio'])})"
            for name, k in (
                ("in the response", "within_response"),
                ("in the previous rollout", "previous_rollout"),
                ("in another response of the prompt", "within_prompt"),
            )
        )
        print(
            f"sparkrl: {lab}: {r['drafted_positions']} drafted positions, miss rate {f(r['miss_rate'])}; "
            f"miss-probability ratio after an earlier miss {ratios}; misses seen earlier in the response "
            f"{f(r['misses_seen_earlier_in_response'])}, in the prompt {f(r['misses_seen_earlier_in_prompt'])}",
            file=sys.stderr,
        )
    print(f"sparkrl: {cfg.out}/analysis.json, {cfg.out}/analysis.png", file=sys.stderr)


def run_export(cfg: ExportConfig) -> None:
    step, out = export_run(cfg.run, cfg.out)
    print(
        f"sparkrl: exported step {step} of {cfg.run} -> {out} (transformers: AutoModelForCausalLM.from_pretrained)",
        file=sys.stderr,
    )


def run_export_draft(cfg: ExportDraftConfig) -> None:
    what, out = export_drafter(cfg.drafter, cfg.model, cfg.out, cfg.dtype, cfg.draft)
    cfg_json = json.loads((out / "config.json").read_text())
    k = cfg_json["block_size"] - 1 if "block_size" in cfg_json else 3
    print(
        f'sparkrl: exported {what} -> {out} (vLLM: speculative_config={{"method": "{method(out)}", "model": '
        f'"{out}", "num_speculative_tokens": {k}}})',
        file=sys.stderr,
    )


def run_bench(cfg: BenchConfig) -> None:
    res = bench(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    print((Path(cfg.out) / "bench.md").read_text(), end="")
    print(
        f"sparkrl: bench finished in {res['wall_s']:.0f}s -> {cfg.out}/bench.json, bench.md, bench.png", file=sys.stderr
    )


def main(argv: list[str] | None = None) -> int:
    try:
        cmd, cfg = parse(sys.argv[1:] if argv is None else argv)
        {
            "train": run_train,
            "generate": run_generate,
            "pretrain-draft": run_pretrain,
            "analyze": run_analyze,
            "bench": run_bench,
            "export": run_export,
            "export-draft": run_export_draft,
        }[cmd](cfg)
    except UserError as e:
        print(f"sparkrl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a run in its loop writes a checkpoint first (trainer, pretrain)
        print("sparkrl: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        line = output_error(e)
        if line is None:
            raise
        print(f"sparkrl: error: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
