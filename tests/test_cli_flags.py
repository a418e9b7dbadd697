"""The command-line contract: every command's flags, their choices and defaults, against a snapshot.

A change to the interface must be on purpose: regenerate the snapshot with
`SPARKRL_UPDATE_SNAPSHOT=1 .venv/bin/python -m pytest tests/test_cli_flags.py` and commit it.
"""

from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path

from sparkrl.commands.cli import make_parser

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

    from sparkrl.commands.cli import parse
    from sparkrl.errors import UserError

    cmd, cfg = parse(
        [
            "train",
            "--out",
            str(tmp_path / "r"),
            "--num_generations",
            "4",
            "--beta",
            "0.0",
            "--epsilon",
            "0.2",
            "--learning_rate",
            "1e-5",
            "--max_completion_length",
            "64",
            "--max_prompt_length",
            "256",
        ]
    )
    assert cmd == "train"
    assert (cfg.grpo.group_size, cfg.grpo.kl_beta, cfg.grpo.clip_eps, cfg.grpo.lr) == (4, 0.0, 0.2, 1e-5)
    assert (cfg.sampling.max_new_tokens, cfg.data.max_prompt_tokens) == (64, 256)
    _, ours = parse(["train", "--out", str(tmp_path / "r"), "--group-size", "4", "--kl-beta", "0.0"])
    assert (ours.grpo.group_size, ours.grpo.kl_beta) == (4, 0.0)
    with pytest.raises(UserError, match="max_completion_length"):
        parse(["generate", "--prompt", "hi", "--max_completion_length", "64"])


def test_bad_output_locations_and_interrupts_give_one_line(tmp_path, capsys, monkeypatch):
    """--out as an existing file, a read-only folder, a disk filling up while writing, Ctrl-C during start-up:
    one line on stderr and a non-zero exit, never a traceback."""
    import errno
    import os

    import sparkrl.commands.cli as cli
    from sparkrl.errors import output_error

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli.main(["train", "--out", str(afile)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"sparkrl: error: --out {afile} is a file, not a folder; pass a folder (new or existing)"
    )
    assert cli.main(["export", str(tmp_path / "run"), "--out", str(afile)]) == 2
    assert "is a file" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere: the read-only case is checked on the error's mapping below
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        assert cli.main(["train", "--out", str(ro / "run")]) == 2
        assert "cannot be written" in capsys.readouterr().err
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    assert (
        output_error(full) == f"could not write ({tmp_path / 'x'}): No space left on device; free some space or "
        "choose a writable --out"
    )
    assert output_error(OSError(errno.EROFS, "Read-only file system")).startswith("could not write: Read-only")
    assert output_error(ValueError("other")) is None

    def raising(e):
        def run(cfg):
            raise e

        return run

    monkeypatch.setattr(cli, "run_train", raising(full))
    assert cli.main(["train", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err
    monkeypatch.setattr(cli, "run_train", raising(KeyboardInterrupt()))
    assert cli.main(["train", "--out", str(tmp_path / "r")]) == 130
    assert capsys.readouterr().err == "sparkrl: interrupted\n"
