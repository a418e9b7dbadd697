"""Model engine: parity with transformers per family, cached/tree forwards, commit/rollback."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import FAMILIES, hf_model, ours_from_hf

from sparkrl.cpu.accelerate import CpuAttention, accelerate
from sparkrl.errors import UserError
from sparkrl.model import transformer as model_mod
from sparkrl.model.transformer import ModelArgs, Transformer


def _rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _attending_in(m: Transformer, dtype: torch.dtype | None) -> Transformer:
    """m on torch's kernels, attending in `dtype` (the CPU layer's `CpuAttention.attn_dtype`)."""
    accelerate(m, "plain")
    for a in m.modules():
        if isinstance(a, CpuAttention):
            a.attn_dtype = dtype
    return m


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family):
    hf = hf_model(family)
    ours = ours_from_hf(hf)
    x = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        ref = hf(x).logits
        got = ours.logits(ours(x).hidden)
    assert _rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("attn", [None, torch.float64])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "llama3-rope"])
def test_cached_chunks_equal_full_forward(family, attn):
    """Also with attention in another dtype than the weights' (`Attention.attn_dtype`: its cache in that dtype)."""
    m = _attending_in(ours_from_hf(hf_model(family)), attn)
    x = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        full = m.logits(m(x).hidden)
        cache = m.new_cache(2, 64)
        assert cache.k[0].dtype == (attn or torch.float32)
        outs = []
        for a, b in [(0, 7), (7, 8), (8, 20), (20, 30)]:
            outs.append(m.logits(m(x[:, a:b], cache).hidden))
            cache.commit(n_keep=torch.full((2,), b - a))
    assert _rel_err(torch.cat(outs, 1), full) < 1e-5


def test_ragged_batch_equals_each_alone(tiny_llama):
    m = tiny_llama
    a, b = torch.randint(0, 97, (1, 12)), torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        cache = m.new_cache(2, 32)
        toks = torch.zeros(2, 12, dtype=torch.long)
        toks[0], toks[1, :5] = a[0], b[0]
        m(toks, cache)
        cache.commit(n_keep=torch.tensor([12, 5]))
        nxt = torch.tensor([[3, 4], [5, 6]])
        batched = m.logits(m(nxt, cache).hidden)
        alone_a = m.logits(m(torch.cat([a, nxt[:1]], 1)).hidden)[:, -2:]
        alone_b = m.logits(m(torch.cat([b, nxt[1:]], 1)).hidden)[:, -2:]
    assert _rel_err(batched[0], alone_a[0]) < 1e-5
    assert _rel_err(batched[1], alone_b[0]) < 1e-5


def _tree():
    """A 6-node tree: 0 -> 1 -> 3 -> 5 ; 0 -> 2 ; 1 -> 4. Returns parents, ancestor mask, depths."""
    parents = [-1, 0, 0, 1, 1, 3]
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    depth = torch.zeros(T, dtype=torch.long)
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
        depth[i] = int(mask[i].sum()) - 1
    return parents, mask, depth


