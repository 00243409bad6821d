"""Pieces every text environment shares: the contract the trainer reads, the text spaces and action cleaning.

The contract (:class:`TextEnv`) is what the rest of the project may rely on; a new environment family
implements it and registers its ids (see docs/adding-an-environment.md). The contract test
(``tests/envs/test_contract.py``) checks every registered ``agentopsd/*`` id against it.
"""

from __future__ import annotations

import importlib
import importlib.util
import string
from typing import Any, Protocol, runtime_checkable

from gymnasium import spaces

# Gymnasium's default Text charset is alphanumeric only: it rejects spaces and brackets.
CHARSET = frozenset(string.printable)
MAX_OBS_CHARS = 16_384
MAX_ACTION_CHARS = 1_024

RESET_INFO_KEYS = ("task", "skill_key")
"""Keys every ``reset`` info holds: ``task`` (the instruction, str, shown in every prompt) and ``skill_key``
(str, which skills of a SkillBank apply). Optional: ``admissible_actions`` (list of str, shown to the policy
when present), ``task_type`` (str, per-type success), ``expert_steps`` (int, the expert's episode length, -1
unknown)."""
STEP_INFO_KEYS = ("won", "action_valid")
"""Keys every ``step`` info holds: ``won`` (bool, the success bit behind the outcome reward) and ``action_valid``
(bool: False charges the invalid-action penalty; the env's state must not change). Optional:
``admissible_actions`` (replaces the list shown), ``score`` (float in [0, 1], the graded reward
``env.reward=score`` uses)."""


@runtime_checkable
class TextEnv(Protocol):
    """What the trainer, the collector, the evaluation and the study read from an environment.

    ``gym.make(env_id, split=..., max_episode_steps=..., **kwargs)`` builds one; ``split`` is ``train`` or
    ``eval`` (the evaluation's fixed list). Observations and actions are text (``observation_space()``,
    ``action_space()``); ``reset(options={"task_index": i})`` starts task ``i`` of the split deterministically
    (``seed`` alone draws one), and its info holds ``RESET_INFO_KEYS``; ``step`` infos hold ``STEP_INFO_KEYS``.

    Capabilities:

    - ``num_tasks``: how many tasks the split holds (required: the task stream and the evaluation size read it);
    - ``expert_action()``: the env's expert's next action from the current state (required: warm-start
      demonstrations; the ground-truth labels of :mod:`agentopsd.study.groundtruth`);
    - ``state_snapshot``: True when ``copy.deepcopy(env)`` is an exact and cheap snapshot of the episode, so a
      logged trajectory can be replayed from its task index and labelled turn by turn (the run report's
      ground-truth panel is drawn only for such envs; optional, default False);
    - ``lift_step_limit(extra_steps)``: reopen an episode the env's own step limit closed (optional: the expert
      label runs the expert past the episode's budget on a copy);
    - ``thread_safe_step``: False when ``step`` must not run on a worker thread while other instances step or the
      trainer generates (it touches interpreter-wide state); :class:`agentopsd.envs.runner.BatchedRunner` then steps
      inline whatever ``env.num_threads`` says, and ``rollout.overlap_waves`` falls back to serial turns (optional,
      default True: instances share nothing);
    - ``requires``: ``(modules, install hint)`` when the env needs packages outside the core install (an optional
      extra): ``train.py`` checks them before any work and stops in one line with the hint (optional, default none).
    """

    num_tasks: int

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...

    def expert_action(self) -> str: ...


def registration_problem(env_id: str) -> str | None:
    """Why ``env_id`` cannot be made, in one line naming the fix, or None.

    Takes Gymnasium's ``module:Id`` form, as ``gym.make`` does: ``my_pkg.envs:Countdown-v0`` imports
    ``my_pkg.envs`` (which registers ``Countdown-v0``) first, so an environment from your own package needs no
    edit inside this repository.
    """
    import gymnasium as gym

    import agentopsd.envs  # noqa: F401  (registers the agentopsd/* ids)

    module, sep, name = env_id.rpartition(":")
    if sep:
        try:
            importlib.import_module(module)
        except ImportError as err:
            return (f"env.id={env_id}: importing {module} failed ({err}); install your package (pip install -e <its folder>) "
                    "or run from the folder that holds it (python -m agentopsd.run.train ...)")
        if name not in gym.registry:
            return f"env.id={env_id}: importing {module} registered no {name!r}; call gymnasium.register({name!r}, ...) in {module}"
        return None
    if env_id not in gym.registry:
        known = sorted(k for k in gym.registry if k.startswith("agentopsd/"))
        return (f"env.id={env_id!r} is not registered; choose one of {known} (or env=<babyai|alfworld|webshop|searchqa>), "
                "or name your own as <module>:<id> (env.id=my_pkg.envs:Countdown-v0 imports my_pkg.envs first)")
    return None


def env_spec(env_id: str):
    """``gym.spec`` that also takes ``module:Id`` (the module imported first, as ``gym.make`` does)."""
    import gymnasium as gym

    import agentopsd.envs  # noqa: F401  (registers the agentopsd/* ids)

    module, sep, name = env_id.rpartition(":")
    if sep:
        importlib.import_module(module)
    return gym.spec(name)


