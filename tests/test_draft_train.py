"""Drafter training and checkpoints: the loss learns, checkpoints round-trip and refuse mismatches,
GRPO with --draft eagle3 trains the drafter online and resumes exactly."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ParityGrader, hf_model, ours_from_hf, run_config

from sparkrl.config import DraftConfig
from sparkrl.drafters import load_drafter
from sparkrl.drafters.eagle3 import Eagle3Drafter, draft_loss
from sparkrl.engine.budget import CostModel
from sparkrl.errors import UserError
from sparkrl.model.weights import load_model
from sparkrl.train.checkpoint import load_latest
from sparkrl.train.drafting import make_drafter
from sparkrl.train.trainer import train


def test_draft_loss_decreases_and_top1_rises(tiny_llama):
    torch.manual_seed(0)
    drafter = Eagle3Drafter(tiny_llama.args).bind(tiny_llama)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    toks = torch.randint(0, 97, (4, 24))
    mask = torch.ones(4, 24, dtype=torch.bool)
    with torch.no_grad():
        out = tiny_llama(toks, taps=drafter.feature_layers)
        logits = tiny_llama.logits(out.hidden)
    first = None
    for _ in range(60):
        loss, st = draft_loss(drafter, toks, out.taps, out.hidden, logits, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first or (loss.item(), st["top1"])
    assert loss.item() < 0.5 * first[0] and st["top1"] > first[1]
    # the shared embedding and head are the policy's and are not trained
    assert not any(p is tiny_llama.lm_head.weight for p in drafter.parameters())


@pytest.mark.parametrize("feature_weight", [2.0, 0.0])
def test_draft_loss_by_hand(tiny_llama, feature_weight):
    """The loss equals w * SmoothL1 + 0.1 * softCE computed position by position in float64 (w 2: the
    paper's appendix A; w 0: EAGLE-3's token-only loss, what --feature-loss 0 trains with)."""
    torch.manual_seed(1)
    d = Eagle3Drafter(tiny_llama.args, vocab_ids=torch.arange(0, 97, 2)).bind(tiny_llama)
    d.feature_weight = feature_weight
    toks = torch.randint(0, 97, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        out = tiny_llama(toks, taps=d.feature_layers)
        logits = tiny_llama.logits(out.hidden)
        loss, _ = d.loss(toks, out.taps, out.hidden, logits, mask)
        assert (
            abs(
                loss.item()
                - draft_loss(d, toks, out.taps, out.hidden, logits, mask, feature_weight=feature_weight)[0].item()
            )
            < 1e-7
        )
        loss, st = draft_loss(d, toks, out.taps, out.hidden, logits, mask, steps=1, feature_weight=feature_weight)
        step = d(toks[:, 1:], d.features({i: t[:, :-1] for i, t in out.taps.items()}))
    total, tree, n = 0.0, 0.0, 0
    for b in range(2):
        for t in range(5):
            if not mask[b, t]:
                continue
            diff = (step.a[b, t] - out.hidden[b, t + 1]).double()
            sl1 = torch.where(diff.abs() < 1, 0.5 * diff**2, diff.abs() - 0.5).mean()
            p = torch.softmax(logits[b, t + 1].double(), -1)[d.vocab_ids]
            ce = -(p * torch.log_softmax(step.z[b, t].double(), -1)).sum()
            total += feature_weight * sl1 + 0.1 * ce
            tree += p[step.z[b, t].double().argsort(descending=True)[:4]].sum()  # mass on the 4 best drafts
            n += 1
    assert abs(loss.item() - total.item() / n) < 1e-5
    assert st["tree_1"] == pytest.approx(tree.item() / n, abs=1e-6)


@pytest.mark.parametrize("layers", [1, 2])
def test_unrolled_training_matches_tree_drafting(tiny_llama, layers):
    """Segment 2 of the unrolled training forward at position j computes exactly what the engine
    computes for a depth-1 tree node drafted after the committed prefix 0..j (one decoder layer, as
    EAGLE-3, or more)."""
    from sparkrl.drafters.eagle3 import unrolled

    torch.manual_seed(2)
    d = Eagle3Drafter(tiny_llama.args, num_layers=layers).bind(tiny_llama)
    toks = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        out = tiny_llama(toks, taps=d.feature_layers)
        feats = d.features({i: t[:, :-1] for i, t in out.taps.items()})  # (1, 9, d)
        padded = torch.cat([toks, toks[:, -1:].expand(-1, 3)], 1)
        segs = unrolled(d, padded, feats, 3)
        for j in (0, 4, 7):
            cache = d.new_cache(1, 32)
            first = d(toks[:, 1 : j + 2], feats[:, : j + 1], cache)
            cache.commit(n_keep=torch.tensor([j + 1]))
            a1 = first.a[:, -1:]
            assert torch.allclose(a1[0, 0], segs[0][0][0, j], atol=1e-5)
            node = d(
                toks[:, j + 2 : j + 3],
                a1,
                cache,
                tree_mask=torch.ones(1, 1, 1, dtype=torch.bool),
                depth=torch.zeros(1, 1, dtype=torch.long),
            )
            assert torch.allclose(node.z[0, 0], segs[1][1][0, j], atol=1e-4)
            if j + 3 < 10:
                node2 = d(
                    toks[:, j + 3 : j + 4],
                    node.a,
                    cache,
                    tree_mask=torch.ones(1, 1, 2, dtype=torch.bool),
                    depth=torch.ones(1, 1, dtype=torch.long),
                )
                assert torch.allclose(node2.z[0, 0], segs[2][1][0, j], atol=1e-4)


@pytest.mark.parametrize("layers", [1, 2])
def test_unrolled_reuses_earlier_segments_exactly(tiny_llama, layers):
    """Each segment run once against the earlier segments' kept keys and values gives the reference's
    outputs and gradients (every earlier segment run again inside each forward), in float64 (which
    RMSNorm keeps: it used to round float64 inputs to float32, off by 1e-8 here)."""
    from sparkrl.drafters.eagle3 import unrolled

    torch.manual_seed(3)
    policy = tiny_llama.double()
    d = Eagle3Drafter(policy.args, num_layers=layers).double().bind(policy)
    toks = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        out = policy(toks, taps=d.feature_layers)
    padded = torch.cat([toks, toks[:, -1:].expand(-1, 3)], 1)
    results = []
    for reuse in (True, False):
        d.zero_grad()
        feats = d.features({i: t[:, :-1] for i, t in out.taps.items()})
        segs = unrolled(d, padded, feats, 3, reuse=reuse)
        sum(a.square().sum() + z.sin().sum() * s for s, (a, z) in enumerate(segs, 1)).backward()
        results.append(([t.detach() for a_z in segs for t in a_z], [p.grad.clone() for p in d.parameters()]))
    (outs, grads), (ref_outs, ref_grads) = results
    assert all(o.shape == r.shape and torch.allclose(o, r, atol=1e-12) for o, r in zip(outs, ref_outs))
    assert all(torch.allclose(g, r, rtol=1e-12, atol=1e-12) for g, r in zip(grads, ref_grads))
    assert any(g.abs().sum() > 0 for g in grads)


def test_checkpoint_round_trip_and_mismatch_errors(tmp_path, tiny_llama):
    d = Eagle3Drafter(tiny_llama.args, vocab_ids=torch.arange(50))
    path = tmp_path / "d.pt"
    torch.save(d.checkpoint(), path)
    back = load_drafter(path, tiny_llama.args)
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), back.state_dict().values()))
    other = ours_from_hf(hf_model("qwen2"))  # same sizes, other family
    with pytest.raises(UserError, match="made for a policy with arch=llama"):
        load_drafter(path, other.args)
    bigger = ours_from_hf(hf_model("llama", hidden_size=128))
    with pytest.raises(UserError, match="hidden_size=64"):
        load_drafter(path, bigger.args)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="not a readable checkpoint"):
        load_drafter(tmp_path / "junk.pt", tiny_llama.args)
    with pytest.raises(UserError, match="holds a drafter of kind 'eagle3', not 'dflash'; pass --draft eagle3"):
        load_drafter(path, tiny_llama.args, "dflash")
    torch.save({"kind": "eagle3", "state": {}}, tmp_path / "partial.pt")
    with pytest.raises(UserError, match="not a sparkrl drafter checkpoint"):
        load_drafter(tmp_path / "partial.pt", tiny_llama.args)
    with pytest.raises(UserError, match="does not exist"):
        load_drafter(tmp_path / "none.pt", tiny_llama.args)


def _cfg(model_dir, out, **kw):
    """A run drafting EAGLE3-style trees."""
    return run_config(model_dir, out, **{**dict(draft="eagle3", tree_depth=2, tree_branch=2, tree_nodes=3), **kw})


def test_train_with_drafter_writes_draft_metrics_and_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    # a cost model under which trees pay while the budget still expects many accepted drafts (the
    # prior), and stop paying once it has seen this untrained drafter's low acceptance
    cost = CostModel(
        (1, 4, 16, 64),
        {(0, 0): [1.0] * 4, (1, 1): [2.1] * 4, (2, 2): [2.6] * 4, (3, 2): [3.1] * 4},
        {s: [0.0] * 4 for s in [(1, 1), (2, 2), (3, 2)]},
        [0.0] * 4,
    )
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda cls, *a, **k: cost))
    train(_cfg(tiny_model_dir, tmp_path / "a", steps=3), grader=ParityGrader())
    train(_cfg(tiny_model_dir, tmp_path / "b", steps=1), grader=ParityGrader())
    train(_cfg(tiny_model_dir, tmp_path / "b", steps=3, resume=True), grader=ParityGrader())
    m = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    timing = lambda k: k.endswith("_s") or k == "gen_tok_per_s"
    # with --budget auto (the default) the resumed run makes the same tree / autoregressive choices:
    # the budget's estimates and cost model are in the checkpoint
    assert [{k: v for k, v in x.items() if not timing(k)} for x in mb] == [
        {k: v for k, v in x.items() if not timing(k)} for x in m
    ]
    assert 0 < sum(x["tree_rounds"] for x in m) < sum(x["rounds"] for x in m)  # the budget mixed both kinds
    for key in ("aal", "rounds", "policy_forwards", "draft_s", "verify_s", "accept_at_depth", "draft_ce"):
        assert key in m[0]
    assert m[0]["draft_train_s"] > 0 and all(x["gen_ar_estimate_s"] > 0 for x in m)
    assert all(x["aal"] == x["committed"] / x["row_rounds"] for x in m)
    ca, cb = (load_latest(tmp_path / x) for x in "ab")
    for k, v in ca["draft"]["drafter"]["state"].items():
        assert torch.equal(v, cb["draft"]["drafter"]["state"][k]), k
    for k in ca["policy"]:
        assert torch.equal(ca["policy"][k], cb["policy"][k]), k
    # the online steps moved the drafter away from its (seeded) initialisation
    policy = load_model(str(tiny_model_dir), with_tokenizer=False).model
    init = make_drafter(DraftConfig(draft="eagle3"), policy, seed=0).state_dict()
    assert any(not torch.equal(v, init[k]) for k, v in ca["draft"]["drafter"]["state"].items() if k != "vocab_ids")


def test_draft_vocabulary_keeps_eos_and_the_most_frequent():
    from collections import Counter

    from sparkrl.train.pretrain import draft_vocabulary

    counts = Counter({5: 10, 6: 9, 7: 8, 8: 1})
    assert draft_vocabulary(counts, 3, 20, (2,)).tolist() == [2, 5, 6]  # EOS kept though rare
    assert draft_vocabulary(counts, 7, 20, (2,)).tolist() == [0, 1, 2, 5, 6, 7, 8]  # filled with unused ids
