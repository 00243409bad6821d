"""Contract tests for the BabyAI text environments (envs/babyai/env.py and its helpers).

Measured on the 2-core dev machine (shared with other jobs, so +-30%); expert = the
BabyAIBot on the 100 eval tasks; env steps/s = text env with random actions, no expert;
reset includes the bot run behind info["expert_steps"] on the four short levels:

    level            horizon  expert wins  expert steps    env steps/s  expert+env  reset
                                           mean / max                   steps/s     ms
    GoToLocal             64     100/100    4.8 / 12          ~5,900      ~1,750     ~6
    PickupLoc             64     100/100    5.8 / 16          ~7,500      ~1,050    ~14
    PutNextLocal         128     100/100   11.3 / 22          ~6,700      ~1,400     ~9
    UnlockPickup         128     100/100   19.4 / 28         ~12,800      ~1,300    ~13
    Open                 256     100/100   27.4 / 139         ~5,700        ~860    ~15
    GoToObjMaze          384     100/100   64.2 / 181         ~5,900        ~680     ~5
    KeyCorridorS3R3      270     100/100   61.9 / 112        ~11,400      ~1,440     ~2
    BossLevel            512     100/100   83.2 / 287         ~3,100        ~540     ~6

minigrid's own BabyAI-GoToLocal steps at ~2,100/s here: the fast view (envs/babyai/view.py)
makes the text env faster than the image env it wraps. With the expert, the bot's planning
dominates. The tests run all 100 eval tasks for GoToLocal and a fixed sample of 5 per other
level (tasks 0, 20, 40, 60, 80).
"""

from __future__ import annotations

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agentopsd.envs  # noqa: F401  (registers the ids)
from agentopsd.envs.babyai.env import ACTIONS, EVAL_TASKS, LEVELS, BabyAIEnv, env_id
from agentopsd.envs.babyai.text import (
    describe_offset,
    mission_kind,
    parse_action,
    visible_objects,
    wall_distances,
)
from agentopsd.envs.babyai.view import EMPTY_CELL, UNSEEN_CELL, WALL_CELL
from agentopsd.rollout.skills import SkillBank

SAMPLE = [0, 20, 40, 60, 80]


def _run_expert(env: BabyAIEnv, task_index: int) -> tuple[bool, int, dict]:
    _, info0 = env.reset(options={"task_index": task_index})
    steps, done, info = 0, False, info0
    while not done:
        _, reward, terminated, truncated, info = env.step(env.expert_action())
        steps, done = steps + 1, terminated or truncated
    assert reward == (1.0 if info["won"] else 0.0)
    return info["won"], steps, info0


@pytest.mark.parametrize("level", list(LEVELS))
def test_check_env(level: str) -> None:
    check_env(gym.make(env_id(level)).unwrapped)


def test_registry_horizons() -> None:
    for level, horizon in LEVELS.items():
        spec = gym.spec(env_id(level))
        assert spec.max_episode_steps == horizon
        assert spec.kwargs["max_steps"] == horizon and spec.kwargs["level"] == level
    assert LEVELS["GoToLocal"] == 64
    assert list(LEVELS.values())[0] <= list(LEVELS.values())[-1]


def test_import_does_not_load_minigrid() -> None:
    code = "import sys, agentopsd.envs.babyai.env; assert 'minigrid' not in sys.modules, 'minigrid imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_expert_wins_all_goto_local_eval_tasks() -> None:
    env = BabyAIEnv("GoToLocal", split="eval")
    for k in range(EVAL_TASKS):
        won, steps, info0 = _run_expert(env, k)
        assert won, f"expert lost eval task {k}: {info0['task']}"
        assert info0["expert_steps"] == steps  # the reset-time bot run predicts the episode


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "GoToLocal"])
def test_expert_wins_eval_sample(level: str) -> None:
    env = BabyAIEnv(level, split="eval")
    for k in SAMPLE:
        won, steps, info0 = _run_expert(env, k)
        assert won, f"expert lost {level} eval task {k}: {info0['task']}"
        assert info0["expert_steps"] in (steps, -1)


