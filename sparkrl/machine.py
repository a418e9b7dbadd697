"""The CPU this process shares: torch's thread count, and warnings when other work competes for it.

Measured (`bench/threads.py`, BENCHMARKS.md): on a 2-core machine one decode step of the default
model takes 85 ms alone; next to a second process running the same loop with torch's default 2
threads each, 210-1,800 ms (OpenMP threads spin-wait for cores the other process holds); with 1
thread each, or with OMP_WAIT_POLICY=PASSIVE, 135 ms (a fair share). PASSIVE costs 28% when alone,
so it is not the default; sparkrl warns instead and says what to do.
"""

from __future__ import annotations

import os
import sys

import torch

ADVICE = ("pass --threads 1 (or start with OMP_WAIT_POLICY=PASSIVE) while other work shares this CPU: torch's "
          "spinning threads then make each step several times slower")


def set_threads(threads: int) -> None:
    """Apply --threads (0: torch's default, one per core) and warn when the machine is already busy."""
    if threads:
        torch.set_num_threads(threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = os.cpu_count() or 1
    if torch.get_num_threads() > 1 and load >= 0.75 * cores:
        print(f"sparkrl: warning: this machine is busy (load {load:.1f} on {cores} cores); {ADVICE}",
              file=sys.stderr)


class RateWatch:
    """Warns once when a step's generation rate falls below a third of the run's best so far."""

    def __init__(self):
        self.best, self.warned = 0.0, False

    def observe(self, tok_per_s: float) -> None:
        if not self.warned and self.best and tok_per_s < self.best / 3 and torch.get_num_threads() > 1:
            self.warned = True
            print(f"\nsparkrl: warning: generation ran at {tok_per_s:.0f} tok/s, under a third of this run's best "
                  f"({self.best:.0f}); if another process is using the CPU, {ADVICE}", file=sys.stderr)
        self.best = max(self.best, tok_per_s)
