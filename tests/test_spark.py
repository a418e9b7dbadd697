"""SPARK: the update against a float64 reference of Eq. (5), the A gradient against autograd, the
properties of appendix B (locality, isolation, reset, fixed point) and exactness through the engine."""

from __future__ import annotations

import pytest
import torch
from helpers import ParityGrader, assert_drawn, random_round, reference, run_config

from sparkrl.config import SamplingConfig, TreeShape
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.tree import build_chain, build_tree
from sparkrl.engine.autoregressive import generate, response_generators
from sparkrl.engine.spark import Projection, Spark, SparseRows, init_projection, sparse_delta
from sparkrl.engine.speculative import generate_speculative
from sparkrl.errors import UserError
from sparkrl.model.weights import load_model
from sparkrl.train.checkpoint import list_checkpoints, load_latest

V, D, R = 40, 12, 3


def run_spark(spark, rounds, responses, T):
    """Drive a Spark like the engine: correct the logits with the current B, feed back, end the round."""
    for row, h, z, p, w in rounds:
        spark.select(responses[row])  # one batch row per context
        zc = spark.correct(z, h)
        spark.feedback(torch.arange(len(row)), h, zc, p, w)
        spark.end_round()


def dense(spark, n_owners):
    B = torch.zeros(n_owners, V, spark.A.shape[1], dtype=torch.float64)
    for key, row in zip(spark.store.keys.tolist(), spark.store.rows.double()):
        B[key // V, key % V] = row
    return B


@pytest.mark.parametrize("k,T", [(4, 1.0), (16, 0.7), (V, 1.0)])
def test_update_and_A_gradient_equal_float64_reference(k, T):
    g = torch.Generator().manual_seed(k)
    P, G = 3, 2
    A = init_projection(torch.randn(50, D, generator=g), R)
    spark = Spark(A, V, k=k, eta=0.5, temperature=T)
    spark.begin(P, G)
    responses = torch.tensor([0, 2, 3, 5])  # active responses: owners (groups) 0, 1, 1, 2
    rounds = [random_round(9, responses, g, V, D) for _ in range(4)]
    run_spark(spark, rounds, responses, T)
    B_ref, gA_ref = reference(rounds, responses // G, A, k, 0.5, T, P)
    assert torch.allclose(dense(spark, P), B_ref, atol=1e-5)
    assert torch.allclose(spark.take_grad().double(), gA_ref, atol=1e-5)
    # the correction applied to new contexts is z + B_g A^T h
    row, h, z, _, _ = random_round(6, responses, g, V, D)
    own = (responses // G)[row]
    want = z.double() + torch.einsum("nvr,nr->nv", B_ref[own], h.double() @ A.double())
    spark.select(responses[row])  # correct() works on batch rows: one row per context
    assert torch.allclose(spark.correct(z, h).double(), want, atol=1e-5)


def test_A_gradient_is_autograd_of_the_truncated_loss():
    """With S_c the whole vocabulary, G^A_c = h (B^T (q - p))^T = d KL(p || softmax(z + B A^T h)) / dA, B fixed."""
    g = torch.Generator().manual_seed(1)
    A = torch.randn(D, R, generator=g, dtype=torch.float64)
    B = torch.randn(V, R, generator=g, dtype=torch.float64)
    h = torch.randn(D, generator=g, dtype=torch.float64)
    z = torch.randn(V, generator=g, dtype=torch.float64)
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)
    Ad = A.clone().requires_grad_(True)
    zt = z + B @ (Ad.T @ h)
    kl = (p * (p.log() - torch.log_softmax(zt, -1))).sum()
    kl.backward()
    spark = Spark(A.float(), V, k=V, eta=0.1)
    spark.begin(1, 1)
    spark.store.add(torch.arange(V), B.float())
    spark.select(torch.tensor([0]))
    zc = spark.correct(z.float()[None], h.float()[None])
    spark.feedback(torch.tensor([0]), h.float()[None], zc, p.float()[None], torch.ones(1))
    assert torch.allclose(spark.take_grad().double(), Ad.grad, atol=1e-5)


def test_sparse_update_is_a_descent_direction():
    """<full gradient q - p, folded sparse delta> = sum_S delta^2 + tail^2 >= 0 (appendix B.2)."""
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        q = torch.softmax(torch.randn(1, V, generator=g) * 3, -1)
        p = torch.softmax(torch.randn(1, V, generator=g) * 3, -1)
        idx, delta = sparse_delta(q, p, 4)
        full = torch.zeros(1, V).scatter_add(1, idx, delta)
        assert float(((q - p) * full).sum()) >= 0


def test_token_locality_isolation_reset_and_fixed_point():
    g = torch.Generator().manual_seed(3)
    A = init_projection(torch.randn(50, D, generator=g), R)
    spark = Spark(A, V, k=3, eta=1.0)
    spark.begin(2, 2)  # owners: responses 0, 1 -> group 0; 2, 3 -> group 1
    responses = torch.arange(4)
    row, h, z, p, w = random_round(5, responses, g, V, D)
    row = row % 2  # feedback only from group 0
    spark.select(responses)
    spark.feedback(row, h, spark.correct(z, h), p, w)
    spark.end_round()
    touched = set((spark.store.keys % V).tolist())
    assert 0 < len(touched) < V and (spark.store.keys // V == 0).all()
    spark.select(responses)
    _, h2, z2, _, _ = random_round(4, responses, g, V, D)
    zc = spark.correct(z2, h2)  # rows 0..3 of the batch: groups 0, 0, 1, 1
    assert torch.equal(zc[2:], z2[2:])  # prompt isolation: group 1 untouched, bit for bit
    untouched = torch.tensor(sorted(set(range(V)) - touched))
    assert torch.equal(zc[:2, untouched], z2[:2, untouched])  # token locality: logits outside every S_c
    assert not torch.equal(zc[:2], z2[:2])
    spark.begin(2, 2)  # reset at the next rollout
    spark.select(responses)
    assert torch.equal(spark.correct(z2, h2), z2)
    carry = Spark(A, V, k=3, eta=1.0, carry=True)
    carry.begin(2, 2)
    carry.store = spark.store
    carry.store.add(torch.tensor([5]), torch.ones(1, R))
    carry.begin(2, 2)
    assert len(carry.store) == 1  # carried across rollouts
    # q = p: delta = 0, the correction stays 0
    fixed = Spark(A, V, k=5, eta=1.0)
    fixed.begin(1, 4)
    for _ in range(3):
        fixed.select(responses)
        zc = fixed.correct(z2, h2)
        fixed.feedback(torch.arange(4), h2, zc, torch.softmax(zc, -1), torch.ones(4))
        fixed.end_round()
    assert (fixed.store.rows == 0).all()


def test_scopes_and_update_every_n_rounds():
    g = torch.Generator().manual_seed(4)
    A = init_projection(torch.randn(50, D, generator=g), R)
    responses = torch.arange(4)
    for scope, owners in (("response", {0, 1, 2, 3}), ("batch", {0}), ("group", {0, 1})):
        s = Spark(A, V, k=3, eta=1.0, scope=scope)
        s.begin(2, 2)
        row, h, z, p, w = random_round(16, responses, g, V, D)
        s.select(responses)
        s.feedback(row, h, z, p, w)
        s.end_round()
        assert set((s.store.keys // V).tolist()) == owners
    s = Spark(A, V, k=3, eta=1.0, every=3)
    s.begin(1, 4)
    for t in range(3):
        row, h, z, p, w = random_round(4, responses, g, V, D)
        s.select(responses[row])
        s.feedback(torch.arange(4), h, s.correct(z, h), p, w)
        s.end_round()
        assert (len(s.store) > 0) == (t == 2)  # B stays 0 until the third round has committed


def test_non_finite_feedback_is_skipped_and_counted():
    g = torch.Generator().manual_seed(5)
    A = init_projection(torch.randn(50, D, generator=g), R)
    s = Spark(A, V, k=3, eta=1.0)
    s.begin(2, 1)
    s.select(torch.arange(2))
    row, h, z, p, w = random_round(6, torch.arange(2), g, V, D)
    row = torch.tensor([0, 0, 0, 1, 1, 1])
    p[4, 3] = float("nan")
    s.feedback(row, h, z, p, w)
    s.end_round()
    assert s.stats["spark_skipped"] == 1 and s.stats["spark_contexts"] == 3
    assert torch.isfinite(s.store.rows).all() and set((s.store.keys // V).tolist()) == {0}


def test_sparse_rows_lookup_and_padding():
    st = SparseRows(10, 2, "cpu")
    st.add(torch.tensor([13, 2, 13, 7]), torch.tensor([[1.0, 0], [2, 0], [3, 0], [4, 0]]))
    assert st.keys.tolist() == [2, 7, 13] and st.rows[:, 0].tolist() == [2, 4, 4]
    assert st.lookup(torch.tensor([[7, 8], [13, 2]]))[..., 0].tolist() == [[4, 0], [4, 2]]
    tok, rows = st.of_owners(torch.tensor([1, 0, 2]))
    assert tok.tolist() == [[3, 0], [2, 7], [0, 0]] and rows[..., 0].tolist() == [[4, 0], [2, 4], [0, 0]]


def test_projection_init_and_checkpoint_errors():
    head = torch.randn(100, D)
    A = init_projection(head, 4)
    assert torch.allclose(A.T @ A, torch.eye(4), atol=1e-5)
    with pytest.raises(UserError, match="--spark-rank"):
        init_projection(head, D + 1)
    proj = Projection(A)
    with pytest.raises(UserError, match="needs 12 x 4"):
        proj.load(Projection(init_projection(head, 3)).checkpoint())
    other = Projection(torch.zeros(D, 4))
    other.load(proj.checkpoint())
    assert torch.equal(other.A, proj.A)


def _drafter_state(policy, B=3, seed=0):
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(policy.args).bind(policy)
    cache = drafter.new_cache(B, 32)
    root = torch.tensor([1, 2, 3])[:B]
    step = drafter(root[:, None], torch.randn(B, 1, policy.args.hidden_size), cache)
    cache.commit(n_keep=torch.ones(B, dtype=torch.long))
    return drafter, cache, root, step.z[:, 0], step.a[:, 0], step.h[:, 0]


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_first_round_proposes_what_the_baseline_proposes(tiny_llama, mode):
    drafter, cache, root, z, a, h = _drafter_state(tiny_llama)
    shape = TreeShape(3, 2, 5)
    spark = Spark(init_projection(tiny_llama.lm_head.weight, 4), tiny_llama.args.vocab_size)
    spark.begin(1, 3)
    spark.select(torch.arange(3))
    u = torch.rand(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    zero = torch.zeros(3, dtype=torch.long)
    if mode == "tree":
        base = build_tree(drafter, cache, root, z, a, h, shape)
        cache.commit(n_keep=zero)
        on = build_tree(drafter, cache, root, z, a, h, shape, correct=spark.correct)
    else:
        base = build_chain(drafter, cache, root, z, a, h, 3, 1.0, u)
        cache.commit(n_keep=zero)
        on = build_chain(drafter, cache, root, z, a, h, 3, 1.0, u, spark.correct)
        assert torch.equal(base.q, on.q)
    ctx = on.contexts
    assert torch.equal(base.tree.tokens, on.tree.tokens) and torch.equal(base.tree.parents, on.tree.parents)
    assert torch.equal(base.contexts.z, ctx.z) and torch.equal(base.contexts.h, ctx.h)  # B = 0: no change
    assert ctx.z.shape[:2] == ctx.h.shape[:2] and int(ctx.node.max()) < ctx.z.shape[1]
    assert (ctx.node[:, 0] == 0).all()


def test_greedy_with_spark_equals_greedy(tiny_llama):
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    sc = SamplingConfig(0.0, 1.0, 12)
    ar = generate(tiny_llama, prompts, sc, (5,), response_generators(0, 2, 3), group_size=3)
    spark = Spark(init_projection(tiny_llama.lm_head.weight, 4), tiny_llama.args.vocab_size, eta=5.0)
    sp = generate_speculative(
        tiny_llama,
        Eagle3Drafter(tiny_llama.args),
        prompts,
        sc,
        (5,),
        response_generators(0, 2, 3),
        TreeShape(4, 3, 8),
        group_size=3,
        spark=spark,
    )
    assert sp.tokens == ar.tokens and sp.stats.adapter["spark_contexts"] > 0


def _train_cfg(model_dir, out, **kw):
    """A run drafting EAGLE3-style trees with SPARK."""
    spark = dict(
        max_new_tokens=8,
        draft="eagle3",
        tree_depth=2,
        tree_branch=2,
        tree_nodes=3,
        budget="fixed",
        spark=True,
        spark_rank=4,
        spark_lr=1e-2,
    )
    return run_config(model_dir, out, **{**spark, **kw})


def test_carried_corrections_survive_a_resume(tiny_model_dir, tmp_path):
    from sparkrl.train.trainer import train

    train(_train_cfg(tiny_model_dir, tmp_path / "a", steps=3, spark_carry=True), grader=ParityGrader())
    train(_train_cfg(tiny_model_dir, tmp_path / "b", steps=1, spark_carry=True), grader=ParityGrader())
    train(_train_cfg(tiny_model_dir, tmp_path / "b", steps=3, spark_carry=True, resume=True), grader=ParityGrader())
    ca, cb = (load_latest(tmp_path / x) for x in "ab")
    assert len(ca["spark_carry"]["keys"]) > 0
    assert torch.equal(ca["spark_carry"]["keys"], cb["spark_carry"]["keys"])
    assert torch.equal(ca["spark_carry"]["rows"], cb["spark_carry"]["rows"])
    for k in ca["policy"]:
        assert torch.equal(ca["policy"][k], cb["policy"][k]), k


def test_train_with_spark_learns_A_resumes_exactly_and_logs_rounds(tiny_model_dir, tmp_path):
    import json

    from sparkrl.commands.cli import main
    from sparkrl.train.trainer import train

    log = tmp_path / "rounds.jsonl"
    train(_train_cfg(tiny_model_dir, tmp_path / "a", steps=3, round_log=str(log)), grader=ParityGrader())
    logb = tmp_path / "rounds_b.jsonl"
    train(_train_cfg(tiny_model_dir, tmp_path / "b", steps=1, round_log=str(logb)), grader=ParityGrader())
    with open(logb, "a") as f:  # a step logged, then killed before its checkpoint: resume drops it
        f.write(json.dumps({**json.loads(log.read_text().splitlines()[1]), "responses": []}) + "\n")
    train(_train_cfg(tiny_model_dir, tmp_path / "b", steps=3, resume=True, round_log=str(logb)), grader=ParityGrader())
    assert logb.read_text() == log.read_text()  # exact resume, round log included
    m = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["spark_contexts"] > 0 and x["spark_skipped"] == 0 and "spark_s" in x for x in m)
    ca, cb = (load_latest(tmp_path / x) for x in "ab")
    A = ca["draft"]["drafter"]["spark"]["A"]
    assert torch.equal(A, cb["draft"]["drafter"]["spark"]["A"])  # exact resume, A included
    init = Projection.for_policy(load_model(str(tiny_model_dir), with_tokenizer=False).model, 4).A
    assert not torch.allclose(A, init)  # learned at the draft optimizer steps
    from sparkrl.vllm.spark import read_projection  # the learned A travels with the drafter exported to vLLM

    assert main(["export-draft", str(tmp_path / "a"), "--out", str(tmp_path / "vd"), "--dtype", "float32"]) == 0
    got, settings = read_projection(tmp_path / "vd")
    assert torch.equal(got, A) and settings["k"] == 16 and settings["scope"] == "group"
    recs = [json.loads(l) for l in log.read_text().splitlines()]
    assert len(recs) == 3 and recs[0]["spark"] and len(recs[0]["responses"]) == 6
    resp = recs[0]["responses"][0]
    assert len(resp["tokens"]) == len(resp["outcome"]) == len(resp["round"])
    # the run's checkpoint serves as a drafter checkpoint, its A included; a different rank is refused
    ck = list_checkpoints(tmp_path / "a")[-1]
    gen = [
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "hi",
        "--n",
        "2",
        "--max-new-tokens",
        "6",
        "--draft",
        "eagle3",
        "--draft-checkpoint",
        str(ck),
        "--budget",
        "fixed",
        "--spark",
    ]
    assert main(gen + ["--spark-rank", "4", "--round-log", str(tmp_path / "gen.jsonl")]) == 0
    assert main(gen + ["--spark-rank", "8"]) == 2
    assert (
        main(
            [
                "analyze",
                "--logs",
                f"{log},{tmp_path / 'gen.jsonl'}",
                "--labels",
                "train,generate",
                "--out",
                str(tmp_path / "an"),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "an" / "analysis.json").read_text())["results"]
    assert res["train"]["rollouts"] == 3 and res["train"]["drafted_positions"] > 0
    assert_drawn(tmp_path / "an" / "analysis.png")
    assert main(["analyze", "--logs", str(log), "--stages", "3", "--out", str(tmp_path / "st")]) == 0
    st = json.loads((tmp_path / "st" / "analysis.json").read_text())["results"]["rounds"]["stages"]
    assert [s["steps"] for s in st] == [[1, 1], [2, 2], [3, 3]]
    assert sum(s["drafted_positions"] for s in st) == res["train"]["drafted_positions"]
    assert_drawn(tmp_path / "st" / "analysis_stages.png")


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--spark"], "--spark corrects a drafter"),
        (["--draft", "eagle3", "--spark", "--spark-rank", "0"], "--spark-rank must be >= 1"),
        (["--draft", "eagle3", "--spark", "--spark-k", "0"], "--spark-k must be >= 1"),
        (["--draft", "eagle3", "--spark", "--spark-eta", "0"], "--spark-eta must be > 0"),
        (["--draft", "eagle3", "--spark", "--spark-every", "0"], "--spark-every must be >= 1"),
        (["--draft", "eagle3", "--spark", "--spark-scope", "world"], "invalid choice"),
    ],
)
def test_spark_bad_input_is_one_clear_line(argv, msg, capsys, tmp_path, monkeypatch):
    from sparkrl.commands.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--out", "X"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


def test_spark_rank_above_hidden_size_and_bad_round_log(tiny_model_dir, tmp_path, capsys):
    from sparkrl.commands.cli import main

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
                "--spark",
                "--spark-rank",
                "100000",
            ]
        )
        == 2
    )
    assert "--spark-rank must be in [1," in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("{}\n")
    assert main(["analyze", "--logs", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "not a round-log record" in capsys.readouterr().err
    assert main(["analyze", "--logs", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]) == 2
