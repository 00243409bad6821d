"""ALFWorld: household tasks in text, played by the real ``alfworld`` engine (TextWorld PDDL).

The engine (``alfworld`` and ``textworld``) is imported only when an environment is built,
so ``import agentopsd.envs`` works without the ``[alfworld]`` extra.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium.error import ResetNeeded

from agentopsd.envs.alfworld.data import EVAL_SPLITS, official_games, resolve_data_dir
from agentopsd.envs.alfworld.engine import (
    FALLBACK_ACTION,
    INSTALL_HINT,
    expert_rng,
    load_engine,
    play_expert,
    private_random,
    strip_welcome,
    task_of,
)
from agentopsd.envs.alfworld.scenes import (
    EXPERT_STEP_LIMIT,
    GAME_FILE,
    SIZES,
    TRAJ_FILE,
    cache_root,
    ensure_task,
)
from agentopsd.envs.base import action_space, clean_text, normalize_action, observation_space

ENV_ID = "agentopsd/ALFWorld-v0"
DEFAULT_TURNS = 50
SPLITS = ("train", "eval")
INVALID = "Nothing happens."
"""What ALFWorld itself answers to a command it cannot carry out."""
DONE = "The task is already done. Call reset() for a new one."


def _verify(game_file: Path) -> list[str] | None:
    return play_expert(game_file, EXPERT_STEP_LIMIT)


class ALFWorldEnv(gym.Env[str, str]):
    """ALFWorld's text household tasks (Shridhar et al., 2021) in the real engine.

    Six task types: pick_and_place_simple, look_at_obj_in_light, pick_clean_then_place_in_recep,
    pick_heat_then_place_in_recep, pick_cool_then_place_in_recep, pick_two_obj_and_place.

    Games come from the official release when ``data_dir=`` or ``$ALFWORLD_DATA`` points at it
    (train: ``json_2.1.1/train``; eval: ``json_2.1.1/<eval_split>``, ``valid_seen`` by default),
    filtered like alfworld's ``AlfredTWEnv`` and sorted by path. Otherwise they are scenes the
    project generates (``envs/alfworld/scenes.py``): 3,600 train and a fixed list of 72 eval
    tasks (12 per type), each written on first use into a cache folder in the official
    format and kept only if ALFWorld's handcoded expert wins it within 50 steps. The cache
    folder is ``cache_dir=``, ``$AGENTOPSD_ALFWORLD_CACHE`` or ``~/.cache/agentopsd/alfworld``
    (a subfolder per generator and alfworld version); ``scene_seed`` (default 0, the fixed
    lists) draws another set of scenes. ``source="generated"`` forces generated
    scenes even when ``$ALFWORLD_DATA`` is set; ``source="official"`` requires the release.
    ``$ALFWORLD_DATA`` equal to alfworld's own default, ``~/.cache/alfworld`` (``import
    alfworld`` sets it when unset), counts as unset unless ``source="official"``.

    ## Action Space
    One text command. It is lower-cased and its whitespace collapsed, then must equal one of
    ``info["admissible_actions"]`` (the engine's admissible commands: "go to fridge 1",
    "take apple 1 from countertop 1", "move apple 1 to diningtable 1", "heat apple 1 with
    microwave 1", "use desklamp 1", "look", ...). Anything else is not sent to the engine:
    the observation is ALFWorld's "Nothing happens.", ``info["action_valid"]`` is False and
    the state does not change.

    ## Observation Space
    The engine's text. At reset, the room ("You are in the middle of a room. Looking quickly
    around you, you see ...") and "Your task is to: ..." (TextWorld's banner line removed);
    after a command, its feedback ("You arrive at fridge 1. The fridge 1 is closed.").

    ## Rewards
    1.0 on the step that solves the task (the engine's ``won``), else 0.0.

    ## Episode End
    Terminates when the task is solved. Truncated by the registered ``max_episode_steps``
    (50 turns; on generated scenes the expert needs 15 on average and never more than 50).
    Steps after the end change nothing and return reward 0.

    ``expert_action()`` is ALFWorld's handcoded expert (``extra.expert_plan``), run with its
    own random stream seeded by the game, so its plan is a fixed function of the task, and
    told "put X in/on Y" for "move X to Y" (alfworld 0.4 renamed the command, the expert
    still tracks the old one; see ``agentopsd.envs.alfworld.engine.legacy_command``);
    ``info["expert_steps"]`` at reset is that plan's length for generated scenes, -1 for
    official games (not computed: it would mean playing the game once more).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        split: str = "train",
        data_dir: str | Path | None = None,
        eval_split: str = "valid_seen",
        source: str = "auto",
        cache_dir: str | Path | None = None,
        scene_seed: int = 0,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: choose one of {list(SPLITS)}")
        if eval_split not in EVAL_SPLITS:
            raise ValueError(f"unknown eval_split {eval_split!r}: choose one of {list(EVAL_SPLITS)}")
        if isinstance(scene_seed, bool) or not isinstance(scene_seed, int) or scene_seed < 0:
            raise ValueError(f"scene_seed must be an int >= 0, got {scene_seed!r}")
        load_engine()  # first: an ImportError naming the extra when it is missing
        self._init_kwargs = {"split": split, "data_dir": data_dir, "eval_split": eval_split, "source": source,
                             "cache_dir": cache_dir, "scene_seed": scene_seed}
        self._commands: list[str] = []
        self.split = split
        self.scene_seed = scene_seed
        data = resolve_data_dir(data_dir, source)
        self._official: tuple[tuple[Path, str], ...] | None = None
        if data is not None:
            self._official = official_games(data, "train" if split == "train" else eval_split)
        else:
            self._root = cache_root(cache_dir)
        self.observation_space = observation_space()
        self.action_space = action_space()
        self._engine: Any = None  # built at the first reset: it loads a 34 MB planner library
        self._loaded: Path | None = None
        self._state: Any = None
        self._game: dict[str, Any] = {}
        self._done = False

    @property
    def num_tasks(self) -> int:
        return len(self._official) if self._official is not None else SIZES[self.split]

    @property
    def source(self) -> str:
        return "official" if self._official is not None else "generated"

    def game_file(self, index: int) -> Path:
        """The game file of task ``index`` (a generated one is written on first use)."""
        if self._official is not None:
            return self._official[index][0]
        return ensure_task(self._root, self.split, index, _verify, self.scene_seed) / GAME_FILE

    def _pick_index(self, options: dict[str, Any] | None) -> int:
        if options and "task_index" in options:
            index = options["task_index"]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_tasks:
                raise ValueError(
                    f"task_index must be an int in [0, {self.num_tasks - 1}] for split {self.split!r}, got {index!r}"
                )
            return index
        return int(self.np_random.integers(self.num_tasks))

    def _load(self, game_file: Path) -> None:
        if game_file == self._loaded:
            return
        traj = json.loads((game_file.parent / TRAJ_FILE).read_text())
        problem = json.loads(game_file.read_text())["pddl_problem"]
        if self._engine is None:
            self._engine = load_engine().make()
        self._engine.load(str(game_file))
        self._loaded = game_file
        self._game = {
            "task_type": traj["task_type"],
            "expert_steps": int(traj.get("agentopsd", {}).get("expert_steps", -1)),
            "problem": problem,
        }

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        index = self._pick_index(options)
        self._load(self.game_file(index))
        self._rng = expert_rng(self._game["problem"])
        with private_random(self._rng):
            self._state = self._engine.reset()
        self._index, self._done = index, False
        self._commands = []
        obs = clean_text(strip_welcome(self._state["feedback"]))
        self._task = task_of(obs)
        info = self._info(action_valid=True)
        info["expert_steps"] = self._game["expert_steps"]
        return obs, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._state is None:
            raise ResetNeeded("call reset() before step()")
        if self._done:
            return DONE, 0.0, True, False, self._info(action_valid=False)
        commands = {normalize_action(c): c for c in self._state["admissible_commands"]}
        command = commands.get(normalize_action(action))
        if command is None:
            return INVALID, 0.0, False, False, self._info(action_valid=False)
        with private_random(self._rng):
            self._state, _, _ = self._engine.step(command)
        self._commands.append(command)
        obs = clean_text(self._state["feedback"].strip())
        won = bool(self._state["won"])
        self._done = won
        return obs, float(won), won, False, self._info(action_valid=True)

    def _info(self, action_valid: bool) -> dict[str, Any]:
        return {
            "task": self._task,
            "admissible_actions": list(self._state["admissible_commands"]),
            "skill_key": self._game["task_type"],
            "task_type": self._game["task_type"],
            "task_index": self._index,
            "won": bool(self._state["won"]),
            "action_valid": action_valid,
            "gamefile": str(self._loaded),
        }

    requires = (("alfworld", "textworld"), INSTALL_HINT)
    """Checked before any work (the tokenizer, the warm start): the engine itself is imported on first use."""

    thread_safe_step = False
    """Not on worker threads: every reset and step runs the engine inside ``private_random``, which swaps the
    interpreter-wide ``random`` state for the expert's own stream; two threads doing so at once trade streams
    (the expert's plans stop being a function of the task) and leave another stream behind as the process's
    (see ``agentopsd.envs.base.TextEnv``)."""

    state_snapshot = False
    """``copy.deepcopy`` is exact but replays the episode's commands on a fresh engine (slow): the study scripts
    use it, the run report's ground-truth panel does not (see ``agentopsd.envs.base.TextEnv``)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> ALFWorldEnv:
        """A snapshot of this episode (what ``copy.deepcopy`` and the ground-truth replays use).

        The engine holds the PDDL planner behind a C pointer, which cannot be copied; the game is
        deterministic given its file and the expert's seeded stream, so the copy is a fresh env on the
        same task that replays this episode's commands. The copy's state is checked against this one's.
        """
        clone = ALFWorldEnv(**self._init_kwargs)
        clone.spec = self.spec
        memo[id(self)] = clone
        if self._state is None:
            return clone
        clone.reset(options={"task_index": self._index})
        for command in self._commands:
            clone.step(command)
        if (clone._state["feedback"], clone._state["won"], clone._done) != (self._state["feedback"], self._state["won"], self._done):
            raise RuntimeError(f"ALFWorld task {self._index}: replaying {len(self._commands)} commands did not restore the "
                               "episode's state (a nondeterministic engine?)")
        return clone

    def expert_action(self) -> str:
        """ALFWorld's handcoded expert's next command (always admissible; "look" when it has none)."""
        if self._state is None:
            raise ResetNeeded("call reset() before expert_action()")
        plan = self._state.get("extra.expert_plan") or [FALLBACK_ACTION]
        return plan[0] if plan[0] in self._state["admissible_commands"] else FALLBACK_ACTION

    def close(self) -> None:
        if getattr(self, "_engine", None) is not None:
            self._engine.close()


def register_envs() -> None:
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point="agentopsd.envs.alfworld.env:ALFWorldEnv", max_episode_steps=DEFAULT_TURNS)
