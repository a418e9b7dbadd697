"""A GRPO run's folder: config.json (the resolved settings; a resumed run must match them), metrics.jsonl
(one line per step) and its picture metrics.png, the trimming of lines a resumed run writes again, the folder
left as it was found by a start that fails (`kept_as_found`), and the exports of its latest checkpoint: the
policy as a Hugging Face model folder, the drafter as vLLM's EAGLE-3 checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from sparkrl import __version__
from sparkrl.config import RunConfig, SparkConfig, to_dict
from sparkrl.drafters import find_checkpoint, load_drafter
from sparkrl.drafters.base import read_checkpoint
from sparkrl.drafters.vllm_export import export_draft
from sparkrl.errors import UserError, writable_dir
from sparkrl.model.export import export_model
from sparkrl.model.weights import load_model
from sparkrl.train.checkpoint import STATE, checkpoints_at, load_checkpoint, remove_stale, step_folders
from sparkrl.vllm.spark import settings_of, write_projection

# Settings that may change between a run and its resumption (they do not change the maths).
# A checkpoint holds whole tensors whatever --shard-policy wrote it.
_RESUMABLE = {"steps", "resume", "checkpoint_every", "keep_checkpoints", "threads", "out", "shard_policy"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def prepare_out_dir(cfg: RunConfig) -> dict:
    """Refuse to mix runs: an out dir with checkpoints needs --resume and the same settings. Returns
    what the resumed run resolved at its start ({} for a new run): e.g. the measured rollout dtype."""
    out = writable_dir(cfg.out)
    for p in remove_stale(out):
        print(f"sparkrl: removed {p}, left by an interrupted checkpoint write", file=sys.stderr)
    if any((out / "checkpoints").glob("step-*.pt")):
        raise UserError(
            f"{out}/checkpoints holds step-N.pt files of an older sparkrl, which this one does not read; "
            "continue that run with the sparkrl that wrote it, or choose a new --out"
        )
    has_ckpt = bool(step_folders(out))
    if has_ckpt and not cfg.resume:
        raise UserError(
            f"{out} already holds checkpoints of a run; pass --resume to continue it, or choose a new --out"
        )
    saved = out / "config.json"
    resolved = {}
    if cfg.resume and has_ckpt and saved.exists():
        before = json.loads(saved.read_text())
        resolved = before.get("resolved", {})
        old = _flat(before["config"])
        new = _flat(to_dict(cfg))
        diff = [k for k in new if k.split(".")[-1] not in _RESUMABLE and old.get(k) != new[k]]
        if diff:
            k = diff[0]
            raise UserError(
                f"--resume with different settings than the run in {out}: {k} was {old.get(k)!r}, "
                f"now {new[k]!r} ({len(diff)} differ); use the run's settings or a new --out"
            )
    out.mkdir(parents=True, exist_ok=True)
    write_run_config(cfg, resolved)
    return resolved


def write_run_config(cfg: RunConfig, resolved: dict) -> None:
    """DIR/config.json: the settings, what was resolved from them at the start (`resolved`), versions."""
    (Path(cfg.out) / "config.json").write_text(
        json.dumps(
            {"config": to_dict(cfg), "resolved": resolved, "sparkrl": __version__, "torch": torch.__version__}, indent=2
        )
    )


def run_policy(run_dir: str, steps: list[Path]):
    """The policy of a run's checkpoint `steps[-1]` (a `weights.LoadedModel`, without its tokenizer), and the
    checkpoint."""
    if not steps:
        raise UserError(
            f"{run_dir} holds no checkpoint: pass a `sparkrl train --out` folder or one of its "
            "checkpoints/step-N folders"
        )
    ck = load_checkpoint(steps[-1])
    lm = load_model(ck["config"]["model"]["model"], with_tokenizer=False)
    lm.model.to(next(iter(ck["policy"].values())).dtype)
    missing, unexpected = lm.model.load_weights(ck["policy"])
    if missing or unexpected:
        raise UserError(
            f"{steps[-1]} does not fit {ck['config']['model']['model']} (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    return lm, ck


def check_out_folder(out: str) -> None:
    """--out of an export: a folder (new or existing) whose parent takes the temporary it is written through."""
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file, not a folder; pass a folder (new or existing)")
    writable_dir(Path(out).absolute().parent, "the folder of --out")  # the export is written beside it, then renamed


def export_run(run_dir: str, out: str) -> tuple[int, Path]:
    """Export a run's latest checkpoint (or the checkpoints/step-N folder given) as a Hugging Face folder;
    returns (its step, the folder)."""
    check_out_folder(out)
    lm, ck = run_policy(run_dir, checkpoints_at(run_dir))
    return ck["step"], export_model(lm.model, lm.path, Path(out))


def export_drafter(
    source: str, model: str, out: str, dtype: str = "bfloat16", kind: str = "eagle3"
) -> tuple[str, Path]:
    """Write a drafter as the checkpoint vLLM's speculative method for its kind loads
    (`drafters.vllm_export.export_draft`): a GRPO run's (its latest checkpoint's drafter, with the policy it served
    then), or a drafter checkpoint (`--draft-checkpoint`'s values: default, the shipped one of `kind`; a file)
    serving `model`. Returns (what was exported, the folder)."""
    check_out_folder(out)
    steps = checkpoints_at(source) if Path(source).is_dir() else []
    if steps:
        lm, ck = run_policy(source, steps)
        what, path = f"the drafter of {steps[-1]}", steps[-1] / STATE
        if not isinstance(ck.get("draft"), dict) or "drafter" not in ck["draft"]:
            raise UserError(f"{steps[-1]} holds no drafter: the run trained with --draft none")
    else:
        lm = load_model(model or "default", with_tokenizer=False)
        path = find_checkpoint(source, kind, lm.model, flag="the drafter")
        if path is None:
            raise UserError(f"no drafter named by {source!r}: pass a drafter file, a run folder, or 'default'")
        what = path
    dck = read_checkpoint(path)
    d = load_drafter(dck, lm.model.args, None, str(path)).bind(lm.model)
    config = json.loads((lm.path / "config.json").read_text())
    folder = export_draft(d.to(lm.model.lm_head.weight.dtype), lm.model, config, Path(out), getattr(torch, dtype))
    if "spark" in dck and d.kind == "dflash":
        what += " (its SPARK projection left out: SPARK inside vLLM corrects EAGLE-3 chains)"
    elif "spark" in dck:  # a --spark run's drafter: its learned A, and the run's SPARK settings, go too
        sc = SparkConfig(**ck["config"]["draft"]["spark_config"]) if steps else SparkConfig()
        write_projection(folder, dck["spark"]["A"], **settings_of(sc))
        what += " with its SPARK projection (SPARK on in vLLM with sparkrl's plugin)"
    return what, folder


def append_metrics(out: str, m: dict) -> None:
    """One step's metrics line, appended to out/metrics.jsonl."""
    with open(Path(out) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(m) + "\n")


def truncate_steps(path: Path, step: int) -> None:
    """Drop the JSONL records (metrics, round log) of steps past `step`, atomically."""
    if not path.exists():
        return
    keep = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(l + "\n" for l in keep))
    os.replace(tmp, path)


