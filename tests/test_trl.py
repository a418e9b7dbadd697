"""sparkrl's rollouts as a TRL GRPOTrainer rollout function (sparkrl.commands.trl_rollout), on a tiny random Llama."""

from __future__ import annotations

import os

import pytest
import torch

trl = pytest.importorskip("trl")  # the optional extra sparkrl[trl]; CI installs it
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from helpers import default_tokenizer_dir, hf_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from sparkrl.commands.trl_rollout import SparkRollout, consecutive_groups, math_reward, problem_dataset, tokenize  # noqa: E402
from sparkrl.config import DraftConfig, SparkConfig, TRLConfig  # noqa: E402
from sparkrl.errors import UserError  # noqa: E402
from sparkrl.train.data import build_prompts, load_problems  # noqa: E402
from sparkrl.train.rewards import Grader  # noqa: E402

PROMPTS = ["What is 2+2?", "Name a colour.", "Count to three.", "Say hi.", "Add 5 and 7.", "Spell cat."]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))


def tiny_hf():
    return hf_model(
        "llama", vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, tie_word_embeddings=True
    )


def grpo_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        learning_rate=1e-2,
        beta=0.0,
        seed=0,
        disable_tqdm=True,
    )
    return trl.GRPOConfig(**{**base, **kw})


def draft_cfg(draft="eagle3", spark=True) -> TRLConfig:
    return TRLConfig(
        draft=DraftConfig(
            draft=draft,
            draft_checkpoint="fresh",
            budget="fixed",
            block_size=4,
            spark_config=SparkConfig(spark=spark and draft != "none"),
        ),
        rollout_dtype="float32",
        micro_batch=2,
    )


def odd_share(completion_ids, **kw):
    """A reward that differs between responses (so the policy update moves the weights)."""
    return [sum(t % 2 for t in c) / max(len(c), 1) for c in completion_ids]


def make_trainer(tmp_path, tok, rollout, model=None, trainer_cls=None, **kw):
    args = grpo_args(tmp_path, **kw)
    return (trainer_cls or trl.GRPOTrainer)(
        model=model or tiny_hf(),
        args=args,
        reward_funcs=odd_share,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tok,
        rollout_func=rollout,
    )


def rollout_logprobs(model, prompt_ids, completion_ids, temperature=1.0) -> list[float]:
    """log softmax(logits / T) of each completion token under a full forward of the transformers model."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


def test_consecutive_groups():
    assert consecutive_groups(["a", "a", "b", "a", "a", "a"]) == [("a", 2), ("b", 1), ("a", 3)]
    conv = [{"role": "user", "content": "x"}]
    assert consecutive_groups([conv, list(conv)]) == [(conv, 2)]


def test_grpo_trains_on_sparkrl_rollouts(tmp_path, tok):
    """Two GRPO steps: the completions TRL trains on are sparkrl's, the log-probabilities are the rollout
    model's, the engine's weights follow the trained model, and AAL reaches TRL's logs."""
    rollout = SparkRollout(draft_cfg())
    calls, trained = [], []

    def spy(prompts, trainer):
        out = rollout(prompts, trainer)
        hf = trainer.model
        theirs = dict(hf.named_parameters())
        for (
            name,
            p,
        ) in rollout.generation.policy.model.named_parameters():  # (d) the engine samples with the trained weights
            assert torch.equal(p, theirs[name]), name
        for p_ids, c_ids, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):  # (b)
            assert len(lp) == len(c_ids) > 0
            torch.testing.assert_close(
                torch.tensor(lp), torch.tensor(rollout_logprobs(hf, p_ids, c_ids, 0.7)), atol=2e-4, rtol=0
            )
        calls.append((out, {n: p.detach().clone() for n, p in theirs.items()}))
        return out

    class Recording(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            trained.append(batch)
            return batch

    trainer = make_trainer(tmp_path, tok, spy, trainer_cls=Recording, temperature=0.7, top_p=0.95)
    trainer.train()
    assert len(calls) == len(trained) == 2
    for (out, _), batch in zip(calls, trained):  # (a) what the loss sees is what sparkrl generated
        ids, mask = batch["completion_ids"], batch["completion_mask"].bool()
        assert [row[m].tolist() for row, m in zip(ids, mask)] == out["completion_ids"]
        p_ids, p_mask = batch["prompt_ids"], batch["prompt_mask"].bool()
        assert [row[m].tolist() for row, m in zip(p_ids, p_mask)] == out["prompt_ids"]
        assert len(set(map(tuple, out["prompt_ids"]))) == 2  # 2 prompts x 3 responses
    w1, w2 = calls[0][1], calls[1][1]
    assert any(not torch.equal(w1[n], w2[n]) for n in w1)  # the first step moved the weights: a real sync
    assert not all(torch.equal(p, w2[n]) for n, p in trainer.model.named_parameters())  # the second step too
    assert rollout.sync(trainer)  # after the last step: copied again, and equal
    theirs = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in rollout.policy.named_parameters())
    assert not rollout.sync(trainer)  # nothing changed since
    logged = [h for h in trainer.state.log_history if "sparkrl/aal" in h]
    assert len(logged) == 2 and all(h["sparkrl/aal"] >= 1.0 and h["sparkrl/draft_train_s"] > 0 for h in logged)


