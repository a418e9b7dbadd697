"""Data-parallel GRPO (gloo, two CPU processes, the tiny model): two ranks make the update one process
makes on the same global batch, resume exactly, and a world size that does not split a step's prompts
is one clear line; so do two ranks that shard the policy with FSDP2 (`--shard-policy fsdp`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

import sparkrl.train.trainer as trainer_mod
from sparkrl.commands.cli import main
from sparkrl.config import RunConfig, build
from sparkrl.model.weights import load_model
from sparkrl.train.checkpoint import load_latest
from sparkrl.train.rewards import Score
from sparkrl.train.trainer import train

# Figures that differ with the number of ranks by design: times, and engine rounds (each rank runs its own).
PER_RANK = {"rounds", "tree_rounds", "tree_sizes", "policy_forwards", "gen_tok_per_s"}
TIME_SHARES = {"spark_share"}  # like the *_s timings, a measured time: no two runs agree
# Float-noise figures (the rollout copy against the update's forward, in other batch shapes): absolute tolerance.
NOISE = {"rollout_logp_abs_mean", "rollout_logp_abs_max", "rollout_kl"}


class RecordingGrader:
    """The parity of the response's length as reward (random tiny models earn it), recording every text."""

    def __init__(self):
        self.texts = []

    def score(self, text, answer):
        self.texts.append(text)
        return Score(float(len(text) % 2), 0.0)

    def close(self):
        pass


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with its EOS embedding (tied to the head) scaled up, so responses end at varied
    lengths: with equal token counts on every rank, a mean of per-rank means would equal the whole
    batch's token mean and a wrong reduction would go unseen."""
    out = tmp_path_factory.mktemp("eos-model") / "m"
    shutil.copytree(tiny_model_dir, out)
    state = load_file(str(out / "model.safetensors"))
    for e in load_model(str(out), with_tokenizer=True).eos_ids:
        state["model.embed_tokens.weight"][e] *= 60
    save_file(state, str(out / "model.safetensors"))
    return out


def _flat(model_dir, out, **kw) -> dict:
    return {
        "model": str(model_dir),
        "out": str(out),
        "steps": 2,
        "group_size": 2,
        "prompts_per_step": 4,
        "max_new_tokens": 8,
        "default_size": 20,
        "lr": 1e-3,
        "micro_batch": 2,
        "rollout_dtype": "float32",
        "budget": "fixed",
        "threads": 1,
        "cpu_kernels": "plain",
        **kw,
    }  # one thread in every process: the same
    # float reductions; plain kernels: under auto a packed float32 layer rounds a row differently by how many rows
    # share the product (weight-major up to 4, oneDNN above), and a rank's batch is half the one process's


def _rank(rank: int, size: int, port: int, flat: dict) -> None:
    """One torchrun-like rank: the environment torchrun sets, then `train`; writes the texts it scored,
    a digest of the weights it ended with (every rank must hold the same; a sharded policy's differ
    by rank and are left out) and whether its policy was sharded."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(size), RANK=str(rank), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    runs, loop = [], trainer_mod._train  # keep the run, to read the weights this rank ends with
    trainer_mod._train = lambda run, start: (runs.append(run), loop(run, start))[1]
    grader = RecordingGrader()
    train(build(RunConfig, flat), grader=grader)
    out, run = Path(flat["out"]), runs[0]
    sharded = isinstance(next(run.policy.parameters()), DTensor)
    modules = ([] if sharded else [run.policy]) + (
        [run.drafting.drafter] + ([run.drafting.projection] if run.drafting.adapts else [])
        if run.cfg.draft.draft != "none"
        else []
    )
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for m in modules for p in m.parameters()))
    (out / f"rank-{rank}-{flat['steps']}.json").write_text(json.dumps([grader.texts, digest.hexdigest(), sharded]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(flat: dict, size: int = 2) -> list[list[str]]:
    """Run `train` on `size` ranks; returns the texts scored at each step, in the whole batch's order."""
    mp.spawn(_rank, args=(size, _free_port(), flat), nprocs=size, join=True)
    texts, digests, sharded = zip(
        *(json.loads((Path(flat["out"]) / f"rank-{r}-{flat['steps']}.json").read_text()) for r in range(size))
    )
    assert len(set(digests)) == 1, "the ranks ended with different weights"
    assert set(sharded) == {flat.get("shard_policy") == "fsdp"}
    per = flat["prompts_per_step"] // size * flat["group_size"]  # a rank's responses per step
    return [sum((t[i : i + per] for t in texts), []) for i in range(0, len(texts[0]), per)]


