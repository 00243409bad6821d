"""Which trajectories the report draws as credit pictures."""

from __future__ import annotations

from agentopsd.report import pick_credit_examples


def _rec(i: int, success: bool, adv: float, credit: bool = True, turns: int = 4) -> dict:
    turn = {"belief": 0.5, "revision": 0.0, "multiplier": 1.0} if credit else {}
    return {"id": i, "success": success, "seq_advantage": adv, "turns": [dict(turn, k=k) for k in range(turns)]}


def test_latest_won_and_lost_with_mixed_outcomes_first() -> None:
    records = [_rec(0, True, 0.5), _rec(1, False, -0.5), _rec(2, True, 0.7), _rec(3, False, 0.0), _rec(4, False, -0.2)]
    assert [r["id"] for r in pick_credit_examples(records)] == [2, 4]


def test_falls_back_to_any_trajectory_with_credit() -> None:
    records = [_rec(0, False, 0.0), _rec(1, False, 0.0), _rec(2, False, 0.0, turns=2)]
    assert [r["id"] for r in pick_credit_examples(records)] == [1]


def test_nothing_without_credit_values() -> None:
    assert pick_credit_examples([_rec(0, True, 0.5, credit=False), _rec(1, False, -0.5, credit=False)]) == []