@pytest.mark.parametrize("draft", ["none", "eagle3", "dflash"])
def test_greedy_rollouts_equal_trl_generation(tmp_path, tok, draft):
    """(c) do_sample=False: sparkrl's rollouts (autoregressive, EAGLE3-style + SPARK, DFlash-style + SPARK)
    equal TRL's own generation (transformers generate) for the same weights, also for groups split
    across the call's edges (one engine call per group size)."""
    rollout = SparkRollout(draft_cfg(draft))
    trainer = make_trainer(tmp_path, tok, rollout, max_completion_length=12, generation_kwargs={"do_sample": False})
    prompts = [PROMPTS[0]] * 2 + [PROMPTS[1]] * 3 + [PROMPTS[2]] + [PROMPTS[3]] * 3
    out = rollout(prompts, trainer)
    prompt_ids = trainer._tokenize_prompts(prompts)[0]
    assert out["prompt_ids"] == [list(p) for p in prompt_ids]
    theirs, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    assert out["completion_ids"] == theirs
    for p_ids, c_ids, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        torch.testing.assert_close(
            torch.tensor(lp), torch.tensor(rollout_logprobs(trainer.model, p_ids, c_ids)), atol=2e-4, rtol=0
        )


def test_conversational_prompts_use_the_trainers_chat_template(tmp_path, tok):
    trainer = make_trainer(tmp_path, tok, SparkRollout(draft_cfg("none")))
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    assert tokenize(trainer, convs) == [list(x) for x in trainer._tokenize_prompts(convs)[0]]
    assert tokenize(trainer, PROMPTS[:2]) == [list(x) for x in trainer._tokenize_prompts(PROMPTS[:2])[0]]


@pytest.mark.parametrize(
    "setting, words",
    [
        (dict(use_vllm=True), "use_vllm"),
        (dict(top_k=5), "top_k"),
        (dict(min_p=0.1), "min_p"),
        (dict(repetition_penalty=1.1), "repetition_penalty"),
        (dict(generation_kwargs={"num_beams": 2}), "num_beams"),
        (dict(generation_kwargs={"do_sample": False}, temperature=0.7), "temperature=1.0"),
        (dict(max_completion_length=None), "max_completion_length"),
    ],
)
def test_unsupported_grpo_settings_are_refused_at_construction(tmp_path, setting, words):
    with pytest.raises(UserError, match=words) as e:
        SparkRollout(draft_cfg(), grpo_args(tmp_path, **setting))
    assert "\n" not in str(e.value)


