"""Wall-clock timing shared by the bench scripts (one call, or repeated calls after warm-up ones)."""

from __future__ import annotations

import time


def seconds(fn) -> float:
    """Seconds one call of fn() takes."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def repeated(fn, reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `reps` calls of fn(), after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return [seconds(fn) for _ in range(reps)]
