"""What a new user meets in the first hour: a negative number in any notation reaches the flag's own check, a
start that fails leaves --out as it found it, the weights files honour the umask, and a run draws its metrics."""

from __future__ import annotations

import os
import stat

import pytest
from helpers import ParityGrader, run_config

from sparkrl.commands.cli import parse
from sparkrl.errors import UserError
from sparkrl.train.trainer import train


@pytest.mark.parametrize(
    "flag,value,check",
    [
        ("--lr", "-3e-5", "--lr must be > 0"),
        ("--lr", "-1E+2", "--lr must be > 0"),
        ("--learning_rate", "-.5", "--lr must be > 0"),
        ("--temperature", "-1", "--temperature must be >= 0"),
        ("--top-p", "-0.5", "--top-p must be in (0, 1]"),
        ("--kl-beta", "-inf", "--kl-beta must be >= 0"),
        ("--steps", "-2", "--steps must be >= 1"),
    ],
)
def test_a_negative_number_in_any_notation_reaches_the_flags_own_check(tmp_path, flag, value, check):
    for argv in ([flag, value], [f"{flag}={value}"]):
        with pytest.raises(UserError, match=check.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
            parse(["train", "--out", str(tmp_path / "r"), *argv])


def test_a_start_that_fails_leaves_a_new_out_folder_unmade(tiny_model_dir, tmp_path):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(b"not a drafter")
    out = tmp_path / "runs" / "r"  # neither folder exists yet
    cfg = run_config(tiny_model_dir, out, draft="eagle3", draft_checkpoint=str(bad))
    with pytest.raises(UserError):
        train(cfg, grader=ParityGrader())
    assert not (tmp_path / "runs").exists()


def test_a_start_that_fails_leaves_an_existing_out_folder_as_it_was(tiny_model_dir, tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    missing = tmp_path / "no-such-data.jsonl"
    with pytest.raises(UserError):
        train(run_config(tiny_model_dir, out, data=str(missing)), grader=ParityGrader())
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_a_resumed_start_that_fails_restores_config_json(tiny_model_dir, tmp_path):
    out = tmp_path / "r"
    train(run_config(tiny_model_dir, out, steps=1), grader=ParityGrader())
    before = {p.name for p in out.iterdir()}
    saved = (out / "config.json").read_bytes()
    state = next((out / "checkpoints").iterdir()) / "state.pt"
    state.write_bytes(b"")  # a checkpoint that cannot be read: the resumed start fails
    with pytest.raises(Exception):
        train(run_config(tiny_model_dir, out, steps=2, resume=True), grader=ParityGrader())
    assert {p.name for p in out.iterdir()} == before and (out / "config.json").read_bytes() == saved


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_the_weights_files_honour_the_umask(tiny_model_dir, tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        out = tmp_path / "r"
        train(run_config(tiny_model_dir, out, steps=1), grader=ParityGrader())
    finally:
        os.umask(old)
    ck = next((out / "checkpoints").iterdir())
    for path in (ck / "policy.safetensors", ck / "state.pt", out / "model" / "model.safetensors"):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path


def test_a_run_draws_its_metrics_at_every_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "r"
    train(run_config(tiny_model_dir, out, steps=2, draft="eagle3", tree_depth=2), grader=ParityGrader())
    png = out / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first = png.stat().st_mtime_ns
    train(run_config(tiny_model_dir, out, steps=3, resume=True, draft="eagle3", tree_depth=2), grader=ParityGrader())
    assert png.stat().st_mtime_ns > first  # drawn again with the new step
