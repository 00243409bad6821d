"""The BabyAI oracle: minigrid's BabyAIBot kept in step with an env the agent drives.

The bot is a planner with memory (a stack of subgoals and a mask of the cells it has
seen) and expects ``replan(action_taken)`` exactly once per env step. The agent may take
other actions than the bot suggests and may go several steps without asking the expert,
so :class:`ExpertTracker`:

- feeds the bot the action actually taken when exactly one step passed since it was
  last asked (the bot's own "advising" mode plans to undo harmful deviations);
- otherwise, or when the bot raises (it asserts on states it did not plan for, e.g. a
  box the agent opened), builds a fresh bot for the current state: it gets the cells seen
  so far this episode (tracked here at every step) and only the parts of a sequence
  mission that are not done yet, and drops a carried object first, close by (the bot's pickup
  subgoal assumes empty hands), except a key that opens a door still locked: the bot unlocks
  with it and drops it after.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from agentopsd.envs.babyai.text import DONE
from agentopsd.envs.babyai.view import Cell, mark_seen


class ExpertTracker:
    """One bot per episode for one minigrid env; call :meth:`reset` at each episode start."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.bot: Any = None
        self.pending: list[int] = []
        self.suggestion: int | None = None
        self.views: list[tuple[tuple[int, int], int, list[Cell]]] = []

    def reset(self) -> None:
        self.bot, self.pending, self.suggestion, self.views = None, [], None, []
        self.observe()

    def observe(self) -> None:
        """Remember the current view (cheap: a reference); the seen mask is built on demand."""
        env = self.env
        self.views.append(((int(env.agent_pos[0]), int(env.agent_pos[1])), int(env.agent_dir), env.view))

    def seen(self) -> np.ndarray:
        """Cells seen so far this episode, as the bot's ``vis_mask`` (world ``[x, y]``)."""
        mask = np.zeros((self.env.width, self.env.height), dtype=bool)
        for pos, direction, view in self.views:
            mark_seen(mask, pos, direction, view)
        return mask

    def record(self, action: int) -> None:
        """The env stepped with ``action``; the bot (if any) must hear of it."""
        if self.bot is not None:
            self.pending.append(action)
        self.suggestion = None

    def action(self) -> int:
        """The bot's next action (a minigrid action index) for the current state."""
        if self.suggestion is not None:
            return self.suggestion
        suggestion: int | None = None
        if self.bot is not None and len(self.pending) <= 1:
            try:
                suggestion = int(self.bot.replan(self.pending[0] if self.pending else None))
            except Exception:  # the bot asserts on states it did not plan for: start over
                suggestion = None
        if suggestion is None:
            suggestion = self._fresh_bot_action()
        self.pending = []
        self.suggestion = suggestion
        return suggestion

    def _fresh_bot_action(self) -> int:
        try:
            self.bot = fresh_bot(self.env, self.seen())
            return int(self.bot.replan(None))
        except Exception:
            # Nothing sensible left (e.g. the target box was opened and vanished).
            self.bot = None
            return DONE


def remaining_instrs(instr: Any) -> list[Any]:
    """The action instructions of a (possibly sequenced) mission still to do, in order."""
    from minigrid.envs.babyai.core.verifier import AfterInstr, AndInstr, BeforeInstr

    if isinstance(instr, (BeforeInstr, AndInstr)):
        first, second = (instr.instr_a, instr.a_done), (instr.instr_b, instr.b_done)
    elif isinstance(instr, AfterInstr):  # "do a after you do b": b comes first
        first, second = (instr.instr_b, instr.b_done), (instr.instr_a, instr.a_done)
    else:
        return [instr]
    return [x for sub, done in (first, second) if done != "success" for x in remaining_instrs(sub)]


_BOT_CLASS: type | None = None


def bot_class() -> type:
    """BabyAIBot with a fast ``_process_obs``.

    The bot marks what it has seen by asking minigrid for the view grid again at every
    replan (``gen_obs_grid``: most of its time). The level already holds that view
    (``_FastLevel.view``), so read it; the marked cells are the same (the tests compare
    the two bots' actions).
    """
    global _BOT_CLASS
    if _BOT_CLASS is None:
        from minigrid.utils.baby_ai_bot import BabyAIBot

        class FastBabyAIBot(BabyAIBot):
            def _process_obs(self) -> None:
                env = self.mission
                pos = (int(env.agent_pos[0]), int(env.agent_pos[1]))
                mark_seen(self.vis_mask, pos, int(env.agent_dir), env.view)

        _BOT_CLASS = FastBabyAIBot
    return _BOT_CLASS


