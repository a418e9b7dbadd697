"""scripts/device_check.sh's smoke mode: the CUDA tier on the CPU and bench/gpu_costs.py at the tiny shape, so the
GPU check cannot rot where no GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import assert_drawn

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_device_check_runs_in_smoke_mode_and_writes_its_json_and_png(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "passed" in p.stdout
    result = json.loads((tmp_path / "gpu_costs_smoke.json").read_text())
    row = result["rows"][0]
    assert {"ar_step", "tree", "chain3", "chain4", "chain5", "block", "spark"} <= set(row["seconds"])
    assert all(v > 0 for v in row["seconds"].values())
    assert_drawn(tmp_path / "gpu_costs_smoke.png")
