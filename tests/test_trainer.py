"""GRPO loop end to end on a tiny model: metrics, checkpoints, exact resume, Ctrl-C, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ParityGrader, run_config

from sparkrl.commands.cli import main
from sparkrl.cpu.kernels import is_packed, packable
from sparkrl.errors import UserError
from sparkrl.train.checkpoint import list_checkpoints, load_checkpoint, load_latest
from sparkrl.train.trainer import DataOrder, train

TIMING = {"gen_s", "train_s", "draft_train_s", "gen_tok_per_s"}


def _metrics(out):
    return [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _policy(out):
    return load_latest(out)


def test_train_writes_contract_files(tiny_model_dir, tmp_path):
    s = train(run_config(tiny_model_dir, tmp_path / "run"), grader=ParityGrader())
    assert s.steps_run == 2
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["config"]["grpo"]["group_size"] == 3
    m = _metrics(tmp_path / "run")
    assert [x["step"] for x in m] == [1, 2]
    for key in ("step", "reward_mean", "accuracy", "gen_s", "train_s", "draft_train_s", "gen_tokens"):
        assert key in m[0]
    assert 0 < m[0]["gen_tokens"] <= 2 * 3 * 6
    assert m[0]["grad_norm"] > 0  # the parity reward gives non-zero advantages
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-000002"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step-000002").iterdir()) == [
        "checksums.json",
        "policy.safetensors",
        "state.pt",
    ]
    # the exported model is the last checkpoint's weights file, linked: stored once
    weights = tmp_path / "run" / "model" / "model.safetensors"
    assert (
        weights.stat().st_ino == (tmp_path / "run" / "checkpoints" / "step-000002" / "policy.safetensors").stat().st_ino
    )


def test_resume_continues_exactly(tiny_model_dir, tmp_path):
    train(run_config(tiny_model_dir, tmp_path / "a", steps=3), grader=ParityGrader())
    train(run_config(tiny_model_dir, tmp_path / "b", steps=1), grader=ParityGrader())
    train(run_config(tiny_model_dir, tmp_path / "b", steps=3, resume=True), grader=ParityGrader())
    a, b = _policy(tmp_path / "a"), _policy(tmp_path / "b")
    assert a["step"] == b["step"] == 3
    for k in a["policy"]:
        assert torch.equal(a["policy"][k], b["policy"][k]), k
    from sparkrl.model.weights import load_model

    initial = load_model(str(tiny_model_dir), with_tokenizer=False).model.state_dict()
    assert any(not torch.equal(a["policy"][k], initial[k]) for k in initial)  # training moved the weights
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIMING} for m in ms]
    assert strip(_metrics(tmp_path / "a")) == strip(_metrics(tmp_path / "b"))


def test_resume_refuses_other_settings_and_fresh_run_refuses_old_dir(tiny_model_dir, tmp_path):
    train(run_config(tiny_model_dir, tmp_path / "r", steps=1), grader=ParityGrader())
    with pytest.raises(UserError, match="already holds checkpoints.*--resume"):
        train(run_config(tiny_model_dir, tmp_path / "r", steps=2), grader=ParityGrader())
    with pytest.raises(UserError, match="group_size was 3, now 4"):
        train(run_config(tiny_model_dir, tmp_path / "r", steps=2, resume=True, group_size=4), grader=ParityGrader())


def test_a_killed_checkpoint_write_leaves_nothing_after_the_next_start(tiny_model_dir, tmp_path):
    train(run_config(tiny_model_dir, tmp_path / "r", steps=1), grader=ParityGrader())
    stale = tmp_path / "r" / "checkpoints" / ".tmp-abc123"  # what a kill during save_checkpoint leaves
    stale.mkdir()
    (stale / "policy.safetensors").write_bytes(b"x" * 1000)
    train(run_config(tiny_model_dir, tmp_path / "r", steps=2, resume=True), grader=ParityGrader())
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step-000002"]


def test_data_order_covers_each_epoch():
    order = DataOrder(n=10, per_step=3, seed=5)
    seen = [i for s in range(10) for i in order.batch(s)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != seen[10:20]  # every epoch is reshuffled
    assert [i for s in range(4) for i in DataOrder(10, 3, 6).batch(s)] != seen[:12]  # and the order is seeded


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["train", "--out", "X", "--group-size", "1"], "--group-size must be >= 2"),
        (["train", "--out", "X", "--temperature", "-1"], "--temperature must be >= 0"),
        (["train", "--out", "X", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["train", "--out", "X", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["train", "--out", "X", "--steps", "0"], "--steps must be >= 1"),
        (["train", "--steps", "2"], "--out is required"),
        (["train", "--out", "X", "--model", "/no/such/model"], "does not exist"),
        (["train", "--out", "X", "--data", "/no/such.jsonl"], "is not a file"),
        (["train", "--out", "X", "--bogus"], "unrecognized arguments"),
        (["generate", "--prompt", "a", "--prompts-file", "b"], "exactly one of"),
        (["train", "--out", "X", "--draft", "eagle3", "--draft-checkpoint", "/no/such.pt"], "does not exist"),
        (["train", "--out", "X", "--draft", "eagle3", "--tree-nodes", "0"], "--tree-nodes must be >= 1"),
        (
            ["train", "--out", "X", "--draft", "eagle3", "--tree-depth", "9", "--tree-nodes", "4"],
            "larger than the node budget",
        ),
        (["train", "--out", "X", "--draft", "eagle3", "--tree-branch", "0"], "--tree-branch must be >= 1"),
    ],
)
def test_bad_input_is_one_clear_line(argv, msg, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_ctrl_c_writes_checkpoint_and_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "int"
    cmd = [
        sys.executable,
        "-m",
        "sparkrl.commands.cli",
        "train",
        "--model",
        str(tiny_model_dir),
        "--out",
        str(out),
        "--steps",
        "500",
        "--group-size",
        "2",
        "--prompts-per-step",
        "1",
        "--max-new-tokens",
        "4",
        "--default-size",
        "20",
        "--checkpoint-every",
        "1000",
    ]
    # a shell's background job inherits SIGINT ignored, and Python then installs no Ctrl-C handler:
    # give the run the default disposition, as an interactive terminal would
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted; checkpoint at step" in err and "Traceback" not in err
    ck = list_checkpoints(out)
    assert len(ck) == 1
    step = load_checkpoint(ck[0], with_policy=False)["step"]
    assert step >= 2 and len(_metrics(out)) >= step


@pytest.mark.slow
def test_cli_train_and_generate_on_default_model(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparkrl.commands.cli",
            "train",
            "--model",
            "default",
            "--data",
            "default",
            "--out",
            str(out),
            "--steps",
            "1",
            "--group-size",
            "2",
            "--prompts-per-step",
            "1",
            "--max-new-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    assert "trained 1 step ->" in r.stderr and (out / "model" / "model.safetensors").exists()
    assert len(_metrics(out)) == 1 and (out / "checkpoints" / "step-000001" / "policy.safetensors").exists()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparkrl.commands.cli",
            "generate",
            "--model",
            "default",
            "--prompt",
            "What is 2+3?",
            "--temperature",
            "0",
            "--json",
            "--max-new-tokens",
            "20",
            "--n",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in r.stdout.splitlines()]
    assert len(rows) == 2 and rows[0]["token_ids"] == rows[1]["token_ids"]  # greedy
    for key in ("prompt_index", "prompt_token_ids", "text", "token_ids", "finish_reason"):
        assert key in rows[0]
    # any drafter, even an untrained one, gives exactly the greedy tokens
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparkrl.commands.cli",
            "generate",
            "--model",
            "default",
            "--prompt",
            "What is 2+3?",
            "--temperature",
            "0",
            "--json",
            "--max-new-tokens",
            "20",
            "--draft",
            "eagle3",
            "--draft-checkpoint",
            "fresh",
            "--budget",
            "fixed",
            "--tree-nodes",
            "6",
            "--tree-depth",
            "3",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["token_ids"] == rows[0]["token_ids"]
    assert "drafting: aal" in r.stderr


def test_cli_train_shows_drafting_resumes_aloud_and_exports(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from sparkrl.model.weights import load_model

    out = tmp_path / "run"
    argv = [
        "train",
        "--model",
        str(tiny_model_dir),
        "--out",
        str(out),
        "--group-size",
        "2",
        "--prompts-per-step",
        "1",
        "--max-new-tokens",
        "6",
        "--default-size",
        "20",
        "--draft",
        "eagle3",
        "--tree-depth",
        "2",
        "--tree-branch",
        "2",
        "--tree-nodes",
        "3",
        "--budget",
        "fixed",
    ]
    assert main(argv + ["--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "trained 1 step ->" in err and "tokens per verification round (AAL), 100% of" in err
    assert "first step -> last: reward " in err and ", format " in err and " in all" in err
    assert main(argv + ["--steps", "2", "--resume"]) == 0
    assert "resuming " + str(out) + " from step 1" in capsys.readouterr().err
    assert main(["export", str(out), "--out", str(tmp_path / "hf")]) == 0
    assert "exported step 2" in capsys.readouterr().err
    # the run's drafter as vLLM's EAGLE-3 checkpoint, which reads back as the run's drafter (its layer tapped twice
    # by this 2-layer policy's default summed into one fc block)
    assert main(["export-draft", str(out), "--out", str(tmp_path / "vd")]) == 0
    assert "exported the drafter of" in capsys.readouterr().err
    cfg = json.loads((tmp_path / "vd" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_aux_hidden_states"] == 2
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_model_dir),
                "--prompt",
                "hi",
                "--max-new-tokens",
                "4",
                "--draft",
                "eagle3",
                "--draft-checkpoint",
                str(tmp_path / "vd"),
                "--budget",
                "fixed",
                "--tree-depth",
                "2",
                "--tree-nodes",
                "3",
                "--tree-branch",
                "2",
            ]
        )
        == 0
    )
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    (other / "model.safetensors").symlink_to(tmp_path / "vd" / "model.safetensors")
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_model_dir),
                "--prompt",
                "hi",
                "--draft",
                "eagle3",
                "--draft-checkpoint",
                str(other),
            ]
        )
        == 2
    )
    assert "was made for a policy with vocab_size=1000" in capsys.readouterr().err
    ours = load_model(str(tiny_model_dir), with_tokenizer=False).model
    assert not ours.load_weights(load_latest(out)["policy"])[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    toks = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        want = ours.logits(ours(toks).hidden)
        got = hf(toks).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    for bad, msg in (
        (["export", str(tmp_path), "--out", str(tmp_path / "x")], "holds no checkpoint"),
        (["export", "--out", str(tmp_path / "x")], "give the run folder"),
    ):
        assert main(bad) == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["generate", "--prompt", "x", "--device", "gpu"], "--device 'gpu' is not a torch device"),
        (["generate", "--prompt", "x", "--device", "cuda"], "--device cuda: "),
        (["train", "--out", "X", "--device", "cuda:1"], "use --device cpu"),
        (["train", "--out", "X", "--dtype", "float16"], "--dtype float16 on a CPU"),
        (["generate", "--prompts-file", "p.jsonl"], "p.jsonl:2: no 'prompt' string"),
        (["generate", "--prompts-file", "q.jsonl"], "q.jsonl:1: not JSON"),
        (["generate", "--prompts-file", "none.txt"], "does not exist"),
        (
            ["generate", "--prompt", "x", "--engine", "vllm", "--draft", "eagle3"],
            "--engine vllm drafts chains, not trees",
        ),
        (
            ["generate", "--prompt", "x", "--engine", "vllm", "--draft", "eagle3", "--draft-mode", "chain"],
            "pass --budget fixed",
        ),
        (["generate", "--prompt", "x", "--engine", "vllm", "--draft", "dflash"], "fixed block size every round"),
        (
            ["generate", "--prompt", "x", "--engine", "vllm", "--draft", "dflash", "--budget", "fixed", "--spark"],
            "SPARK on blocks",
        ),
        (
            [
                "train",
                "--out",
                "X",
                "--engine",
                "vllm",
                "--draft",
                "eagle3",
                "--draft-mode",
                "chain",
                "--budget",
                "fixed",
                "--spark",
                "--spark-carry",
            ],
            "--spark-carry keeps B across rollouts",
        ),
        (["export-draft", "runs/none.safetensors", "--out", "d"], "runs/none.safetensors"),
    ],
)
def test_new_user_mistakes_are_one_clear_line(argv, msg, capsys, tmp_path, monkeypatch):
    if "cuda" in " ".join(argv) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n{"question": "no prompt"}\n')
    (tmp_path / "q.jsonl").write_text("what is 2+2?\n")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_help_groups_flags_marks_required_and_hides_training_flags_from_generate(capsys):
    for argv in (["train", "--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    out = capsys.readouterr().out
    train_help, gen_help = out.split("usage: sparkrl generate")
    assert "spark options:" in train_help and "draft options:" in train_help and "(required)" in train_help
    assert "--draft {none,eagle3,dflash,self-int8}" in train_help and "--draft-lr" in train_help
    assert "--draft-lr" not in gen_help and "--spark-carry" not in gen_help and "--spark-rank" in gen_help


def test_round_log_of_autoregressive_rollouts_is_analysable(tiny_model_dir, tmp_path):
    log = tmp_path / "rounds.jsonl"
    train(run_config(tiny_model_dir, tmp_path / "r", steps=1, round_log=str(log)), grader=ParityGrader())
    rec = json.loads(log.read_text().splitlines()[0])
    assert len(rec["responses"]) == 6 and all(set(r["outcome"]) == {-1} for r in rec["responses"])  # all undrafted
    assert main(["analyze", "--logs", str(log), "--out", str(tmp_path / "an")]) == 0
    res = json.loads((tmp_path / "an" / "analysis.json").read_text())["results"]
    assert next(iter(res.values()))["drafted_positions"] == 0


def test_bfloat16_rollouts_of_float32_weights(tiny_model_dir, tmp_path):
    """The rollout copy follows the master weights after every update, the gap between the two is
    measured, and a resumed run continues exactly."""
    from sparkrl.train.trainer import GRPORun

    kw = dict(rollout_dtype="bfloat16", draft="eagle3", tree_depth=2, tree_branch=2, tree_nodes=3, budget="fixed")
    run = GRPORun(run_config(tiny_model_dir, tmp_path / "x", steps=1, **kw), grader=ParityGrader())
    assert run.generation.policy.copied and run.generation.policy.model.lm_head.weight.dtype == torch.bfloat16
    assert run.policy.lm_head.weight.dtype == torch.float32
    assert (
        run.drafting.copy.model.fc.weight.dtype == torch.bfloat16
        and run.drafting.drafter.fc.weight.dtype == torch.float32
    )
    m = run.step(0)
    run.grader.close()
    for a, b in zip(run.generation.policy.model.parameters(), run.policy.parameters()):  # refreshed after the update
        assert torch.equal(a, b.to(torch.bfloat16))
    for a, b in zip(run.drafting.copy.model.parameters(), run.drafting.drafter.parameters()):
        assert torch.equal(a, b.to(torch.bfloat16))
    assert 0 < m["rollout_logp_abs_mean"] <= m["rollout_logp_abs_max"] and m["rollout_kl"] >= 0
    train(run_config(tiny_model_dir, tmp_path / "a", steps=3, **kw), grader=ParityGrader())
    train(run_config(tiny_model_dir, tmp_path / "b", steps=1, **kw), grader=ParityGrader())
    train(run_config(tiny_model_dir, tmp_path / "b", steps=3, resume=True, **kw), grader=ParityGrader())
    strip = lambda ms: [{k: v for k, v in x.items() if k not in TIMING and not k.endswith("_s")} for x in ms]
    assert strip(_metrics(tmp_path / "a")) == strip(_metrics(tmp_path / "b"))


def test_weight_major_cpu_kernels_are_used_unpacked_and_unmeasured(tiny_model_dir, tmp_path, monkeypatch):
    import sparkrl.train.trainer as trainer_mod
    from sparkrl.cpu.kernels import CpuLinear as Linear

    run = trainer_mod.GRPORun(
        run_config(tiny_model_dir, tmp_path / "x", steps=1, rollout_dtype="float32", cpu_kernels="weight-major"),
        grader=ParityGrader(),
    )
    run.grader.close()
    layers = [m for m in run.generation.policy.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.weight_major and not m.packed for m in layers)
    resolved = json.loads((tmp_path / "x" / "config.json").read_text())["resolved"]
    assert resolved["weight_major_kernels"] is True and resolved["packed_kernels"] is False


@pytest.mark.skipif(not packable(torch.float32, "cpu"), reason="no oneDNN in this torch")
def test_packed_float32_rollouts_sample_from_the_updated_policy_and_the_reference_stays_packed(
    tiny_model_dir, tmp_path
):
    """float32 rollouts on prepacked weights: the rollout model is the policy itself, its packed copies are
    remade after the update (logits as plain F.linear's of the new weights), the reference's are made once."""
    import copy

    import sparkrl.train.trainer as trainer_mod
    from sparkrl.cpu.kernels import pack

    kw = dict(
        rollout_dtype="float32",
        cpu_kernels="packed",
        draft="eagle3",
        tree_depth=2,
        tree_branch=2,
        tree_nodes=3,
        budget="fixed",
    )
    run = trainer_mod.GRPORun(run_config(tiny_model_dir, tmp_path / "x", steps=1, **kw), grader=ParityGrader())
    assert run.generation.policy.model is run.policy and run.policy.lm_head.packed and run.ref.lm_head.packed
    assert run.drafting.copy.model._head[0].packed
    toks = torch.randint(0, run.policy.args.vocab_size, (2, 7))
    with torch.no_grad():
        run.ref(toks)
        ref_pack = run.ref.model.layers[0].mlp.up_proj._pack[0]
        before = run.policy.logits(run.policy(toks).hidden)
    run.step(0)
    run.grader.close()
    plain = pack(copy.deepcopy(run.policy), False)
    with torch.no_grad():
        after = run.policy.logits(run.policy(toks).hidden)  # 14 rows: the prepacked path
        want = plain.logits(plain(toks).hidden)
        run.ref(toks)
    assert run.policy.lm_head._pack is not None and not torch.allclose(after, before, atol=1e-4)
    assert torch.allclose(after, want, rtol=1e-4, atol=1e-4)
    assert run.ref.model.layers[0].mlp.up_proj._pack[0] is ref_pack  # the reference never changes: packed once


@pytest.mark.skipif(not packable(torch.bfloat16, "cpu"), reason="this torch/CPU cannot prepack bfloat16 weights")
def test_packed_bfloat16_rollouts_with_a_float32_head_follow_the_updates_and_resume_exactly(
    tiny_model_dir, tmp_path, monkeypatch
):
    import sparkrl.train.trainer as trainer_mod

    kw = dict(
        rollout_dtype="bfloat16",
        cpu_kernels="packed",
        rollout_head="float32",
        draft="eagle3",
        tree_depth=2,
        tree_branch=2,
        tree_nodes=3,
        budget="fixed",
    )
    run = trainer_mod.GRPORun(run_config(tiny_model_dir, tmp_path / "x", steps=1, **kw), grader=ParityGrader())
    assert (
        run.generation.policy.model.lm_head.packed
        and run.drafting.copy.model.fc.packed
        and run.generation.policy.model.head32
    )
    assert run.drafting.copy.model._head[0].packed and not is_packed(run.policy) and not is_packed(run.drafting.drafter)
    run.step(0)
    run.grader.close()
    for a, b in zip(
        run.generation.policy.model.parameters(), run.policy.parameters()
    ):  # refreshed: repacked at next use
        assert torch.equal(a, b.to(torch.bfloat16))
    assert torch.equal(run.generation.policy.model.head32[0], run.policy.lm_head.weight)  # the float32 head too
    train(run_config(tiny_model_dir, tmp_path / "a", steps=3, **kw), grader=ParityGrader())
    assert json.loads((tmp_path / "a" / "config.json").read_text())["resolved"]["packed_kernels"] is True
    train(run_config(tiny_model_dir, tmp_path / "b", steps=1, **kw), grader=ParityGrader())
    train(run_config(tiny_model_dir, tmp_path / "b", steps=3, resume=True, **kw), grader=ParityGrader())
    strip = lambda ms: [{k: v for k, v in x.items() if k not in TIMING and not k.endswith("_s")} for x in ms]
    assert strip(_metrics(tmp_path / "a")) == strip(_metrics(tmp_path / "b"))  # resumed exactly
    again = trainer_mod.GRPORun(
        run_config(tiny_model_dir, tmp_path / "b", steps=4, resume=True, **kw), grader=ParityGrader()
    )
    again.grader.close()
    assert again.generation.policy.model.lm_head.packed  # the start's choice, not this (patched) measurement


def test_bfloat16_autocast_update_trains(tiny_model_dir, tmp_path):
    s = train(
        run_config(
            tiny_model_dir,
            tmp_path / "r",
            steps=2,
            train_dtype="bfloat16",
            draft="eagle3",
            tree_depth=2,
            tree_branch=2,
            tree_nodes=3,
            budget="fixed",
        ),
        grader=ParityGrader(),
    )
    assert s.steps_run == 2
    m = _metrics(tmp_path / "r")
    assert all(x["grad_norm"] > 0 and x["draft_train_s"] > 0 for x in m)


def test_resume_keeps_the_rollout_dtype_its_start_resolved(tiny_model_dir, tmp_path, monkeypatch):
    import sparkrl.train.generation as generation_mod
    import sparkrl.train.trainer as trainer_mod

    train(run_config(tiny_model_dir, tmp_path / "r", steps=1), grader=ParityGrader())
    first = json.loads((tmp_path / "r" / "config.json").read_text())["resolved"]["rollout_dtype"]
    other = "bfloat16" if first == "float32" else "float32"
    monkeypatch.setattr(generation_mod, "rollout_dtype", lambda *a: getattr(torch, other))  # another machine's measure
    run = trainer_mod.GRPORun(run_config(tiny_model_dir, tmp_path / "r", steps=2, resume=True), grader=ParityGrader())
    assert str(run.generation.policy.model.lm_head.weight.dtype) == f"torch.{first}"


def test_bfloat16_rollouts_attend_in_float32_where_measured_and_resume_keeps_the_choice(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Where torch's attention serves (here --cpu-kernels weight-major), the rollout copy and its drafter attend in
    float32 where this machine's measurement says so (the master weights and the trained drafter do not); the
    run records the choice and a resumed run keeps it."""
    import sparkrl.train.generation as generation_mod
    import sparkrl.train.trainer as trainer_mod
    from sparkrl.model.transformer import Attention

    attn = lambda module: {getattr(m, "attn_dtype", None) for m in module.modules() if isinstance(m, Attention)}
    monkeypatch.setattr(generation_mod, "float32_attention", lambda *a: True)  # this machine's measurement
    kw = dict(
        rollout_dtype="bfloat16",
        draft="eagle3",
        tree_depth=2,
        tree_branch=2,
        tree_nodes=3,
        budget="fixed",
        cpu_kernels="weight-major",
    )
    train(run_config(tiny_model_dir, tmp_path / "r", steps=1, **kw), grader=ParityGrader())
    assert json.loads((tmp_path / "r" / "config.json").read_text())["resolved"]["float32_attention"] is True
    monkeypatch.setattr(generation_mod, "float32_attention", lambda *a: False)  # another machine's
    run = trainer_mod.GRPORun(
        run_config(tiny_model_dir, tmp_path / "r", steps=2, resume=True, **kw), grader=ParityGrader()
    )
    run.grader.close()
    assert attn(run.generation.policy.model) == attn(run.drafting.copy.model) == {torch.float32}
    assert attn(run.policy) == attn(run.drafting.drafter) == {None}


def test_auto_cpu_kernels_run_the_compiled_kernels_and_record_it(tiny_model_dir, tmp_path):
    """Under --cpu-kernels auto every product, norm, RoPE and cached attention of the rollout copy runs the
    compiled kernels (where they can be built), unmeasured, and the run config says so."""
    import sparkrl.train.trainer as trainer_mod
    from sparkrl.cpu import native

    if not native.available():
        pytest.skip("the compiled kernels are not available here")
    run = trainer_mod.GRPORun(
        run_config(tiny_model_dir, tmp_path / "r", steps=1, rollout_dtype="float32"), grader=ParityGrader()
    )
    run.grader.close()
    model = run.generation.policy.model
    assert model.lm_head.native and model.model.layers[0].mlp.up_proj.native and not model.lm_head.packed
    assert model.model.norm.native and model.model.layers[0].self_attn.native
    resolved = json.loads((tmp_path / "r" / "config.json").read_text())["resolved"]
    assert resolved["compiled_kernels"] is True and resolved["packed_kernels"] is False


def test_checkpoints_of_an_older_format_are_refused_not_ignored(tiny_model_dir, tmp_path):
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "step-000001.pt").write_bytes(b"old")
    with pytest.raises(UserError, match="older sparkrl"):
        train(run_config(tiny_model_dir, tmp_path / "r", steps=2, resume=True), grader=ParityGrader())


