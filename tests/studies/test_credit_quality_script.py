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


def test_the_fidelity_check_recomputes_each_run_at_its_own_band(cq) -> None:
    """A wide lever's run (band 0.5) logged multipliers beyond the paper's band: the check must recompute them at
    the run's own band (at 0.2 it would report a gap of up to 0.3 where training and the recompute agree)."""
    import numpy as np
    import torch

    from agentopsd.credit import turn_multipliers
    from agentopsd.study.groundtruth import LoggedTrajectory, LoggedTurn

    evidence = [[2.0, -1.5, 0.3], [-2.5, 1.0, 0.0], [0.7, 0.2, -0.4]]
    success = [1.0, 0.0, 1.0]
    adv = [0.5, -1.0, 0.5]
    gaps = torch.tensor(evidence, dtype=torch.float64)
    mask = torch.ones_like(gaps, dtype=torch.bool)
    prior = torch.tensor(success, dtype=torch.float64).mean().expand(3)
    _, _, w = turn_multipliers(torch.tensor(adv, dtype=torch.float64), gaps, mask, prior, gamma=0.95, band=0.5, mode="belief")
    assert float((w - 1).abs().max()) > 0.25  # beyond the paper's band: the planted defect would show
    labelled = []
    for i in range(3):
        turns = tuple(LoggedTurn(k=k, action="go forward", observation="", valid=True,
                                 signals={"evidence": evidence[i][k], "multiplier": float(w[i, k])}, gaps=(evidence[i][k],))
                      for k in range(3))
        traj = LoggedTrajectory(run="r", algorithm="agentopsd", env_id="e", iteration=1, task_index=0,
                                success=bool(success[i]), seq_advantage=adv[i], turns=turns, group=0)
        labelled.append((traj, None, None, None, [(i, k) for k in range(3)]))
    cfg = {"data": {"group_size": 3}, "algorithm": {"name": "agentopsd", "mult_band": 0.5, "gap_decay_gamma": 0.95}}
    rows, worst = cq.rule_rows(cfg, labelled, lambda: None)
    assert len(rows) == 3
    assert worst < 1e-9
    # the rules themselves stay at the shipped band
    assert all(np.max(np.abs(np.asarray(r["agentopsd"]))) <= 1.2 + 1e-9 for r in rows.values())