def fresh_bot(env: Any, seen: np.ndarray) -> Any:
    """A bot planning from the current state with the given memory of seen cells."""
    from minigrid.utils.baby_ai_bot import DropSubgoal, GoNextToSubgoal

    bot = bot_class()(env)
    bot.stack = []
    for instr in reversed(remaining_instrs(env.instrs)):
        bot._process_instr(instr)
    bot.vis_mask |= reachable_part(env, seen)
    if env.carrying is not None and not opens_a_locked_door(env, env.carrying):
        # The plan assumes empty hands (PickupSubgoal asserts it): put the object down first.
        # A key that opens a locked door is kept: the bot unlocks with the key in hand and drops
        # it right after (OpenSubgoal), as the bot that fetched it would; dropping it here and
        # fetching it again would make carrying the key look like a step backwards.
        bot.stack.append(DropSubgoal(bot))
        bot.stack.append(GoNextToSubgoal(bot, near_drop_pos(env) or bot._find_drop_pos()))
    return bot


def near_drop_pos(env: Any) -> tuple[int, int] | None:
    """An empty cell to drop into at once (ahead) or after one turn (right, left), or None.

    The bot's own choice (``_find_drop_pos``) depends on where it stands and what it remembers, so a
    bot built anew at every step of a drop-and-go plan keeps choosing other, farther cells: the path
    it measures would shrink by more than a step on the turn that reaches one. Never in or beside a
    doorway, where the object would block the way.
    """
    grid = env.grid

    def door(x: int, y: int) -> bool:
        cell = grid.get(x, y) if 0 <= x < grid.width and 0 <= y < grid.height else None
        return cell is not None and cell.type == "door"

    pos, right = np.asarray(env.agent_pos), np.asarray(env.right_vec)
    if door(int(pos[0]), int(pos[1])):
        return None
    for cell in (np.asarray(env.front_pos), pos + right, pos - right):
        x, y = int(cell[0]), int(cell[1])
        if (0 <= x < grid.width and 0 <= y < grid.height and grid.get(x, y) is None
                and not any(door(x + dx, y + dy) for dx, dy in ((1, 0), (-1, 0), (0, 1), (0, -1)))):
            return x, y
    return None


def opens_a_locked_door(env: Any, obj: Any) -> bool:
    """Is ``obj`` the key of a door of ``env`` that is still locked?"""
    if getattr(obj, "type", None) != "key":
        return False
    grid = env.grid
    return any(cell is not None and cell.type == "door" and cell.is_locked and cell.color == obj.color
               for cell in grid.grid)


def reachable_part(env: Any, seen: np.ndarray) -> np.ndarray:
    """The seen cells the agent can reach now through seen cells and open doors, plus
    their neighbours (the walls and doors around them).

    The bot asserts that every object it has seen has a path to it, and its paths never
    cross closed doors: an object seen through a door the agent has since closed breaks
    that. Forgetting what lies behind closed doors makes the bot explore (open) them again.
    """
    grid = env.grid
    start = (int(env.agent_pos[0]), int(env.agent_pos[1]))
    reached = {start}
    frontier = [start]
    while frontier:
        x, y = frontier.pop()
        for nx, ny in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
            if (nx, ny) in reached or not (0 <= nx < grid.width and 0 <= ny < grid.height) or not seen[nx, ny]:
                continue
            cell = grid.get(nx, ny)
            if cell is not None and (cell.type == "wall" or (cell.type == "door" and not cell.is_open)):
                continue
            reached.add((nx, ny))
            frontier.append((nx, ny))
    keep = np.zeros_like(seen)
    for x, y in reached:
        keep[x, max(y - 1, 0):y + 2] = True
        keep[max(x - 1, 0):x + 2, y] = True
    return seen & keep


_CACHE: dict[tuple[str, int, int], int] = {}
_CACHE_LOCK = threading.Lock()
_CACHE_MAX = 100_000


def expert_steps(sim: Any, seed: int, key: tuple[str, int, int], max_steps: int) -> int:
    """Steps the bot needs to win the task of minigrid ``seed``, -1 if it fails in ``max_steps``.

    ``sim`` is a spare env of the same level, reset here with the task's seed: a reset
    regenerates the same layout and costs a third of a deep copy. Cached by ``key`` =
    (level, seed, max_steps): a group of G copies of one task, and every eval pass, pay
    for it once.
    """
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
    sim.reset(seed=seed)
    bot = bot_class()(sim)
    result = -1
    try:
        for step in range(1, max_steps + 1):
            _, reward, terminated, truncated, _ = sim.step(bot.replan())
            if terminated or truncated:
                result = step if terminated and reward > 0 else -1
                break
    except Exception:  # the bot gives up on a few states (e.g. a box it must not open)
        result = -1
    with _CACHE_LOCK:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = result
    return result
