"""KeyDoorBox, the credit ladder's level, and the turn-scoped skills its teacher view uses."""

from __future__ import annotations

import re

import numpy as np
import pytest

import agentopsd.envs  # noqa: F401  (registers the ids)
from agentopsd.envs.babyai.env import BabyAIEnv
from agentopsd.rollout.base import Generation, SamplingConfig
from agentopsd.rollout.collector import Collector
from agentopsd.rollout.prompts import PromptBuilder
from agentopsd.rollout.skills import SkillBank
from agentopsd.study.groundtruth import advance, expert_remaining, make_env, start
from agentopsd.types import TaskSpec

LEVEL = "KeyDoorBoxS5"
ENV_ID = f"agentopsd/BabyAI-{LEVEL}-v0"


def _expert_episode(env: BabyAIEnv, k: int) -> tuple[list[str], list[str], bool]:
    obs, _ = env.reset(options={"task_index": k})
    observations, actions, won = [obs], [], False
    for _ in range(env.max_steps):
        a = env.unwrapped.expert_action()
        obs, _, term, trunc, info = env.step(a)
        actions.append(a)
        observations.append(obs)
        if term or trunc:
            won = info["won"]
            break
    return observations, actions, won


def test_the_doors_key_and_the_expert_wins_through_the_locked_door() -> None:
    env = BabyAIEnv(LEVEL, split="eval")
    assert env.num_tasks == 256  # the ladder's longer fixed evaluation list
    for k in range(12):
        grid = env._grid
        env.reset(options={"task_index": k})
        keys = [o for o in grid.grid.grid if o is not None and o.type == "key"]
        doors = [o for o in grid.grid.grid if o is not None and o.type == "door" and o.is_locked]
        assert len(keys) == 1 and len(doors) == 1 and keys[0].color == doors[0].color
        observations, actions, won = _expert_episode(env, k)
        assert won and actions.count("toggle") >= 1 and actions.count("pick up") >= 2  # the key and the box


def test_a_wrong_key_variant_adds_a_key_of_another_colour() -> None:
    from agentopsd.envs.babyai.levels import level_class

    cls, kwargs = level_class(LEVEL)
    grid = cls(max_steps=40, **{**kwargs, "wrong_key": True})
    grid.reset(seed=4)
    keys = [o for o in grid.grid.grid if o is not None and o.type == "key"]
    assert len(keys) == 2 and len({key.color for key in keys}) == 2


def test_room_size_sets_the_horizon_past_30_turns() -> None:
    means = [np.mean([BabyAIEnv(lv, split="eval").reset(options={"task_index": k})[1]["expert_steps"] for k in range(40)])
             for lv in ("KeyDoorBoxS5", "KeyDoorBoxS7", "KeyDoorBoxS9")]
    assert means[0] < means[1] < means[2] and means[0] > 15 and means[2] > 30, means


def test_toggling_the_box_ends_the_episode_as_lost() -> None:
    env = BabyAIEnv(LEVEL, split="train")
    env.reset(options={"task_index": 3})
    for _ in range(60):
        a = env.expert_action()
        if a == "pick up" and "box right in front of you" in env._obs:
            _, reward, term, trunc, info = env.step("toggle")
            assert term and not trunc and reward == 0.0 and not info["won"]
            assert env.expert_action() == "done"
            return
        env.step(a)
    pytest.fail("the expert never faced the box")


def test_a_restored_keydoor_state_continues_exactly() -> None:
    state = start(make_env(ENV_ID, 40), 5)
    rng = np.random.default_rng(0)
    moves = ["turn left", "turn right", "go forward", "pick up", "toggle", "drop"]
    for a in rng.choice(moves, 8):
        advance(state, str(a))
    snap = state.copy()
    tail = [str(a) for a in rng.choice(moves, 25)]
    seen = [advance(state, a).observation for a in tail if not state.done]
    again = snap.copy()
    assert seen == [advance(again, a).observation for a in tail[: len(seen)]]


@pytest.mark.parametrize("level, tasks", [("KeyDoorBoxS5", [0, 1, 6]), ("KeyDoorBoxS9", [0, 3, 7])])
def test_the_expert_label_counts_each_turn_of_the_experts_own_path_as_one_step_of_progress(level, tasks) -> None:
    """Replayed without asking the env's expert (as the credit table replays logs), every state's remaining
    path is planned by a bot built anew there. Along the expert's own path it must shrink by exactly one a
    turn: carrying the door's key is progress (a bot that dropped it first measured the pick-up as -1 or -3
    and the unlock as +5), and so is each step towards where the key is put down (S5 task 1 and 6, S9 task
    0: a bot choosing a new drop cell at every step measured -1 then +3). One known miss stays: on S5 task
    2 the bot that fetched the key drops it right after unlocking, a bot built after the pick-up walks
    farther to drop it (the bot's own choice of drop cell)."""
    env_id = f"agentopsd/BabyAI-{level}-v0"
    for k in tasks:
        guide, actions = start(make_env(env_id, 200), k), []
        while not guide.done:
            actions.append(guide.env.unwrapped.expert_action())
            advance(guide, actions[-1])
        assert guide.won
        state = start(make_env(env_id, 200), k)
        path = [expert_remaining(state)]
        for a in actions:
            path.append(expert_remaining(advance(state, a)))
        assert path == list(range(len(actions), -1, -1)), (k, list(zip(actions, path[1:])))
        assert "pick up" in actions and "toggle" in actions and "drop" in actions  # the decisive turns were on it