def run_single(flat: dict, monkeypatch) -> list[list[str]]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    grader = RecordingGrader()
    train(build(RunConfig, flat), grader=grader)
    n = flat["prompts_per_step"] * flat["group_size"]
    return [grader.texts[i : i + n] for i in range(0, len(grader.texts), n)]


def _metrics(out) -> list[dict]:
    return [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _close(x: torch.Tensor, y: torch.Tensor, atol: float) -> bool:
    """Within atol but for a few in a million elements: Adam divides by sqrt(v) + eps, so where an
    element's gradient is ~0 (a tied embedding row of a token no response used) float noise between
    batch layouts becomes a visible fraction of its step. A wrong reduction moves most elements."""
    off = int(((x.float() - y.float()).abs() > atol).sum())
    return off <= x.numel() // 200_000


def assert_same_run(a, b, exact: bool = False, atol: float = 1e-5):
    """Two runs' last checkpoints (policy, drafter, SPARK's A) and metrics agree (bit for bit if exact)."""
    ca, cb = load_latest(a), load_latest(b)
    assert ca["step"] == cb["step"]
    tensors = [(f"policy.{k}", ca["policy"][k], cb["policy"][k]) for k in ca["policy"]]
    if "draft" in ca:
        da, db = ca["draft"]["drafter"], cb["draft"]["drafter"]
        tensors += [(f"drafter.{k}", v, db["state"][k]) for k, v in da["state"].items()]
        if "spark" in da:
            tensors.append(("spark.A", da["spark"]["A"], db["spark"]["A"]))
    bad = [
        f"{name}: max |diff| {float((x.float() - y.float()).abs().max()):.3g}"
        for name, x, y in tensors
        if not (torch.equal(x, y) if exact else _close(x, y, atol))
    ]
    ma, mb = _metrics(a), _metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb):
        for k, v in x.items():
            close = y[k] if isinstance(v, str) else pytest.approx(y[k], rel=1e-4, abs=1e-5 if k in NOISE else 1e-7)
            if not (k.endswith("_s") or k in PER_RANK | TIME_SHARES or ((v == y[k]) if exact else (v == close))):
                bad.append(f"step {x['step']} {k}: {v} != {y[k]}")
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def autoregressive_runs(model_dir, tmp_path_factory):
    """The same 2-step run in one process and on two ranks."""
    d = tmp_path_factory.mktemp("dp")
    mp_ = pytest.MonkeyPatch()
    try:
        single = run_single(_flat(model_dir, d / "one"), mp_)
    finally:
        mp_.undo()
    return d, single, run_ranks(_flat(model_dir, d / "two"))


def test_two_ranks_make_the_update_of_one_process(autoregressive_runs):
    d, single, ranks = autoregressive_runs
    assert single == ranks and len(single) == 2 and len(single[0]) == 8  # the same responses, in the same order
    m = _metrics(d / "one")
    assert m[0]["grad_norm"] > 0 and 0 < m[0]["truncated_frac"] < 1  # a gradient, and responses of varied lengths
    assert_same_run(d / "one", d / "two")
    assert sorted(p.name for p in (d / "two").iterdir()) == [
        "checkpoints",
        "config.json",
        "metrics.jsonl",
        "metrics.png",
        "model",
        "rank-0-2.json",
        "rank-1-2.json",
    ]


def test_two_ranks_resume_exactly(autoregressive_runs, model_dir):
    d, _, ranks = autoregressive_runs
    first = run_ranks(_flat(model_dir, d / "resumed", steps=1))
    rest = run_ranks(_flat(model_dir, d / "resumed", steps=2, resume=True))
    assert first + rest == ranks
    assert_same_run(d / "two", d / "resumed", exact=True)


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(
            dict(draft="eagle3", spark=True, spark_rank=4, tree_depth=2, tree_branch=2, tree_nodes=3), id="eagle3-spark"
        ),
        pytest.param(dict(draft="dflash", block_size=4), id="dflash", marks=pytest.mark.slow),
    ],
)
def test_two_ranks_train_drafter_and_spark_as_one_process(kind, model_dir, tmp_path, monkeypatch):
    flat = lambda name: _flat(model_dir, tmp_path / name, draft_checkpoint="fresh", **kind)
    log = lambda name: {"round_log": str(tmp_path / f"{name}.jsonl")}
    single = run_single({**flat("one"), **log("one")}, monkeypatch)
    assert run_ranks({**flat("two"), **log("two")}) == single
    assert_same_run(tmp_path / "one", tmp_path / "two")
    outcomes = lambda name: [
        [(r["tokens"], r["outcome"]) for r in json.loads(line)["responses"]]
        for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()
    ]
    assert outcomes("one") == outcomes("two")  # the same tokens and drafting outcomes (rounds are per rank)
    m = _metrics(tmp_path / "two")
    assert all(x["draft_ce"] > 0 and x["committed"] > 0 for x in m)
    if kind.get("spark"):
        assert all(x["spark_contexts"] > 0 for x in m)


