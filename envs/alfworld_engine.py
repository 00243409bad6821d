"""The ALFWorld engine: TextWorld's PDDL environment with alfworld's wrappers, imported lazily.

Nothing here imports ``alfworld`` or ``textworld`` at module level, so ``import envs`` works
without the ``[alfworld]`` extra; ``load_engine()`` raises an ImportError that says how to
install it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

INSTALL_HINT = "the ALFWorld environment needs the alfworld extra: pip install 'agentopsd[alfworld]'"
WELCOME = "-= Welcome to TextWorld, ALFRED! =-"
FALLBACK_ACTION = "look"
"""Always admissible; what the expert says when its heuristics have no answer."""


@functools.lru_cache(maxsize=1)
def load_engine() -> SimpleNamespace:
    """Import textworld and alfworld once; patch the grammar parser cache; return the pieces."""
    try:
        import textworld
        import textworld.envs
        from alfworld.agents.environment.alfred_tw_env import (
            AlfredDemangler,
            AlfredExpert,
            AlfredExpertType,
            AlfredInfos,
        )
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(INSTALL_HINT) from err
    _memoize_textworld_parsers()

    class RobustExpert(AlfredExpert):
        """alfworld's AlfredExpert (handcoded), but a failing heuristic never breaks a step.

        The handcoded expert raises HandCodedAgentFailed/Timeout when its subgoals run out or
        after 200 calls; AlfredExpert only catches the timeout and re-raises it. Here any
        failure leaves the plan at "look" and marks the expert as lost for this episode.
        """

        def _gather_infos(self) -> None:
            if getattr(self, "expert_lost", False):
                self.state["extra.expert_plan"] = [FALLBACK_ACTION]
                return
            try:
                super()._gather_infos()
            except Exception:  # noqa: BLE001 - the expert is advisory; the game goes on
                self.expert_lost = True
                self.state["extra.expert_plan"] = [FALLBACK_ACTION]

        def reset(self):  # noqa: ANN201 - textworld's signature
            self.expert_lost = False
            return super().reset()

    def make() -> Any:
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile", "expert_plan"])
        env = textworld.envs.PddlEnv(infos)
        env = AlfredInfos(AlfredDemangler(env, shuffle=False))
        return RobustExpert(env, expert_type=AlfredExpertType.HANDCODED)

    return SimpleNamespace(make=make)


def _memoize_textworld_parsers() -> None:
    """Cache TextWorld's grammar and query parsing (a 3x speed-up per step, same output).

    ``PddlEnv`` re-parses every command template and every grammar condition with TatSu on
    each step. Parsing is a pure function of the string, so a cache returning a fresh copy of
    the parse (the derivation mutates its symbols) changes nothing but the time.
    """
    import textworld.envs.pddl.textgen as textgen
    import textworld.logic as logic

    if getattr(textgen, "_agentopsd_memoized", False):
        return
    parse = textgen._parse_and_convert
    parsed: dict[tuple[str, str], Any] = {}

    def cached_parse(text: str, rule_name: str, **kwargs: Any) -> Any:
        if kwargs.get("trace"):
            return parse(text, rule_name=rule_name, **kwargs)
        key = (text, rule_name)
        if key not in parsed:
            parsed[key] = parse(text, rule_name=rule_name)
        return copy.deepcopy(parsed[key])

    query = logic.Rule.parse_conjunctive_query.__func__
    queries: dict[str, Any] = {}

    def cached_query(cls: type, expr: str) -> Any:
        # Rules are only read (matched against the state), never mutated: share them.
        if expr not in queries:
            queries[expr] = query(cls, expr)
        return queries[expr]

    textgen._parse_and_convert = cached_parse
    logic.Rule.parse_conjunctive_query = classmethod(cached_query)
    textgen._agentopsd_memoized = True


@contextlib.contextmanager
def private_random(rng: random.Random) -> Iterator[None]:
    """Run code that draws from the global ``random`` (alfworld's expert does) on ``rng``'s state.

    The caller's global random state is untouched, and the expert's draws are a function of
    ``rng`` alone, which makes the expert deterministic for a task.
    """
    saved = random.getstate()
    random.setstate(rng.getstate())
    try:
        yield
    finally:
        rng.setstate(random.getstate())
        random.setstate(saved)


def expert_rng(pddl_problem: str) -> random.Random:
    """The expert's private random stream: a function of the game, so its plan is fixed per task."""
    return random.Random(zlib.crc32(pddl_problem.encode()))


def strip_welcome(text: str) -> str:
    """The intro as ALFWorld agents see it: without TextWorld's banner line."""
    return text.replace(WELCOME, "", 1).strip()


def task_of(intro: str) -> str:
    """The instruction: what follows "Your task is to: " in the intro."""
    marker = "Your task is to: "
    return intro.split(marker, 1)[1].strip() if marker in intro else ""


def play_expert(game_file: Path, max_steps: int) -> list[str] | None:
    """The expert's winning plan for a game file, or None if it does not win within ``max_steps``."""
    import json

    problem = json.loads(Path(game_file).read_text())["pddl_problem"]
    env = load_engine().make()
    rng = expert_rng(problem)
    plan: list[str] = []
    try:
        env.load(str(game_file))
        with private_random(rng):
            state = env.reset()
        while not state["won"] and len(plan) < max_steps:
            if getattr(env, "expert_lost", False):
                return None
            action = state["extra.expert_plan"][0]
            with private_random(rng):
                state, _, _ = env.step(action)
            plan.append(action)
        return plan if state["won"] else None
    finally:
        env.close()
