"""The BabyAI level ladder and the minigrid-facing helpers of the BabyAI text env.

minigrid is imported inside functions only: importing ``envs`` must stay cheap.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentopsd.envs.babyai.text import DROP, PICKUP, TOGGLE, Snapshot, door_state
from agentopsd.envs.babyai.view import DIR_VEC, VIEW, Cell, GridEncoding, encode_cell


@dataclass(frozen=True)
class LevelSpec:
    """One rung of the ladder."""

    minigrid_id: str
    """The minigrid registration this level wraps (its class and kwargs are reused), or an
    entry point ``module:Class`` of a level of our own (``agentopsd.envs.babyai.custom``)."""
    max_steps: int
    """Default horizon: at least 1.5x the bot's longest episode on the eval tasks."""
    expert_at_reset: bool
    """Run the bot at reset to report ``expert_steps``: only where a whole bot episode
    costs well under 50 ms on this CPU (measured mean 6-15 ms; the long levels take 40-120 ms)."""
    kwargs: tuple[tuple[str, Any], ...] = ()
    """Constructor arguments of an entry-point level (a minigrid registration brings its own)."""
    eval_tasks: int = 100
    """Size of the fixed evaluation list."""


# Ordered by the bot's mean episode length on the eval tasks (see the report in
# tests/envs/babyai/test_env.py's module docstring for the measurements).
LEVEL_SPECS: dict[str, LevelSpec] = {
    # one object, no distractors: the quickstart's ladder (room size sets the horizon)
    "PickupObjS5": LevelSpec("agentopsd.envs.babyai.custom:PickupObj", 32, True, (("room_size", 5),)),
    "PickupObj": LevelSpec("agentopsd.envs.babyai.custom:PickupObj", 64, True, (("room_size", 8),)),
    "PickupObjS12": LevelSpec("agentopsd.envs.babyai.custom:PickupObj", 96, True, (("room_size", 12),)),
    "GoToObj": LevelSpec("BabyAI-GoToObj-v0", 64, True),
    "GoToLocal": LevelSpec("BabyAI-GoToLocal-v0", 64, True),
    "PickupLoc": LevelSpec("BabyAI-PickupLoc-v0", 64, True),
    "PutNextLocal": LevelSpec("BabyAI-PutNextLocal-v0", 128, True),
    "UnlockPickup": LevelSpec("BabyAI-UnlockPickup-v0", 128, True),
    # several decisive turns (the key of the door's colour, the door, the box): the credit ladder
    "KeyDoorBoxS4": LevelSpec("agentopsd.envs.babyai.custom:KeyDoorBox", 64, True, (("room_size", 4),), 256),
    "KeyDoorBoxS5": LevelSpec("agentopsd.envs.babyai.custom:KeyDoorBox", 64, True, (("room_size", 5),), 256),
    "KeyDoorBoxS6": LevelSpec("agentopsd.envs.babyai.custom:KeyDoorBox", 64, True, (("room_size", 6),), 256),
    "KeyDoorBoxS7": LevelSpec("agentopsd.envs.babyai.custom:KeyDoorBox", 96, True, (("room_size", 7),), 256),
    "KeyDoorBoxS8": LevelSpec("agentopsd.envs.babyai.custom:KeyDoorBox", 96, True, (("room_size", 8),), 256),
    "KeyDoorBoxS9": LevelSpec("agentopsd.envs.babyai.custom:KeyDoorBox", 128, True, (("room_size", 9),), 256),
    "KeyDoorBoxS10": LevelSpec("agentopsd.envs.babyai.custom:KeyDoorBox", 128, True, (("room_size", 10),), 256),
    "Open": LevelSpec("BabyAI-Open-v0", 256, False),
    "GoToObjMaze": LevelSpec("BabyAI-GoToObjMaze-v0", 384, False),
    "KeyCorridorS3R3": LevelSpec("BabyAI-KeyCorridorS3R3-v0", 270, False),
    "BossLevel": LevelSpec("BabyAI-BossLevel-v0", 512, False),
}

_FAST: dict[type, type] = {}


