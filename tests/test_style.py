"""The code's format and lint: `ruff format --check` and `ruff check` over the repository, as pyproject.toml's
[tool.ruff] configures them (line length 120). Fix a failure with `.venv/bin/ruff format . && .venv/bin/ruff check
--fix .`; a line that is still too long is split by meaning, never packed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_the_code_is_formatted():
    r = ruff("format", "--check", "--diff", ".")
    assert r.returncode == 0, f"ruff format would change these files:\n{r.stdout[-4000:]}{r.stderr[-2000:]}"


def test_the_linter_passes():
    r = ruff("check", "--output-format", "concise", ".")
    assert r.returncode == 0, f"ruff check:\n{r.stdout[-4000:]}{r.stderr[-2000:]}"
