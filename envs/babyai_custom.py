"""BabyAI levels of our own, built from minigrid's parts (imported only when a level is made).

``PickupObj`` is GoToObj's layout (one room, one object, no distractors) with BabyAI's
pick-up instruction: the quickstart's task. A tiny model learns to find a lone object
quickly, so the interesting part is the last, decisive turn (``pick up``, not ``toggle``,
which destroys a box and does nothing to a ball or key). The room size sets the horizon.
"""

from __future__ import annotations

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
