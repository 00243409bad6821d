"""Text rendering of a BabyAI state: the agent's egocentric view as sentences.

Everything here reads a view in minigrid's compact encoding (``view[i * 7 + j]`` = (object
type, colour, door state) = ``obs["image"][i, j]``, see ``agentopsd.envs.babyai.view``) and never imports
minigrid, so it stays cheap and pure. The agent stands at column 3 of the last row and
faces "up": column ``i`` is ``i - 3`` cells to the right, row ``j`` is ``6 - j`` ahead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Cell = tuple[int, int, int]

# minigrid.core.constants, copied as plain values so this module needs no minigrid import.
UNSEEN, EMPTY, WALL, DOOR = 0, 1, 2, 4
AGENT = 3 * 7 + 6  # the agent's own cell in a flat view
OBJECT_NAMES = {4: "door", 5: "key", 6: "ball", 7: "box", 8: "goal", 9: "lava"}
COLOR_NAMES = ("red", "green", "blue", "purple", "yellow", "grey")
DOOR_STATES = ("open", "closed", "locked")

ACTIONS: tuple[str, ...] = ("turn left", "turn right", "go forward", "pick up", "drop", "toggle", "done")
"""Action words in minigrid's action order: ``ACTIONS[i]`` is ``minigrid.core.actions.Actions(i)``."""
ACTION_INDEX = {name: i for i, name in enumerate(ACTIONS)}
# Short forms a model may emit; anything else is an invalid action (no state change).
ALIASES = {
    "left": "turn left", "right": "turn right", "forward": "go forward", "move forward": "go forward",
    "pickup": "pick up", "open": "toggle", "open door": "toggle",
}
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)


def parse_action(text: str) -> int | None:
    """Index of a normalized action string, or None when it is not an action.

    ``text`` is already lower-cased and whitespace-collapsed (``agentopsd.envs.base.normalize_action``);
    trailing punctuation is forgiven because models like to end sentences.
    """
    text = text.rstrip(".!")
    text = ALIASES.get(text, text)
    return ACTION_INDEX.get(text)


_AND = re.compile(r",? and |, then | after you ")


def mission_kind(mission: str) -> str:
    """Mission category from the mission text: goto, pickup, open, putnext or sequence.

    BabyAI composes clauses with "and", ", then" and "after you": those are ``sequence``.
    (``unlock`` cannot be read from the text; ``agentopsd.envs.babyai.levels.needs_unlock`` decides it.)
    """
    if _AND.search(mission):
        return "sequence"
    for prefix, kind in (("go to", "goto"), ("pick up", "pickup"), ("open", "open"), ("put", "putnext")):
        if mission.startswith(prefix):
            return kind
    return "other"


def describe_object(type_idx: int, color_idx: int, state: int) -> str:
    """'a red ball', 'a locked blue door', 'an open grey door'."""
    name = OBJECT_NAMES.get(type_idx, "object")
    color = COLOR_NAMES[color_idx] if color_idx < len(COLOR_NAMES) else "strange"
    if type_idx == DOOR:
        words = f"{DOOR_STATES[state] if state < 3 else 'closed'} {color} door"
    else:
        words = f"{color} {name}"
    return ("an " if words[0] in "aeiou" else "a ") + words


def _steps(n: int) -> str:
    return "1 step" if n == 1 else f"{n} steps"


def describe_offset(ahead: int, right: int) -> str:
    """Position relative to the agent: '2 steps ahead and 1 to your left'."""
    if ahead == 1 and right == 0:
        return "right in front of you"
    side = "right" if right > 0 else "left"
    if right == 0:
        return f"{_steps(ahead)} ahead"
    if ahead == 0:
        return f"{_steps(abs(right))} to your {side}"
    return f"{_steps(ahead)} ahead and {abs(right)} to your {side}"


def visible_objects(view: Sequence[Cell]) -> list[str]:
    """Objects and doors in view, nearest first, each with its offset."""
    items: list[tuple[int, int, int, str]] = []
    for k, cell in enumerate(view):
        if cell[0] < DOOR or k == AGENT:
            continue  # the agent's own cell shows what it carries, reported separately
        i, j = divmod(k, 7)
        ahead, right = 6 - j, i - 3
        items.append((ahead + abs(right), ahead, right, f"{describe_object(*cell)} {describe_offset(ahead, right)}"))
    items.sort()
    return [text for *_, text in items]


def _where(k: int, direction: str) -> str:
    if direction == "ahead":
        return "right in front of you" if k == 1 else f"{_steps(k)} ahead"
    return f"{_steps(k)} to your {direction}"


