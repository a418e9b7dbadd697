"""User-facing errors: the CLI prints their message on one line and exits non-zero, no traceback.

Output locations are checked before expensive work (`writable_dir`, `enough_space`); an operating-system
error of writing that still happens later (a disk filling up during a checkpoint) becomes one line naming
the path and the fix (`output_error`)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


class UserError(Exception):
    """Bad input from the user: the message says what is wrong and how to fix it."""


def writable_dir(path: str | Path, flag: str = "--out") -> Path:
    """`path` as an existing, writable folder (made, with its parents, if missing); a UserError otherwise."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {p} is a file, not a folder; pass a folder (new or existing)")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".sparkrl-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{flag} {p} cannot be written ({e.strerror}); pass a writable folder") from None
    return p


def enough_space(path: str | Path, needed: int, what: str, flag: str = "--out") -> None:
    """A UserError unless the disk holding `path` has `needed` bytes free."""
    free = shutil.disk_usage(path).free
    if free < needed:
        raise UserError(
            f"{flag} {path}: {what} needs about {needed / 1e9:.1f} GB and the disk has {free / 1e9:.1f} GB "
            "free; free some space or choose another folder"
        )


WRITE_ERRORS = (
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.EEXIST,
    errno.ENOTDIR,
    errno.EISDIR,
)


def output_error(e: BaseException) -> str | None:
    """One line for an error of writing an output (disk full, read-only, not a folder), else None."""
    if isinstance(e, OSError) and e.errno in WRITE_ERRORS:
        where = f" ({e.filename})" if e.filename else ""
        return f"could not write{where}: {e.strerror}; free some space or choose a writable --out"
    if type(e).__name__ == "SafetensorError" and "No space left" in str(e):  # safetensors' own error type
        return "could not write a safetensors file: no space left on device; free some space or choose another --out"
    return None