def _tool(x: int) -> int:
    """Doubles x.

    Args:
        x: a number.
    """
    return 2 * x


def _gpt2():
    cfg = AutoConfig.for_model("gpt2", vocab_size=49152, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    return AutoModelForCausalLM.from_config(cfg)


def _renamed_norm():
    m = tiny_hf()
    m.model.norm = torch.nn.Sequential(m.model.norm)  # model.norm.0.weight: names nested as PEFT's wrappers do
    return m


@pytest.mark.parametrize(
    "case, words",
    [
        ("tools", "tools"),
        ("vlm", "vision"),
        ("fsdp", "FSDP"),
        ("gpt2", "cannot run this model"),
        ("names", "do not match"),
        ("prompt type", "strings or lists of chat messages"),
        ("image", "text-only"),
    ],
)
def test_unsupported_trainers_and_prompts_are_refused_before_generating(tmp_path, tok, case, words):
    rollout = SparkRollout(draft_cfg())
    model = {"gpt2": _gpt2, "names": _renamed_norm}.get(case, tiny_hf)()
    trainer = make_trainer(tmp_path, tok, rollout, model=model)
    if case == "tools":
        trainer.tools = [_tool]
    trainer._is_vlm = case == "vlm"
    if case == "fsdp":
        trainer.is_fsdp_enabled = True
    prompts = PROMPTS[:1] * 3
    if case == "prompt type":
        prompts = [[1, 2, 3]] * 3
    if case == "image":
        prompts = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]] * 3
    with pytest.raises(UserError, match=words) as e:
        rollout(prompts, trainer)
    assert "\n" not in str(e.value)
    if case not in ("prompt type", "image"):
        assert rollout.policy is None  # refused before the engine was built


def test_sparkrl_problems_and_reward_for_trl(tmp_path, tok):
    """The dataset gives TRL the prompts `sparkrl train` uses; the reward is sparkrl's."""
    problems = load_problems("default", 4, 0).problems
    data = problem_dataset(problems).to_dict()
    trainer = make_trainer(tmp_path, tok, SparkRollout(draft_cfg("none")))
    assert tokenize(trainer, data["prompt"]) == build_prompts(tok, problems, 512, "skip").prompt_ids
    with Grader() as grader:
        got = math_reward(grader)(
            [[{"role": "assistant", "content": f"So \\boxed{{{a}}}"}] for a in data["answer"]]
            + [[{"role": "assistant", "content": "no answer"}]],
            data["answer"] + ["1"],
        )
    assert all(r >= 1.0 for r in got[:4]) and got[4] == 0.0  # correct answers (format aside), and none


def test_every_response_of_a_call_has_its_own_randomness(tmp_path, tok):
    """Groups of one call that run in different engine calls (their sizes differ) draw from different
    generators: the same prompt twice gives different responses."""
    rollout = SparkRollout(draft_cfg("none"))
    trainer = make_trainer(tmp_path, tok, rollout)
    out = rollout([PROMPTS[0]] * 2 + [PROMPTS[1]] + [PROMPTS[0]] * 3, trainer)
    c = out["completion_ids"]
    assert c[0] != c[3] and c[1] != c[4] and len({tuple(x) for x in c}) == 6


def test_the_adapter_refuses_vllms_engine_in_one_line():
    with pytest.raises(UserError, match="the TRL adapter generates with sparkrl's engine"):
        TRLConfig(draft=DraftConfig(draft="none", engine="vllm"))


def test_trl_treats_sparkrls_vllm_as_available_with_a_warning_only():
    """TRL 1.16 supports vLLM 0.22-0.31; beside sparkrl's 0.32 it warns and goes on (docs/trl.md)."""
    pytest.importorskip("vllm")
    from trl.import_utils import is_vllm_available

    with pytest.warns(UserWarning, match="TRL currently supports vLLM versions"):
        assert is_vllm_available()
