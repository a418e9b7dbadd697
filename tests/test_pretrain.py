"""Draft pretraining at scale: solutions as chat turns, the held-out split, the schedule, held-out
scores, resume after a crash, several drafters on one policy pass, and the safetensors drafter files."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import assert_drawn

from sparkrl.config import DraftConfig, PretrainConfig, build
from sparkrl.drafters.base import expected_length, read_checkpoint, save_safetensors, target_probs
from sparkrl.errors import UserError
from sparkrl.train.data import Problem, held_out, load_problems, parse_row
from sparkrl.train.features import policy_pass
from sparkrl.train.generation import RolloutPlan, build_generation
from sparkrl.train.pretrain import batch_plan, build_corpus, load_corpus_problems, lr_at, per_depth, pretrain

PLAIN = RolloutPlan(torch.float32, cpu_kernels="plain")  # the eager reference's kernels

GSM_ROW = {
    "question": "Tom has {n} apples and buys 3 more. How many apples does he have?",
    "answer": "He buys 3 so he has {n}+3=<<{n}+3={m}>>{m} apples.\n#### {m}",
}


def gsm8k_file(tmp_path, n: int = 60):
    path = tmp_path / "gsm.jsonl"
    rows = [{k: v.format(n=i, m=i + 3) for k, v in GSM_ROW.items()} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_solution_is_a_boxed_answer_without_calculator_notes():
    p, _ = parse_row({k: v.format(n=4, m=7) for k, v in GSM_ROW.items()})
    assert p.answer == "7"
    assert p.solution == "He buys 3 so he has 4+3=7 apples.\nThe final answer is \\boxed{7}."
    m, _ = parse_row({"problem": "1+1?", "solution": "It is $\\boxed{2}$."})
    assert m.answer == "2" and m.solution == "It is $\\boxed{2}$."
    assert parse_row({"question": "q", "gt_answer": "3"})[0].solution == ""


def test_held_out_split_is_stable_and_about_the_asked_share():
    probs = [Problem(f"question {i}", "1") for i in range(4000)]
    share = sum(held_out(p, 0.05) for p in probs) / len(probs)
    assert 0.04 < share < 0.06
    assert [held_out(p, 0.05) for p in probs] == [held_out(Problem(p.question, "other"), 0.05) for p in probs]
    assert not any(held_out(p, 0.0) for p in probs)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(55, 100, 1.0, 10) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(100, 100, 1.0, 10) == pytest.approx(0.1)


def test_batch_plan_covers_every_sequence_once_grouped_by_length():
    lengths = [(i * 37) % 101 + 1 for i in range(500)]
    plan = batch_plan(lengths, 4, seed=3, epoch=0)
    assert sorted(j for b in plan for j in b) == list(range(500))
    assert plan == batch_plan(lengths, 4, seed=3, epoch=0) and plan != batch_plan(lengths, 4, seed=3, epoch=1)
    spread = sum(max(lengths[j] for j in b) - min(lengths[j] for j in b) for b in plan) / len(plan)
    assert spread < 10  # random batches of 4 would spread ~50


def test_target_probs_match_a_float64_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 300, generator=g) * 4
    ids = torch.tensor([0, 7, 8, 150, 299])
    ref = torch.softmax(logits.double(), -1)[..., ids]
    assert torch.allclose(target_probs(logits, ids).double(), ref, atol=1e-7)


def test_expected_length_by_hand():
    assert expected_length([]) == 1.0
    assert expected_length([0.5, 0.4, 0.2]) == pytest.approx(1 + 0.5 + 0.2 + 0.04)
    assert per_depth({"acc_1": 0.5, "tree_1": 0.6, "tree_2": 0.5}, "tree") == [0.6, 0.5]


def _cfg(tmp_path, tiny_model_dir, data, **kw):
    flat = dict(
        model=str(tiny_model_dir),
        out=str(tmp_path / "pre"),
        data=str(data),
        prompts=4,
        max_new_tokens=8,
        draft_vocab=64,
        micro_batch=4,
        eval_sequences=6,
        eval_every=3,
        checkpoint_every=2,
        warmup=2,
        holdout=0.2,
        lr=1e-3,
        draft="eagle3,dflash",
        block_size=4,
    )
    return build(PretrainConfig, {**flat, **kw})


def test_held_out_problems_never_enter_the_corpus(tiny_model_dir, tmp_path):
    from sparkrl.model.weights import load_model

    data = gsm8k_file(tmp_path)
    cfg = _cfg(tmp_path, tiny_model_dir, data, prompts=8)
    lm = load_model(str(tiny_model_dir))
    train, test, sources = build_corpus(
        cfg,
        build_generation(PLAIN, DraftConfig(), lm.model, 1.0, trains=False),
        lm.tokenizer,
        lm.eos_ids,
        load_corpus_problems(cfg),
    )
    problems = load_problems(str(data)).problems
    held = [p for p in problems if held_out(p, 0.2)]
    assert held and sources["solutions"] > 0 and sources["policy responses"] > 0
    texts = [lm.tokenizer.decode(s.ids) for s in train]
    assert not any(p.question in t for p in held for t in texts)
    assert sum("\\boxed{" in t for t in texts) >= len(problems) - len(held)  # every training solution is in
    assert any(p.question in lm.tokenizer.decode(s.ids) for p in held for s in test)
    # the drafter trains from the last prompt position on: every sequence's answer start is its prompt
    for s in train + test:
        head = lm.tokenizer.decode(s.ids[: s.start])
        assert s.start > 0 and head.rstrip().endswith("assistant") and lm.tokenizer.decode(s.ids[s.start :]).strip()
    _, _, _, _, mask = policy_pass(lm.model, train[:2], ())
    for row, s in zip(mask, train[:2]):
        assert row.nonzero()[0, 0] == s.start - 1 and row.nonzero()[-1, 0] == len(s.ids) - 3
    _, _, _, _, every = policy_pass(lm.model, train[:2], (), answers_only=False)  # --train-positions all
    assert every[:, 0].all() and (every.sum(1) == torch.tensor([len(s.ids) - 2 for s in train[:2]])).all()


def test_feature_store_batch_equals_the_policy_pass_and_is_read_back(tiny_model_dir, tmp_path, monkeypatch):
    """A batch assembled from stored per-sequence features equals the plain policy pass at every real
    position (padding is zero); a second read runs no policy; other feature layers or another tag are
    other files."""
    from sparkrl.model.weights import load_model
    from sparkrl.train.features import FeatureStore
    from sparkrl.train.pretrain import Seq

    policy = load_model(str(tiny_model_dir), with_tokenizer=False).model
    seqs = [Seq(list(range(5, 5 + n)), 3) for n in (9, 30, 17)]
    store = FeatureStore(tmp_path / "f", "tag")
    ref = policy_pass(policy, seqs, (0, 1))
    got = policy_pass(policy, seqs, (0, 1), store=store)
    assert len(list((tmp_path / "f").iterdir())) == 3
    monkeypatch.setattr(type(policy), "forward", lambda *a, **k: pytest.fail("the policy ran on a stored batch"))
    again = policy_pass(policy, seqs, (0, 1), store=store)
    for a, b, c in ((ref[0], got[0], again[0]), (ref[4], got[4], again[4])):  # tokens, mask
        assert torch.equal(a, b) and torch.equal(b, c)
    for name, a, b, c in [("hidden", ref[2], got[2], again[2]), ("logits", ref[3], got[3], again[3])] + [
        (f"tap {i}", ref[1][i], got[1][i], again[1][i]) for i in (0, 1)
    ]:
        assert torch.equal(b, c), name
        for row, s in enumerate(seqs):
            assert torch.equal(a[row, : len(s.ids)], b[row, : len(s.ids)]), name
        if name != "logits":
            assert not b[0, len(seqs[0].ids) :].any(), name
    assert store.path(seqs[0].ids, (0, 1)) != store.path(seqs[0].ids, (1,))
    assert store.path(seqs[0].ids, (0, 1)) != FeatureStore(tmp_path / "f", "other").path(seqs[0].ids, (0, 1))
    with pytest.raises(UserError, match="--no-feature-cache"):
        store.check_space(10**15, 100, torch.float32)
    store.check_space(10, 100, torch.float32)


def test_epochs_read_stored_features_and_train_the_same_drafter(tiny_model_dir, tmp_path, monkeypatch):
    """--epochs 2: the second pass and every held-out score after the first read the stored features (one
    policy pass per training and held-out sequence in the whole run) and train exactly the drafter that
    recomputing them every time trains."""
    from sparkrl.model.transformer import Transformer

    data = gsm8k_file(tmp_path)
    real = Transformer.forward
    passes = []

    def counted(self, tokens, *a, **k):
        if k.get("taps"):
            passes.append(tokens.shape[0])
        return real(self, tokens, *a, **k)

    monkeypatch.setattr(Transformer, "forward", counted)
    cached = pretrain(_cfg(tmp_path / "a", tiny_model_dir, data, epochs=2))
    out = tmp_path / "a" / "pre"
    info = json.loads((out / "config.json").read_text())
    n = info["corpus_sequences"] + info["heldout_sequences"]
    assert sum(passes) == n and len(list((out / "features").iterdir())) == n
    passes.clear()
    plain = pretrain(_cfg(tmp_path / "b", tiny_model_dir, data, epochs=2, feature_cache=False))
    assert sum(passes) > 2 * n and not (tmp_path / "b" / "pre" / "features").exists()
    for kind in ("eagle3", "dflash"):
        a, b = (read_checkpoint(r["drafters"][kind]["path"])["state"] for r in (cached, plain))
        assert all(torch.equal(a[k], b[k]) for k in a), kind
    recs = [json.loads(l) for l in (out / "pretrain.jsonl").read_text().splitlines() if "heldout" not in l]
    assert recs[-1]["step"] == cached["steps"] and 0 < recs[0]["seconds"] <= recs[-1]["seconds"]


def test_pretrain_two_kinds_scores_held_out_and_resumes_exactly_after_a_crash(tiny_model_dir, tmp_path, monkeypatch):
    from sparkrl.train.draft_train import DraftTrainer

    data = gsm8k_file(tmp_path)
    full = pretrain(_cfg(tmp_path / "a", tiny_model_dir, data))
    out = tmp_path / "a" / "pre"
    recs = [json.loads(l) for l in (out / "pretrain.jsonl").read_text().splitlines()]
    held = [r for r in recs if r.get("heldout")]
    assert (
        {r["kind"] for r in held} == {"eagle3", "dflash"} and held[0]["step"] == 0 and held[-1]["step"] == full["steps"]
    )
    for r in held:
        assert 1.0 <= r["expected_length"] and all(0 <= r[f"acc_{d}"] <= 1 for d in (1, 2, 3))
        assert ("tree_expected_length" in r) == (r["kind"] == "eagle3")  # the EAGLE3-style trees' estimate
        assert 1.0 <= r.get("tree_expected_length", 1.0) <= 4.0 and all(
            0 <= r.get(f"tree_{d}", 0) <= 1 for d in (1, 2, 3)
        )
    assert_drawn(out / "pretrain.png")
    assert (out / "eagle3" / "snapshots" / "step-000003.safetensors").exists()
    lrs = [r["lr"] for r in recs if not r.get("heldout") and r["kind"] == "eagle3"]
    assert lrs[0] == pytest.approx(5e-4) and lrs[-1] == pytest.approx(1e-4, rel=0.2)

    # the same run, killed after its 5th step (the last checkpoint is step 4), then resumed
    crash = {"n": 0}
    real_step = DraftTrainer.step

    def dying_step(self, *a, **k):
        crash["n"] += 1
        if crash["n"] == 10:  # two drafters step per batch: the 5th batch's second drafter
            raise RuntimeError("killed")
        return real_step(self, *a, **k)

    monkeypatch.setattr(DraftTrainer, "step", dying_step)
    with pytest.raises(RuntimeError, match="killed"):
        pretrain(_cfg(tmp_path / "b", tiny_model_dir, data))
    monkeypatch.setattr(DraftTrainer, "step", real_step)
    with pytest.raises(UserError, match="--resume"):
        pretrain(_cfg(tmp_path / "b", tiny_model_dir, data))
    with pytest.raises(UserError, match="other settings.*lr"):
        pretrain(_cfg(tmp_path / "b", tiny_model_dir, data, resume=True, lr=2e-3))
    pretrain(_cfg(tmp_path / "b", tiny_model_dir, data, resume=True))
    for kind in ("eagle3", "dflash"):
        a = read_checkpoint(out / kind / "drafter.pt")["state"]
        b = read_checkpoint(tmp_path / "b" / "pre" / kind / "drafter.pt")["state"]
        for k in a:
            assert torch.equal(a[k], b[k]), (kind, k)
    rb = [json.loads(l) for l in (tmp_path / "b" / "pre" / "pretrain.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rb] == [r["step"] for r in recs]


def test_pretrain_continues_from_a_drafter_with_its_vocabulary(tiny_model_dir, tmp_path):
    from sparkrl.drafters import load_drafter
    from sparkrl.model.weights import load_model

    """--init FILE: training starts from that drafter (the step-0 snapshot is it) and keeps its draft
    vocabulary whatever --draft-vocab says; --feature-loss reaches the EAGLE3-style loss, and without it
    a fresh drafter trains with 2 and an --init drafter keeps its own."""
    args = load_model(str(tiny_model_dir)).model.args
    data = gsm8k_file(tmp_path)
    first = pretrain(_cfg(tmp_path / "a", tiny_model_dir, data, draft="eagle3"))
    init = first["drafters"]["eagle3"]["path"]
    assert load_drafter(init, args).feature_weight == 2
    cfg = _cfg(tmp_path / "b", tiny_model_dir, data, draft="eagle3", init=init, draft_vocab=32, feature_loss=0.0)
    again = pretrain(cfg)
    start = read_checkpoint(tmp_path / "b" / "pre" / "eagle3" / "snapshots" / "step-000000.safetensors")["state"]
    given = read_checkpoint(init)["state"]
    assert all(torch.equal(start[k], given[k]) for k in given) and again["draft_vocab"] == 64
    end = read_checkpoint(again["drafters"]["eagle3"]["path"])["state"]
    assert not torch.equal(end["fc.weight"], given["fc.weight"])  # and it trained
    recs = [json.loads(l) for l in (tmp_path / "b" / "pre" / "pretrain.jsonl").read_text().splitlines()]
    assert json.loads((tmp_path / "b" / "pre" / "config.json").read_text())["config"]["feature_loss"] == 0.0
    assert all(r["feat"] > 0 for r in recs if not r.get("heldout"))  # reported, though not trained on
    # the drafter keeps the loss it was trained with (online training goes on with it); older files: 2
    assert load_drafter(again["drafters"]["eagle3"]["path"], args).feature_weight == 0
    older = {**read_checkpoint(init), "settings": {"layout": "eagle3"}}  # from before the setting was saved
    assert load_drafter(older, args).feature_weight == 2
    kept = pretrain(
        _cfg(tmp_path / "c", tiny_model_dir, data, draft="eagle3", init=again["drafters"]["eagle3"]["path"])
    )
    assert load_drafter(kept["drafters"]["eagle3"]["path"], args).feature_weight == 0
    recs = [json.loads(l) for l in (tmp_path / "c" / "pre" / "pretrain.jsonl").read_text().splitlines()]
    assert recs and all(r["feat"] > 0 for r in recs if not r.get("heldout"))


def test_dflash_anchors_are_a_saved_setting(tiny_model_dir, tmp_path):
    """--anchors sets the DFlash-style drafter's training blocks per sequence; the drafter keeps it (online
    training and --init go on with it); a file from before the setting trains with 8."""
    from sparkrl.drafters import load_drafter
    from sparkrl.model.weights import load_model

    args = load_model(str(tiny_model_dir)).model.args
    data = gsm8k_file(tmp_path)
    first = pretrain(_cfg(tmp_path / "a", tiny_model_dir, data, draft="dflash", block_size=4, anchors=3))
    path = first["drafters"]["dflash"]["path"]
    assert load_drafter(path, args).anchors == 3
    kept = pretrain(_cfg(tmp_path / "b", tiny_model_dir, data, draft="dflash", block_size=4, init=path))
    assert load_drafter(kept["drafters"]["dflash"]["path"], args).anchors == 3
    older = read_checkpoint(path)
    older["settings"].pop("anchors")
    assert load_drafter(older, args).anchors == 8
    with pytest.raises(UserError, match="--anchors 0 must be >= 1"):
        _cfg(tmp_path, tiny_model_dir, data, anchors=0)


def test_draft_layers_are_a_saved_setting(tiny_model_dir, tmp_path):
    """--draft-layers sets a fresh drafter's decoder layers (both kinds); the file keeps it; an EAGLE3-style
    file from before the setting has one; with --init (which keeps the drafter's own) it is refused."""
    from sparkrl.drafters import load_drafter
    from sparkrl.model.weights import load_model

    args = load_model(str(tiny_model_dir)).model.args
    data = gsm8k_file(tmp_path)
    out = pretrain(_cfg(tmp_path / "a", tiny_model_dir, data, draft_layers=2))
    for kind in ("eagle3", "dflash"):
        d = load_drafter(out["drafters"][kind]["path"], args)
        assert d.num_layers == 2 and len(d.stack.layers) == 2
    older = read_checkpoint(out["drafters"]["eagle3"]["path"])
    older["settings"].pop("num_layers")
    older["state"] = {k: v for k, v in older["state"].items() if ".layers.1." not in k}
    assert load_drafter(older, args).num_layers == 1
    with pytest.raises(UserError, match="--draft-layers 2 with --init"):
        _cfg(tmp_path, tiny_model_dir, data, draft="eagle3", init=out["drafters"]["eagle3"]["path"], draft_layers=2)


def test_pretrain_init_errors(tiny_model_dir, tmp_path):
    data = gsm8k_file(tmp_path)
    with pytest.raises(UserError, match="--init .* does not exist"):
        _cfg(tmp_path, tiny_model_dir, data, draft="eagle3", init=str(tmp_path / "none.safetensors"))
    (tmp_path / "d.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="one --draft kind"):
        _cfg(tmp_path, tiny_model_dir, data, init=str(tmp_path / "d.safetensors"))
    with pytest.raises(UserError, match="--feature-loss -0.5 must be >= 0"):
        _cfg(tmp_path, tiny_model_dir, data, feature_loss=-0.5)
    with pytest.raises(UserError, match="--init fresh"):
        _cfg(tmp_path, tiny_model_dir, data, init="fresh")
    with pytest.raises(UserError, match="--init default: the shipped eagle3 drafter .* serves --model default"):
        pretrain(_cfg(tmp_path, tiny_model_dir, data, init="default"))
    assert not (tmp_path / "pre" / "corpus").exists() or not any(
        (tmp_path / "pre" / "corpus").iterdir()
    )  # before the corpus


def test_safetensors_drafter_round_trip_and_checks(tiny_model_dir, tmp_path):
    from sparkrl.drafters import load_drafter
    from sparkrl.drafters.eagle3 import Eagle3Drafter
    from sparkrl.model.weights import load_model

    policy = load_model(str(tiny_model_dir), with_tokenizer=False).model
    torch.manual_seed(0)
    d = Eagle3Drafter(policy.args, vocab_ids=torch.arange(0, 128, 2))
    save_safetensors(d.checkpoint(), tmp_path / "d.safetensors")
    assert (tmp_path / "d.safetensors").stat().st_size < 0.6 * 4 * sum(p.numel() for p in d.parameters())  # bf16
    e = load_drafter(tmp_path / "d.safetensors", policy.args, "eagle3")
    assert torch.equal(e.vocab_ids, d.vocab_ids)
    for (k, v), w in zip(d.state_dict().items(), e.state_dict().values()):
        assert torch.equal(v.to(torch.bfloat16).to(v.dtype), w) if v.is_floating_point() else torch.equal(v, w), k
    with pytest.raises(UserError, match="kind 'eagle3', not 'dflash'"):
        load_drafter(tmp_path / "d.safetensors", policy.args, "dflash")
    (tmp_path / "x.safetensors").write_bytes((tmp_path / "d.safetensors").read_bytes()[:40])
    with pytest.raises(UserError):
        read_checkpoint(tmp_path / "x.safetensors")


def test_draft_checkpoint_choices(tiny_model_dir, tmp_path):
    from sparkrl.config import DraftConfig
    from sparkrl.drafters import find_checkpoint
    from sparkrl.model.weights import load_model
    from sparkrl.train.drafting import make_drafter

    policy = load_model(str(tiny_model_dir), with_tokenizer=False).model
    assert find_checkpoint("", "eagle3", policy) is None  # no drafter is shipped for this policy: fresh
    assert find_checkpoint("fresh", "eagle3", policy) is None
    assert find_checkpoint("some/file.pt", "eagle3", policy) == "some/file.pt"
    with pytest.raises(
        UserError, match="--draft-checkpoint default: the shipped eagle3 drafter .* serves --model default"
    ):
        find_checkpoint("default", "eagle3", policy)
    with pytest.raises(UserError, match="--draft-checkpoint default"):
        make_drafter(DraftConfig(draft="eagle3", draft_checkpoint="default"), policy)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_shipped_drafters_serve_the_default_model(kind, tmp_path):
    """Both shipped drafters load for the default model; the EAGLE3-style one is in EAGLE-3's layout, so
    `export-draft default` writes it for vLLM's eagle3 method, and the export reads back as the same drafter."""
    from sparkrl.commands.cli import main
    from sparkrl.config import DraftConfig
    from sparkrl.drafters import find_checkpoint, load_drafter, shipped_path
    from sparkrl.model.weights import load_model
    from sparkrl.train.drafting import make_drafter

    path = shipped_path(kind)
    assert path.is_file() and path.stat().st_size < 40e6, path
    policy = load_model("default", with_tokenizer=False).model
    assert find_checkpoint("", kind, policy) == find_checkpoint("default", kind, policy) == str(path)
    d = make_drafter(DraftConfig(draft=kind), policy)  # --draft KIND alone: the shipped drafter
    ship = read_checkpoint(path)["state"]
    for k, v in d.state_dict().items():
        assert torch.equal(v, ship[k].to(v.dtype)), k
    assert all(torch.isfinite(p.detach()).all() for p in d.parameters())
    if kind == "dflash":
        return
    assert d.layout == "eagle3"
    assert main(["export-draft", "default", "--out", str(tmp_path / "vllm"), "--dtype", "float32"]) == 0
    back = load_drafter(str(tmp_path / "vllm"), policy.args, "eagle3").bind(policy)
    assert back.feature_layers == d.feature_layers and torch.equal(back.vocab_ids, d.vocab_ids)
    tokens = torch.randint(0, policy.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        o = policy(tokens, taps=d.feature_layers)
        a, b = d(tokens, d.features(o.taps)), back(tokens, back.features(o.taps))
    assert torch.equal(a.z, b.z)  # in float32 the export's output head is the policy's rows: the same weights


@pytest.mark.slow
def test_train_with_draft_eagle3_alone_uses_the_shipped_drafter(tmp_path, capsys):
    from sparkrl.commands.cli import main

    assert (
        main(
            [
                "train",
                "--model",
                "default",
                "--data",
                "default",
                "--out",
                str(tmp_path / "run"),
                "--steps",
                "1",
                "--prompts-per-step",
                "1",
                "--group-size",
                "2",
                "--max-new-tokens",
                "24",
                "--draft",
                "eagle3",
                "--budget",
                "fixed",
            ]
        )
        == 0
    )
    assert "freshly initialised" not in capsys.readouterr().err
    m = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert m["aal"] > 1.0 and m["tree_rounds"] == m["rounds"]


def test_relayout_reads_what_the_fused_layer_reads(tiny_model_dir):
    """drafters.eagle3.relayout (float64): at a position whose norm ratios are the ones it was given, the
    carried drafter's attention reads (q, k, v) what the fused one's reads, its residual is W_f of the fused
    feature, and every other weight is the fused drafter's."""
    from sparkrl.drafters.eagle3 import Eagle3Drafter, relayout
    from sparkrl.model.weights import load_model

    policy = load_model(str(tiny_model_dir), dtype="float32").model.double()
    torch.manual_seed(0)
    args = dataclasses.replace(policy.args, rms_norm_eps=1e-30)  # the norms' eps aside, the mapping is exact here
    fused = Eagle3Drafter(args, layout="fused").double()
    for p in fused.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3 if p.dim() > 1 else 1.0)  # norms' gains far from 1
    fused.bind(policy)
    d = policy.args.hidden_size
    taps = {i: torch.randn(1, 1, d, dtype=torch.float64) for i in fused.feature_layers}
    e, f = fused.embed(torch.tensor([[5]])), fused.features(taps)
    carried = relayout(fused, e, f).double().bind(policy)
    assert carried.layout == "eagle3" and carried.settings()["layout"] == "eagle3"
    old, new = fused.stack.layers[0], carried.stack.layers[0]
    x = fused.fuse(torch.cat([e, f], -1))
    f2 = carried.features(taps)
    torch.testing.assert_close(f2, f @ fused.fuse.weight[:, d:].T)
    h = torch.cat([new.input_layernorm(e), new.hidden_norm(f2)], -1)
    for name in ("q_proj", "k_proj", "v_proj"):
        want = getattr(old.self_attn, name)(old.input_layernorm(x))
        torch.testing.assert_close(getattr(new.self_attn, name)(h), want, rtol=1e-10, atol=1e-12)
    kept = {
        k: v
        for k, v in fused.state_dict().items()
        if "attn.q" not in k
        and "attn.k" not in k
        and "attn.v" not in k
        and k not in ("fuse.weight", "fc.weight", "stack.layers.0.input_layernorm.weight")
    }
    assert all(torch.equal(carried.state_dict()[k], v) for k, v in kept.items())
    # over many positions the two scales are the means of the norms' ratios there
    taps = {i: torch.randn(1, 9, d, dtype=torch.float64) * torch.rand(1, 9, 1, dtype=torch.float64) for i in taps}
    e, f = fused.embed(torch.arange(9)[None] % policy.args.vocab_size), fused.features(taps)
    many = relayout(fused, e, f).stack.layers[0].self_attn.q_proj.weight
    rms = lambda t: t.pow(2).mean(-1).sqrt()
    x, wf_f = fused.fuse(torch.cat([e, f], -1)), f @ fused.fuse.weight[:, d:].T
    p = old.self_attn.q_proj.weight * old.input_layernorm.weight
    torch.testing.assert_close(many[:, :d], p @ fused.fuse.weight[:, :d] * (rms(e) / rms(x)).mean())
    torch.testing.assert_close(many[:, d:], p * (rms(wf_f) / rms(x)).mean())


def test_pretrain_carries_a_fused_drafter_into_eagle3s_layout(tiny_model_dir, tmp_path):
    """--init FUSED --draft-layout eagle3: the run starts from the carried drafter (its step-0 snapshot is in
    EAGLE-3's layout, vLLM-exportable) and trains it, and resumes with the saved drafter (no second carrying
    over, with or without the flag); without --draft-layout an --init drafter keeps the fused layout; an
    EAGLE-3-layout --init with --draft-layout fused is refused before the corpus is made."""
    from sparkrl.drafters import load_drafter
    from sparkrl.drafters.base import policy_fingerprint
    from sparkrl.drafters.eagle3 import Eagle3Drafter
    from sparkrl.drafters.vllm_export import exportable
    from sparkrl.model.weights import load_model
    from sparkrl.train.pretrain import relayout_init

    policy = load_model(str(tiny_model_dir)).model
    args, data, path = policy.args, gsm8k_file(tmp_path), tmp_path / "fused.safetensors"
    torch.manual_seed(0)
    fused = Eagle3Drafter(args, layout="fused")
    save_safetensors(fused.checkpoint(), path, fingerprint=policy_fingerprint(policy))
    auto = _cfg(tmp_path / "k", tiny_model_dir, data, draft="eagle3", init=str(path))
    assert relayout_init(auto, fused, policy, []) is fused
    out = pretrain(_cfg(tmp_path / "b", tiny_model_dir, data, draft="eagle3", init=str(path), draft_layout="eagle3"))
    start = load_drafter(
        read_checkpoint(tmp_path / "b" / "pre" / "eagle3" / "snapshots" / "step-000000.safetensors"), args
    )
    end = load_drafter(out["drafters"]["eagle3"]["path"], args)
    assert start.layout == end.layout == "eagle3" and exportable(end) is None
    assert not torch.equal(start.fc.weight, end.fc.weight)  # and it trained
    again = pretrain(_cfg(tmp_path / "b", tiny_model_dir, data, draft="eagle3", init=str(path), resume=True))
    assert read_checkpoint(again["drafters"]["eagle3"]["path"])["state"]["fc.weight"].equal(
        read_checkpoint(out["drafters"]["eagle3"]["path"])["state"]["fc.weight"]
    )
    with pytest.raises(UserError, match="not back"):
        pretrain(
            _cfg(
                tmp_path / "c",
                tiny_model_dir,
                data,
                draft="eagle3",
                init=out["drafters"]["eagle3"]["path"],
                draft_layout="fused",
            )
        )
    assert not (tmp_path / "c" / "pre" / "corpus").exists()


def test_pretrain_carries_a_stacked_dflash_drafter_into_dflashs_layout(tiny_model_dir, tmp_path):
    """--init STACKED --draft-layout dflash: the run starts from the carried drafter (its step-0 snapshot in DFlash's
    layout, vLLM-exportable, the stacked one's weights kept); a DFlash-layout --init with --draft-layout stacked is
    refused before the corpus is made, and a layout of the other kind by the config."""
    from sparkrl.drafters import load_drafter
    from sparkrl.drafters.base import policy_fingerprint
    from sparkrl.drafters.dflash import DFlashDrafter
    from sparkrl.drafters.vllm_export import exportable
    from sparkrl.model.weights import load_model

    policy = load_model(str(tiny_model_dir)).model
    args, data, path = policy.args, gsm8k_file(tmp_path), tmp_path / "stacked.safetensors"
    torch.manual_seed(0)
    stacked = DFlashDrafter(args, block_size=4, layout="stacked")
    save_safetensors(stacked.checkpoint(), path, fingerprint=policy_fingerprint(policy), dtype=torch.float32)
    out = pretrain(_cfg(tmp_path / "b", tiny_model_dir, data, draft="dflash", block_size=4, init=str(path),
                        draft_layout="dflash"))  # fmt: skip
    start = load_drafter(
        read_checkpoint(tmp_path / "b" / "pre" / "dflash" / "snapshots" / "step-000000.safetensors"), args
    )
    assert start.layout == load_drafter(out["drafters"]["dflash"]["path"], args).layout == "dflash"
    assert exportable(start) is None and torch.equal(start.fc.weight, stacked.fc.weight.bfloat16().float())  # kept
    with pytest.raises(UserError, match="not back"):
        pretrain(_cfg(tmp_path / "c", tiny_model_dir, data, draft="dflash", block_size=4,
                      init=out["drafters"]["dflash"]["path"], draft_layout="stacked"))  # fmt: skip
    assert not (tmp_path / "c" / "pre" / "corpus").exists()
    with pytest.raises(UserError, match="a layout of eagle3 drafters"):
        _cfg(tmp_path / "d", tiny_model_dir, data, draft="dflash", draft_layout="eagle3")
