"""BabyAI levels (minigrid) as text environments: ``agentopsd/BabyAI-<Level>-v0``.

minigrid ships no text view, so this module writes one: the mission, the objects and
doors in the agent's 7x7 egocentric view with their offsets, the nearest walls, what
the agent carries and what the last action did. minigrid is imported only when an env
is constructed.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from agentopsd.envs import base
from agentopsd.envs.babyai.expert import ExpertTracker, expert_steps
from agentopsd.envs.babyai.levels import LEVEL_SPECS, make_level, needs_unlock, snapshot
from agentopsd.envs.babyai.text import (
    ACTIONS,
    DONE,
    describe_cell,
    describe_effect,
    mission_kind,
    parse_action,
    render,
)

LEVELS: dict[str, int] = {name: spec.max_steps for name, spec in LEVEL_SPECS.items()}
"""Level name -> default max_episode_steps, in order of growing expert episode length."""

SPLITS = ("train", "eval")
TRAIN_TASKS = 1_000_000
"""Train task i is minigrid seed i."""
EVAL_SEED_BASE = 1_000_000_000
EVAL_TASKS = 100
"""Eval task i is minigrid seed EVAL_SEED_BASE + i: a fixed list, disjoint from train (this many by
default; a level may set a longer list, ``LevelSpec.eval_tasks``)."""
MAX_ECHO = 40


def env_id(level: str) -> str:
    return f"agentopsd/BabyAI-{level}-v0"


def task_seed(split: str, task_index: int) -> int:
    """The minigrid seed of task ``task_index`` of ``split``."""
    return task_index if split == "train" else EVAL_SEED_BASE + task_index


class BabyAIEnv(gym.Env[str, str]):
    """A BabyAI level played through text.

    ## Action Space
    Text. The seven actions are the words in ``ACTIONS``: "turn left", "turn right",
    "go forward", "pick up", "drop", "toggle" (open/close/unlock the door in front, open
    a box) and "done" (does nothing in BabyAI: missions succeed by acting). Matching is
    case- and whitespace-insensitive, forgives a trailing period and accepts a few short
    forms ("left", "forward", "pickup", "open"). Any other string is invalid: the state
    does not change, the observation says why and ``info["action_valid"]`` is False.

    ## Observation Space
    Text (printable ASCII) of five lines: the mission; the visible objects and doors,
    nearest first, each with its offset ("a red ball 2 steps ahead and 1 to your left");
    the nearest wall or door straight ahead, to the left and to the right; what the agent
    carries; the last action and its effect ("go forward: you could not move, a wall is in
    the way."). The view is the agent's own 7x7 partial view (walls and closed doors hide
    what is behind them).

    ## Rewards
    1.0 when the mission succeeds, else 0.0. minigrid itself pays ``1 - 0.9 * steps /
    max_steps`` on success; this env reports the success bit only (the trainer's group
    statistics must be computed from success bits), and keeps minigrid's value in
    ``info["minigrid_reward"]``.

    ## Episode End
    Terminated when the mission succeeds (``info["won"]``) or, in levels with strict
    instructions, fails. Truncated after ``max_steps`` calls to ``step`` (invalid actions
    count too). Stepping after the end changes nothing and says so.

    ## Info
    ``task`` (the mission), ``admissible_actions`` (``ACTIONS``), ``skill_key`` and
    ``task_type`` (goto, pickup, open, putnext, sequence, or unlock when the target can
    only be reached through a locked door), ``task_index``, ``seed``, ``won``,
    ``action_valid``, ``minigrid_reward``; at reset ``expert_steps``: the bot's episode
    length from this start (run on a spare env, cached per task), or -1 where the bot fails
    or where it is not computed: by default on the long levels, where a bot episode costs
    more than 50 ms (``compute_expert_steps`` overrides the level's default).

    ``expert_action()`` returns the bot's next action from the current state, however the
    episode got there (see ``agentopsd.envs.babyai.expert``); "done" when the mission has become
    impossible (a target box was opened and vanished).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    state_snapshot = True
    """``copy.deepcopy`` is an exact, cheap snapshot (grid, bot memory, counters): the report's ground truth replays it."""

    def __init__(self, level: str = "GoToLocal", split: str = "train", max_steps: int | None = None,
                 render_mode: str | None = None, compute_expert_steps: bool | None = None) -> None:
        if level not in LEVEL_SPECS:
            raise ValueError(f"unknown level {level!r}: choose one of {list(LEVEL_SPECS)}")
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: choose one of {list(SPLITS)}")
        if max_steps is None:
            max_steps = LEVELS[level]
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.level, self.split, self.max_steps, self.render_mode = level, split, max_steps, render_mode
        self.num_tasks = TRAIN_TASKS if split == "train" else LEVEL_SPECS[level].eval_tasks
        self.observation_space = base.observation_space()
        self.action_space = base.action_space()
        self._grid = make_level(level, max_steps)
        self._sim: Any = None  # a spare level for the bot run behind info["expert_steps"]
        if compute_expert_steps is None:
            compute_expert_steps = LEVEL_SPECS[level].expert_at_reset
        self.compute_expert_steps = compute_expert_steps
        self._expert = ExpertTracker(self._grid)
        self._obs = ""
        self._info: dict[str, Any] = {}
        self._steps = 0
        self._ended = True
        self._terminated = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        index = self._task_index(options)
        minigrid_seed = task_seed(self.split, index)
        self._grid.reset(seed=minigrid_seed)
        self._expert.reset()
        self._steps, self._ended, self._terminated = 0, False, False
        mission = self._grid.mission
        kind = mission_kind(mission)
        if kind != "sequence" and needs_unlock(self._grid):
            kind = "unlock"
        self._info = {
            "task": mission, "admissible_actions": list(ACTIONS), "skill_key": kind, "task_type": kind,
            "task_index": index, "seed": minigrid_seed, "won": False, "action_valid": True,
            "minigrid_reward": 0.0,
        }
        # The text is built from a fixed ASCII vocabulary and minigrid's ASCII mission; only
        # echoed user input needs base.clean_text (cleaning every observation halved steps/s).
        self._obs = render(mission, self._grid.view, describe_cell(self._grid.carrying),
                           "none yet, the episode just started.")
        info = dict(self._info, expert_steps=-1)
        if self.compute_expert_steps:
            if self._sim is None:
                self._sim = make_level(self.level, self.max_steps)
            key = (self.level, minigrid_seed, self.max_steps)
            info["expert_steps"] = expert_steps(self._sim, minigrid_seed, key, self.max_steps)
        return self._obs, info

    def _task_index(self, options: dict[str, Any] | None) -> int:
        if not options or "task_index" not in options:
            return int(self.np_random.integers(self.num_tasks))
        index = options["task_index"]
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_tasks:
            raise ValueError(f"task_index must be an int in [0, {self.num_tasks - 1}] for split "
                             f"{self.split!r}, got {index!r}")
        return index

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not self._info:
            raise RuntimeError("call reset() before step()")
        text = base.normalize_action(action)
        if self._ended:
            return self._unchanged("the episode is over; call reset() to start a new one.")
        self._steps += 1
        index = parse_action(text)
        if index is None:
            shown = base.clean_text(text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "...")
            return self._unchanged(f"{shown!r} is not an action; nothing happened. "
                                   f"Valid actions: {', '.join(ACTIONS)}.")
        before = snapshot(self._grid)
        _, reward, terminated, truncated, _ = self._grid.step(index)
        self._expert.record(index)
        self._expert.observe()
        won = bool(terminated and reward > 0)
        truncated = bool(truncated or self._steps >= self.max_steps) and not terminated
        self._terminated = bool(terminated)
        self._ended = bool(terminated or truncated)
        effect = "you completed the mission!" if won else describe_effect(index, before, snapshot(self._grid))
        self._obs = render(self._grid.mission, self._grid.view, describe_cell(self._grid.carrying), effect)
        self._info.update(won=won, action_valid=True, minigrid_reward=float(reward))
        return self._obs, 1.0 if won else 0.0, bool(terminated), truncated, dict(self._info)

    def _unchanged(self, why: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """An invalid action or a step after the end: same state, a note on the last line."""
        head = self._obs.rsplit("\n", 1)[0]
        obs = f"{head}\nLast action: {why}"
        truncated = not self._terminated and (self._ended or self._steps >= self.max_steps)
        self._ended = self._ended or truncated
        info = dict(self._info, action_valid=False)
        return obs, 0.0, self._terminated, truncated, info

    def expert_action(self) -> str:
        """The BabyAI bot's next action for the current state, as an action string."""
        if not self._info:
            raise RuntimeError("call reset() before expert_action()")
        if self._ended:
            return ACTIONS[DONE]
        return ACTIONS[self._expert.action()]

    def lift_step_limit(self, extra_steps: int) -> None:
        """Reopen an episode the step limit closed and allow ``extra_steps`` more steps (the expert label runs the
        bot on a copy past the episode's budget). An episode the mission itself ended stays ended."""
        if self._terminated:
            return
        self._ended = False
        self.max_steps = self._steps + extra_steps
        self._grid.max_steps = self._grid.step_count + extra_steps

    def render(self) -> str | None:
        return self._obs if self.render_mode == "ansi" else None


def register_envs() -> None:
    """Register ``agentopsd/BabyAI-<Level>-v0`` for every level of ``LEVELS`` (idempotent)."""
    for level, horizon in LEVELS.items():
        if env_id(level) not in gym.registry:
            gym.register(id=env_id(level), entry_point="agentopsd.envs.babyai.env:BabyAIEnv", max_episode_steps=horizon,
                         kwargs={"level": level, "split": "train", "max_steps": horizon})
