"""Warnings for a CPU shared with other work (why: bench/threads.py, BENCHMARKS.md)."""

from __future__ import annotations

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
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (0.3, 0.3, 0.3))
    machine.set_threads(0)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (1.9, 1.0, 0.5))
    machine.set_threads(0)
    assert "busy (load 1.9 on 2 cores)" in capsys.readouterr().err
