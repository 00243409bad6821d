"""WebShop-compatible shopping environment over a generated catalogue (``agentopsd/WebShop-v0``)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from agentopsd.envs.base import action_space, clean_text, normalize_action, observation_space
from agentopsd.envs.webshop.catalog import Catalog, Goal, build_catalog
from agentopsd.envs.webshop.pages import (
    BACK_TO_SEARCH,
    BUY_NOW,
    DONE,
    ITEM,
    NEXT_PAGE,
    PREV_PAGE,
    RESULTS,
    SEARCH,
    PageState,
    admissible_actions,
    render,
    step_page,
)
from agentopsd.envs.webshop.reward import webshop_score
from agentopsd.envs.webshop.search import search_asins

ENV_ID = "agentopsd/WebShop-v0"
MAX_EPISODE_STEPS = 15
KEYWORD_PAGES = 2
"""Result pages the expert scans for its keyword query before it searches the goal title."""
_EXPERT_STEP_CAP = 40

Options = tuple[tuple[str, str], ...]


def expert_keyword_query(goal: Goal) -> str:
    """The instruction's key words: product type and goal attributes."""
    return normalize_action(f"{goal.query} {' '.join(goal.attributes)}")


def winning_options(catalog: Catalog, goal: Goal, asin: str) -> Options | None:
    """The options to select on ``asin`` for a 1.0 score, or None when no choice scores 1.0."""
    product = catalog.by_asin[asin]
    wanted = dict(goal.options)
    chosen = tuple((name, wanted[name] if wanted.get(name) in values else values[0])
                   for name, values in product.options)
    return chosen if webshop_score(product, goal, dict(chosen)) >= 1.0 else None


def expert_next(state: PageState, goal: Goal, winnable: Callable[[str], Options | None]) -> str:
    """The oracle's action: keyword search, scan two pages, else search the goal title; pick options; buy."""
    keyword_query = expert_keyword_query(goal)
    if state.page == SEARCH:
        query = keyword_query if keyword_query not in state.searched else normalize_action(goal.name)
        return f"search[{query}]"
    if state.page == RESULTS:
        on_page = state.page_asins()
        ordered = ([goal.asin] if goal.asin in on_page else []) + [a for a in on_page if a != goal.asin]
        for asin in ordered:
            if winnable(asin) is not None:
                return f"click[{asin.lower()}]"
        page_limit = KEYWORD_PAGES if state.query == keyword_query else state.num_pages
        if state.page_num < min(page_limit, state.num_pages):
            return f"click[{NEXT_PAGE}]"
        return f"click[{BACK_TO_SEARCH}]"
    if state.page == ITEM:
        target = winnable(state.asin)
        if target is None:
            return f"click[{PREV_PAGE}]"
        current = dict(state.selected)
        for name, value in target:
            if current.get(name) != value:
                return f"click[{value}]"
        return f"click[{BUY_NOW}]"
    if state.page == DONE:
        return f"click[{BUY_NOW}]"  # nothing is left to do; the env rejects any action now
    return f"click[{PREV_PAGE}]"  # description / features page


