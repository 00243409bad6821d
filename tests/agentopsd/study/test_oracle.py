"""The oracle credit mode (agentopsd/study/oracle.py) on hand-built KeyDoorBox episodes: the expert's path
saved by each turn, fed through AgentOPSD's whole recursion at the evidence's spread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import agentopsd.envs  # noqa: F401  (registers the ids)
from agentopsd.credit import grpo_advantages
from agentopsd.credit.algorithms import AgentOPSD, Algorithm
from agentopsd.study.groundtruth import advance, start
from agentopsd.study.oracle import OracleOPSD, expert_turn_gains, matched_scale, oracle_env
from agentopsd.types import TaskSpec, Trajectory, Turn

ENV_ID = "agentopsd/BabyAI-KeyDoorBoxS5-v0"
MAX_TURNS = 32
TASK = 3
ROOT = Path(__file__).resolve().parents[3]


def _episode(task: int, *, key_toggles: int = 0, detour: int = -1, box: str = "pick up") -> tuple[Trajectory, dict[str, list[int]]]:
    """The expert's episode on train task ``task`` with mistakes put in by hand: ``key_toggles`` wasted toggles
    at the key before the (decisive, right) pick-up, a turn away and back at turn ``detour``, and ``box`` as the
    action at the box ("toggle" is fatal). Returns the trajectory and the turn indices of each kind."""
    state = start(oracle_env(ENV_ID, MAX_TURNS, None), task)
    turns: list[Turn] = []
    kinds: dict[str, list[int]] = {"key_pickup": [], "key_toggle": [], "detour": [], "box": []}
    picked_key = False
    while not state.done and state.turn < MAX_TURNS:
        expert = state.env.unwrapped.expert_action()
        plan = [expert]
        if state.turn == detour:
            plan, kind = ["turn left", "turn right", expert], "detour"
        elif expert == "pick up" and not picked_key:
            plan, kind, picked_key = ["toggle"] * key_toggles + ["pick up"], "key", True
        elif expert == "pick up" and "box right in front of you" in state.observation:
            plan, kind = [box], "box"
        else:
            kind = ""
        for n, action in enumerate(plan):
            if kind == "detour" and n < 2:
                kinds["detour"].append(state.turn)
            elif kind == "key":
                kinds["key_toggle" if action == "toggle" else "key_pickup"].append(state.turn)
            elif kind == "box":
                kinds["box"].append(state.turn)
            shown = state.observation
            advance(state, action)
            turns.append(Turn(index=len(turns), prompt_ids=(1,), teacher_prompt_ids=(1,), action_ids=(2,), behaviour_logprobs=(0.0,),
                              action_text=action, parsed_action=action, observation=state.observation, reward=0.0, valid=True,
                              penalty=0.0, state=shown))
            if state.done:
                break
    traj = Trajectory(task=TaskSpec(ENV_ID, "train", task, 0, 0), turns=tuple(turns), success=state.won, score=float(state.won),
                      task_type="", expert_steps=-1, skill_text="", fault=None, truncated=not state.done, reward=float(state.won))
    return traj, kinds


def _batch(trajs: list[Trajectory], evidence: list[list[float]] | None = None, penalties: bool = False) -> dict:
    """A row-layout batch (one row per turn, one action token each) of one task group; ``evidence`` is each
    turn's teacher-minus-student gap (0 where not given)."""
    rows = [(i, t) for i, traj in enumerate(trajs) for t in traj.turns]
    gaps = torch.tensor([evidence[i][t.index] if evidence else 0.0 for i, t in rows])
    success = torch.tensor([float(t.success) for t in trajs])
    groups = torch.zeros(len(trajs), dtype=torch.long)
    return {
        "teacher_logprobs": gaps[:, None].clone(), "student_logprobs": torch.zeros(len(rows), 1),
        "action_mask": torch.ones(len(rows), 1, dtype=torch.bool),
        "turn_traj": torch.tensor([i for i, _ in rows]), "turn_index": torch.tensor([t.index for _, t in rows]),
        "turn_penalties": torch.tensor([0.1 * (t.index % 3 == 0) if penalties else 0.0 for _, t in rows]),
        "seq_advantages": grpo_advantages(success, groups), "success": success, "group_ids": groups,
        "rewards": success.clone(), "trajectories": tuple(trajs),
    }


@pytest.fixture(scope="module")
def group() -> tuple[list[Trajectory], list[dict[str, list[int]]]]:
    won, won_kinds = _episode(TASK, key_toggles=2, detour=1)
    lost, lost_kinds = _episode(TASK, box="toggle")
    assert won.success and not lost.success and lost_kinds["box"] == [len(lost.turns) - 1]
    return [won, lost], [won_kinds, lost_kinds]


