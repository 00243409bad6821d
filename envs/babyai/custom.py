"""BabyAI levels of our own, built from minigrid's parts (imported only when a level is made).

``PickupObj`` is GoToObj's layout (one room, one object, no distractors) with BabyAI's
pick-up instruction: the quickstart's task. A tiny model learns to find a lone object
quickly, so the interesting part is the last, decisive turn (``pick up``, not ``toggle``,
which destroys a box and does nothing to a ball or key). The room size sets the horizon.
"""

from __future__ import annotations

from minigrid.core.constants import COLOR_NAMES
from minigrid.envs.babyai.core.roomgrid_level import RoomGridLevel
from minigrid.envs.babyai.core.verifier import ObjDesc, PickupInstr


class PickupObj(RoomGridLevel):
    """Pick up the only object in a single square room of ``room_size`` cells (walls included)."""

    def __init__(self, room_size: int = 8, **kwargs) -> None:
        super().__init__(num_rows=1, num_cols=1, room_size=room_size, **kwargs)

    def gen_mission(self) -> None:
        self.place_agent()
        obj = self.add_distractors(num_distractors=1)[0]
        self.instrs = PickupInstr(ObjDesc(obj.type, obj.color))


class KeyDoorBox(RoomGridLevel):
    """Fetch the key of the locked door's colour, unlock the door, pick up the box behind it.

    Two rooms of ``room_size`` side by side, joined by a locked door. The agent starts in the
    left room with the door's key (``wrong_key``: and a key of another colour, which opens
    nothing). The target box is in the right room. Several turns decide the episode: picking
    up the key ("pick up": "toggle" does nothing to a key), unlocking the door ("toggle" while
    carrying its key), dropping the key (one object at a time) and picking up the box
    ("toggle" opens a box and it is gone).
    When the box is gone the mission can no longer succeed and the episode ends as a failure
    rather than running out the turn limit. The room size sets the horizon.
    """

    def __init__(self, room_size: int = 6, wrong_key: bool = False, **kwargs) -> None:
        self.wrong_key = wrong_key
        super().__init__(num_rows=1, num_cols=2, room_size=room_size, **kwargs)

    def gen_mission(self) -> None:
        box, _ = self.add_object(1, 0, kind="box")
        door, _ = self.add_door(0, 0, 0, locked=True)
        self.add_object(0, 0, "key", door.color)
        if self.wrong_key:
            self.add_object(0, 0, "key", self._rand_elem([c for c in COLOR_NAMES if c != door.color]))
        self.place_agent(0, 0)
        self.target = box
        self.instrs = PickupInstr(ObjDesc(box.type, box.color))

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if not terminated and self.carrying is not self.target and self.grid.get(*self.target.cur_pos) is not self.target:
            terminated, reward = True, 0  # the box was opened: it vanished, the mission is lost
        return obs, reward, terminated, truncated, info
