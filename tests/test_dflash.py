"""DFlash-style block drafter: training forward = inference forward, exact block rollouts (with and
without SPARK, in test_speculative), checkpoints and bad input, training end to end."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ALPHA, SEEDS, ParityGrader, chi_square_pvalue, run_config, small_policy

from sparkrl.config import SamplingConfig, TreeShape
from sparkrl.drafters import load_drafter
from sparkrl.drafters.dflash import DFlashDrafter, block_logits, block_loss, build_block, sample_anchors
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.engine.autoregressive import generate, response_generators
from sparkrl.engine.speculative import generate_speculative
from sparkrl.errors import UserError


@pytest.mark.parametrize("layout", ["dflash", "stacked"])
def test_training_blocks_equal_inference_blocks(tiny_llama, layout):
    torch.manual_seed(0)
    d = DFlashDrafter(tiny_llama.args, block_size=4, layout=layout).bind(tiny_llama)
    toks = torch.randint(0, tiny_llama.args.vocab_size, (2, 12))
    if layout == "dflash":
        toks[1, 9] = d.mask_token_id  # an anchor that is vLLM's mask token reads the mask embedding, as there
    feats = torch.randn(2, 12, tiny_llama.args.hidden_size)
    a = torch.tensor([[3, 7], [5, 9]])
    with torch.no_grad():
        z = block_logits(d, toks, feats, a)  # (2, 2, 3, V)
        for b in range(2):
            for k in range(2):
                cache = d.new_cache(1, 32)
                anchor = int(a[b, k])
                d(None, feats[b : b + 1, :anchor], cache)  # the context before the anchor
                cache.commit(n_keep=torch.tensor([anchor]))
                step = d.block(toks[b : b + 1, anchor], cache, 3)
                assert torch.allclose(step.z[0], z[b, k], atol=1e-4)
                cache.commit(n_keep=torch.tensor([0]))  # roll the block back
                prop = build_block(d, cache, toks[b : b + 1, anchor], 3)
                tree = prop.tree
                assert tree.tokens[0, 1:].tolist() == d.vocab_ids[z[b, k].argmax(-1)].tolist()
                assert tree.parents[0].tolist() == [-1, 0, 1, 2] and prop.q is None
                assert prop.contexts.node[0].tolist() == [0, 1, 2, -1] and not prop.contexts.rejected_children


def test_block_loss_weights_decay_and_training_helps():
    torch.manual_seed(0)
    policy = small_policy()  # peaked distributions, so the loss can fall well below its start
    d = DFlashDrafter(policy.args, block_size=4).bind(policy)
    toks = torch.randint(0, policy.args.vocab_size, (2, 16))
    with torch.no_grad():
        o = policy(toks, taps=d.feature_layers)
        logits = policy.logits(o.hidden)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[:, -1] = False
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, st = block_loss(d, toks, o.taps, logits, mask, generator=torch.Generator().manual_seed(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0] and {"ce", "top1", "top1_1", "positions"} <= set(st)
    # by hand: one anchor, uniform-ish check of the exp(-(j-1)/gamma) weighting
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        loss1, _ = block_loss(d, toks, o.taps, logits, mask, anchors=1, gamma=1e-6, generator=g)
        a, real = sample_anchors(mask.float(), 1, torch.Generator().manual_seed(1))
        assert real.all()
        z = block_logits(d, toks, d.features(o.taps), a)[:, 0, 0]  # only position 1 weighs (gamma -> 0)
        p = torch.softmax(logits, -1).gather(1, a[..., None].expand(-1, -1, logits.shape[-1]))[:, 0]
        want = -(p * torch.log_softmax(z, -1)).sum(-1).mean()
    assert torch.allclose(loss1, want, atol=1e-5)


def test_anchors_are_distinct_draws_by_weight():
    w = torch.tensor([[1.0, 0, 2, 3, 0, 4], [0, 0, 5, 0, 0, 0]])
    a, real = sample_anchors(w, 3, torch.Generator().manual_seed(0))
    assert a.shape == (2, 3) and real.tolist() == [[True] * 3, [True, False, False]]
    assert len(set(a[0].tolist())) == 3 and all(w[0, i] > 0 for i in a[0].tolist()) and a[1, 0] == 2
    assert sample_anchors(w, 9)[0].shape == (2, 6)  # at most every position once
    # per-row generators: a row's anchors do not depend on the other rows
    gens = lambda: [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]
    both, _ = sample_anchors(w, 2, gens())
    assert torch.equal(both[1:], sample_anchors(w[1:], 2, gens()[1:])[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_anchors_are_drawn_by_weight_without_replacement(seed):
    """The first anchor with probability w / sum(w), the second among the rest likewise."""
    w = torch.tensor([1.0, 0, 2, 3, 0, 4])
    a = sample_anchors(w[None].expand(20000, -1), 2, torch.Generator().manual_seed(1 + seed))[0].tolist()
    p = (w.double() / w.sum()).tolist()
    assert chi_square_pvalue([i for i, _ in a], dict(enumerate(p))) > ALPHA
    pairs = {(i, j): p[i] * p[j] / (1 - p[i]) for i in range(6) for j in range(6) if i != j}  # P(first i, then j)
    assert chi_square_pvalue([tuple(x) for x in a], pairs) > ALPHA


def test_held_out_scores_use_the_same_blocks_whatever_the_training_setting(tiny_llama):
    from sparkrl.drafters.dflash import EVAL_ANCHORS

    toks = torch.randint(0, tiny_llama.args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        o = tiny_llama(toks, taps=DFlashDrafter(tiny_llama.args).feature_layers)
        logits = tiny_llama.logits(o.hidden)
    mask = torch.ones(2, 48, dtype=torch.bool)
    g = lambda: torch.Generator().manual_seed(3)
    scores = []
    for k in (2, 40):
        d = DFlashDrafter(tiny_llama.args, block_size=4, anchors=k).bind(tiny_llama)
        with torch.no_grad():
            _, held = d.loss(toks, o.taps, o.hidden, logits, mask, generator=g(), held_out=True)
            _, want = block_loss(d, toks, o.taps, logits, mask, anchors=EVAL_ANCHORS, generator=g())
        _, trained = d.loss(toks, o.taps, o.hidden, logits, mask, generator=g())  # training: its own k
        assert held == want and trained == block_loss(d, toks, o.taps, logits, mask, anchors=k, generator=g())[1]
        scores.append(held["positions"])
    assert scores[0] == scores[1] > 2 * 2 * 3


def test_greedy_with_block_drafter_equals_greedy(tiny_llama):
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    sc = SamplingConfig(0.0, 1.0, 12)
    ar = generate(tiny_llama, prompts, sc, (5,), response_generators(0, 2, 3), group_size=3)
    sp = generate_speculative(
        tiny_llama,
        DFlashDrafter(tiny_llama.args, block_size=5),
        prompts,
        sc,
        (5,),
        response_generators(0, 2, 3),
        TreeShape.block(4),
        group_size=3,
    )
    assert sp.tokens == ar.tokens and sp.finish_reason == ar.finish_reason and sp.stats.rounds > 0


def test_checkpoints_and_block_size_errors(tmp_path, tiny_llama):
    d = DFlashDrafter(tiny_llama.args, vocab_ids=torch.arange(40), block_size=6)
    path = tmp_path / "d.pt"
    torch.save(d.checkpoint(), path)
    back = load_drafter(path, tiny_llama.args, "dflash")
    assert back.block_size == 6 and all(
        torch.equal(a, b) for a, b in zip(d.state_dict().values(), back.state_dict().values())
    )
    with pytest.raises(UserError, match="holds a drafter of kind 'dflash', not 'eagle3'; pass --draft dflash"):
        load_drafter(path, tiny_llama.args, "eagle3")
    torch.save(Eagle3Drafter(tiny_llama.args).checkpoint(), tmp_path / "e.pt")
    with pytest.raises(UserError, match="holds a drafter of kind 'eagle3', not 'dflash'"):
        load_drafter(tmp_path / "e.pt", tiny_llama.args, "dflash")
    with pytest.raises(UserError, match="larger than the drafter was trained for"):
        back.check_block(7)


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["train", "--out", "X", "--draft", "dflash", "--block-size", "1"], "--block-size must be >= 2"),
        (["pretrain-draft", "--out", "X", "--draft", "dflash", "--block-size", "0"], "--block-size must be >= 2"),
    ],
)
def test_bad_block_size_is_one_clear_line(argv, msg, capsys, tmp_path, monkeypatch):
    from sparkrl.commands.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_pretrain_and_train_with_dflash_and_spark(tiny_model_dir, tmp_path):
    from sparkrl.commands.cli import main
    from sparkrl.train.trainer import train

    assert (
        main(
            [
                "pretrain-draft",
                "--model",
                str(tiny_model_dir),
                "--out",
                str(tmp_path / "pre"),
                "--draft",
                "dflash",
                "--block-size",
                "4",
                "--prompts",
                "8",
                "--epochs",
                "1",
                "--max-new-tokens",
                "12",
                "--draft-vocab",
                "64",
                "--default-size",
                "20",
            ]
        )
        == 0
    )
    ck = tmp_path / "pre" / "dflash" / "drafter.pt"
    kw = dict(
        max_new_tokens=8,
        draft="dflash",
        draft_checkpoint=str(ck),
        block_size=3,
        budget="fixed",
        spark=True,
        spark_rank=4,
    )
    train(run_config(tiny_model_dir, tmp_path / "run", **kw), grader=ParityGrader())
    m = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(
        x["aal"] == x["committed"] / x["row_rounds"] and x["spark_contexts"] > 0 and x["draft_train_s"] > 0 for x in m
    )
    assert len(m[0]["accept_at_depth"]) == 2
    with pytest.raises(UserError, match="larger than the drafter was trained for"):
        train(run_config(tiny_model_dir, tmp_path / "r2", **{**kw, "block_size": 5}), grader=ParityGrader())
    # generate, with the measured per-round budget (the default) and without SPARK
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_model_dir),
                "--prompt",
                "hi",
                "--n",
                "3",
                "--max-new-tokens",
                "6",
                "--draft",
                "dflash",
                "--draft-checkpoint",
                str(ck),
                "--block-size",
                "3",
                "--json",
            ]
        )
        == 0
    )