def test_the_gains_are_the_expert_path_saved_and_a_fatal_turn_costs_the_budget_left(group) -> None:
    (won, lost), (won_kinds, lost_kinds) = group
    env = oracle_env(ENV_ID, MAX_TURNS, None)
    g_won = expert_turn_gains(won, env, MAX_TURNS)
    assert [g_won[k] for k in won_kinds["key_toggle"]] == [0.0, 0.0]  # a toggle at a key does nothing
    assert g_won[won_kinds["key_pickup"][0]] == 1.0
    assert sum(g_won[k] for k in won_kinds["detour"]) == 0.0 and min(g_won[k] for k in won_kinds["detour"]) < 0  # away and back
    assert g_won[won_kinds["box"][0]] == 1.0 and sum(g_won) == pytest.approx(len(won.turns) - won_kinds_wasted(won_kinds))
    g_lost = expert_turn_gains(lost, env, MAX_TURNS)
    k = lost_kinds["box"][0]
    assert g_lost[k] == -(MAX_TURNS - k) and all(g == 1.0 for g in g_lost[:k])  # the expert's path, then the fatal toggle
    assert expert_turn_gains(lost, env, MAX_TURNS, fatal_gain=7.0)[k] == -7.0


def won_kinds_wasted(kinds: dict[str, list[int]]) -> int:
    """Turns of the won episode that did not shorten the path, counted as the path they cost: two key toggles
    (0 each) and the detour (a turn away, -1, and back, +1: two turns for nothing)."""
    return len(kinds["key_toggle"]) + len(kinds["detour"])


def test_the_oracle_ranks_the_decisive_pickup_above_routine_turns_and_the_fatal_toggle_lowest() -> None:
    won, won_kinds = _episode(TASK, key_toggles=2)  # the expert's path but two wasted toggles at the key
    lost, lost_kinds = _episode(TASK, box="toggle")
    # the real evidence: 0 on routine turns, the teacher view's marks at the key and the box
    ev = [[-3.6 if k in won_kinds["key_toggle"] else 0.4 if k in won_kinds["key_pickup"] else 0.0 for k in range(len(won.turns))],
          [-3.7 if k in lost_kinds["box"] else 0.0 for k in range(len(lost.turns))]]
    batch = _batch([won, lost], ev)
    credit = OracleOPSD(max_turns=MAX_TURNS).assign(batch)
    w, adv = credit["multipliers"], batch["turn_advantages"]
    # won episode: the key pick-up after the wasted toggles above the routine turns (their mean, and every one after
    # it but a turn the label scores above a step) and above every wasted turn
    pick, toggles = won_kinds["key_pickup"][0], won_kinds["key_toggle"]
    gains = credit["expert_gain"][0]
    routine = [k for k in range(len(won.turns)) if k not in {*toggles, pick}]
    assert float(w[0, pick]) > sum(float(w[0, k]) for k in routine) / len(routine)
    assert all(float(w[0, pick]) > float(w[0, k]) for k in routine if k > pick and gains[k] <= 1)
    assert all(float(w[0, pick]) > float(w[0, k]) for k in toggles)
    # the recursion's own shape, whatever the evidence: the belief saturates along a won episode's progress, so the
    # first routine steps (belief near the prior, steepest sigmoid) get more than the pick-up, the winning pick-up of
    # the box less than the average
    assert float(w[0, 0]) > float(w[0, pick]) and float(w[0, won_kinds["box"][0]]) < 1.0
    # lost episode: the fatal toggle takes the most blame (the band's top, the lowest turn advantage)
    fatal = lost_kinds["box"][0]
    rows_lost = adv[batch["turn_traj"] == 1]
    assert float(w[1, fatal]) == pytest.approx(1.2) and all(float(w[1, k]) < 1.2 for k in range(fatal))
    assert float(rows_lost[fatal]) == float(rows_lost.min()) < 0
    # AgentOPSD on the real evidence puts the pick-up lower (the teacher view gives the right action little)
    real = AgentOPSD().assign(_batch([won, lost], ev))["multipliers"]
    assert float(real[0, pick]) < float(w[0, pick])


def test_the_oracle_evidence_has_the_evidence_spread_on_the_turns_credit_acts_on(group) -> None:
    trajs, (won_kinds, _) = group
    ev = [[(-3.6 if k in won_kinds["key_toggle"] else 0.1 * (k % 2)) for k in range(len(trajs[0].turns))], [0.0] * len(trajs[1].turns)]
    credit = OracleOPSD(max_turns=MAX_TURNS).assign(_batch(trajs, ev))
    mask = credit["turn_mask"]
    assert float(credit["evidence"][mask].std(unbiased=False)) == pytest.approx(float(credit["teacher_evidence"][mask].std(unbiased=False)), rel=1e-5)
    assert torch.equal(credit["evidence"], credit["expert_gain"] * credit["oracle_scale"])
    fixed = OracleOPSD(max_turns=MAX_TURNS, spread=2.0)
    assert not fixed.needs_teacher and OracleOPSD(max_turns=MAX_TURNS).needs_teacher
    credit = fixed.assign(_batch(trajs))
    assert float(credit["evidence"][mask].std(unbiased=False)) == pytest.approx(2.0, rel=1e-5)


