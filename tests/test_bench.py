"""`sparkrl bench` end to end on a tiny model: the Table-1 layout, interleaved runs, resume, ablations."""

from __future__ import annotations

import json

import pytest
from helpers import ParityGrader, assert_drawn

from sparkrl.commands import bench as bench_mod
from sparkrl.commands.bench import BenchConfig
from sparkrl.commands.cli import main
from sparkrl.config import build


def _cfg(model_dir, out, **kw):
    flat = dict(
        model=str(model_dir),
        out=str(out),
        datasets="default",
        steps=2,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=8,
    )
    return build(BenchConfig, {**flat, **kw})


def _metrics(folder):
    return [json.loads(l) for l in (folder / "metrics.jsonl").read_text().splitlines()]


def test_bench_quick_table_resume_and_plots(tiny_model_dir, tmp_path):
    out = tmp_path / "b"
    methods = "ar,eagle3,eagle3+spark,dflash,dflash+spark"
    res = bench_mod.bench(
        _cfg(tiny_model_dir, out, methods=methods, block_size=4), grader=ParityGrader(), log=lambda s: None
    )
    ms = res["datasets"]["default"]["methods"]
    assert set(ms) == set(methods.split(","))
    ar = _metrics(out / "default" / "ar")
    per_token = lambda xs: sum(x["gen_s"] for x in xs) / sum(x["gen_tokens"] for x in xs)
    step_s = lambda xs: sum(x["gen_s"] + x["train_s"] + x["draft_train_s"] for x in xs)
    for m in ("eagle3", "eagle3+spark", "dflash", "dflash+spark"):  # the table's figures are the runs' own
        run = _metrics(out / "default" / m.replace("+", "_"))
        assert ms[m]["steps"] == len(run) == 2
        assert ms[m]["aal"] == pytest.approx(sum(x["committed"] for x in run) / sum(x["row_rounds"] for x in run))
        assert ms[m]["gen_speedup"] == pytest.approx(per_token(ar) / per_token(run))
        assert ms[m]["e2e_speedup"] == pytest.approx(step_s(ar) / step_s(run))
    assert ms["eagle3+spark"]["spark_s"] > 0 and ms["eagle3"]["spark_s"] == 0
    for fam in ("eagle3", "dflash"):  # +SPARK against its own baseline, with intervals over paired steps
        sg = res["datasets"]["default"]["spark_gain"][fam]
        assert sg["aal"] == pytest.approx(ms[fam + "+spark"]["aal"] / ms[fam]["aal"])
        assert sg["aal_ci"][0] - 1e-9 <= sg["aal"] <= sg["aal_ci"][1] + 1e-9  # a ratio of sums lies between the steps'
        assert sg["e2e"] == pytest.approx(ms[fam]["e2e_speedup"] ** -1 * ms[fam + "+spark"]["e2e_speedup"])
    assert len(ms["eagle3"]["e2e_speedup_ci"]) == 2 and len(ms["ar"]["kl_per_step"]) == 2
    log = out / "default" / "eagle3_spark" / "round_log.jsonl"  # every drafting run logs its rounds for analyze
    assert [json.loads(l)["step"] for l in log.read_text().splitlines()] == [1, 2]
    seeds = {
        json.loads((out / "default" / f / "config.json").read_text())["config"]["seed"]
        for f in ("ar", "eagle3", "eagle3_spark")
    }
    assert seeds == {0}
    md = (out / "bench.md").read_text()
    assert "| default |" in md and "paper mean" in md and "EAGLE3-style:" in md and "DFlash-style:" in md
    assert "default: +SPARK over EAGLE3-style (95% interval" in md
    assert_drawn(out / "bench.png")
    saved = json.loads((out / "bench.json").read_text())
    assert saved["machine"]["torch"] and saved["sizes"]["group_size"] == 2
    # resume continues every method to the new step count, keeping what was done
    res = bench_mod.bench(
        _cfg(tiny_model_dir, out, steps=3, resume=True, methods=methods, block_size=4),
        grader=ParityGrader(),
        log=lambda s: None,
    )
    assert all(s["steps"] == 3 for s in res["datasets"]["default"]["methods"].values())
    assert [json.loads(l)["step"] for l in log.read_text().splitlines()] == [1, 2, 3]
    # a bench summarised at fewer steps than some run did (killed just after a step) counts only those
    res = bench_mod.bench(
        _cfg(tiny_model_dir, out, steps=2, resume=True, methods=methods, block_size=4),
        grader=ParityGrader(),
        log=lambda s: None,
    )
    ms = res["datasets"]["default"]["methods"]
    assert all(s["steps"] == 2 and len(s["kl_per_step"]) == 2 for s in ms.values())
    assert res["datasets"]["default"]["spark_gain"]["eagle3"]["steps"] == 2
    with pytest.raises(Exception, match="already holds a bench"):
        bench_mod.bench(_cfg(tiny_model_dir, out), grader=ParityGrader(), log=lambda s: None)