def env_class(env_id: str) -> type:
    """The class behind a registered id (or ``module:Id``), without building an env (its module is imported, its
    engine is not)."""
    entry = env_spec(env_id).entry_point
    if callable(entry):
        return entry if isinstance(entry, type) else type(entry)
    module, _, name = str(entry).partition(":")
    return getattr(importlib.import_module(module), name)


def steps_thread_safe(env: object) -> bool:
    """May ``env`` (an instance, wrapped or not, or a class) step on a worker thread (``TextEnv.thread_safe_step``)?"""
    raw = env if isinstance(env, type) else getattr(env, "unwrapped", env)  # on a class, ``unwrapped`` is a property object
    return bool(getattr(raw, "thread_safe_step", True))


def missing_requirement(env_id: str) -> str | None:
    """The install hint of ``env_id``'s ``requires`` when one of its modules is not importable here, else None;
    found by the import system without importing the module (a heavy engine stays unloaded)."""
    modules, hint = getattr(env_class(env_id), "requires", ((), ""))
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or blocked install counts as missing
            found = False
        if not found:
            return hint or f"{env_id} needs the {module} package"
    return None


def has_state_snapshot(env_id: str) -> bool:
    """Can a logged episode of ``env_id`` be replayed and labelled by its expert (``TextEnv.state_snapshot``)?"""
    cls = env_class(env_id)
    return bool(getattr(cls, "state_snapshot", False)) and callable(getattr(cls, "expert_action", None))


def check_contract(env_id: str, *, steps: int = 3, **kwargs: Any) -> None:
    """Raise AssertionError naming the broken part of :class:`TextEnv` for ``env_id`` (both splits).

    Resets task 0 of each split, plays ``steps`` expert actions and one invalid action, and checks the info keys,
    their types, that an invalid action leaves the observation's state alone, that a reset of the same task index
    gives the same start, and, where ``state_snapshot`` is set, that a deep copy continued with the same action
    gives the same observation. ``kwargs`` go to ``gym.make``. Used by ``tests/envs/test_contract.py`` on every
    registered ``agentopsd/*`` id.
    """
    import copy

    import gymnasium as gym

    import agentopsd.envs  # noqa: F401

    for split in ("train", "eval"):
        env = gym.make(env_id, split=split, disable_env_checker=True, **kwargs)
        try:
            raw = env.unwrapped
            assert isinstance(raw, TextEnv), f"{env_id}: lacks part of TextEnv (num_tasks, reset, step, expert_action)"
            assert isinstance(raw.num_tasks, int) and raw.num_tasks > 0, f"{env_id} {split}: num_tasks={raw.num_tasks!r}"
            obs, info = env.reset(options={"task_index": 0})
            again, info_again = env.reset(options={"task_index": 0})
            assert (obs, info.get("task")) == (again, info_again.get("task")), f"{env_id} {split}: task 0 resets differently"
            assert isinstance(obs, str) and obs, f"{env_id} {split}: reset gave no text observation"
            for key in RESET_INFO_KEYS:
                assert isinstance(info.get(key), str), f"{env_id} {split}: reset info[{key!r}] is {info.get(key)!r}, not a str"
            _check_admissible(env_id, info)
            obs, _, _, _, bad = env.step("xyzzy plugh 42")
            assert bad.get("action_valid") is False, f"{env_id} {split}: an invalid action has action_valid={bad.get('action_valid')!r}"
            for _ in range(steps):
                action = raw.expert_action()
                assert isinstance(action, str) and action, f"{env_id} {split}: expert_action() gave {action!r}"
                twin = copy.deepcopy(env) if getattr(raw, "state_snapshot", False) else None
                obs, _, terminated, truncated, info = env.step(action)
                if twin is not None:
                    assert twin.step(action)[0] == obs, f"{env_id} {split}: a snapshot continued differently"
                assert isinstance(obs, str), f"{env_id} {split}: step gave a {type(obs).__name__} observation"
                for key in STEP_INFO_KEYS:
                    assert isinstance(info.get(key), bool), f"{env_id} {split}: step info[{key!r}] is {info.get(key)!r}, not a bool"
                assert info["action_valid"], f"{env_id} {split}: the expert's action {action!r} is invalid"
                _check_admissible(env_id, info)
                if terminated or truncated:
                    break
        finally:
            env.close()


def _check_admissible(env_id: str, info: dict[str, Any]) -> None:
    actions = info.get("admissible_actions")
    assert actions is None or (isinstance(actions, list | tuple) and all(isinstance(a, str) for a in actions)), (
        f"{env_id}: admissible_actions must be a list of str, got {actions!r}")


def observation_space(max_length: int = MAX_OBS_CHARS) -> spaces.Text:
    return spaces.Text(min_length=0, max_length=max_length, charset=CHARSET)


def action_space(max_length: int = MAX_ACTION_CHARS) -> spaces.Text:
    return spaces.Text(min_length=0, max_length=max_length, charset=CHARSET)


def clean_text(text: str, max_length: int = MAX_OBS_CHARS) -> str:
    """Keep an observation inside the observation space: printable ASCII, bounded length."""
    out = "".join(ch if ch in CHARSET else "?" for ch in text)
    return out[:max_length]


def normalize_action(action: object) -> str:
    """Lower-case, strip, collapse whitespace; any non-string becomes ''."""
    if not isinstance(action, str):
        return ""
    return " ".join(action.strip().lower().split())
