"""A fast egocentric view for minigrid levels, the same numbers as ``MiniGridEnv.gen_obs``.

minigrid builds each observation by slicing the grid into new ``Grid`` objects (a
``Wall()`` per out-of-bounds cell), rotating them cell by cell and encoding them: most of
a step's time. Here the grid's encoding is kept as a flat list of ``(type, color, state)``
tuples padded with walls (so no bounds checks), re-encoded only where an action can change
it (the cell in front, after pick up / drop / toggle), and the 7x7 view is read from it
through precomputed offsets. ``tests/envs/babyai/test_env.py`` checks the result against
minigrid's own ``gen_obs``.

A view is a flat list of 49 cells, ``view[i * 7 + j]`` = minigrid's ``obs["image"][i, j]``:
the agent is at ``(3, 6)`` facing "up", so column ``i`` lies ``i - 3`` cells to the right
and row ``j`` lies ``6 - j`` cells ahead.
"""

from __future__ import annotations

from typing import Any

Cell = tuple[int, int, int]
VIEW = 7
HALF = VIEW // 2
PAD = VIEW - 1
AGENT = HALF * VIEW + VIEW - 1
"""Flat index of the agent's own cell (3, 6)."""
UNSEEN_CELL: Cell = (0, 0, 0)
EMPTY_CELL: Cell = (1, 0, 0)
WALL_CELL: Cell = (2, 5, 0)  # minigrid's out-of-bounds filler is a grey wall
# minigrid.core.constants.DIR_TO_VEC as plain ints: (dx, dy) per agent_dir.
DIR_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))


def encode_cell(obj: Any) -> Cell:
    return EMPTY_CELL if obj is None else tuple(obj.encode())


class GridEncoding:
    """The grid's cell encodings, flat, with a border of PAD walls on every side."""

    def __init__(self, grid: Any) -> None:
        self.width, self.height = grid.width, grid.height
        self.stride = self.width + 2 * PAD
        self.cells = [WALL_CELL] * (self.stride * (self.height + 2 * PAD))
        for y in range(self.height):
            row = grid.grid[y * self.width:(y + 1) * self.width]
            start = (y + PAD) * self.stride + PAD
            self.cells[start:start + self.width] = [encode_cell(obj) for obj in row]
        # Offsets of the 49 view cells from the agent's index, per agent direction.
        self.offsets = [self._offsets(d) for d in range(4)]

    def _offsets(self, direction: int) -> list[int]:
        fx, fy = DIR_VEC[direction]
        rx, ry = -fy, fx  # right of (fx, fy), as minigrid's right_vec
        out = []
        for i in range(VIEW):
            for j in range(VIEW):
                ahead, side = VIEW - 1 - j, i - HALF
                out.append((fy * ahead + ry * side) * self.stride + fx * ahead + rx * side)
        return out

    def index(self, x: int, y: int) -> int:
        return (y + PAD) * self.stride + x + PAD

    def update(self, grid: Any, x: int, y: int) -> None:
        self.cells[self.index(x, y)] = encode_cell(grid.grid[y * self.width + x])

    def view(self, pos: tuple[int, int], direction: int, carrying: Cell | None) -> list[Cell]:
        """The agent's 7x7 view: occluded cells UNSEEN, the agent's cell shows what it carries."""
        cells, base = self.cells, self.index(*pos)
        view = [cells[base + o] for o in self.offsets[direction]]
        # Only walls and closed or locked doors block sight (their see_behind() is False).
        opaque = tuple([c[0] == 2 or (c[0] == 4 and c[2] != 0) for c in view])
        mask = _VISIBILITY.get(opaque)
        if mask is None:
            mask = visibility(list(opaque))
            if len(_VISIBILITY) >= _VISIBILITY_MAX:
                _VISIBILITY.clear()
            _VISIBILITY[opaque] = mask
        view = [c if m else UNSEEN_CELL for c, m in zip(view, mask)]
        view[AGENT] = carrying if carrying is not None else EMPTY_CELL
        return view


# Rooms repeat the same few occlusion patterns, so visibility masks are memoized by pattern
# (a dict lookup on a 49-tuple is several times cheaper than the propagation below).
_VISIBILITY: dict[tuple[bool, ...], list[bool]] = {}
_VISIBILITY_MAX = 1 << 16


def visibility(opaque: list[bool]) -> list[bool]:
    """minigrid's ``Grid.process_vis`` on flat indices ``i * 7 + j``: light spreads from the
    agent's cell along each row both ways and one row further ahead, stopping at opaque cells."""
    mask = [False] * (VIEW * VIEW)
    mask[AGENT] = True
    for j in range(VIEW - 1, -1, -1):
        for i in range(VIEW - 1):
            k = i * VIEW + j
            if mask[k] and not opaque[k]:
                mask[k + VIEW] = True  # (i + 1, j)
                if j > 0:
                    mask[k + VIEW - 1] = mask[k - 1] = True  # (i + 1, j - 1), (i, j - 1)
        for i in range(VIEW - 1, 0, -1):
            k = i * VIEW + j
            if mask[k] and not opaque[k]:
                mask[k - VIEW] = True  # (i - 1, j)
                if j > 0:
                    mask[k - VIEW - 1] = mask[k - 1] = True  # (i - 1, j - 1), (i, j - 1)
    return mask


def view_to_world(pos: tuple[int, int], direction: int, k: int) -> tuple[int, int]:
    """World coordinates of flat view cell ``k`` for an agent at ``pos`` facing ``direction``."""
    fx, fy = DIR_VEC[direction]
    i, j = divmod(k, VIEW)
    ahead, side = VIEW - 1 - j, i - HALF
    return pos[0] + fx * ahead - fy * side, pos[1] + fy * ahead + fx * side


def mark_seen(mask: Any, pos: tuple[int, int], direction: int, view: list[Cell]) -> None:
    """Set ``mask[x, y]`` (a ``[width, height]`` bool array) for every visible cell of ``view``."""
    width, height = mask.shape
    for k, cell in enumerate(view):
        if cell[0] != 0:
            x, y = view_to_world(pos, direction, k)
            if 0 <= x < width and 0 <= y < height:
                mask[x, y] = True
