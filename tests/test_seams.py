"""The declared seams: every null object and real implementation provides each member of the protocol it
declares (`engine.seams`, `train.drafting.OnlineDrafting`), and one builder makes what rollouts need
(`train.generation`)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Protocol

import pytest
import torch

from sparkrl.config import DraftConfig
from sparkrl.drafters.dflash import DFlashDrafter
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.selfdraft import SelfDrafter
from sparkrl.engine.autoregressive import Autoregressive
from sparkrl.engine.budget import Budget, FixedBudget
from sparkrl.engine.seams import DraftAdapter, DraftModel, RolloutEngine, RoundBudget
from sparkrl.engine.spark import Spark
from sparkrl.engine.speculative import NoAdaptation, Speculative
from sparkrl.train.drafting import Drafting, NoDrafting, OnlineDrafting
from sparkrl.train.generation import RolloutPlan, build_generation
from sparkrl.vllm.engine import VllmGeneration

ROOT = Path(__file__).resolve().parents[1]
IMPLEMENTS = {
    DraftModel: [Eagle3Drafter, DFlashDrafter, SelfDrafter],
    RoundBudget: [FixedBudget, Budget],
    DraftAdapter: [NoAdaptation, Spark],
    RolloutEngine: [Autoregressive, Speculative, VllmGeneration],
    OnlineDrafting: [NoDrafting, Drafting],
}


def members(protocol) -> set[str]:
    """What a protocol asks for: its methods and its annotated attributes."""
    own = {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_") or n == "__call__"}
    return own | set(getattr(protocol, "__annotations__", {}))


@pytest.mark.parametrize("protocol", IMPLEMENTS, ids=lambda p: p.__name__)
def test_each_implementation_declares_its_protocol_and_defines_every_member(protocol):
    for cls in IMPLEMENTS[protocol]:
        assert protocol in cls.__mro__, f"{cls.__name__} does not declare {protocol.__name__}"
        for name in members(protocol):
            owner = next(c for c in cls.__mro__ if name in vars(c) or name in getattr(c, "__annotations__", {}))
            if name in vars(protocol) and owner is protocol:  # only the protocol's empty body: not implemented
                pytest.fail(f"{cls.__name__} leaves {protocol.__name__}.{name} unimplemented")


def test_an_instance_of_each_null_object_passes_the_runtime_check(tiny_llama):
    from sparkrl.config import TreeShape

    assert isinstance(NoAdaptation(), DraftAdapter) and isinstance(FixedBudget(TreeShape()), RoundBudget)
    assert isinstance(Autoregressive(), RolloutEngine) and isinstance(NoDrafting(), OnlineDrafting)
    assert isinstance(Eagle3Drafter(tiny_llama.args).bind(tiny_llama), DraftModel)


def test_no_engine_field_is_typed_object():
    """A seam is a declared type, never `object`."""
    for path in (ROOT / "sparkrl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.annotation, ast.Name):
                assert node.annotation.id != "object", f"{path}:{node.lineno} types a field `object`"


def test_only_the_builder_makes_inference_copies_and_engines():
    """`generation.build_generation` is the one place that builds rollouts: no other module of sparkrl calls
    `inference_copy`, `make_drafter` or `make_budget`, or constructs an engine."""
    built = {"inference_copy", "make_budget", "Speculative", "Autoregressive", "VllmGeneration", "VllmEngine.serving"}
    allowed = {"train/generation.py", "train/drafting.py", "train/precision.py"}
    for path in (ROOT / "sparkrl").rglob("*.py"):
        rel = str(path.relative_to(ROOT / "sparkrl"))
        if rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                assert name not in built, (
                    f"sparkrl/{rel}:{node.lineno} calls {name}: build rollouts with build_generation"
                )


@pytest.mark.parametrize("draft", ["none", "eagle3", "dflash"])
def test_the_builder_makes_the_engine_the_plan_asks_for(tiny_llama, draft):
    plan = RolloutPlan(torch.bfloat16, cpu_kernels="plain", draft=draft)
    cfg = DraftConfig(draft=draft, draft_checkpoint="fresh" if draft != "none" else "", budget="fixed")
    gen = build_generation(plan, cfg, tiny_llama, 1.0)
    assert gen.policy.model.lm_head.weight.dtype == torch.bfloat16 and gen.policy.master is tiny_llama
    if draft == "none":
        assert isinstance(gen.engine, Autoregressive) and isinstance(gen.drafting, NoDrafting)
    else:
        assert isinstance(gen.engine, Speculative) and gen.engine.drafter is gen.drafting.copy.model
        assert gen.drafting.drafter.fc.weight.dtype == torch.float32  # the trained drafter keeps master weights


def test_a_plan_is_settled_once_and_recorded_as_typed_values(tiny_llama):
    recorded = {"rollout_dtype": "bfloat16", "float32_attention": True}  # what a resumed run's start chose
    plan = RolloutPlan.settle(tiny_llama, "float32", "plain", DraftConfig(), recorded=recorded)
    assert plan.dtype is torch.bfloat16 and plan.float32_attention is True
    assert plan.record() == recorded
    fresh = RolloutPlan.settle(tiny_llama, "float32", "plain", DraftConfig())
    assert fresh.dtype is torch.float32 and fresh.float32_attention is False  # plain: the reference's attention
    assert inspect.signature(RolloutPlan).parameters["dtype"].annotation in ("torch.dtype", torch.dtype)


def test_protocols_are_protocols():
    for protocol in IMPLEMENTS:
        assert Protocol in protocol.__mro__ and protocol._is_protocol