@contextmanager
def kept_as_found(out: str | Path, main: bool = True):
    """Leave the folder `out` as it was found when what runs inside fails (a start that fails before its first
    step: missing or garbage data, a bad model or drafter): what it added is removed, a config.json it rewrote is
    restored, and a folder it made (with the parents it made) is removed. main: whether this rank writes."""
    out = Path(out)
    made = out
    while not made.parent.exists():
        made = made.parent
    found = out.is_dir()
    before = {p.name: p.read_bytes() if p.name == "config.json" else None for p in out.iterdir()} if found else {}
    try:
        yield
    except BaseException:
        if main and not found and made.exists():
            shutil.rmtree(made, ignore_errors=True)
        elif main and out.is_dir():
            for p in out.iterdir():
                if p.name not in before:
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                elif before[p.name] is not None:
                    p.write_bytes(before[p.name])
        raise


# metrics.jsonl's figures that metrics.png draws, with their titles; a run without drafting has no AAL
PLOTTED = {
    "reward_mean": "reward",
    "accuracy": "accuracy",
    "format": "format rate",
    "kl": "KL to the reference",
    "gen_tok_per_s": "generation tokens/s",
    "aal": "AAL (tokens per round)",
}


def plot_metrics(out: str | Path) -> Path | None:
    """OUT/metrics.png: each of `PLOTTED` that the run logs, per step, from OUT/metrics.jsonl (written to a
    temporary file, then renamed over the last one). None when there is no step yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    path = out / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
    shown = [k for k in PLOTTED if any(k in r for r in rows)]
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 3), squeeze=False)
    for ax, key in zip(axes[0], shown):
        steps = [r["step"] for r in rows if key in r]
        ax.plot(steps, [r[key] for r in rows if key in r], marker="o", ms=3)
        ax.set(title=PLOTTED[key], xlabel="step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{out.name}: {len(rows)} steps", fontsize=10)
    fig.tight_layout()
    tmp = out / ".metrics.png.tmp"
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    os.replace(tmp, out / "metrics.png")
    return out / "metrics.png"
