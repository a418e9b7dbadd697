"""The speculation budget: cost model measurement and caching, decisions, exactness with a budget."""

from __future__ import annotations

import pytest

from sparkrl.budget import Budget, CostModel
from sparkrl.config import SamplingConfig
from sparkrl.drafters.eagle3 import Eagle3Drafter
from sparkrl.drafters.tree import TreeShape
from sparkrl.rollout import generate, generate_speculative, response_generators

ROWS = (1, 2, 4, 8)


def synthetic(ar=(1.0, 1.1, 1.3, 2.0), tree=(1.5, 2.5, 4.5, 9.0), draft=(0.1, 0.1, 0.2, 0.3)):
    return CostModel(ROWS, list(ar), list(tree), list(draft))


def test_budget_speculates_with_few_rows_and_not_with_many():
    b = Budget(synthetic(), TreeShape(3, 2, 6), prior_aal=2.5)
    assert b.choose(1) == 6  # (1.5 + 0.1) / 2.5 < 1.0
    assert b.choose(8) == 0  # (9.0 + 0.3) / (8 * 2.5) > 2.0 / 8
    b.observe(6, 1.0)  # poor acceptance lowers the running AAL
    assert b.aal < 2.5
    b.observe(0, 5.0)  # autoregressive rounds say nothing about the tree
    assert b.aal == pytest.approx(0.9 * 2.5 + 0.1)


def test_cost_model_is_measured_once_and_cached(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKRL_CACHE", str(tmp_path))
    d = Eagle3Drafter(tiny_llama.args).bind(tiny_llama)
    shape = TreeShape(2, 2, 3)
    cm = CostModel.measure(tiny_llama, d, shape, repeats=1)
    assert all(t > 0 for t in cm.verify_ar + cm.verify_tree + cm.draft)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    again = CostModel.measure(tiny_llama, d, shape)
    assert again == cm


class Alternating(Budget):
    """Tree and autoregressive rounds in turn."""

    calls = 0

    def choose(self, B):
        self.calls += 1
        return self.shape.nodes if self.calls % 2 else 0


def test_mixed_rounds_stay_exact_greedy(tiny_llama):
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    sc = SamplingConfig(0.0, 1.0, 14)
    shape = TreeShape(3, 2, 5)
    ar = generate(tiny_llama, prompts, sc, (7,), response_generators(0, 2, 3), group_size=3)
    b = Alternating(synthetic(), shape)
    sp = generate_speculative(tiny_llama, Eagle3Drafter(tiny_llama.args), prompts, sc, (7,),
                              response_generators(0, 2, 3), shape, group_size=3, budget=b)
    assert sp.tokens == ar.tokens
    assert 0 < sp.stats["tree_rounds"] < sp.stats["rounds"]
