"""agentopsd.rollout.staleness: each turn's staleness, the bound's check and the staleness metrics, on hand cases."""

from __future__ import annotations

import pytest

from agentopsd.rollout.staleness import check_staleness, spanning_share, staleness_metrics, turn_staleness


def test_staleness_is_the_updates_since_each_turns_weights():
    assert turn_staleness(5, [5, 4, 3, 5]) == [0, 1, 2, 0]
    assert turn_staleness(0, []) == []


def test_turns_within_the_bound_pass():
    check_staleness(5, [5, 4, 3], max_staleness=2)
    check_staleness(5, [5, 5], max_staleness=0)  # lockstep
    check_staleness(5, [], max_staleness=0)


def test_a_turn_beyond_the_bound_names_the_iteration_the_staleness_and_the_bound():
    with pytest.raises(RuntimeError, match=r"iteration 7: a turn is 3 updates stale, beyond rollout.max_staleness=2") as err:
        check_staleness(7, [7, 6, 4, 5], max_staleness=2)
    assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match="1 updates stale, beyond rollout.max_staleness=0"):
        check_staleness(3, [3, 2], max_staleness=0)


def test_a_turn_newer_than_the_update_is_a_bug():
    with pytest.raises(RuntimeError, match=r"iteration 4: a turn carries policy version 5, newer than the update"):
        check_staleness(4, [4, 5], max_staleness=3)


def test_metrics_give_mean_max_and_the_share_of_turns_at_each_staleness():
    # iteration 10, versions 10, 10, 9, 8, 8, 8 -> staleness 0, 0, 1, 2, 2, 2
    metrics = staleness_metrics(10, [10, 10, 9, 8, 8, 8], max_staleness=3)
    assert metrics == {
        "rollout/staleness_mean": pytest.approx(7 / 6),
        "rollout/staleness_max": 2.0,
        "rollout/staleness_share_0": pytest.approx(2 / 6),
        "rollout/staleness_share_1": pytest.approx(1 / 6),
        "rollout/staleness_share_2": pytest.approx(3 / 6),
        "rollout/staleness_share_3": 0.0,
    }


def test_lockstep_metrics_and_no_turns():
    assert staleness_metrics(2, [2, 2, 2], 0) == {
        "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0, "rollout/staleness_share_0": 1.0}
    assert staleness_metrics(2, [], 1) == {
        "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0,
        "rollout/staleness_share_0": 0.0, "rollout/staleness_share_1": 0.0}


def test_spanning_share_counts_episodes_whose_turns_carry_several_versions():
    assert spanning_share([[3, 3, 3], [3, 4], [2], [2, 3, 4]]) == pytest.approx(2 / 4)
    assert spanning_share([[1, 1], [2]]) == 0.0
    assert spanning_share([]) == 0.0