def _scan(cells: Sequence[int], direction: str) -> str:
    """First wall or door along a straight line of view cell types (nearest first)."""
    words = "ahead" if direction == "ahead" else f"to your {direction}"
    for k, t in enumerate(cells, start=1):
        if t == WALL:
            return f"a wall {_where(k, direction)}"
        if t == DOOR:
            return f"a door {_where(k, direction)}"
        if t == UNSEEN:
            return f"no wall seen within {_steps(k - 1)} {words}" if k > 1 else f"nothing seen {words}"
    return f"no wall within {_steps(len(cells))} {words}"


# Flat view indices (i * 7 + j) walking away from the agent (3, 6): ahead, left, right.
_AHEAD = [3 * 7 + j for j in range(5, -1, -1)]
_LEFT = [i * 7 + 6 for i in range(2, -1, -1)]
_RIGHT = [i * 7 + 6 for i in range(4, 7)]


def wall_distances(view: Sequence[Cell]) -> str:
    """'a wall 3 steps ahead; a wall 1 step to your left; no wall within 3 steps to your right'."""
    return "; ".join((
        _scan([view[k][0] for k in _AHEAD], "ahead"),
        _scan([view[k][0] for k in _LEFT], "left"),
        _scan([view[k][0] for k in _RIGHT], "right"),
    ))


def render(mission: str, view: Sequence[Cell], carrying: str | None, last: str) -> str:
    """The whole observation text."""
    seen = visible_objects(view)
    return "\n".join((
        f"Mission: {mission}",
        "You see: " + ("; ".join(seen) if seen else "no objects") + ".",
        f"Walls: {wall_distances(view)}.",
        f"You are carrying {carrying or 'nothing'}.",
        f"Last action: {last}",
    ))


def describe_cell(obj: Any) -> str | None:
    """A minigrid world object in words ('a wall', 'a locked red door'); None for no object."""
    if obj is None:
        return None
    if obj.type == "wall":
        return "a wall"
    if obj.type == "door":
        return f"{'an' if door_state(obj) == 'open' else 'a'} {door_state(obj)} {obj.color} door"
    return f"a {obj.color} {obj.type}"


def door_state(obj: Any) -> str | None:
    if obj is None or obj.type != "door":
        return None
    return "open" if obj.is_open else ("locked" if obj.is_locked else "closed")


@dataclass(frozen=True)
class Snapshot:
    """What an action can change, captured just before the step to narrate its effect.

    Holds minigrid objects by reference; a door's state is copied because toggling
    mutates the door in place.
    """

    pos: tuple[int, int]
    carrying: Any
    front: Any
    door_state: str | None


def describe_effect(action: int, before: Snapshot, after: Snapshot) -> str:
    """One sentence saying what the last action did, from the states around it."""
    name = ACTIONS[action]
    front, carried = describe_cell(before.front), describe_cell(before.carrying)
    if action in (LEFT, RIGHT):
        return f"{name}: you turned {'left' if action == LEFT else 'right'}."
    if action == FORWARD:
        if after.pos != before.pos:
            return "go forward: you moved one step forward."
        return f"go forward: you could not move, {front} is in the way."
    if action == PICKUP:
        if after.carrying is not before.carrying:
            return f"pick up: you picked up {describe_cell(after.carrying)}."
        if front is None:
            return "pick up: there is nothing in front of you to pick up."
        if before.front.type in ("wall", "door"):
            return f"pick up: you cannot pick up {front}."
        return f"pick up: your hands are full (you carry {carried}); drop it first."
    if action == DROP:
        if carried is None:
            return "drop: you are not carrying anything."
        if after.carrying is None:
            return f"drop: you dropped {carried} in front of you."
        return f"drop: the cell in front of you is not empty ({front})."
    if action == TOGGLE:
        return _toggle_effect(before, after)
    return "done: you said you are done, but the mission is not complete yet."


def _toggle_effect(before: Snapshot, after: Snapshot) -> str:
    front = describe_cell(before.front)
    if front is None:
        return "toggle: there is nothing in front of you to toggle."
    kind = before.front.type
    if kind == "door":
        the_door = f"the {before.front.color} door"
        if before.door_state == after.door_state:
            if before.door_state == "locked":
                return f"toggle: {the_door} is locked; you need a key of the same color."
            return "toggle: nothing happened."
        if before.door_state == "locked":
            return f"toggle: you unlocked and opened {the_door}."
        return f"toggle: you {'opened' if after.door_state == 'open' else 'closed'} {the_door}."
    if kind == "box":
        return f"toggle: you opened {front}; it is gone and in its place is {describe_cell(after.front) or 'nothing'}."
    return f"toggle: nothing happens to {front}."