@pytest.mark.parametrize("level", ["GoToLocal", "PutNextLocal", "UnlockPickup", "KeyCorridorS3R3"])
def test_expert_recovers_from_other_actions(level: str) -> None:
    """The agent ignores the expert 20% of the time and does not ask it 20% of the time.

    Toggle is left out of the detours: it can open (destroy) the box a mission needs.
    """
    env = BabyAIEnv(level, split="eval", max_steps=3 * LEVELS[level])
    rng = np.random.default_rng(0)
    detours = ["turn left", "turn right", "go forward", "pick up", "drop"]
    for k in SAMPLE[:3]:
        env.reset(options={"task_index": k})
        done, info = False, {}
        while not done:
            if rng.random() < 0.2:
                action = detours[rng.integers(len(detours))]
            else:
                action = env.expert_action()
                assert action in ACTIONS
                if rng.random() < 0.2:
                    action = detours[rng.integers(len(detours))]
            _, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
        assert info["won"], f"expert did not recover on {level} task {k}: {info['task']}"


def test_determinism() -> None:
    a, b = BabyAIEnv("PutNextLocal"), BabyAIEnv("PutNextLocal")
    obs_a, info_a = a.reset(seed=123)
    obs_b, info_b = b.reset(seed=123)
    assert obs_a == obs_b and info_a == info_b
    for action in ["go forward", "turn left", "pick up", "go forward", "drop", "toggle"]:
        assert a.step(action) == b.step(action)
    assert a.reset(seed=124)[1]["task_index"] != info_a["task_index"]
    # a task index names one fixed layout, whatever the reset seed
    assert a.reset(seed=1, options={"task_index": 7})[0] == b.reset(seed=2, options={"task_index": 7})[0]


def test_splits_are_disjoint_and_fixed() -> None:
    train, evaluation = BabyAIEnv("GoToLocal"), BabyAIEnv("GoToLocal", split="eval")
    assert evaluation.num_tasks == EVAL_TASKS and train.num_tasks > EVAL_TASKS
    eval_seeds = {evaluation.reset(options={"task_index": k})[1]["seed"] for k in range(EVAL_TASKS)}
    assert len(eval_seeds) == EVAL_TASKS
    assert max(eval_seeds) - min(eval_seeds) == EVAL_TASKS - 1
    assert min(eval_seeds) >= train.num_tasks  # train task i is seed i < num_tasks


def test_fast_view_matches_minigrid() -> None:
    """The fast observation equals minigrid's own gen_obs through moves, pickups, drops, toggles."""
    from minigrid.minigrid_env import MiniGridEnv

    rng = np.random.default_rng(0)
    for level in ["GoToLocal", "PutNextLocal", "UnlockPickup", "KeyCorridorS3R3", "BossLevel"]:
        env = BabyAIEnv(level, compute_expert_steps=False)
        env.reset(seed=1)
        grid = env._grid
        for _ in range(150):
            action = int(rng.choice([0, 1, 2, 2, 2, 3, 4, 5]))
            _, _, terminated, truncated, _ = env.step(ACTIONS[action])
            expected = MiniGridEnv.gen_obs(grid)["image"]
            np.testing.assert_array_equal(grid.image(), expected)
            if terminated or truncated:
                env.reset()


def test_fast_bot_plans_like_the_original() -> None:
    from minigrid.utils.baby_ai_bot import BabyAIBot

    from agentopsd.envs.babyai.expert import bot_class
    from agentopsd.envs.babyai.levels import make_level

    for level in ["GoToLocal", "Open"]:
        for seed in range(3):
            actions = []
            for cls in (BabyAIBot, bot_class()):
                sim = make_level(level, 256)
                sim.reset(seed=seed)
                bot, taken, done = cls(sim), [], False
                while not done:
                    taken.append(int(bot.replan()))
                    _, _, terminated, truncated, _ = sim.step(taken[-1])
                    done = terminated or truncated
                actions.append(taken)
            assert actions[0] == actions[1]


