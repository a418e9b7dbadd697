"""Wall-clock timing shared by the bench scripts (one call, repeated calls after warm-up ones, or several
systems interleaved per call) and the speedup of one system over another."""

from __future__ import annotations

import statistics
import time

import torch


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


def speedup(by: dict[str, list[float]], before: str, now: str) -> dict:
    """Medians of two systems' timings (name -> seconds) and the speedup of `now` over `before`."""
    med = {name: statistics.median(v) for name, v in by.items()}
    return {**{f"{name} s": m for name, m in med.items()}, "speedup": med[before] / med[now]}


def interleaved_us(fns: dict, repeats: int, calls: int) -> dict:
    """Microseconds per call of each of `fns`: the median of `repeats` runs of `calls` calls, interleaved."""
    t = {name: [] for name in fns}
    with torch.no_grad():  # forwards, not training
        for _ in range(repeats):
            for name, f in fns.items():
                start = time.perf_counter()
                for _ in range(calls):
                    f()
                t[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(v) for name, v in t.items()}
