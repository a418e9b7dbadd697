"""Faults a long run survives: a damaged checkpoint is named in one line and passed over for the newest intact
one, and a diverging update is refused (the weights and the optimizer untouched) until a run that keeps
diverging stops, with finite weights in every checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ParityGrader, run_config

from sparkrl.errors import UserError
from sparkrl.train.checkpoint import STATE, damage, load_checkpoint, step_folders
from sparkrl.train.trainer import train


def _run(tiny_model_dir, out, **kw):
    return train(run_config(tiny_model_dir, out, **kw), grader=ParityGrader())


def _truncate(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize(
    "hurt,said",
    [
        (lambda f: _truncate(f / "policy.safetensors", 100), "holds 100 of the"),
        (lambda f: (f / STATE).write_bytes(bytes((f / STATE).stat().st_size)), "differs from what was written"),
        (lambda f: (f / "policy.safetensors").unlink(), "is missing"),
    ],
    ids=["truncated policy", "zeroed state", "missing file"],
)
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_resumes(tiny_model_dir, tmp_path, capfd, hurt, said):
    out = tmp_path / "r"
    _run(tiny_model_dir, out, steps=2, keep_checkpoints=2)
    newest = step_folders(out)[-1]
    hurt(newest)
    assert said in damage(newest)
    capfd.readouterr()
    _run(tiny_model_dir, out, steps=3, keep_checkpoints=2, resume=True)
    err = capfd.readouterr().err
    assert f"{newest.name}" in err and said in err and "resuming from step-000001" in err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # step 2 made again from step 1's checkpoint


def test_a_damaged_only_checkpoint_stops_the_resume_with_one_line_naming_the_file(tiny_model_dir, tmp_path):
    out = tmp_path / "r"
    _run(tiny_model_dir, out, steps=1)
    newest = step_folders(out)[-1]
    _truncate(newest / "policy.safetensors", 10)
    with pytest.raises(UserError, match=r"policy\.safetensors holds 10 of the .* no older checkpoint is intact"):
        _run(tiny_model_dir, out, steps=2, resume=True)


def test_a_diverging_run_refuses_its_updates_then_stops_with_finite_checkpoints(tiny_model_dir, tmp_path, capfd):
    out = tmp_path / "r"
    with pytest.raises(UserError, match="not finite 3 steps in a row"):
        _run(tiny_model_dir, out, steps=8, lr=1e30, max_grad_norm=1e30)
    err = capfd.readouterr().err
    assert "was refused, the weights unchanged" in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    refused = [r["step"] for r in rows if r.get("refused")]
    assert refused and refused == list(range(refused[0], rows[-1]["step"] + 1))  # refused to the end
    for folder in step_folders(out):
        assert all(torch.isfinite(t).all() for t in load_checkpoint(folder)["policy"].values())
    assert not (out / "model").exists()  # nothing exported


def test_a_full_disk_stops_the_run_in_one_line_and_the_last_checkpoint_resumes(tiny_model_dir, tmp_path, monkeypatch):
    import sparkrl.train.checkpoint as checkpoint

    out = tmp_path / "r"
    _run(tiny_model_dir, out, steps=1)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1000)  # a full disk
    with pytest.raises(UserError, match="no room for checkpoint step 2 .* intact: free space, then --resume"):
        _run(tiny_model_dir, out, steps=2, resume=True)
    assert [f.name for f in step_folders(out)] == ["step-000001"] and damage(step_folders(out)[0]) is None
    monkeypatch.undo()  # room again
    _run(tiny_model_dir, out, steps=2, resume=True)
    assert [f.name for f in step_folders(out)] == ["step-000002"]


def test_an_error_naming_a_full_disk_is_one(tmp_path):
    import errno

    from sparkrl.train.checkpoint import disk_full

    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(Exception("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))


@pytest.mark.parametrize("lr", ["inf", "nan", "1e38"])
def test_a_learning_rate_adamw_cannot_hold_is_refused_before_the_run(tmp_path, lr):
    from sparkrl.commands.cli import parse

    with pytest.raises(UserError, match="--lr must be"):
        parse(["train", "--out", str(tmp_path / "r"), "--lr", lr])
