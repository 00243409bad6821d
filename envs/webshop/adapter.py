"""Adapter: the original WebShop text environment behind this project's env contract.

``WebShopAdapter`` wraps ``web_agent_site.envs.WebAgentTextEnv`` (princeton-nlp/WebShop)
when that package is installed; it is not registered with gymnasium because the original
needs its own data download. The mapping:

- observation: the original's text observation, cleaned into ``agentopsd.envs.base`` spaces;
- ``admissible_actions``: ``search[<your query>]`` while the page has a search bar, plus
  ``click[<clickable>]`` for the page's clickables (``get_available_actions``);
- actions outside that grammar are rejected here (``action_valid=False``, no call to the
  original), so both WebShop environments share one grammar;
- ``skill_key``/``task_type``: the goal's category (beauty, electronics, fashion, food,
  furniture), the same keys as ``agentopsd/WebShop-v0``; ``won``: reward == 1.0.
Splits follow the usual protocol on human goals: eval = goals 0-499, train = the rest.
"""

from __future__ import annotations

import importlib
import numbers
from typing import Any

import gymnasium as gym

from agentopsd.envs.base import action_space, clean_text, normalize_action, observation_space
from agentopsd.envs.webshop.pages import BUY_NOW, NEXT_PAGE, SEARCH_PLACEHOLDER, parse_action

EVAL_GOALS = 500
INSTALL_HINT = (
    "the original WebShop (module 'web_agent_site') is not installed. Clone "
    "https://github.com/princeton-nlp/WebShop, run its setup.sh (downloads the product data and "
    "spaCy models, builds the search index; needs Java) and `pip install -e .` it into this "
    "environment. The PyPI package named 'webshop' is an unrelated stub. Without it, use "
    "agentopsd/WebShop-v0, the offline WebShop-compatible environment."
)


def load_original_env_class() -> type:
    """``web_agent_site.envs.WebAgentTextEnv``, or an ImportError that says how to install it."""
    try:
        module = importlib.import_module("web_agent_site.envs")
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return module.WebAgentTextEnv


class WebShopAdapter(gym.Env[str, str]):
    """The original WebShop text env with this project's info keys (see module docstring).

    ``env`` lets a caller pass an already built original env (it owns a large index);
    otherwise one is built with ``observation_mode`` and ``env_kwargs``.
    """

    metadata = {"render_modes": []}

    def __init__(self, split: str = "train", observation_mode: str = "text", env: Any = None,
                 **env_kwargs: Any) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"unknown split {split!r}: choose one of ['train', 'eval']")
        if env is None:
            env = load_original_env_class()(observation_mode=observation_mode, **env_kwargs)
        self.env = env
        self.split = split
        num_goals = len(env.server.goals)
        self._goal_ids = list(range(min(EVAL_GOALS, num_goals))) if split == "eval" else \
            list(range(EVAL_GOALS, num_goals))
        if not self._goal_ids:
            raise ValueError(f"split {split!r} is empty: the original env has {num_goals} goals")
        self.observation_space = observation_space()
        self.action_space = action_space()
        self._task_index = 0
        self._obs = ""
        self._won = False
        self._done = False
        self._clicked: set[str] = set()

    @property
    def num_tasks(self) -> int:
        return len(self._goal_ids)

    def _goal(self) -> dict[str, Any]:
        return self.env.server.user_sessions[self.env.session]["goal"]

    def _available(self) -> tuple[bool, list[str]]:
        found = self.env.get_available_actions()
        # The original lower-cases the clicked text before looking it up, so option values with
        # capitals can never be clicked there: leave them out rather than promise them.
        clickables = [c for c in found["clickables"] if c != "search" and c == c.lower()]
        return bool(found["has_search_bar"]), clickables

    def _admissible(self) -> list[str]:
        has_search, clickables = self._available()
        return ([SEARCH_PLACEHOLDER] if has_search else []) + [f"click[{c}]" for c in clickables]

    def _info(self, valid: bool) -> dict[str, Any]:
        category = str(self._goal().get("category", "webshop"))
        return {
            "task": str(self.env.instruction_text),
            "admissible_actions": [] if self._done else self._admissible(),
            "skill_key": category,
            "task_type": category,
            "task_index": self._task_index,
            "won": self._won,
            "action_valid": valid,
        }

    def _is_valid(self, action: str) -> bool:
        parsed = parse_action(action)
        if parsed is None or self._done:
            return False
        kind, arg = parsed
        has_search, clickables = self._available()
        return (has_search and bool(arg)) if kind == "search" else arg in clickables

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options and "task_index" in options:
            index = options["task_index"]
            if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < self.num_tasks:
                raise ValueError(f"task_index must be an int in [0, {self.num_tasks - 1}], got {index!r}")
        else:
            index = int(self.np_random.integers(self.num_tasks))
        self._task_index = index = int(index)
        obs, _ = self.env.reset(session=self._goal_ids[index])
        self._obs, self._won, self._done, self._clicked = clean_text(str(obs)), False, False, set()
        info = self._info(valid=True)
        info["expert_steps"] = -1  # the original has no planner to count with
        return self._obs, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        text = normalize_action(action)
        if not self._is_valid(text):
            return (clean_text(f"Invalid action '{text[:80]}'.\n{self._obs}"), 0.0, False, False,
                    self._info(valid=False))
        parsed = parse_action(text)
        if parsed is not None and parsed[0] == "click":
            self._clicked.add(parsed[1])
        obs, reward, done, _ = self.env.step(text)
        self._obs, self._done = clean_text(str(obs)), bool(done)
        self._won = self._done and float(reward) >= 1.0
        return self._obs, float(reward), self._done, False, self._info(valid=True)

    def expert_action(self) -> str:
        """Best effort (not guaranteed to win): search the goal title, open the goal ASIN, pick its options, buy."""
        goal = self._goal()
        has_search, clickables = self._available()
        if has_search:
            return f"search[{normalize_action(str(goal.get('name') or goal.get('query', '')))}]"
        asin = str(goal.get("asin", "")).lower()
        if asin in clickables:
            return f"click[{asin}]"
        wanted = goal.get("goal_options", {})
        values = wanted.values() if isinstance(wanted, dict) else wanted
        for value in (str(v).lower() for v in values):
            if value in clickables and value not in self._clicked:
                return f"click[{value}]"
        if BUY_NOW in clickables:
            return f"click[{BUY_NOW}]"
        return f"click[{NEXT_PAGE}]" if NEXT_PAGE in clickables else "click[back to search]"

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()
