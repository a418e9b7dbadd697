"""A decoder layer's cached forward in one compiled call (`native.decode_layer`, run by `CpuDecoderLayer`): the same
bits as the layer's modules on the same kernels, float32 within rounding of a float64 reference, a row's bits
independent of its batch, its span and the thread count, and never a stale weight."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import hf_model, ours_from_hf

from sparkrl.cpu import accelerate as cpu_layer
from sparkrl.cpu import native
from sparkrl.cpu.accelerate import CpuDecoderLayer, accelerate, use_int8
from sparkrl.drafters.eagle3 import Eagle3Drafter, Eagle3Layer

F32, BF16 = torch.float32, torch.bfloat16
pytestmark = pytest.mark.skipif(not native.available(), reason="the compiled kernels are not available here")
FAMILIES = ["llama", "llama-tied-bias", "qwen2", "qwen3"]  # plain, biased q/k/v/o, biased q/k/v, q/k norms


def _model(family: str, dtype: torch.dtype, int8: bool = False):
    model = accelerate(ours_from_hf(hf_model(family)).to(dtype), "auto").model
    return use_int8(model.model.layers) and model if int8 else model


@pytest.fixture
def counted(monkeypatch):
    """The calls of `native.decode_layer`, counted."""
    calls = []
    f = native.decode_layer
    monkeypatch.setattr(native, "decode_layer", lambda *a: calls.append(1) or f(*a))
    return calls


def _rollout(model, tokens: torch.Tensor, tree_seed: int = 0):
    """What a rollout's cached forwards make of tokens (B, 12): a 6-token prefill, a 4-token draft tree (a random
    mask among its tokens) of which 2 are committed, then two one-token steps. The hidden states and the cache."""
    B = tokens.shape[0]
    g = torch.Generator().manual_seed(tree_seed)
    tree = torch.tril(torch.rand(B, 4, 4, generator=g) < 0.6) | torch.eye(4, dtype=torch.bool)
    with torch.no_grad():
        cache = model.new_cache(B, 24)
        out = [model(tokens[:, :6], cache).hidden]
        cache.commit(None, torch.full((B,), 6))
        out.append(model(tokens[:, 6:10], cache, tree_mask=tree).hidden)
        cache.commit(torch.tensor([[0, 2]] * B), torch.full((B,), 2))
        for t in (10, 11):
            out.append(model(tokens[:, t : t + 1], cache).hidden)
            cache.commit(None, torch.ones(B, dtype=torch.long))
    return out, cache.kv


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_call_gives_the_bits_the_modules_give(family, dtype, int8, counted, monkeypatch):
    """Prefill, a draft tree, a commit and decode steps: every hidden state and every cache entry the same bits
    with the layer as one call and as its modules (each on the compiled kernels; int8: the 8-bit products)."""
    model = _model(family, dtype, int8)
    tokens = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    fused, kv = _rollout(model, tokens)
    assert len(counted) == 4 * model.args.num_layers  # every cached forward of every layer was one call
    monkeypatch.setattr(cpu_layer, "FUSE_LAYERS", False)
    modules, kv_modules = _rollout(model, tokens)
    assert len(counted) == 4 * model.args.num_layers
    assert all(torch.equal(a, b) for a, b in zip(fused, modules)) and torch.equal(kv, kv_modules)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_call_in_float32_matches_a_float64_reference(family, counted):
    """The float32 call against the eager model in float64 (torch's ops, no compiled kernel) on the same rollout."""
    model = _model(family, F32)
    reference = ours_from_hf(hf_model(family)).double()
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    got, kv = _rollout(model, tokens)
    assert counted
    want, kv64 = _rollout(reference, tokens)
    for a, b in zip(got, want):
        assert torch.allclose(a.double(), b, atol=2e-5, rtol=2e-5), (a.double() - b).abs().max()
    assert torch.allclose(kv.double(), kv64, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype,int8", [(F32, False), (BF16, False), (BF16, True)])
def test_a_row_of_one_call_depends_only_on_its_own_tokens(dtype, int8, threads, counted):
    """A sequence's next token alone (one row, a one-token step) and as the first of three new tokens beside two other
    sequences (a verify forward: a longer span, more rows), at 1-3 threads: the same bits. What keeps speculative
    rollouts token-identical to AR ones."""
    model = _model("llama-tied-bias", dtype, int8)
    g = torch.Generator().manual_seed(3)
    prefix, others = torch.randint(0, 97, (1, 9), generator=g), torch.randint(0, 97, (2, 9), generator=g)
    chain = torch.randint(0, 97, (1, 2), generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            alone = model.new_cache(1, 16)
            model(prefix[:, :8], alone)
            alone.commit(None, torch.tensor([8]))
            step = model(prefix[:, 8:], alone).hidden[0, 0]
            batch = model.new_cache(3, 16)
            model(torch.cat([others[:, :8], prefix[:, :8]])[[0, 2, 1]], batch)
            batch.commit(None, torch.full((3,), 8))
            new = torch.cat([torch.cat([prefix[:, 8:], chain], 1), others[:, 6:]])[[1, 0, 2]]
            verify = model(new, batch).hidden[1, 0]
    finally:
        torch.set_num_threads(before)
    assert counted and torch.equal(step, verify)


def test_a_changed_or_replaced_weight_is_never_served_stale(counted, monkeypatch):
    """An optimizer step (in place) and a parameter replaced by another tensor: the next call runs the new weights,
    as the modules do."""
    model = _model("qwen2", BF16)
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    before, _ = _rollout(model, tokens)
    layer = model.model.layers[1]
    with torch.no_grad():
        layer.mlp.up_proj.weight.mul_(1.5)  # in place (version counter)
        layer.self_attn.k_proj.bias = torch.nn.Parameter(layer.self_attn.k_proj.bias + 0.5)  # another tensor
        layer.input_layernorm.weight.data = layer.input_layernorm.weight.data * 2  # another storage, same version
    after, kv = _rollout(model, tokens)
    monkeypatch.setattr(cpu_layer, "FUSE_LAYERS", False)
    modules, kv_modules = _rollout(model, tokens)
    assert not torch.equal(before[-1], after[-1])
    assert all(torch.equal(a, b) for a, b in zip(after, modules)) and torch.equal(kv, kv_modules)


def test_training_uncached_forwards_and_other_layers_run_the_modules(counted):
    """Gradients recorded, forwards without a cache (training, scoring), another kernel choice: the modules serve.
    EAGLE-3's first layer, a subclass with a forward of its own, keeps it."""
    model = _model("llama", F32)
    tokens = torch.randint(0, 97, (1, 6))
    assert model(tokens, model.new_cache(1, 8)).hidden.requires_grad  # gradients recorded: the modules
    with torch.no_grad():
        model(tokens)  # no cache
        plain = accelerate(copy.deepcopy(ours_from_hf(hf_model("llama"))), "plain").model
        plain(tokens, plain.new_cache(1, 8))
    assert not counted
    assert isinstance(plain.model.layers[0], CpuDecoderLayer)
    drafter = accelerate(Eagle3Drafter(model.args), "auto").model
    assert type(drafter.stack.layers[0]) is Eagle3Layer
