"""studies/quickstart_diagnose.py: the batch's group statistics and the decisive turn's action statistics (no training)."""

from __future__ import annotations

import math

import pytest

from tests.studies.loader import load_study


@pytest.fixture(scope="module")
def qd():
    return load_study("quickstart_diagnose")


def _traj(group: int, success: bool, actions: list[str], adv: float) -> dict:
    return {"group": group, "success": success, "seq_advantage": adv,
            "turns": [{"action": a, "advantage": adv} for a in actions]}


def test_group_stats_counts_silent_groups_one_failure_groups_and_the_negative_share(qd) -> None:
    records = [
        # group 0: all won, no advantage
        _traj(0, True, ["go forward", "pick up"], 0.0), _traj(0, True, ["pick up"], 0.0),
        # group 1: one failure of three, a long failed episode and two short wins
        _traj(1, False, ["go forward"] * 3 + ["pick up"], -1.0), _traj(1, True, ["pick up"], 0.5), _traj(1, True, ["turn right", "pick up"], 0.5),
        # group 2: all lost
        _traj(2, False, ["toggle"], 0.0), _traj(2, False, ["toggle"], 0.0),
    ]
    s = qd.group_stats(records)
    assert s["groups"] == 3 and s["trajectories"] == 7
    assert s["zero_adv_groups"] == pytest.approx(2 / 3)
    assert s["one_failure_groups"] == pytest.approx(1 / 3)
    assert s["neg_mass"] == pytest.approx(4.0 / (4.0 + 1.5))  # four failed turns at -1 against three won turns at +0.5
    assert s["failure_turn_share"] == pytest.approx(4 / 7)
    assert s["pickup_net"] == pytest.approx(0.0)  # the two won pick-ups (+0.5 each) against the failed one (-1)
    # a two-failure group is not a one-failure group
    records[3]["success"] = False
    records[4]["success"] = False
    assert qd.group_stats(records)["one_failure_groups"] == 0.0


def test_action_stats_on_the_decisive_turn(qd) -> None:
    probs = [{"pick up": 0.5, "toggle": 0.5}, {"pick up": 0.9, "toggle": 0.05, "turn right": 0.05}]
    s = qd.action_stats(probs)
    assert s["p_pickup"] == pytest.approx(0.7) and s["p_toggle"] == pytest.approx(0.275)
    assert s["entropy"] == pytest.approx((math.log(2) + -(0.9 * math.log(0.9) + 2 * 0.05 * math.log(0.05))) / 2)
    assert s["greedy_pickup"] == 0.5  # a tie is not yet the flip
    assert math.isnan(qd.action_stats([])["p_pickup"])


def test_first_arrival_is_the_decisive_turn_before_any_toggle(qd) -> None:
    arrive = {"expert": "pick up", "history": [{"action": "go forward", "observation": ""}]}
    assert qd.first_arrival(arrive)
    assert qd.first_arrival({"expert": "pick up", "history": []})
    assert not qd.first_arrival({"expert": "pick up", "history": [{"action": "toggle", "observation": ""}]})
    assert not qd.first_arrival({"expert": "go forward", "history": []})


def test_markdown_shows_only_the_columns_measured(qd) -> None:
    rows = [{"iteration": 0.0, "eval/success": 0.0, "decisive/p_pickup": 0.14},
            {"iteration": 1.0, "rollout/success": 0.125, "batch/neg_mass": 0.64, "loss/clip_frac": 0.004}]
    text = qd.markdown("run", rows)
    assert "| it | greedy eval | train success | p(pick up) decisive | neg. adv mass | clip frac |" in text
    assert "| 0 | 0 |  | 0.14 |  |  |" in text and "| 1 |  | 12 |  | 64 | 0.004 |" in text
