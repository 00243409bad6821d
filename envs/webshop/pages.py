"""Pages and action grammar of WebShop's text mode, as pure functions over a frozen page state.

Pages: search -> results (10 per page) -> item -> description / features, and the done page
after ``click[buy now]``. Clickables use the original's lower-case names: ``back to search``,
``next >``, ``< prev``, product ASINs (or titles), option values, ``description``,
``features``, ``buy now``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from agentopsd.envs.webshop.catalog import Catalog, Product

RESULTS_PER_PAGE = 10
BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE = "back to search", "next >", "< prev"
DESCRIPTION, FEATURES, BUY_NOW = "description", "features", "buy now"
SEARCH_PLACEHOLDER = "search[<your query>]"
"""Stands for every search action in admissible_actions while the search box is shown."""
SEARCH, RESULTS, ITEM, DONE = "search", "results", "item", "done"
_ACTION = re.compile(r"^(search|click)\[(.*)\]$", re.DOTALL)


@dataclass(frozen=True)
class PageState:
    """Where the shopper is. ``searched`` lists every query of the episode (the expert reads it)."""

    page: str = SEARCH
    """One of search, results, item, description, features, done."""
    query: str = ""
    results: tuple[str, ...] = ()
    page_num: int = 1
    asin: str = ""
    selected: tuple[tuple[str, str], ...] = ()
    searched: tuple[str, ...] = ()

    @property
    def num_pages(self) -> int:
        return max(1, -(-len(self.results) // RESULTS_PER_PAGE))

    def page_asins(self) -> tuple[str, ...]:
        start = (self.page_num - 1) * RESULTS_PER_PAGE
        return self.results[start:start + RESULTS_PER_PAGE]


@dataclass(frozen=True)
class Transition:
    state: PageState
    valid: bool
    message: str
    """Why the action was rejected ('' when valid)."""
    bought: bool = False


def parse_action(action: str) -> tuple[str, str] | None:
    """``search[x]`` / ``click[x]`` -> (kind, x) on a normalized action; None if neither."""
    match = _ACTION.match(action)
    if match is None:
        return None
    return match.group(1), match.group(2).strip()


def clickables(state: PageState, catalog: Catalog) -> list[str]:
    """What can be clicked on the current page, in page order."""
    if state.page == RESULTS:
        out = [BACK_TO_SEARCH]
        out += [PREV_PAGE] if state.page_num > 1 else []
        out += [NEXT_PAGE] if state.page_num < state.num_pages else []
        return out + [a.lower() for a in state.page_asins()]
    if state.page == ITEM:
        values = [v for _, vals in catalog.by_asin[state.asin].options for v in vals]
        return [BACK_TO_SEARCH, PREV_PAGE, *values, DESCRIPTION, FEATURES, BUY_NOW]
    if state.page in (DESCRIPTION, FEATURES):
        return [BACK_TO_SEARCH, PREV_PAGE]
    return []


def admissible_actions(state: PageState, catalog: Catalog) -> list[str]:
    search = [SEARCH_PLACEHOLDER] if state.page == SEARCH else []
    return search + [f"click[{c}]" for c in clickables(state, catalog)]


def _select(product: Product, selected: tuple[tuple[str, str], ...], value: str) -> tuple[tuple[str, str], ...]:
    chosen = dict(selected)
    for name, values in product.options:
        if value in values:
            chosen[name] = value
    return tuple((name, chosen[name]) for name, _ in product.options if name in chosen)


def _click(state: PageState, target: str, catalog: Catalog) -> Transition:
    ok = lambda s: Transition(s, True, "")  # noqa: E731
    if target == BACK_TO_SEARCH and state.page in (RESULTS, ITEM, DESCRIPTION, FEATURES):
        return ok(PageState(searched=state.searched))
    if state.page == RESULTS:
        if target == NEXT_PAGE and state.page_num < state.num_pages:
            return ok(replace(state, page_num=state.page_num + 1))
        if target == PREV_PAGE and state.page_num > 1:
            return ok(replace(state, page_num=state.page_num - 1))
        for asin in state.page_asins():
            if target in (asin.lower(), catalog.by_asin[asin].title.lower()):
                return ok(replace(state, page=ITEM, asin=asin, selected=()))
    elif state.page == ITEM:
        product = catalog.by_asin[state.asin]
        if target == PREV_PAGE:  # back to the same results page; options reset as in the original
            return ok(replace(state, page=RESULTS, asin="", selected=()))
        if target in (DESCRIPTION, FEATURES):
            return ok(replace(state, page=target))
        if target == BUY_NOW:
            return Transition(replace(state, page=DONE), True, "", bought=True)
        if any(target in values for _, values in product.options):
            return ok(replace(state, selected=_select(product, state.selected, target)))
    elif state.page in (DESCRIPTION, FEATURES) and target == PREV_PAGE:
        return ok(replace(state, page=ITEM))
    return Transition(state, False, f"there is no '{target[:60]}' to click on this page")


def step_page(state: PageState, action: str, catalog: Catalog,
              search: Callable[[str], tuple[str, ...]]) -> Transition:
    """Apply a normalized action; invalid actions leave the state unchanged and say why."""
    if state.page == DONE:
        return Transition(state, False, "the episode is over: you already bought an item")
    parsed = parse_action(action)
    if parsed is None:
        return Transition(state, False, "actions look like search[query] or click[button]")
    kind, arg = parsed
    if kind == "search":
        if state.page != SEARCH:
            return Transition(state, False, "there is no search box here: click[back to search] first")
        if not arg:
            return Transition(state, False, "the search query is empty")
        results = search(arg)
        return Transition(PageState(page=RESULTS, query=arg, results=results,
                                    searched=(*state.searched, arg)), True, "")
    return _click(state, arg, catalog)


def _item_lines(product: Product, selected: tuple[tuple[str, str], ...]) -> list[str]:
    lines = [f"{name}: " + " ".join(f"[{v}]" for v in values) for name, values in product.options]
    chosen = ", ".join(f"{k}: {v}" for k, v in selected) or "none"
    return lines + [f"Selected options: {chosen}", product.title, f"Price: ${product.price:.2f}",
                    "Rating: N.A.", "[Description]", "[Features]", "[Buy Now]"]


def render(state: PageState, catalog: Catalog, instruction: str, score: float = 0.0) -> str:
    """The observation text of the current page (brackets mark what can be clicked)."""
    head = ["WebShop", f"Instruction: {instruction}"]
    if state.page == SEARCH:
        return "\n".join([*head, "[Search]", "Type search[your query] to look for products."])
    if state.page == DONE:
        chosen = ", ".join(f"{k}: {v}" for k, v in state.selected) or "none"
        return "\n".join(["Thank you for shopping with us!", f"Purchased: {state.asin} (options: {chosen})",
                          f"Your score (min 0.0, max 1.0): {score:.4f}"])
    lines = [*head, "[Back to Search]"]
    if state.page == RESULTS:
        lines.append(f"Page {state.page_num} of {state.num_pages} (Total results: {len(state.results)}) "
                     f"for '{state.query}'")
        lines += ["[< Prev]"] if state.page_num > 1 else []
        lines += ["[Next >]"] if state.page_num < state.num_pages else []
        for asin in state.page_asins():
            product = catalog.by_asin[asin]
            lines += [f"[{asin}]", product.title, f"${product.price:.2f}"]
        if not state.results:
            lines.append("No products matched your query.")
        return "\n".join(lines)
    product = catalog.by_asin[state.asin]
    lines.append("[< Prev]")
    if state.page == ITEM:
        return "\n".join(lines + _item_lines(product, state.selected))
    if state.page == DESCRIPTION:
        return "\n".join(lines + [product.description])
    return "\n".join(lines + [f"- {b}" for b in product.bullet_points])
