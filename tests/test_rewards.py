"""Rewards: extraction, equivalence, format, and untrusted pathological outputs within a time bound."""

from __future__ import annotations

import time

import pytest

from sparkrl.train.rewards import FORMAT_WEIGHT, Grader, as_fraction, format_ok, last_boxed

REASONING = "First we add the two numbers, then we check the result carefully. "


@pytest.fixture(scope="module")
def grader():
    g = Grader(timeout_s=2.0)
    yield g
    g.close()


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so \boxed{72}.", "72"),
        (r"\boxed{1} then \boxed{\frac{3}{4}}", r"\frac{3}{4}"),
        (r"\boxed 5", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{a^{2}+\sqrt{b}}", r"a^{2}+\sqrt{b}"),
        (r"no box here", None),
        (r"\boxed{}", None),
        (r"\boxed{unbalanced", None),
        (r"\boxed", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "pred,gold,ok",
    [
        ("72", "72", True),
        ("72.0", "72", True),
        ("1,234", "1234", True),
        (r"\$18", "18", True),
        (r"\frac{3}{4}", "0.75", True),
        ("3/4", r"\dfrac{3}{4}", True),
        ("-2", "2", False),
        ("71", "72", False),
        (r"\text{18}", "18", True),
        ("x^2+1", "1+x^2", True),
        (r"\sqrt{2}", r"2^{1/2}", True),
        ("(1,2)", "(1, 2)", True),
    ],
)
def test_equivalence(grader, pred, gold, ok):
    assert grader.equivalent(pred, gold) is ok


def test_as_fraction_exact():
    assert as_fraction("0.1") * 10 == 1 and as_fraction(r"-\frac{1}{3}") * 3 == -1
    assert as_fraction("1/0") is None and as_fraction("x") is None


def test_reward_combines_accuracy_and_format(grader):
    s = grader.score(REASONING + r"The answer is \boxed{12}.", "12")
    assert (s.accuracy, s.format, s.reward) == (1.0, 1.0, 1.0 + FORMAT_WEIGHT)
    s = grader.score(r"\boxed{12}", "12")  # right answer, no reasoning
    assert (s.accuracy, s.format) == (1.0, 0.0)
    s = grader.score(REASONING + r"\boxed{13}", "12")
    assert (s.accuracy, s.format) == (0.0, 1.0)
    assert not format_ok(REASONING + r"\boxed{12}" + " and then a long digression" * 20)
    assert grader.score("no answer at all", "12").reward == 0.0


@pytest.mark.parametrize(
    "name,text",
    [
        ("1e6 chars", "1" * 1_000_000),
        ("1e6 chars boxed", r"\boxed{" + "9" * 1_000_000 + "}"),
        ("deep nesting", r"\boxed{" + "{" * 100_000 + "}" * 100_000 + "}"),
        ("power tower", REASONING + r"\boxed{9^9^9^9}"),
        ("big power", REASONING + r"\boxed{10^{10^{10^{10}}}}"),
        ("factorial tower", REASONING + r"\boxed{(10^{100})!!}"),
        ("unbalanced", REASONING + r"\boxed{\frac{1}{2}" + "{" * 1000),
        ("invalid utf-8", (REASONING + r"\boxed{3}").encode() + b"\xff\xfe\x80"),
        ("null bytes", REASONING + "\x00" * 1000 + r"\boxed{\x00}"),
    ],
)
def test_pathological_outputs_score_zero_within_bound(grader, name, text):
    t = time.perf_counter()
    s = grader.score(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text, "5")
    assert time.perf_counter() - t < 2.0 + 10.0  # the time bound, plus a worker restart
    assert s.accuracy == 0.0


def test_grader_survives_a_stuck_check():
    g = Grader(timeout_s=0.5)
    try:
        g._verifier.check("1", "1")  # warm the worker
        g._verifier.timeout_s = 1e-4  # every check now exceeds its bound: the worker is killed
        assert g._verifier.check("x+1", "1+x") is False
        g._verifier.timeout_s = 5.0
        assert g.equivalent("x+1", "1+x")  # a fresh worker answers
    finally:
        g.close()