def test_level_generation_is_quiet_and_unchanged(capfd: pytest.CaptureFixture[str]) -> None:
    import minigrid  # noqa: F401

    original = gym.make("BabyAI-BossLevel-v0").unwrapped
    expected = []
    for seed in range(5):
        original.reset(seed=seed)
        expected.append((original.mission, tuple(original.agent_pos)))
    assert "Sampling rejected" in capfd.readouterr().out  # minigrid's own class prints
    env = BabyAIEnv("BossLevel", compute_expert_steps=False)
    for seed in range(5):
        env._grid.reset(seed=seed)
        assert (env._grid.mission, tuple(env._grid.agent_pos)) == expected[seed]
    assert capfd.readouterr().out == ""


def test_observation_text() -> None:
    env = BabyAIEnv("GoToLocal", split="eval")
    obs, info = env.reset(options={"task_index": 0})
    lines = obs.split("\n")
    assert lines[0] == f"Mission: {info['task']}"
    assert lines[1].startswith("You see: ") and lines[2].startswith("Walls: ")
    assert lines[3] == "You are carrying nothing." and lines[4].startswith("Last action: none")
    assert info["admissible_actions"] == list(ACTIONS)
    assert info["action_valid"] and not info["won"] and info["task_index"] == 0


def test_action_effects_are_narrated() -> None:
    env = BabyAIEnv("UnlockPickup", split="eval")
    env.reset(options={"task_index": 0})
    seen = set()
    while True:
        action = env.expert_action()
        obs, _, terminated, _, info = env.step(action)
        seen.add(obs.split("\n")[-1])
        if terminated:
            break
    text = " ".join(seen)
    assert "you picked up a" in text and "key" in text
    assert "you unlocked and opened the" in text
    assert "you moved one step forward" in text and "you turned" in text
    assert info["won"] and obs.endswith("you completed the mission!")


def test_blocked_move_and_bad_pickup_are_explained() -> None:
    env = BabyAIEnv("GoToLocal", max_steps=200, compute_expert_steps=False)
    env.reset(seed=0)
    for _ in range(10):  # walk into whatever is ahead
        obs, *_ = env.step("go forward")
    assert "you could not move" in obs
    obs, *_ = env.step("drop")
    assert "you are not carrying anything" in obs


def test_text_helpers() -> None:
    assert describe_offset(1, 0) == "right in front of you"
    assert describe_offset(2, -1) == "2 steps ahead and 1 to your left"
    assert describe_offset(0, 3) == "3 steps to your right"
    view = [EMPTY_CELL] * 49
    view[2 * 7 + 4] = (6, 0, 0)  # a red ball: column 2 (1 left), row 4 (2 ahead)
    view[3 * 7 + 2] = (4, 2, 2)  # a locked blue door 4 steps ahead
    view[3 * 7 + 1] = UNSEEN_CELL
    view[1 * 7 + 6] = WALL_CELL  # a wall 2 to the left
    assert visible_objects(view) == ["a red ball 2 steps ahead and 1 to your left", "a locked blue door 4 steps ahead"]
    assert wall_distances(view) == "a door 4 steps ahead; a wall 2 steps to your left; no wall within 3 steps to your right"
    assert mission_kind("go to the red ball") == "goto"
    assert mission_kind("put the red ball next to a key") == "putnext"
    assert mission_kind("open the door, then pick up the box") == "sequence"
    assert mission_kind("pick up a ball after you go to the door") == "sequence"
    assert parse_action(" Go Forward. ".strip().lower()) == 2 and parse_action("go forwards") is None


def test_task_types() -> None:
    assert BabyAIEnv("UnlockPickup").reset(seed=0)[1]["skill_key"] == "unlock"
    assert BabyAIEnv("KeyCorridorS3R3").reset(seed=0)[1]["skill_key"] == "unlock"
    assert BabyAIEnv("Open").reset(seed=0)[1]["skill_key"] == "open"
    assert BabyAIEnv("PickupLoc").reset(seed=0)[1]["skill_key"] == "pickup"
    boss = BabyAIEnv("BossLevel", split="eval", compute_expert_steps=False)
    kinds = {boss.reset(options={"task_index": k})[1]["task_type"] for k in range(20)}
    assert "sequence" in kinds and len(kinds) >= 3


