"""Checkpoints: one file per step under DIR/checkpoints/, written atomically (temp file + rename).

A checkpoint holds everything a run needs to continue exactly: the step, policy and optimizer
states, RNG states and the run config. The data position and every response's sampling generator
are derived from (seed, step), so they need no state of their own.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import torch

_PREFIX, _SUFFIX = "step-", ".pt"


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def list_checkpoints(out: str | Path) -> list[Path]:
    """Checkpoint files of a run, oldest first."""
    d = checkpoint_dir(out)
    if not d.is_dir():
        return []
    files = [p for p in d.iterdir() if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX)]
    return sorted(files, key=lambda p: int(p.name[len(_PREFIX):-len(_SUFFIX)]))


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
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
    """Write DIR/checkpoints/step-N.pt and drop all but the `keep` newest."""
    path = checkpoint_dir(out) / f"{_PREFIX}{step:06d}{_SUFFIX}"
    atomic_save({"step": step, "rng": rng_state(), **state}, path)
    for old in list_checkpoints(out)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_latest(out: str | Path) -> dict | None:
    files = list_checkpoints(out)
    if not files:
        return None
    return torch.load(files[-1], map_location="cpu", weights_only=False)
