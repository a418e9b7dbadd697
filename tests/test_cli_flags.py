"""The command-line contract: every command's flags, their choices and defaults, against a snapshot.

A change to the interface must be on purpose: regenerate the snapshot with
`SPARKRL_UPDATE_SNAPSHOT=1 .venv/bin/python -m pytest tests/test_cli_flags.py` and commit it.
"""

from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path

from sparkrl.cli import make_parser

SNAPSHOT = Path(__file__).with_name("cli_flags.txt")


def describe() -> str:
    lines = []
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        lines.append(f"sparkrl {name}")
        for a in parser._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            kind = "flag" if isinstance(a, argparse.BooleanOptionalAction) else getattr(a.type, "__name__", "str")
            choices = f" {{{','.join(map(str, a.choices))}}}" if a.choices else ""
            lines.append(f"  {' / '.join(a.option_strings) or a.metavar} {kind}{choices}")
    return "\n".join(lines) + "\n"


def test_cli_flags_match_the_snapshot():
    now = describe()
    if os.environ.get("SPARKRL_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(now)
    diff = "".join(difflib.unified_diff(SNAPSHOT.read_text().splitlines(True), now.splitlines(True), "snapshot", "now"))
    assert not diff, f"the CLI changed; if on purpose, regenerate the snapshot (see this file's docstring):\n{diff}"


def test_every_commands_help_renders():
    """argparse expands `%` in help texts: a field docstring with a bare `15%` once broke `--help`."""
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"sparkrl {name}" in parser.format_help()


def test_train_takes_trl_grpo_config_names_as_aliases_and_resolves_them_to_ours(tmp_path):
    """TRL's GRPOConfig names (`--num_generations` ...) set sparkrl's fields, so the run's config.json records
    sparkrl's names; `generate` keeps sparkrl's names only."""
    import pytest

    from sparkrl.cli import parse
    from sparkrl.errors import UserError

    cmd, cfg = parse(["train", "--out", str(tmp_path / "r"), "--num_generations", "4", "--beta", "0.0",
                      "--epsilon", "0.2", "--learning_rate", "1e-5", "--max_completion_length", "64",
                      "--max_prompt_length", "256"])
    assert cmd == "train"
    assert (cfg.grpo.group_size, cfg.grpo.kl_beta, cfg.grpo.clip_eps, cfg.grpo.lr) == (4, 0.0, 0.2, 1e-5)
    assert (cfg.sampling.max_new_tokens, cfg.data.max_prompt_tokens) == (64, 256)
    _, ours = parse(["train", "--out", str(tmp_path / "r"), "--group-size", "4", "--kl-beta", "0.0"])
    assert (ours.grpo.group_size, ours.grpo.kl_beta) == (4, 0.0)
    with pytest.raises(UserError, match="max_completion_length"):
        parse(["generate", "--prompt", "hi", "--max_completion_length", "64"])
