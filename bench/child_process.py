"""The protocol of the benches that time each system in its own process: the child prints one line
`RESULT {json}` (`report`), the parent runs it and reads that line back (`result_of`). Nothing heavy is imported
here, so a child that times another library (llama.cpp) does not load torch by importing it."""

from __future__ import annotations

import json
import subprocess

PREFIX = "RESULT "


def report(out: dict) -> None:
    """A child's result, as the one line its parent reads."""
    print(PREFIX + json.dumps(out), flush=True)


def result_of(cmd: list[str], what: str, **run) -> dict:
    """Run a child (`subprocess.run` keywords in `run`: env, cwd, stderr) and return its `report`. A child that
    fails or reports nothing exits this process, naming `what`, with the end of the child's stderr where it was
    captured."""
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, **run)
    line = next((x for x in p.stdout.splitlines() if x.startswith(PREFIX)), None)
    if p.returncode or line is None:
        tail = f":\n{p.stderr[-3000:]}" if p.stderr else "; its stderr is above"
        raise SystemExit(f"{what} failed (exit {p.returncode}){tail}")
    return json.loads(line.removeprefix(PREFIX))
