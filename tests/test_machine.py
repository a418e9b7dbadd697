"""Warnings for a CPU shared with other work (why: bench/threads.py, BENCHMARKS.md)."""

from __future__ import annotations

import os
import time

import torch

from sparkrl import machine


def test_a_collapsed_generation_rate_is_reported_once(capsys, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    w = machine.RateWatch()
    for rate in (100.0, 80.0, 40.0):
        w.observe(rate)
    assert capsys.readouterr().err == ""  # 40 is not under a third of 100
    w.observe(30.0)
    w.observe(10.0)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "30 tok/s" in err and "--threads 1" in err


def test_a_busy_machine_is_reported_at_start(capsys, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(machine, "cpu_busy", lambda: 0.1)
    machine.set_threads(0)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(machine, "cpu_busy", lambda: 0.9)
    machine.set_threads(0)
    assert "other processes are using 90% of this machine's CPU" in capsys.readouterr().err


def test_cpu_busy_sees_a_busy_process():
    import subprocess
    import sys

    quiet = machine.cpu_busy(0.5)
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.3)
        busy = machine.cpu_busy(0.5)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert 0.0 <= quiet <= 1.0 and busy >= 0.6  # one spinning process per core


def test_timings_are_cached_per_kind_of_processor(monkeypatch):
    """A timing is cached in the cache's costs folder, one file per name and facts, and per kind of processor: its
    model and sorted vector extensions, so another CPU model or extension (say AVX512-BF16) reads other timings."""
    kind = machine.cpu_kind()
    assert list(kind[1:]) == sorted(kind[1:]) and all(f.startswith(("avx", "amx", "fma")) for f in kind[1:])
    here = machine.measurement_path("x", 1)
    assert here.parent == machine.cache_dir() / "costs" and here.name.startswith("x-") and here.suffix == ".json"
    assert len({here, machine.measurement_path("x", 2), machine.measurement_path("y", 1)}) == 3
    monkeypatch.setattr(machine, "cpu_kind", lambda: ("AMD EPYC", "avx2", "avx512_bf16"))
    bf16 = machine.measurement_path("x", 1)
    monkeypatch.setattr(machine, "cpu_kind", lambda: ("AMD EPYC", "avx2"))
    assert len({here, bf16, machine.measurement_path("x", 1)}) == 3
