"""Checkpoints: one folder per step under DIR/checkpoints/, written atomically.

`checkpoints/step-000003/` holds `policy.safetensors` (the policy's weights, loadable by anything
that reads safetensors) and `state.pt` (everything else a run needs to continue exactly: the step,
the optimizer states, RNG states, the drafter and its optimizer, SPARK's carried corrections, the
budget's estimates (every rank's, in a data-parallel run), the run config). A step is written into a
`.tmp-*` folder, fsynced, then renamed; a kill during the write leaves only that temporary, which the
next start removes (`remove_stale`). The data position, every response's sampling generator and the
drafter loss's generators are derived from (seed, step), so they need no state of their own. In a
data-parallel run rank 0 writes the checkpoint and every rank resumes from it.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from sparkrl.model.weights import readable, save_tensors

_PREFIX = "step-"
POLICY, STATE = "policy.safetensors", "state.pt"


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def list_checkpoints(out: str | Path) -> list[Path]:
    """Checkpoint folders of a run, oldest first."""
    d = checkpoint_dir(out)
    if not d.is_dir():
        return []
    steps = [
        p
        for p in d.iterdir()
        if p.is_dir()
        and p.name.startswith(_PREFIX)
        and p.name[len(_PREFIX) :].isdigit()
        and (p / STATE).exists()
        and (p / POLICY).exists()
    ]
    return sorted(steps, key=lambda p: int(p.name[len(_PREFIX) :]))


def checkpoints_at(path: str | Path) -> list[Path]:
    """The checkpoints a path names, oldest first: a checkpoints/step-N folder itself, or a run folder's."""
    path = Path(path)
    return [path] if (path / STATE).exists() else list_checkpoints(path)


def drafter_source(path: str | Path) -> Path:
    """What a --draft-checkpoint that names a GRPO run holds its drafter in: the state file of a
    checkpoints/step-N folder, or of a run folder's latest checkpoint; any other path as it is."""
    steps = checkpoints_at(path) if Path(path).is_dir() else []
    return steps[-1] / STATE if steps else Path(path)


def remove_stale(out: str | Path) -> list[Path]:
    """Remove temporaries a killed write left behind; returns what was removed."""
    d = checkpoint_dir(out)
    stale = sorted(d.glob(".tmp-*")) if d.is_dir() else []
    for p in stale:
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return stale


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        readable(tmp)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_checkpoint(out: str | Path, step: int, state: dict, keep: int) -> Path:
    """Write DIR/checkpoints/step-N/ (state["policy"] as safetensors, the rest as state.pt) and drop
    all but the `keep` newest."""
    d = checkpoint_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{_PREFIX}{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=d, prefix=".tmp-"))
    try:
        state = dict(state)
        save_tensors(
            {k: v.detach().contiguous() for k, v in state.pop("policy").items()},
            tmp / POLICY,
            metadata={"format": "pt"},
        )  # as `export.export_model` writes it, which can then link this file
        torch.save({"step": step, "rng": rng_state(), **state}, tmp / STATE)
        readable(tmp / STATE)
        for f in (POLICY, STATE):
            _fsync(tmp / f)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        old = None
        if path.exists():  # the same step again: move the old one aside (a .tmp-, so a kill leaves it to clean)
            old = Path(tempfile.mkdtemp(dir=d, prefix=".tmp-old-"))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(path: str | Path, with_policy: bool = True) -> dict:
    """A checkpoint folder as one dict: state.pt's entries, plus "policy" (its weights) if asked."""
    path = Path(path)
    ck = torch.load(path / STATE, map_location="cpu", weights_only=False)
    if with_policy:
        ck["policy"] = load_file(str(path / POLICY))
    return ck


def load_latest(out: str | Path) -> dict | None:
    files = list_checkpoints(out)
    return load_checkpoint(files[-1]) if files else None