def test_matched_scale_leaves_out_turns_credit_does_not_act_on_and_constant_gains() -> None:
    gains = torch.tensor([[1.0, -1.0, 0.0], [50.0, 0.0, 0.0]])
    evidence = torch.tensor([[0.0, 2.0, 0.0], [9.0, 9.0, 0.0]])
    mask = torch.tensor([[True, True, True], [False, False, False]])
    s = matched_scale(evidence, gains, mask)
    assert float((gains[0] * s).std(unbiased=False)) == pytest.approx(float(evidence[0].std(unbiased=False)), rel=1e-6)
    assert float(matched_scale(evidence, torch.ones(2, 3), mask)) == 0.0
    assert float(matched_scale(evidence, gains, torch.zeros(2, 3, dtype=torch.bool))) == 0.0


def test_groups_without_a_win_and_a_loss_are_not_replayed(group, monkeypatch) -> None:
    trajs, _ = group
    calls = []
    monkeypatch.setattr("agentopsd.study.oracle.expert_turn_gains", lambda *a, **k: calls.append(a) or [])
    batch = _batch([trajs[0], trajs[0]])  # both won: A_seq = 0
    OracleOPSD(max_turns=MAX_TURNS).assign(batch)
    assert not calls and bool((batch["advantages"] == 0).all())


def test_at_lambda_zero_the_oracle_is_grpo_exactly(group) -> None:
    trajs, (won_kinds, _) = group
    ev = [[-3.6 if k in won_kinds["key_toggle"] else 0.0 for k in range(len(trajs[0].turns))], [0.0] * len(trajs[1].turns)]
    oracle, grpo = _batch(trajs, ev, penalties=True), _batch(trajs, ev, penalties=True)
    OracleOPSD(max_turns=MAX_TURNS, mult_lambda=0.0, mult_band=0.5).assign(oracle)
    Algorithm().assign(grpo)
    assert torch.equal(oracle["advantages"], grpo["advantages"])
    assert torch.equal(oracle["turn_advantages"], grpo["turn_advantages"])
    # and with lambda > 0 the reshaping never flips a sign, even at the wide lever
    wide = _batch(trajs, ev)
    OracleOPSD(max_turns=MAX_TURNS, mult_lambda=1.0, mult_band=0.5).assign(wide)
    seq = wide["seq_advantages"][wide["turn_traj"]]
    assert bool((torch.sign(wide["turn_advantages"]) == torch.sign(seq)).all())


def test_a_replay_that_does_not_match_its_log_raises(group) -> None:
    trajs, _ = group
    with pytest.raises(ValueError, match="differs from the log"):  # another rung: another room
        expert_turn_gains(trajs[0], oracle_env("agentopsd/BabyAI-KeyDoorBoxS7-v0", 44, None), 44)
    with pytest.raises(ValueError, match="ended before"):  # a shorter turn limit than the run's
        expert_turn_gains(trajs[0], oracle_env(ENV_ID, 5, None), 5)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_turns"):
        OracleOPSD()
    with pytest.raises(ValueError, match="token_level"):
        OracleOPSD(max_turns=10, token_level=True)
    with pytest.raises(ValueError, match="mult_band"):
        OracleOPSD(max_turns=10, mult_band=1.0)


def test_hydra_selects_the_oracle_on_the_keydoor_experiment() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    overrides = ["experiment=keydoor", "env.id=agentopsd/BabyAI-KeyDoorBoxS9-v0", "env.max_turns=60", "algorithm=agentopsd",
                 "algorithm._target_=agentopsd.study.oracle.OracleOPSD", "algorithm.name=oracle",
                 "+algorithm.max_turns=${env.max_turns}", "+algorithm.env_kwargs=${oc.select:env.kwargs,null}",
                 "algorithm.mult_lambda=1.0", "algorithm.mult_band=0.5"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=overrides)
    algo = instantiate(cfg.algorithm)
    assert isinstance(algo, OracleOPSD) and algo.max_turns == 60 and algo.mult_band == 0.5 and algo.name == "oracle"


def test_the_trainers_batch_carries_what_the_oracle_reads(group) -> None:
    """A RolloutBatch as the module builds it (collate_trajectories), the teacher view's log-probs filled in."""
    from agentopsd.training.data import collate_trajectories

    trajs, _ = group
    rb = collate_trajectories(trajs, pad_id=0)
    rb.student_logprobs = torch.zeros_like(rb.old_logprobs)
    rb.teacher_logprobs = torch.where(rb.action_mask, -0.5 * (rb.turn_index % 4 == 0).float()[:, None], torch.zeros(()))
    credit = OracleOPSD(max_turns=MAX_TURNS).assign(rb)
    want = {"beliefs", "revisions", "multipliers", "evidence", "turn_mask", "teacher_evidence", "expert_gain", "oracle_scale"}
    assert want <= set(rb.credit) and credit["expert_gain"].shape == credit["turn_mask"].shape
    assert rb.advantages.shape == rb.action_mask.shape and rb.turn_advantages.shape == rb.turn_traj.shape
