"""The ALFWorld engine: TextWorld's PDDL environment with alfworld's wrappers, imported lazily.

Nothing here imports ``alfworld`` or ``textworld`` at module level, so ``import agentopsd.envs`` works
without the ``[alfworld]`` extra; ``load_engine()`` raises an ImportError that says how to
install it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import random
import sys
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
    """Import textworld and alfworld once, speed up TextWorld's text generation, return a factory."""
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
    speed_up_textworld()

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
            except Exception:  # the expert is advisory: the game goes on without it
                self.expert_lost = True
                self.state["extra.expert_plan"] = [FALLBACK_ACTION]

        def reset(self) -> Any:
            self.expert_lost = False
            return super().reset()

        def step(self, command: str) -> Any:
            # AlfredExpert.step, except for what the expert is told it did (see legacy_command).
            self.state, reward, done = super(AlfredExpert, self).step(command)
            self.prev_command = legacy_command(str(command))
            self._gather_infos()
            return self.state, reward, done

    def make() -> Any:
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile", "expert_plan"])
        env = textworld.envs.PddlEnv(infos)
        env = AlfredInfos(AlfredDemangler(env, shuffle=False))
        return RobustExpert(env, expert_type=AlfredExpertType.HANDCODED)

    return SimpleNamespace(make=make)


def speed_up_textworld(enable: bool = True) -> None:
    """Make TextWorld's PDDL engine faster without changing a character of its output.

    - ``PddlEnv`` re-parses every command template and grammar condition with TatSu on each
      step: parsing is a pure function of the string, so it is cached (returning a fresh copy,
      since derivation mutates the symbols).
    - It deep-copies the whole variable binding for every symbol it derives; derivation only
      rebinds top-level keys of ``variables``/``mapping``, so copying those dicts is enough.
    - ``load`` and every ``reset`` translate the PDDL problem to SAS twice (~0.5 s each);
      the translation is a pure function of the texts and its result is only read, so it is
      cached per problem. This also restores ``sys.argv``, which fast_downward overwrites.

    Together about 6x the steps/s and near-free repeated resets (tests/envs/alfworld/test_env.py
    compares the text with and without). ``enable=False`` restores TextWorld's own code.
    """
    import fast_downward
    import textworld.envs.pddl.textgen as textgen
    import textworld.logic as logic

    originals = getattr(textgen, "_agentopsd_originals", None)
    if originals is None:
        originals = (
            textgen._parse_and_convert,
            textgen.copy_context,
            logic.Rule.parse_conjunctive_query,
            fast_downward.pddl2sas,
        )
        textgen._agentopsd_originals = originals
    parse, _, query_rule, pddl2sas = originals
    if not enable:
        textgen._parse_and_convert, textgen.copy_context, logic.Rule.parse_conjunctive_query = originals[:3]
        fast_downward.pddl2sas = pddl2sas
        return
    parsed: dict[tuple[str, str], Any] = {}
    queries: dict[str, Any] = {}

    def cached_parse(text: str, rule_name: str, **kwargs: Any) -> Any:
        if kwargs.get("trace"):
            return parse(text, rule_name=rule_name, **kwargs)
        if (text, rule_name) not in parsed:
            parsed[text, rule_name] = parse(text, rule_name=rule_name)
        return copy.deepcopy(parsed[text, rule_name])

    def cached_query(cls: type, expr: str) -> Any:
        # A query rule is only matched against the state, never mutated: share it.
        if expr not in queries:
            queries[expr] = query_rule.__func__(cls, expr)
        return queries[expr]

    def copy_context(context: dict) -> dict:
        return {
            "state": context["state"],
            "facts": context["facts"],
            "variables": dict(context["variables"]),
            "mapping": dict(context["mapping"]),
            "entity_infos": context["entity_infos"],
        }

    @functools.lru_cache(maxsize=64)
    def translate(domain: str, problem: str, verbose: bool, optimize: bool) -> Any:
        argv = sys.argv
        try:
            return pddl2sas(domain, problem, verbose=verbose, optimize=optimize)
        finally:
            sys.argv = argv

    def cached_pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> Any:
        return translate(domain, problem, verbose, optimize)

    textgen._parse_and_convert = cached_parse
    textgen.copy_context = copy_context
    logic.Rule.parse_conjunctive_query = classmethod(cached_query)
    fast_downward.pddl2sas = cached_pddl2sas


def legacy_command(command: str) -> str:
    """The expert's name for a command: alfworld 0.4 renamed "put X in/on Y" to "move X to Y".

    The handcoded expert still tracks its inventory by looking for "put" in the last command,
    so after a "move" it believes it still holds the object and, in pick_two_obj_and_place,
    walks back and forth instead of fetching the second one.
    """
    if command.startswith("move ") and " to " in command:
        obj, recep = command[len("move ") :].split(" to ", 1)
        return f"put {obj} in/on {recep}"
    return command


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


@functools.lru_cache(maxsize=1)
def _expert_engine() -> Any:
    # One per process: each engine loads its own 34 MB copy of fast_downward's library.
    return load_engine().make()


def play_expert(game_file: Path, max_steps: int) -> list[str] | None:
    """The expert's winning plan for a game file, or None if it does not win within ``max_steps``."""
    problem = json.loads(Path(game_file).read_text())["pddl_problem"]
    env = _expert_engine()
    rng = expert_rng(problem)
    plan: list[str] = []
    env.load(str(game_file))
    with private_random(rng):
        state = env.reset()
    while not state["won"] and len(plan) < max_steps:
        if env.expert_lost:
            return None
        action = state["extra.expert_plan"][0]
        with private_random(rng):
            state, _, _ = env.step(action)
        plan.append(action)
    return plan if state["won"] else None
