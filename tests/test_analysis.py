"""Section-2 statistics on a hand-made round log."""

from __future__ import annotations

import pytest

from sparkrl.commands.analysis import analyze, stages
from sparkrl.engine.records import HIT, MISS, UNDRAFTED
from sparkrl.errors import UserError


def test_statistics_by_hand():
    rec = {
        "group_size": 2,
        "responses": [
            {"tokens": [3, 5, 7, 5, 5], "outcome": [UNDRAFTED, MISS, HIT, MISS, HIT], "round": [0, 0, 1, 2, 3]},
            {"tokens": [5, 9], "outcome": [HIT, MISS], "round": [1, 2]},
        ],
    }
    r = analyze([rec])
    assert r["drafted_positions"] == 6 and r["misses"] == 3  # the undrafted first token is no event
    w = r["within_response"]
    assert (w["events_with"], w["p_miss_with"], w["events_without"], w["p_miss_without"]) == (2, 0.5, 4, 0.5)
    assert w["matched_ratio"] == pytest.approx(1.0)  # token 5: 1 of 2 missed either way
    by = {d["from"]: d for d in r["within_response_by_distance"]}
    assert by[1]["events"] == 1 and by[1]["p_miss"] == 0.0 and by[2]["events"] == 1 and by[2]["p_miss"] == 1.0
    p = r["within_prompt"]  # only response 1's token 5 (round 1) follows another response's miss of 5 (round 0)
    assert (p["events_with"], p["p_miss_with"], p["events_without"], p["p_miss_without"]) == (1, 0.0, 5, 0.6)
    assert r["misses_seen_earlier_in_response"] == pytest.approx(1 / 3)
    assert r["misses_seen_earlier_in_prompt"] == pytest.approx(1 / 3)
    # a second rollout: token 5 was missed in the previous one, token 8 was not
    rec2 = {"group_size": 1, "responses": [{"tokens": [5, 8], "outcome": [MISS, HIT], "round": [0, 1]}]}
    pr = analyze([rec, rec2])["previous_rollout"]
    assert (pr["events_with"], pr["p_miss_with"], pr["events_without"], pr["p_miss_without"]) == (1, 1.0, 1, 0.0)


def _group(tokens, outcomes):
    return {"tokens": tokens, "outcome": outcomes, "round": list(range(len(tokens)))}


def test_raw_ratio_is_confounded_by_frequency_and_the_matched_one_is_not():
    # token 1 is frequent and easy (missed 1 in 4 either way), token 2 rare and hard (missed 3 in 4
    # either way): "missed before" picks mostly token 1, so the raw ratio is < 1, the matched one is 1.
    resp = [_group([1] * 8, [MISS, HIT, HIT, HIT, MISS, HIT, HIT, HIT]), _group([2] * 4, [MISS, MISS, HIT, MISS])]
    w = analyze([{"group_size": 1, "responses": resp}], bootstrap=0)["within_response"]
    assert w["events_without"] == 2 and w["p_miss_without"] == 1.0  # first position of each token
    assert w["events_with"] == 10 and w["p_miss_with"] == pytest.approx(3 / 10)
    assert w["ratio"] == pytest.approx(0.3)
    # by token: 1 (without 1/1 missed, with 1 of 7), 2 (1/1, 2 of 3): expected 7 * 1 + 3 * 1 = 10, observed 3
    assert w["matched_ratio"] == pytest.approx(0.3)
    assert w["matched_tokens"] == 2


def test_bootstrap_interval_over_prompt_groups():
    a = {"tokens": [5, 5, 5, 6], "outcome": [MISS, MISS, HIT, MISS], "round": [0, 1, 2, 3]}
    b = {"tokens": [5, 5, 6, 6], "outcome": [MISS, HIT, HIT, MISS], "round": [0, 1, 2, 3]}
    same = analyze([{"group_size": 1, "responses": [a, a, a]}], bootstrap=200)
    lo, hi = same["within_response"]["ratio_ci"]
    assert lo == pytest.approx(hi) == pytest.approx(same["within_response"]["ratio"])  # identical groups: no spread
    mixed = analyze([{"group_size": 1, "responses": [a, b, a, b]}], bootstrap=200, seed=1)
    lo, hi = mixed["misses_seen_earlier_in_response_ci"]
    assert lo < mixed["misses_seen_earlier_in_response"] < hi
    assert mixed["prompt_groups"] == 4
    assert analyze([{"group_size": 1, "responses": [a, b]}], bootstrap=0)["within_response"].get("ratio_ci") is None


def test_stages_split_by_step_and_carry_the_previous_rollout():
    recs = [{"step": s, "group_size": 1, "responses": [_group([s, 9], [MISS, HIT])]} for s in (1, 2, 3, 3, 4, 5)]
    parts = stages(recs, 3, bootstrap=0)
    assert [p["steps"] for p in parts] == [[1, 1], [2, 3], [4, 5]]
    assert [p["rollouts"] for p in parts] == [1, 3, 2]
    assert parts[0]["previous_rollout"]["events_without"] == 0  # the log's first rollout has none before it
    # the middle stage's first rollout takes its evidence from the record before the stage; only the
    # second step-3 rollout drafts a token (3) the rollout before it missed
    pr = parts[1]["previous_rollout"]
    assert (pr["events_with"], pr["p_miss_with"], pr["events_without"]) == (1, 1.0, 5)
    with pytest.raises(UserError, match="at most 5 stages"):
        stages(recs, 6)