def test_a_step_written_twice_replaces_the_first(tmp_path):
    from sparkrl.train.checkpoint import save_checkpoint

    for v in (1.0, 2.0):
        save_checkpoint(tmp_path, 3, {"policy": {"w": torch.full((2,), v)}, "x": v}, keep=2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000003"]
    ck = load_latest(tmp_path)
    assert ck["x"] == 2.0 and torch.equal(ck["policy"]["w"], torch.full((2,), 2.0))


def test_drafter_training_pauses_while_the_budget_declines_every_round(tiny_model_dir, tmp_path, monkeypatch):
    """A budget that declines every round: the drafter trains on step 1 and every 8th step after (so a paused
    drafter keeps up with the policy), not in between (no draft optimizer step, its weights unchanged, no draft
    figures); the metrics and the summary say so, and a run resumed across a paused step is the same run."""
    import sparkrl.train.generation as generation
    from sparkrl.engine.budget import AR, FixedBudget

    class Declines(FixedBudget):
        def choose(self, B):
            return AR

    monkeypatch.setattr(generation, "make_budget", lambda cfg, policy, drafter: Declines(cfg.shape()))
    kw = dict(draft="eagle3", tree_depth=2, tree_branch=2, tree_nodes=3, prompts_per_step=1, keep_checkpoints=10)
    s = train(run_config(tiny_model_dir, tmp_path / "a", steps=10, **kw), grader=ParityGrader())
    m = _metrics(tmp_path / "a")
    assert [x["draft_paused"] for x in m] == [0, 1, 1, 1, 1, 1, 1, 1, 0, 1]
    assert all(x["tree_rounds"] == 0 < x["rounds"] for x in m)
    assert all(("draft_ce" in x) == (x["draft_train_s"] > 0) == (not x["draft_paused"]) for x in m)
    assert s.draft_paused == 8
    ck = lambda k: load_checkpoint(tmp_path / "a" / "checkpoints" / f"step-{k:06d}")["draft"]["drafter"]["state"]
    a, b, c = ck(2), ck(8), ck(9)
    assert all(torch.equal(a[k], b[k]) for k in a)  # paused from step 2 to step 8
    assert any(not torch.equal(b[k], c[k]) for k in b)  # step 9 trained
    train(run_config(tiny_model_dir, tmp_path / "b", steps=4, **kw), grader=ParityGrader())
    train(run_config(tiny_model_dir, tmp_path / "b", steps=10, resume=True, **kw), grader=ParityGrader())
    strip = lambda ms: [{k: v for k, v in x.items() if k not in TIMING and not k.endswith("_s")} for x in ms]
    assert strip(_metrics(tmp_path / "b")) == strip(m)


def test_drafter_training_pauses_only_when_the_budget_drafts_almost_nothing():
    from sparkrl.engine.records import RoundStats
    from sparkrl.train.drafting import PAUSE_SHARE, PAUSED_EVERY, Drafting, NoDrafting

    learns = lambda drafted, rounds, step: Drafting.learns(None, RoundStats(rounds=rounds, tree_rounds=drafted), step)
    assert not learns(1, 100, 1) and not learns(0, 100, PAUSED_EVERY + 1)  # the budget's probes alone
    assert learns(int(PAUSE_SHARE * 100), 100, 1)  # drafting
    assert learns(0, 100, 0) and learns(0, 100, PAUSED_EVERY)  # every PAUSED_EVERY-th step trains anyway
    assert learns(0, 0, 3)  # an engine that counts no rounds (vLLM's): always
    assert not NoDrafting().learns(RoundStats(rounds=100, tree_rounds=100), 0) and not NoDrafting.trains


def test_a_run_whose_drafter_learns_makes_the_autoregressive_runs_rollouts_and_updates(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Rollouts token-identical to AR's stay so across steps only if the policy update has the same bits whether a
    drafter learns from its forward or not: the head's log-probabilities over the same positions in the same row
    blocks (a few rows a block here, as the default model's 49,152-token head has)."""
    import sparkrl.model.logprobs as logprobs

    monkeypatch.setattr(logprobs, "BLOCK_BYTES", 4 * 3 * 49152)  # 3 rows a block of the 49,152-token head
    kw = dict(steps=3, max_new_tokens=8, checkpoint_every=1, keep_checkpoints=3)
    train(run_config(tiny_model_dir, tmp_path / "ar", **kw), grader=ParityGrader())
    draft = dict(draft="eagle3", tree_depth=2, tree_branch=2, tree_nodes=3, budget="fixed")
    train(run_config(tiny_model_dir, tmp_path / "sp", **kw, **draft), grader=ParityGrader())
    ar, sp = _metrics(tmp_path / "ar"), _metrics(tmp_path / "sp")
    assert [m["token_hash"] for m in ar] == [m["token_hash"] for m in sp] and all(m["tree_rounds"] for m in sp)
    assert [m["loss"] for m in ar] == [m["loss"] for m in sp]
    a, b = _policy(tmp_path / "ar")["policy"], _policy(tmp_path / "sp")["policy"]
    assert all(torch.equal(a[k], b[k]) for k in a)