@pytest.mark.parametrize("attn", [None, torch.float64])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_forward_and_commit_equal_recompute(family, attn):
    m = _attending_in(ours_from_hf(hf_model(family)), attn)
    parents, mask, depth = _tree()
    B, P = 2, [9, 4]
    prefix = [torch.randint(0, 97, (n,)) for n in P]
    nodes = torch.randint(0, 97, (B, len(parents)))
    path = [0, 1, 3, 5]  # root-to-leaf path kept for sequence 0; sequence 1 keeps [0, 2]
    keep = torch.tensor([[0, 1, 3, 5], [0, 2, 0, 0]])
    n_keep = torch.tensor([4, 2])
    with torch.no_grad():
        cache = m.new_cache(B, 40)
        toks = torch.zeros(B, max(P), dtype=torch.long)
        for b in range(B):
            toks[b, : P[b]] = prefix[b]
        m(toks, cache)
        cache.commit(n_keep=torch.tensor(P))
        tree_logits = m.logits(m(nodes, cache, tree_mask=mask.expand(B, -1, -1), depth=depth.expand(B, -1)).hidden)
        # every tree node sees exactly its ancestors: compare with plain forwards of prefix + branch
        for b in range(B):
            for i in range(len(parents)):
                branch = [j for j in range(i + 1) if mask[i, j]]
                seq = torch.cat([prefix[b], nodes[b, branch]])[None]
                ref = m.logits(m(seq).hidden)[0, -1]
                assert _rel_err(tree_logits[b, i], ref) < 1e-5
        cache.commit(keep, n_keep)
        nxt = torch.randint(0, 97, (B, 1))
        after = m.logits(m(nxt, cache).hidden)[:, -1]
        for b, kept in enumerate([path, [0, 2]]):
            seq = torch.cat([prefix[b], nodes[b, kept], nxt[b]])[None]
            ref = m.logits(m(seq).hidden)[0, -1]
            assert _rel_err(after[b], ref) < 1e-5


def test_float32_attention_of_a_bfloat16_model_matches_a_float64_reference(tiny_llama, monkeypatch):
    """A bfloat16 model attending in float32 (`cpu.accelerate`, float32_attention) through a prefill, decode
    steps and a tree forward: every attention reads exactly the bfloat16 keys and values the layers made (its
    float32 cache adds no rounding) and is within float32 rounding of float64 attention on the same inputs,
    where bfloat16 attention is not."""
    seen = []
    sdpa = model_mod.F.scaled_dot_product_attention

    def recorded(q, k, v, **kw):
        out = sdpa(q, k, v, **kw)
        seen.append((q, k, v, kw, out))
        return out

    monkeypatch.setattr(model_mod.F, "scaled_dot_product_attention", recorded)
    parents, mask, depth = _tree()
    x = torch.randint(0, 97, (2, 9))
    errs = {}
    for on in (True, False):
        seen.clear()
        m = accelerate(tiny_llama.to(torch.bfloat16), "plain", float32_attention=on).model
        with torch.no_grad():
            cache = m.new_cache(2, 32)
            for a, b in [(0, 6), (6, 7), (7, 9)]:
                m(x[:, a:b], cache)
                cache.commit(n_keep=torch.full((2,), b - a))
            m(
                torch.randint(0, 97, (2, len(parents))),
                cache,
                tree_mask=mask.expand(2, -1, -1),
                depth=depth.expand(2, -1),
            )
        assert cache.k[0].dtype == (torch.float32 if on else torch.bfloat16)
        err = 0.0
        for q, k, v, kw, out in seen:
            assert q.dtype == k.dtype == out.dtype == (torch.float32 if on else torch.bfloat16)
            for t in (q, k, v):
                assert torch.equal(t.to(torch.bfloat16).to(t.dtype), t)  # bfloat16 values, exactly
            ref = sdpa(q.double(), k.double(), v.double(), **kw)
            err = max(err, _rel_err(out.double(), ref))
        errs[on] = err
    assert errs[True] < 1e-6 and errs[False] > 100 * errs[True], errs


def test_rollback_discards_speculative_tokens(tiny_llama):
    m = tiny_llama
    x = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        cache = m.new_cache(1, 32)
        m(x, cache)
        cache.commit(n_keep=torch.tensor([10]))
        m(torch.randint(0, 97, (1, 6)), cache)  # speculative, then rolled back
        cache.commit(n_keep=torch.tensor([0]))
        y = torch.randint(0, 97, (1, 3))
        got = m.logits(m(y, cache).hidden)
        ref = m.logits(m(torch.cat([x, y], 1)).hidden)[:, -3:]
    assert _rel_err(got, ref) < 1e-5


