"""Checkpoints: one folder per step under DIR/checkpoints/, written atomically.

`checkpoints/step-000003/` holds `policy.safetensors` (the policy's weights, loadable by anything
that reads safetensors) and `state.pt` (everything else a run needs to continue exactly: the step,
the optimizer states, RNG states, the drafter and its optimizer, SPARK's carried corrections, the
budget's estimates (every rank's, in a data-parallel run), the run config). A step is written into a
`.tmp-*` folder, fsynced, then renamed; a kill during the write leaves only that temporary, which the
next start removes (`remove_stale`). Each checkpoint records its files' sizes and SHA-256 sums (`checksums.json`,
written with them); a resumed run checks them (`damage`) and falls back to the newest intact checkpoint, naming
the damaged file, or stops with one line when none is intact (`load_latest`). The data position, every response's
sampling generator and the drafter loss's generators are derived from (seed, step), so they need no state of their
own. In a data-parallel run rank 0 writes the checkpoint and every rank resumes from it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from sparkrl.errors import UserError
from sparkrl.model.weights import readable, save_tensors

_PREFIX = "step-"
POLICY, STATE, SUMS = "policy.safetensors", "state.pt", "checksums.json"


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


def step_folders(out: str | Path) -> list[Path]:
    """Every checkpoints/step-N folder of a run, oldest first, complete or not (`damage` tells)."""
    d = checkpoint_dir(out)
    folders = [p for p in d.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)] if d.is_dir() else []
    return sorted((p for p in folders if p.name[len(_PREFIX) :].isdigit()), key=lambda p: int(p.name[len(_PREFIX) :]))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def damage(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder, in words that name the file (None: intact). A folder written
    before checksums were recorded is checked for its files only."""
    for name in (POLICY, STATE):
        if not (folder / name).is_file():
            return f"{folder / name} is missing"
    if not (folder / SUMS).is_file():
        return None
    try:
        recorded = json.loads((folder / SUMS).read_text())
    except (OSError, ValueError):
        return f"{folder / SUMS} cannot be read"
    for name, want in recorded.items():
        size = (folder / name).stat().st_size
        if size != want["bytes"]:
            return f"{folder / name} holds {size} of the {want['bytes']} bytes written"
        if sha256(folder / name) != want["sha256"]:
            return f"{folder / name} differs from what was written (its SHA-256 sum)"
    return None


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


def tensor_bytes(obj) -> int:
    """The bytes of the tensors in a (nested) checkpoint state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    return sum(tensor_bytes(v) for v in obj) if isinstance(obj, (list, tuple)) else 0


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def disk_full(e: BaseException) -> bool:
    """Whether an error is a full disk (an OSError, or safetensors' own error naming it)."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


def save_checkpoint(out: str | Path, step: int, state: dict, keep: int) -> Path:
    """Write DIR/checkpoints/step-N/ (state["policy"] as safetensors, the rest as state.pt) and drop
    all but the `keep` newest. A disk without room for it is refused in one line before anything is written
    (torch.save's own error on a full disk names no cause)."""
    d = checkpoint_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    need, free = tensor_bytes(state) + (1 << 20), free_bytes(d)
    if free < need:
        raise UserError(
            f"no room for checkpoint step {step} in {d}: it needs {need / 1e9:.3f} GB and {free / 1e9:.3f} GB are "
            "free; the checkpoints written before are intact: free space, then --resume"
        )
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
        sums = {f: {"bytes": (tmp / f).stat().st_size, "sha256": sha256(tmp / f)} for f in (POLICY, STATE)}
        (tmp / SUMS).write_text(json.dumps(sums, indent=1))
        readable(tmp / SUMS)
        _fsync(tmp / SUMS)
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
    """The newest intact checkpoint of a run (None: it has none). A damaged newer one is named and passed over;
    when none is intact, one line says which file is damaged and what to do."""
    damaged = []
    for folder in reversed(step_folders(out)):
        if (why := damage(folder)) is None:
            if damaged:
                print(
                    f"sparkrl: {damaged[0]}: resuming from {folder.name}, the newest intact checkpoint", file=sys.stderr
                )
            return load_checkpoint(folder)
        damaged.append(why)
    if damaged:
        raise UserError(
            f"{damaged[0]}, and no older checkpoint is intact (--keep-checkpoints 2 keeps one to fall back to): "
            "restore the file, or start again with a new --out"
        )
    return None