class _FastLevel:
    """Mixin over a minigrid RoomGridLevel: quiet rejection sampling and a fast ``gen_obs``.

    The view numbers are minigrid's (see ``agentopsd.envs.babyai.view``); ``self.view`` holds the last view
    as a flat list for the text renderer, which reads lists faster than arrays, and the
    returned observation's "image" is None (``image()`` gives the array).
    """

    _enc: GridEncoding | None = None
    _touched: tuple[int, int] | None = None
    view: list[Cell]

    def reset(self, **kwargs: Any) -> Any:
        self._enc = None
        return super().reset(**kwargs)  # type: ignore[misc]

    def step(self, action: int) -> Any:
        if action in (PICKUP, DROP, TOGGLE):
            # These act on the cell in front only: re-encode just that cell afterwards.
            self._touched = front_cell(self)
        return super().step(action)  # type: ignore[misc]

    def gen_obs(self) -> dict[str, Any]:
        grid = self.grid  # type: ignore[attr-defined]
        if self._enc is None:
            self._enc = GridEncoding(grid)
        elif self._touched is not None:
            self._enc.update(grid, *self._touched)
        self._touched = None
        carrying = self.carrying  # type: ignore[attr-defined]
        pos = (int(self.agent_pos[0]), int(self.agent_pos[1]))  # type: ignore[attr-defined]
        self.view = self._enc.view(pos, self.agent_dir, None if carrying is None else encode_cell(carrying))  # type: ignore[attr-defined]
        # No image array: the text env reads self.view, and building the array every step
        # cost as much as the view itself. image() builds it on demand.
        return {"image": None, "direction": self.agent_dir, "mission": self.mission}  # type: ignore[attr-defined]

    def image(self) -> np.ndarray:
        """The last view as minigrid's ``obs["image"]`` array, ``[7, 7, 3]`` uint8."""
        return np.array(self.view, dtype=np.uint8).reshape(VIEW, VIEW, 3)

    def _gen_grid(self, width: int, height: int) -> None:
        """RoomGridLevel._gen_grid's rejection-sampling loop without its print per rejection.

        minigrid prints "Sampling rejected: ..." to stdout for every rejected layout; with
        hundreds of envs that floods the training log. Same calls, same RNG use, same result.
        """
        from minigrid.core.roomgrid import RoomGrid
        from minigrid.envs.babyai.core.roomgrid_level import RejectSampling

        while True:
            try:
                RoomGrid._gen_grid(self, width, height)  # type: ignore[arg-type]
                self.gen_mission()  # type: ignore[attr-defined]
                self.validate_instrs(self.instrs)  # type: ignore[attr-defined]
            except (RecursionError, RejectSampling):
                continue
            break
        self.surface = self.instrs.surface(self)  # type: ignore[attr-defined]
        self.mission = self.surface


def level_class(level: str) -> tuple[type, dict[str, Any]]:
    """The fast subclass of the level's minigrid class, and the kwargs minigrid registers it with."""
    import gymnasium as gym
    import minigrid  # noqa: F401  (registers the BabyAI ids)
    from gymnasium.envs.registration import load_env_creator

    level_spec = LEVEL_SPECS[level]
    if ":" in level_spec.minigrid_id:
        cls, kwargs = load_env_creator(level_spec.minigrid_id), dict(level_spec.kwargs)
    else:
        spec = gym.spec(level_spec.minigrid_id)
        cls, kwargs = load_env_creator(spec.entry_point), dict(spec.kwargs)
    if cls not in _FAST:
        _FAST[cls] = type(f"Fast{cls.__name__}", (_FastLevel, cls), {})
    return _FAST[cls], kwargs


def make_level(level: str, max_steps: int) -> Any:
    """A fresh minigrid RoomGridLevel for ``level`` with a fixed step limit."""
    cls, kwargs = level_class(level)
    return cls(max_steps=max_steps, **kwargs)


def front_cell(env: Any) -> tuple[int, int]:
    """The cell in front of the agent, in plain ints (minigrid's front_pos goes through numpy)."""
    dx, dy = DIR_VEC[env.agent_dir]
    return int(env.agent_pos[0]) + dx, int(env.agent_pos[1]) + dy


def target_positions(instrs: Any) -> list[tuple[int, int]]:
    """Positions of the objects a single (non-sequence) instruction is about."""
    descs = [getattr(instrs, name) for name in ("desc", "desc_move") if hasattr(instrs, name)]
    return [tuple(int(v) for v in pos) for desc in descs for pos in desc.obj_poss]


def needs_unlock(env: Any) -> bool:
    """True when no target of the mission is reachable without unlocking a door.

    Breadth-first search from the agent through everything but walls and locked doors
    (objects can be moved aside, closed doors opened). A locked target door counts as
    unreachable, so "open the door" on a locked door is an unlock task too.
    """
    targets = set(target_positions(env.instrs))
    if not targets:
        return False
    grid = env.grid
    start = tuple(int(v) for v in env.agent_pos)
    seen = {start}
    queue = deque([start])
    while queue:
        x, y = queue.popleft()
        if (x, y) in targets:
            return False
        for nx, ny in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
            if (nx, ny) in seen or not (0 <= nx < grid.width and 0 <= ny < grid.height):
                continue
            cell = grid.get(nx, ny)
            if cell is not None and (cell.type == "wall" or (cell.type == "door" and cell.is_locked)):
                continue
            seen.add((nx, ny))
            queue.append((nx, ny))
    return True


def snapshot(env: Any) -> Snapshot:
    """What the next action may change (agent, carried object, the cell in front)."""
    x, y = front_cell(env)
    front = env.grid.grid[y * env.width + x]
    return Snapshot(
        pos=(int(env.agent_pos[0]), int(env.agent_pos[1])),
        carrying=env.carrying,
        front=front,
        door_state=door_state(front),
    )