def test_keep_rows_and_taps(tiny_llama):
    m = tiny_llama
    x = torch.randint(0, 97, (3, 8))
    with torch.no_grad():
        cache = m.new_cache(3, 16)
        out = m(x, cache, taps=(0, 2))
        cache.commit(n_keep=torch.full((3,), 8))
        cache.keep_rows(torch.tensor([2, 0]))
        y = torch.randint(0, 97, (2, 1))
        got = m.logits(m(y, cache).hidden)
        ref = m.logits(m(torch.cat([x[[2, 0]], y], 1)).hidden)[:, -1:]
    assert _rel_err(got, ref) < 1e-5
    assert set(out.taps) == {0, 2} and out.taps[0].shape == (3, 8, 64)
    # the tap of the last layer, normed, is the final hidden state
    full = m(x, taps=(2,))
    assert torch.allclose(m.model.norm(full.taps[2]), full.hidden)


@pytest.mark.parametrize(
    "steps",
    [[[0, 2, 3, 5]], [[1, 2, 3, 4, 5]], [[0, 1, 2, 3, 4]], [[3, 5], [0]], [[0, 0, 1, 1, 2, 2]], [[4, 1]]],
    ids=["drop", "first", "last", "twice", "expand", "reorder"],
)
def test_keep_rows_equals_a_gather_of_the_rows(steps):
    """Compaction in place (rows ascending, fewer) and gathers (expansion, reorder) keep exactly the rows
    asked for, step after step, and later writes land in the kept rows only."""
    args = ModelArgs(
        "llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    cache = model_mod.KVCache.empty(args, 6, 5, "cpu", torch.float64)
    for buf in (*cache.k, *cache.v):
        buf.copy_(torch.randn_like(buf))
    cache.lengths = torch.arange(6)
    ref = [b.clone() for b in (*cache.k, *cache.v)], cache.lengths.clone()
    for rows in steps:
        rows = torch.tensor(rows)
        cache.keep_rows(rows)
        ref = [b[rows] for b in ref[0]], ref[1][rows]
        assert all(torch.equal(a, b) for a, b in zip((*cache.k, *cache.v), ref[0])) and torch.equal(
            cache.lengths, ref[1]
        )
    k = torch.randn(cache.batch, 1, 1, 4, dtype=torch.float64)
    cache.write(0, cache.rows(torch.zeros(cache.batch, 1, dtype=torch.long)), k, k)
    assert torch.equal(cache.k[0][:, :, :1], k) and torch.equal(cache.k[0][:, :, 1:], ref[0][0][:, :, 1:])
    # a commit of a speculative region on the compacted cache moves the same positions as on a fresh copy of it
    fresh = model_mod.KVCache(
        torch.stack([torch.stack(cache.k), torch.stack(cache.v)]).contiguous(), cache.lengths.clone()
    )
    keep = torch.tensor([[0, 2], [1, 2], [0, 1]]).repeat(2, 1)[: cache.batch]
    for c in (cache, fresh):
        c.lengths = torch.zeros(cache.batch, dtype=torch.long)
        c.pending = 3
        c.commit(keep, torch.full((cache.batch,), 2))
    assert all(torch.equal(a, b) for a, b in zip((*cache.k, *cache.v), (*fresh.k, *fresh.v)))


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match="supported: llama, qwen2, qwen3"):
        ModelArgs.from_hf({"model_type": "gpt2"})


def test_weights_loader_errors(tmp_path, tiny_model_dir):
    from sparkrl.model.weights import load_model

    with pytest.raises(UserError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(UserError, match="unsupported architecture 'mamba'"):
        load_model(str(bad))
    lm = load_model(str(tiny_model_dir))
    assert isinstance(lm.model, Transformer) and lm.eos_ids == (2,)


@pytest.mark.slow
def test_default_model_matches_transformers():
    from transformers import AutoModelForCausalLM

    from sparkrl.model.weights import load_model

    lm = load_model("default", with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(str(lm.path), dtype=torch.float32).eval()
    x = torch.randint(0, 49152, (2, 24))
    with torch.no_grad():
        assert _rel_err(lm.model.logits(lm.model(x).hidden), hf(x).logits) < 1e-4
