"""studies/credit_quality.py: which weights sampled an iteration (the Monte Carlo truth runs that policy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.studies.loader import load_study


@pytest.fixture(scope="module")
def cq():
    return load_study("credit_quality")


def _run(tmp_path: Path, warm: dict) -> Path:
    (tmp_path / ".hydra").mkdir(parents=True)
    (tmp_path / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"warm_start": warm}))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "policy-000008.pt").write_bytes(b"x")
    return tmp_path


def test_iteration_1_is_the_warm_start_the_run_loaded_or_trained(cq, tmp_path) -> None:
    shared = tmp_path / "shared.pt"
    run = _run(tmp_path / "a", {"weights": str(shared)})
    assert cq.sampling_weights(run, 1) == shared  # warm_start.weights: the shared file
    own = _run(tmp_path / "b", {"weights": None})
    (own / "warm_start").mkdir()
    (own / "warm_start" / "policy-abc.pt").write_bytes(b"x")
    assert cq.sampling_weights(own, 1) == own / "warm_start" / "policy-abc.pt"


def test_a_later_iteration_needs_the_policy_kept_after_the_one_before(cq, tmp_path) -> None:
    run = _run(tmp_path / "a", {"weights": None})
    assert cq.sampling_weights(run, 9) == run / "checkpoints" / "policy-000008.pt"
    with pytest.raises(SystemExit, match="no policy-000004.pt .*keep_policies"):
        cq.sampling_weights(run, 5)


def test_evidence_by_action_averages_each_stage_and_leaves_routine_turns_out(cq) -> None:
    evidence = {
        ("agentopsd", "door", "toggle", "early"): [-1.0, -3.0],
        ("agentopsd", "door", "toggle", "late"): [0.5],
        ("agentopsd", "door", "pick up", "mid"): [0.25],
        ("agentopsd", "routine", "go forward", "early"): [0.0, 0.0, 0.0],
    }
    rows = cq.evidence_by_action(evidence)
    assert rows[0] == "| algorithm | kind | action | early | mid | late | all |"
    assert rows[2:] == [  # the most frequent action of a kind first; no routine row
        "| agentopsd | door | toggle | -2.00 (2) | - | +0.50 (1) | -1.17 (3) |",
        "| agentopsd | door | pick up | - | +0.25 (1) | - | +0.25 (1) |",
    ]


def test_format_errors_and_invalid_actions_are_named_as_such_not_by_their_raw_text(cq) -> None:
    from agentopsd.study.groundtruth import FORMAT_ERROR_PREFIX, LoggedTurn

    stepped = LoggedTurn(k=0, action="toggle", observation="You see: a wall.", valid=True, signals={})
    broken = LoggedTurn(k=1, action="pickSturn left", observation=FORMAT_ERROR_PREFIX + " Reply with ...", valid=False,
                        signals={})
    garbled = LoggedTurn(k=2, action="turn up", observation="You see: a wall.\nLast action: 'turn up' is not an action",
                         valid=False, signals={})
    assert [cq.action_name(t) for t in (stepped, broken, garbled)] == ["toggle", "(format error)", "(invalid action)"]


def test_pair_class_table_lists_the_most_frequent_classes_with_both_signals(cq) -> None:
    scores = {
        ("agentopsd", "S9", "door:0", "routine:-", "evidence"): [0.0, 0.0, 1.0, 0.0],
        ("agentopsd", "S9", "door:0", "routine:-", "credit"): [1.0, 1.0, 1.0, 0.0],
        ("agentopsd", "S9", "key:+", "routine:+", "evidence"): [1.0],
    }
    lines = cq.pair_class_table(scores, top=1)
    assert lines[-1] == "| agentopsd | S9 | door:0 | routine:- | 4 | 0.25 | 0.75 |"
    assert sum(line.startswith("| agentopsd") for line in lines) == 1  # top=1: the most frequent class only
    assert cq.pair_class_table({}) == []


def test_trajectories_whose_teacher_was_not_scored_are_left_out(cq, tmp_path) -> None:
    """Under ``rollout.teacher_skip_zero_advantage`` a group with A_seq = 0 logged no evidence (``teacher_scored:
    false``): every signal is read on the groups that have it, not the evidence on some and the advantage on all."""
    from agentopsd.callbacks.rollout_logging import write_shard

    turn = {"k": 0, "action": "pick up", "observation": "", "reward": 1.0, "valid": True, "advantage": 0.0}
    record = {"iteration": 1, "env": "BabyAI-PickupObj", "task_index": 0, "group": 0, "success": True, "score": 1.0,
              "task_type": "", "skill": "", "seq_advantage": 0.0, "turns": [turn]}
    scored = {**record, "group": 1, "task_index": 1, "seq_advantage": 0.5,
              "turns": [{**turn, "advantage": 0.5, "evidence": 0.3, "gaps": [0.3]}]}
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": "agentopsd"}}))
    write_shard(run / "rollouts" / "rollouts-000001.tar", [{**record, "teacher_scored": False}, scored])
    _, trajs = cq.load_run(run)
    assert [t.task_index for t in trajs] == [1]