def test_bench_ablations(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(
        bench_mod,
        "ABLATIONS",
        {"update every 5 rounds": {"spark_every": 5}, "frozen projection A": {"spark_frozen_a": True}},
    )
    res = bench_mod.bench(
        _cfg(tiny_model_dir, tmp_path / "a", ablations=True, steps=1), grader=ParityGrader(), log=lambda s: None
    )
    ms = res["datasets"]["default"]["methods"]
    assert set(ms) == {"full SPARK", "update every 5 rounds", "frozen projection A"}
    for name, s in ms.items():  # each variant ran with its own settings (frozen A: A unchanged)
        assert s["steps"] == 1 and len(s["aal_per_step"]) == 1
    cfgs = {
        p.parent.name: json.loads(p.read_text())["config"]["draft"]["spark_config"]
        for p in (tmp_path / "a").rglob("config.json")
    }
    assert {c["spark_every"] for c in cfgs.values() if c["spark"]} == {1, 5}
    assert sum(c["spark_frozen_a"] for c in cfgs.values()) == 1
    assert "| default | frozen projection A |" in (tmp_path / "a" / "bench.md").read_text()
    for v in ("update every 5 rounds", "frozen projection A"):  # each variant against its chunk's full SPARK
        g = ms[v]["vs_full"][0]
        assert g["aal"] == pytest.approx(ms[v]["aal"] / ms["full SPARK"]["aal"])
        assert g["aal_ci"][0] - 1e-9 <= g["aal"] <= g["aal_ci"][1] + 1e-9
    assert "vs_full" not in ms["full SPARK"]


def test_bench_ablation_variants(tiny_model_dir, tmp_path):
    """--variants runs only the chosen rows (any case), beside full SPARK and AR, in the table's order."""
    res = bench_mod.bench(
        _cfg(
            tiny_model_dir,
            tmp_path / "v",
            ablations=True,
            steps=1,
            variants="Frozen projection A, carry correction across rollouts",
        ),
        grader=ParityGrader(),
        log=lambda s: None,
    )
    assert list(res["datasets"]["default"]["methods"]) == [
        "full SPARK",
        "carry correction across rollouts",
        "frozen projection A",
    ]
    assert sorted(p.name for p in (tmp_path / "v" / "default" / "chunk0").iterdir()) == [
        "ar",
        "carry_correction_across_rollouts",
        "frozen_projection_A",
        "full",
    ]


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["bench"], "--out is required"),
        (["bench", "--out", "X", "--methods", "ar,medusa"], "unknown method 'medusa'"),
        (["bench", "--out", "X", "--preset", "huge"], "invalid choice"),
        (["bench", "--out", "X", "--group-size", "1"], "--group-size must be >= 2"),
        (["bench", "--out", "X", "--datasets", "/no/such.jsonl"], "is not a file"),
        (["bench", "--out", "X", "--variants", "rank 4"], "pass --ablations too"),
        (["bench", "--out", "X", "--ablations", "--variants", "rank 4,rank 5"], "unknown row 'rank 5'"),
    ],
)
def test_bench_bad_input(argv, msg, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


def test_bench_policy_lr_reaches_every_method():
    """--lr (the drift stress test of issue 16) is every method's GRPO learning rate; the default is the paper's."""
    cfg = BenchConfig(out="x", lr=5e-5)
    runs = [bench_mod.run_config(cfg, "default", m, f"x/{m}") for m in ("ar", "eagle3", "eagle3+spark")]
    assert all(r.grpo.lr == 5e-5 for r in runs)
    assert all(r.sampling.temperature == 1.0 for r in runs)
    assert (
        bench_mod.run_config(BenchConfig(out="x", temperature=0.6), "default", "eagle3", "x/e").sampling.temperature
        == 0.6
    )
    assert bench_mod.run_config(BenchConfig(out="x"), "default", "ar", "x/ar").grpo.lr == 1e-6


def test_bench_spark_lr_reaches_the_spark_runs_only(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path / "b", spark_lr=2e-3)
    assert bench_mod.run_config(cfg, "default", "eagle3+spark", str(tmp_path / "x")).draft.spark_config.spark_lr == 2e-3
    assert not bench_mod.run_config(cfg, "default", "eagle3", str(tmp_path / "y")).draft.spark_config.spark
    ablation = bench_mod.run_config(cfg, "default", "eagle3+spark", str(tmp_path / "z"), {"spark_rank": 4})
    assert ablation.draft.spark_config.spark_lr == 2e-3 and ablation.draft.spark_config.spark_rank == 4