def test_world_size_that_does_not_split_the_prompts_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    out = tmp_path / "r"
    assert main(["train", "--model", str(tiny_model_dir), "--out", str(out), "--prompts-per-step", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--prompts-per-step 4 does not split over the 3 ranks" in err and len(err.splitlines()) == 1
    assert not out.exists()  # before anything was loaded or written


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_torchrun_starts_data_parallel_training(shard, model_dir, tmp_path):
    out = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    r = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            "-m",
            "sparkrl",
            "train",
            "--model",
            str(model_dir),
            "--out",
            str(out),
            "--steps",
            "1",
            "--group-size",
            "2",
            "--prompts-per-step",
            "2",
            "--max-new-tokens",
            "4",
            "--default-size",
            "20",
            "--shard-policy",
            shard,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("trained 1 step ->") == 1  # every rank finished (exit 0); rank 0 alone prints the summary
    assert len(_metrics(out)) == 1 and _metrics(out)[0]["gen_tokens"] > 0
    assert (out / "checkpoints" / "step-000001" / "policy.safetensors").exists() and (out / "model").is_dir()


EAGLE3_SPARK = dict(
    draft="eagle3", draft_checkpoint="fresh", spark=True, spark_rank=4, tree_depth=2, tree_branch=2, tree_nodes=3
)


@pytest.fixture(scope="module")
def fsdp_runs(model_dir, tmp_path_factory):
    """A 2-step run with the EAGLE3-style drafter and SPARK in one process, and with the policy and the
    reference sharded by FSDP2 over two ranks."""
    d = tmp_path_factory.mktemp("fsdp")
    mp_ = pytest.MonkeyPatch()
    try:
        single = run_single(_flat(model_dir, d / "one", **EAGLE3_SPARK), mp_)
    finally:
        mp_.undo()
    return d, single, run_ranks(_flat(model_dir, d / "fsdp", shard_policy="fsdp", **EAGLE3_SPARK))


def test_fsdp_ranks_make_the_update_of_one_process(fsdp_runs):
    d, single, ranks = fsdp_runs
    assert single == ranks and len(single) == 2  # the same responses: the rollout copy was refreshed from the shards
    m = _metrics(d / "fsdp")
    assert all(x["grad_norm"] > 0 and x["kl"] >= 0 and x["draft_ce"] > 0 for x in m)
    assert m[1]["kl"] > 0  # the sharded reference took part
    assert_same_run(d / "one", d / "fsdp")  # loss, grad norm, policy, drafter and A (float tolerance)
    exported = load_file(str(d / "fsdp" / "model" / "model.safetensors"))
    policy = load_latest(d / "fsdp")["policy"]
    assert exported.keys() == policy.keys() and all(torch.equal(exported[k], policy[k]) for k in policy)


def test_fsdp_ranks_resume_exactly(fsdp_runs, model_dir):
    """Stopped after step 1 and resumed: exactly the straight run; the same checkpoint resumed with the
    policy whole on every rank (it holds whole tensors): the same run within float tolerance."""
    d, _, ranks = fsdp_runs
    flat = lambda out, **kw: _flat(model_dir, d / out, **EAGLE3_SPARK, **{"shard_policy": "fsdp", **kw})
    first = run_ranks(flat("resumed", steps=1))
    shutil.copytree(d / "resumed", d / "unsharded")
    assert first + run_ranks(flat("resumed", steps=2, resume=True)) == ranks
    assert_same_run(d / "fsdp", d / "resumed", exact=True)
    assert first + run_ranks(flat("unsharded", steps=2, resume=True, shard_policy="none")) == ranks
    assert_same_run(d / "fsdp", d / "unsharded")


def test_fsdp_in_one_process_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "r"
    assert main(["train", "--model", str(tiny_model_dir), "--out", str(out), "--shard-policy", "fsdp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--shard-policy fsdp shards the policy over the ranks torchrun starts" in err and len(err.splitlines()) == 1
    assert not out.exists()  # before anything was loaded or written