def test_skills_retrieval() -> None:
    bank = SkillBank.for_env("babyai")
    cases = {}
    for level in ["GoToLocal", "PickupLoc", "PutNextLocal", "UnlockPickup", "Open"]:
        info = BabyAIEnv(level, compute_expert_steps=False).reset(seed=0)[1]
        cases[info["skill_key"]] = info["task"]
    cases["sequence"] = "open the red door, then go to the blue ball"
    assert set(cases) == {"goto", "pickup", "putnext", "unlock", "open", "sequence"}
    assert {c.name for c in bank.categories} == set(cases)
    for key, task in cases.items():
        got = bank.retrieve(key, task)
        assert got.categories == (key,) and got.skills and got.mistakes
    unrelated = bank.retrieve("cooking", "bake a chocolate cake")
    assert unrelated.categories == () and unrelated.general


def test_errors() -> None:
    with pytest.raises(ValueError, match="train"):
        BabyAIEnv("GoToLocal", split="test")
    with pytest.raises(ValueError, match="GoToLocal"):
        BabyAIEnv("NoSuchLevel")
    with pytest.raises(ValueError, match="max_steps"):
        BabyAIEnv("GoToLocal", max_steps=0)
    env = BabyAIEnv("GoToLocal", split="eval")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("go forward")
    for bad in (-1, EVAL_TASKS, 2.5, True, "3"):
        with pytest.raises(ValueError, match=r"\[0, 99\]"):
            env.reset(options={"task_index": bad})


def test_truncation_and_steps_after_the_end() -> None:
    env = BabyAIEnv("GoToLocal", max_steps=3, compute_expert_steps=False)
    env.reset(seed=0)
    results = [env.step(a) for a in ["turn left", "nonsense", "turn left"]]
    assert [r[3] for r in results] == [False, False, True]
    obs, reward, terminated, truncated, info = env.step("go forward")
    assert "episode is over" in obs and truncated and not terminated and reward == 0.0
    assert not info["action_valid"]


JUNK = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=31), max_size=50),
    st.builds(lambda a, j: f"{j}{a}{j}", st.sampled_from(ACTIONS), st.text(min_size=1, max_size=20)),
    st.just("x" * 10_000),
    st.just("go forward\x00"),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(action=JUNK)
def test_step_never_raises(action: str) -> None:
    env = _FUZZ_ENV
    obs0, _ = env.reset(options={"task_index": 3})
    obs, reward, terminated, truncated, info = env.step(action)
    assert env.observation_space.contains(obs)
    assert isinstance(reward, float) and isinstance(info["action_valid"], bool)
    if not info["action_valid"]:
        assert obs.split("\n")[:4] == obs0.split("\n")[:4]  # no state change
        assert "not an action" in obs


_FUZZ_ENV = BabyAIEnv("PutNextLocal", split="eval", compute_expert_steps=False)


def test_pickup_obj_is_one_object_to_pick_up() -> None:
    """The quickstart's level: one object in the room, and the mission names it."""
    env = BabyAIEnv("PickupObj", split="eval")
    for k in range(EVAL_TASKS):
        obs, info = env.reset(options={"task_index": k})
        assert info["task"].startswith("pick up the "), info["task"]
        seen = obs.split("You see: ")[1].split(".\n")[0]
        assert seen == "no objects" or seen.count(";") == 0, seen  # never two objects in view
        won, steps, info0 = _run_expert(env, k)
        assert won and info0["expert_steps"] == steps


def test_pickup_obj_room_size_sets_the_horizon() -> None:
    means = []
    for level in ("PickupObjS5", "PickupObj", "PickupObjS12"):
        env = BabyAIEnv(level, split="eval")
        means.append(np.mean([env.reset(options={"task_index": k})[1]["expert_steps"] for k in range(30)]))
    assert means[0] < means[1] < means[2], means
