"""Section-2 statistics on a hand-made round log."""

from __future__ import annotations

import pytest

from sparkrl.analysis import analyze
from sparkrl.rollout import HIT, MISS, UNDRAFTED


def test_statistics_by_hand():
    rec = {"group_size": 2, "responses": [
        {"tokens": [3, 5, 7, 5, 5], "outcome": [UNDRAFTED, MISS, HIT, MISS, HIT], "round": [0, 0, 1, 2, 3]},
        {"tokens": [5, 9], "outcome": [HIT, MISS], "round": [1, 2]},
    ]}
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
