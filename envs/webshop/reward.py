"""The WebShop reward (Yao et al. 2022, ``web_agent_site/engine/goal.py``) as pure functions.

    score = r_type * (n_attr + n_opt + [price <= budget]) / (|goal attrs| + |goal options| + 1)

Faithful to goal.py, including its quirks:
- options are scanned from the *purchased* side (each selected option can score once), then
  divided by the number of goal options;
- every option value goes through ``normalize_color`` (first colour word contained wins);
- a goal attribute or a selected option value also matches when it is a substring of the
  product's title, bullet points or description.
The one substitution: r_type's title nouns come from the catalogue's product-type nouns
instead of a spaCy parse of the two titles (no spaCy model can be downloaded here).
Fuzzy matching is ``rapidfuzz.fuzz.token_set_ratio`` with the lower-case/strip-punctuation
preprocessing that the original's ``thefuzz`` applies by default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rapidfuzz import fuzz, utils

from agentopsd.envs.webshop.catalog import Goal, Product
from agentopsd.envs.webshop.data import COLOR_SET

FUZZY_THRESHOLD = 85.0
EXACT_MATCH_OPTIONS = ("size",)


@dataclass(frozen=True)
class TypeReward:
    r_type: float
    query_match: bool
    category_match: bool
    title_score: float


def fuzzy_ratio(a: str, b: str) -> float:
    """Token-set ratio in [0, 100], thefuzz-style preprocessing (empty strings give 0)."""
    return fuzz.token_set_ratio(a, b, processor=utils.default_process)


def normalize_color(value: str) -> str:
    """First colour word of COLOR_SET contained in ``value``, else ``value`` (goal.py's rule)."""
    for color in COLOR_SET:
        if color in value:
            return color
    return value


def product_text(product: Product) -> tuple[str, str, str]:
    """Title, joined bullet points and description, lower-cased: where substring matches look."""
    return product.title.lower(), " ".join(product.bullet_points).lower(), product.description.lower()


def _in_text(value: str, texts: Iterable[str]) -> bool:
    return any(value in t for t in texts)


def type_reward(product: Product, goal: Goal) -> TypeReward:
    """r_type: 1 on query / >= 2 category levels / > 20% title nouns; 0.5 otherwise; 0.1 under 10%; 0 at none."""
    query_match = product.query == goal.query
    category_match = len(set(product.category_path) & set(goal.category_path)) >= 2
    wanted = set(goal.nouns)
    # goal.py gives 0.2 when the goal title has no nouns (then only query/category decide).
    title_score = len(set(product.nouns) & wanted) / len(wanted) if wanted else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return TypeReward(r_type, query_match, category_match, title_score)


def attribute_matches(product: Product, goal_attributes: Sequence[str]) -> int:
    """How many goal attributes the product has (fuzzy > 85 on its attributes, or in its text)."""
    texts = product_text(product)
    count = 0
    for g_attr in goal_attributes:
        if any(fuzzy_ratio(p_attr, g_attr) > FUZZY_THRESHOLD for p_attr in product.attributes):
            count += 1
        elif _in_text(g_attr, texts):
            count += 1
    return count


def option_matches(product: Product, goal_options: Sequence[str], selected: Mapping[str, str]) -> int:
    """How many *selected* options hit a goal option: exact for size, fuzzy > 85 otherwise, or in text."""
    goal_values = [normalize_color(v) for v in goal_options]
    texts = product_text(product)
    count = 0
    for name, raw in selected.items():
        value = normalize_color(raw)
        if name.lower() in EXACT_MATCH_OPTIONS:
            matched = value in goal_values
        else:
            matched = any(fuzzy_ratio(g, value) > FUZZY_THRESHOLD for g in goal_values)
        if matched or _in_text(value, texts):
            count += 1
    return count


def webshop_score(product: Product, goal: Goal, selected: Mapping[str, str]) -> float:
    """The episode score in [0, 1] (see module docstring); ``selected`` maps option name -> value."""
    r_type = type_reward(product, goal).r_type
    n_attr = attribute_matches(product, goal.attributes)
    n_opt = option_matches(product, [v for _, v in goal.options], selected)
    # goal.py skips the price term only for a non-positive budget; every generated goal has one.
    r_price = float(product.price <= goal.price_upper) if goal.price_upper > 0 else 0.0
    total = (n_attr + n_opt + r_price) / (len(goal.attributes) + len(goal.options) + 1)
    return total * r_type