class WebShopEnv(gym.Env[str, str]):
    """Shop for the product an instruction describes, in WebShop's text pages.

    A generated catalogue (1,200 products, 5 categories) and 600 WebShop-style instructions
    (``agentopsd.envs.webshop.catalog``); the eval split is a fixed list of 100 of them.

    ## Action Space
    Text, ``agentopsd.envs.base.action_space()``, lower-cased and whitespace-collapsed before parsing:
    - ``search[<query>]`` on the search page (BM25 over title, attributes, category);
    - ``click[<name>]`` with a clickable of the page: ``back to search``, ``next >``,
      ``< prev``, a product's ASIN or title on the results page, an option value, ``description``,
      ``features``, ``buy now`` on the item page.
    The whole action must be one command. Anything else is rejected with an explanation,
    ``info["action_valid"] = False`` and no state change. ``info["admissible_actions"]`` lists
    ``click[...]`` for every clickable plus the literal ``search[<your query>]`` while the
    search box is shown (it stands for any search).

    ## Observation Space
    Text, ``agentopsd.envs.base.observation_space()``: the instruction and the current page (search,
    results with ten products per page, item with its options, description, features).

    ## Rewards
    0 until ``click[buy now]``, then the WebShop score (``agentopsd.envs.webshop.reward.webshop_score``):
    ``r_type * (attribute matches + option matches + [price <= budget]) / (#attributes + #options + 1)``.
    ``info["score"]`` holds it; ``info["won"]`` is True iff the score is 1.0.

    ## Episode End
    Terminates on ``click[buy now]`` (won or not). ``gymnasium.make`` truncates after
    15 steps (``max_episode_steps``).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, split: str = "train", render_mode: str | None = None) -> None:
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.catalog = build_catalog()
        self.split = split
        self._tasks = self.catalog.split(split)
        self.render_mode = render_mode
        self.observation_space = observation_space()
        self.action_space = action_space()
        self._task_index = 0
        self._goal = self.catalog.goals[self._tasks[0]]
        self._state = PageState()
        self._score = 0.0
        self._winnable: dict[str, Options | None] = {}
        self._obs = ""

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    def _pick_task(self, options: dict[str, Any] | None) -> int:
        if options and "task_index" in options:
            index = options["task_index"]
            if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < self.num_tasks:
                raise ValueError(f"task_index must be an int in [0, {self.num_tasks - 1}] for split "
                                 f"{self.split!r}, got {index!r}")
            return int(index)
        return int(self.np_random.integers(self.num_tasks))

    def _is_winnable(self, asin: str) -> Options | None:
        if asin not in self._winnable:
            self._winnable[asin] = winning_options(self.catalog, self._goal, asin)
        return self._winnable[asin]

    def _info(self, valid: bool) -> dict[str, Any]:
        return {
            "task": self._goal.instruction,
            "admissible_actions": admissible_actions(self._state, self.catalog),
            "skill_key": self._goal.category,
            "task_type": self._goal.category,
            "task_index": self._task_index,
            "won": self._score >= 1.0,
            "action_valid": valid,
            "score": self._score,
            "page": self._state.page,
        }

    def _render_page(self) -> str:
        return render(self._state, self.catalog, self._goal.instruction, self._score)

    def expert_steps(self) -> int:
        """Steps the expert needs from the current state (-1 if it does not buy within a cap)."""
        state = self._state
        for steps in range(1, _EXPERT_STEP_CAP + 1):
            action = normalize_action(expert_next(state, self._goal, self._is_winnable))
            transition = step_page(state, action, self.catalog, search_asins)
            if transition.bought:
                return steps
            state = transition.state
        return -1

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._task_index = self._pick_task(options)
        self._goal = self.catalog.goals[self._tasks[self._task_index]]
        self._state = PageState()
        self._score = 0.0
        self._winnable = {}
        self._obs = clean_text(self._render_page())
        info = self._info(valid=True)
        info["expert_steps"] = self.expert_steps()
        return self._obs, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        text = normalize_action(action)
        transition = step_page(self._state, text, self.catalog, search_asins)
        reward, terminated = 0.0, False
        if transition.valid:
            self._state = transition.state
            if transition.bought:
                product = self.catalog.by_asin[self._state.asin]
                self._score = webshop_score(product, self._goal, dict(self._state.selected))
                reward, terminated = self._score, True
            self._obs = clean_text(self._render_page())
        else:
            shown = text[:80] + ("..." if len(text) > 80 else "")
            self._obs = clean_text(f"Invalid action '{shown}': {transition.message}.\n{self._render_page()}")
        return self._obs, reward, terminated, False, self._info(transition.valid)

    def expert_action(self) -> str:
        """The oracle's next action (wins every generated instruction within 15 steps)."""
        return expert_next(self._state, self._goal, self._is_winnable)

    def render(self) -> str | None:
        return self._obs if self.render_mode == "ansi" else None


def register_envs() -> None:
    """Register ``agentopsd/WebShop-v0`` (idempotent; string entry point keeps import cheap)."""
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point="agentopsd.envs.webshop.env:WebShopEnv",
                     max_episode_steps=MAX_EPISODE_STEPS, kwargs={"split": "train"})
