"""Ground truth for turn credit on BabyAI: exact restore, replay of logs, expert labels, Monte Carlo values."""

from __future__ import annotations

import numpy as np
import pytest

import agentopsd.envs  # noqa: F401  (registers the ids)
from agentopsd.envs.babyai.env import ACTIONS
from agentopsd.rollout.base import SamplingConfig
from agentopsd.rollout.prompts import PromptBuilder
from agentopsd.study.groundtruth import (
    FATAL_GAIN,
    LoggedTrajectory,
    State,
    advance,
    expert_gain,
    expert_label,
    expert_path,
    expert_remaining,
    format_note,
    generator_policy,
    make_env,
    mc_turn_advantages,
    mc_value,
    mc_values,
    replay,
    start,
)

PICKUP = "agentopsd/BabyAI-PickupObj-v0"
UNLOCK = "agentopsd/BabyAI-UnlockPickup-v0"


def _seeded_actions(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [ACTIONS[i] for i in rng.integers(0, len(ACTIONS) - 1, n)]  # all but "done"


def _play(state: State, actions: list[str]) -> list[str]:
    seen = []
    for a in actions:
        if state.done:
            break
        seen.append(advance(state, a).observation)
    return seen


@pytest.mark.parametrize("env_id", [PICKUP, UNLOCK])
@pytest.mark.parametrize("task_index", [0, 7])
def test_restored_state_continues_exactly(env_id: str, task_index: int) -> None:
    """A restored state continued with the same seeded actions gives the same observations."""
    state = start(make_env(env_id, 64), task_index)
    _play(state, _seeded_actions(task_index, 9))
    snap = state.copy()
    tail = _seeded_actions(100 + task_index, 30)
    original = _play(state, tail)
    first = snap.copy()
    restored = _play(first, tail)
    again = _play(snap.copy(), tail)
    assert len(original) > 5 and original == restored == again
    assert (state.done, state.won, state.turn) == (first.done, first.won, first.turn)
    # the bot's plan is part of the state too
    s, c = _fresh_pair(env_id, task_index)
    assert s.env.unwrapped.expert_action() == c.env.unwrapped.expert_action()


def _fresh_pair(env_id: str, task_index: int) -> tuple[State, State]:
    state = start(make_env(env_id, 64), task_index)
    _play(state, _seeded_actions(5, 4))
    return state, state.copy()


def test_a_copy_is_independent_of_its_source() -> None:
    state = start(make_env(PICKUP, 64), 3)
    copy = state.copy()
    before = state.observation
    _play(copy, ["go forward", "turn left", "go forward"])
    assert state.observation == before and state.turn == 0 and copy.turn == 3
    assert state.env.unwrapped._steps == 0


def _log(env_id: str, task_index: int, moves: list[str | None], max_turns: int) -> dict:
    """A rollout-shard record (the fields ``trajectory_records`` writes) of a scripted episode."""
    state = start(make_env(env_id, max_turns), task_index)
    turns = []
    for k, move in enumerate(moves):
        text = move if move is not None else "garbled output"
        advance(state, move, text, "Your output did not follow the format. Reply with <action>...</action>.")
        valid = move is not None and move in ACTIONS
        turns.append({"k": k, "action": text, "observation": state.observation, "reward": float(state.won),
                      "valid": valid, "advantage": 0.1 * k, "evidence": -0.2 * k})
        if state.done:
            break
    return {"iteration": 1, "env": env_id, "task_index": task_index, "group": 0, "success": state.won, "score": 0.0,
            "task_type": "pickup", "skill": "", "seq_advantage": 1.0, "turns": turns}


def test_replay_rebuilds_every_state_of_a_log() -> None:
    # a format error (no env step) and an invalid action (an env step) are replayed as the collector played them
    moves = ["turn left", None, "fly", "go forward", "pick up"]
    traj = LoggedTrajectory.from_record(_log(PICKUP, 11, moves, 12), run="r", algorithm="agentopsd")
    assert [t.stepped for t in traj.turns] == [True, False, True, True, True]
    assert traj.turns[2].signals == {"advantage": 0.2, "evidence": -0.4}
    states = replay(make_env(PICKUP, 12), traj, 12)
    assert len(states) == 6 and [s.turn for s in states] == list(range(6))
    assert [s.observation for s in states[1:]] == [t.observation for t in traj.turns]
    assert [s.env.unwrapped._steps for s in states] == [0, 1, 1, 2, 3, 4]


def test_replay_refuses_a_log_it_cannot_reproduce() -> None:
    rec = _log(PICKUP, 11, ["turn left", "go forward", "turn right"], 12)
    rec["turns"][1]["observation"] = rec["turns"][1]["observation"].replace("Mission", "Mystery")
    with pytest.raises(ValueError, match="turn 1: replayed observation differs"):
        replay(make_env(PICKUP, 12), LoggedTrajectory.from_record(rec, run="r", algorithm="a"), 12)
    short = LoggedTrajectory.from_record(_log(PICKUP, 11, ["turn left"] * 5, 12), run="r", algorithm="a")
    with pytest.raises(ValueError, match="max_turns=3"):
        replay(make_env(PICKUP, 3), short, 3)


def test_expert_path_shrinks_by_one_along_the_bots_own_moves() -> None:
    state = start(make_env(UNLOCK, 128), 0)
    states = [state.copy()]
    while not state.done:
        advance(state, state.env.unwrapped.expert_action())
        states.append(state.copy())
    path = expert_path(states)
    assert state.won and path[-1] == 0 and path == list(range(path[0], -1, -1)) and path[0] > 10
    assert all(expert_label(b, a) == "progress" for b, a in zip(path[:-1], path[1:]))


def test_a_wasted_turn_and_the_turn_limit() -> None:
    state = start(make_env(PICKUP, 2), 1)
    d0 = expert_remaining(state)
    advance(state, "drop")  # nothing to drop: the state does not change
    assert expert_remaining(state) == d0 and expert_label(d0, d0) == "wasted" and expert_gain(d0, d0) == 0.0
    advance(state, "turn left")
    # the turn limit closed the episode, yet the task is still winnable: the last turn is not fatal
    assert state.done and not state.won and expert_remaining(state) > 0


def test_expert_gain_and_label_by_hand() -> None:
    assert (expert_gain(5, 4), expert_label(5, 4)) == (1.0, "progress")
    assert (expert_gain(5, 7), expert_label(5, 7)) == (-2.0, "wasted")
    assert (expert_gain(5, -1), expert_label(5, -1)) == (-FATAL_GAIN, "fatal")
    assert (expert_gain(-1, -1), expert_label(-1, -1)) == (0.0, "lost")
    assert (expert_gain(1, 0), expert_label(1, 0)) == (1.0, "progress")


def _expert_policy(states):
    return [(s.env.unwrapped.expert_action(), "") for s in states]


def test_monte_carlo_advantage_of_a_turn_that_spends_the_last_spare_turn() -> None:
    """Budget = the expert's path: the expert wins from s_0, a detour at turn 0 leaves too few turns."""
    probe = start(make_env(PICKUP, 64), 1)
    d0 = expert_remaining(probe)
    state = start(make_env(PICKUP, d0), 1)
    s0 = state.copy()
    s1 = advance(state.copy(), "drop")  # carrying nothing: a step that changes nothing
    assert mc_value(s0, _expert_policy, samples=2, max_turns=d0) == 1.0
    assert mc_value(s1, _expert_policy, samples=2, max_turns=d0) == 0.0
    assert mc_turn_advantages([s0, s1], _expert_policy, samples=2, max_turns=d0) == [-1.0]
    # with two spare turns the detour costs nothing
    roomy = start(make_env(PICKUP, d0 + 2), 1)
    after = advance(roomy.copy(), "drop")
    assert mc_turn_advantages([roomy, after], _expert_policy, samples=1, max_turns=d0 + 2) == [0.0]


def test_monte_carlo_samples_are_independent_copies() -> None:
    state = start(make_env(PICKUP, 6), 2)
    calls = []

    def random_policy(states):
        calls.append(len(states))
        rng = np.random.default_rng(len(calls))
        return [(ACTIONS[int(rng.integers(0, 3))], "") for _ in states]

    value = mc_value(state, random_policy, samples=4, max_turns=6)
    assert 0.0 <= value <= 1.0 and calls[0] == 4 and len(calls) <= 6
    assert state.turn == 0 and state.env.unwrapped._steps == 0  # the source state was not touched


def test_generator_policy_acts_through_the_trainers_prompts(tiny_walk_policy) -> None:
    from agentopsd.rollout.hf import HFGenerator

    model, tok = tiny_walk_policy
    prompts = PromptBuilder(tok, history_window=2)
    seen = []

    class Recording(HFGenerator):
        def generate(self, ids, sampling):
            seen.extend(ids)
            return super().generate(ids, sampling)

    policy = generator_policy(Recording(model, tok), prompts, SamplingConfig(max_new_tokens=6, seed=0))
    state = start(make_env(PICKUP, 3), 4)
    value = mc_value(state, policy, samples=2, max_turns=3, note=format_note(prompts))
    assert 0.0 <= value <= 1.0
    assert seen[0] == prompts.build_views(state.task, [], state.observation, list(ACTIONS)).student
    assert len(seen) >= 2


def test_monte_carlo_values_of_many_states_share_one_policy_call_per_turn() -> None:
    states = [start(make_env(PICKUP, 5), i) for i in (1, 2, 3)]
    states.append(advance(states[0].copy(), "drop"))
    calls = []

    def counting_expert(batch):
        calls.append(len(batch))
        return _expert_policy(batch)

    together = mc_values(states, counting_expert, samples=2, max_turns=5)
    assert together == [mc_value(s, _expert_policy, samples=2, max_turns=5) for s in states]
    assert calls[0] == 8 and len(calls) <= 5


def test_credit_quality_command_on_a_logged_run(tmp_path) -> None:
    """studies/credit_quality.py end to end: a run folder with one shard in, a table out."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from agentopsd.callbacks.rollout_logging import write_shard

    run = tmp_path / "agentopsd-s0"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(
        {"algorithm": {"name": "agentopsd"}, "env": {"id": PICKUP, "max_turns": 6}}))
    records = [_log(PICKUP, i, ["turn left", "go forward", "drop", "turn right", "go forward", "pick up"], 6)
               for i in range(4)]
    for record in records[:2]:  # a group all won or all lost: no credit on its turns
        record["seq_advantage"] = 0.0
    write_shard(run / "rollouts" / "rollouts-000001.tar", records)
    out = tmp_path / "table"
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "studies/credit_quality.py", str(run), "--resamples", "50", "--out", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    table = (out / "table.md").read_text()
    assert "| expert | agentopsd | BabyAI-PickupObj-v0 | early | uniform | 4 | 0.000 [0.000, 0.000]" in table
    assert "| 0.500 [0.500, 0.500] |" in table and "| evidence |" in table
    # the same truth over the trajectories with A_seq != 0 alone, where the credit acts
    assert "| expert | agentopsd | BabyAI-PickupObj-v0 | early | evidence | 4 |" in table
    assert "| expert_nonzero | agentopsd | BabyAI-PickupObj-v0 | early | evidence | 2 |" in table
    assert (out / "table.csv").read_text().startswith("truth,algorithm,env,stage,signal")
    # the expert's paths are kept beside the run (one per trajectory: before each turn, and after the last)
    import json

    saved = json.loads((run / "groundtruth" / "expert-v2.json").read_text())
    assert len(saved) == 4 and all(len(path) == int(key.split(":")[-1]) + 1 for key, path in saved.items())