def test_a_replanned_drop_is_near_but_never_in_or_beside_a_doorway() -> None:
    from agentopsd.envs.babyai.expert import near_drop_pos

    state = start(make_env(ENV_ID, 60), 0)
    grid = state.env.unwrapped._grid
    while not (grid.carrying is not None and grid.carrying.type == "key"):  # the expert fetches the key
        advance(state, state.env.unwrapped.expert_action())
    while state.env.unwrapped.expert_action() != "toggle":  # and walks to the door
        advance(state, state.env.unwrapped.expert_action())
    advance(state, "toggle")
    door = tuple(int(v) for v in grid.front_pos)
    assert grid.grid.get(*door).type == "door" and grid.grid.get(*door).is_open
    x, y = near_drop_pos(grid)  # facing the open door: one turn aside, not next to the door
    assert grid.grid.get(x, y) is None and abs(x - door[0]) + abs(y - door[1]) == 2
    advance(state, "go forward")  # standing in the doorway: nowhere near is safe
    assert tuple(int(v) for v in grid.agent_pos) == door and near_drop_pos(grid) is None


# ---------------------------------------------------------------- turn-scoped skills

def test_turn_scope_retrieves_only_what_the_observation_shows() -> None:
    bank = SkillBank.for_env("babyai_keydoor")
    assert bank.scope == "turn"
    routine = "Mission: pick up the red box\nYou see: a red key 2 steps ahead.\nWalls: a wall 3 steps ahead.\nYou are carrying nothing."
    assert bank.block("unlock", "pick up the red box", routine) == ""
    at_key = routine.replace("2 steps ahead", "right in front of you")
    assert bank.situational(at_key).categories == ("key",)
    assert "pick up" in bank.block("unlock", "", at_key)
    # carrying something: no key advice (one object at a time)
    assert bank.block("", "", at_key.replace("carrying nothing", "carrying a blue key")) == ""
    assert bank.situational("You see: a locked red door right in front of you.").categories == ("door",)
    assert "Never toggle a box" in bank.block("", "", "You see: a red box right in front of you.")
    every = bank.all_lines()
    assert any("toggle a box" in line for line in every) and len(every) == 7


def test_episode_scope_is_the_default_and_unchanged() -> None:
    bank = SkillBank.for_env("babyai")
    assert bank.scope == "episode" and not bank.situations
    assert bank.block("pickup", "pick up the ball", "anything") == bank.retrieve("pickup", "pick up the ball").render()


def test_bad_skill_files_fail_with_the_fix(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"scope": "turn", "general": ["x"]}')
    with pytest.raises(ValueError, match="needs a 'situations' section"):
        SkillBank.for_env(str(bad))
    bad.write_text('{"scope": "turn", "situations": {"a": {"when": "(unclosed"}}}')
    with pytest.raises(ValueError, match="valid regular expression"):
        SkillBank.for_env(str(bad))
    bad.write_text('{"scope": "always"}')
    with pytest.raises(ValueError, match="scope must be one of"):
        SkillBank.for_env(str(bad))


class _Replay:
    """A generator that writes a fixed action list, the same for every copy."""

    def __init__(self, actions: list[str]) -> None:
        self.actions, self.turn = actions, 0

    def generate(self, prompts, sampling):
        text = f"<action>{self.actions[min(self.turn, len(self.actions) - 1)]}</action>"
        self.turn += 1
        return [Generation((7,), (-0.5,), text, "stop") for _ in prompts]

    def sync_weights(self, model) -> None:
        pass


def test_the_teacher_view_differs_from_the_student_view_exactly_on_skill_turns(tiny_walk_policy) -> None:
    """Routine turns: the two views are the same tokens (the log-prob gap is exactly 0 there)."""
    _, tok = tiny_walk_policy
    env = BabyAIEnv(LEVEL, split="train")
    observations, actions, won = _expert_episode(env, 2)
    assert won
    bank = SkillBank.for_env("babyai_keydoor")
    prompts = PromptBuilder(tok, history_window=0, max_prompt_tokens=4096)
    collector = Collector(ENV_ID, _Replay(actions), prompts, SamplingConfig(max_new_tokens=8), max_turns=40, skill_bank=bank)
    try:
        (traj,) = collector.collect([TaskSpec(ENV_ID, "train", 2, 2, group_id=0)], with_teacher=True)
    finally:
        collector.close()
    assert traj.success and len(traj.turns) == len(actions)
    informed = [t.teacher_prompt_ids != t.prompt_ids for t in traj.turns]
    expected = [bool(bank.situational(obs).categories) for obs in observations[: len(actions)]]
    assert informed == expected and 3 <= sum(informed) < len(informed) / 2
    # the decisive actions all happen on informed turns
    for a, inf in zip(actions, informed):
        if a in ("pick up", "toggle"):
            assert inf, a
    assert traj.skill_text == ""  # no single block describes a turn-scoped episode
    assert all(re.search("You are carrying", t.state) for t in traj.turns)
