"""agentopsd/WebShop-v0: contract, catalogue, reward (hand-computed cases), expert, adapter, skills."""

from __future__ import annotations

import itertools
import sys
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from agentopsd.envs.webshop import env as webshop
from agentopsd.envs.webshop.adapter import WebShopAdapter
from agentopsd.envs.webshop.catalog import Goal, Product, build_catalog, catalog_hash, generate_catalog
from agentopsd.envs.webshop.data import PRODUCT_TYPES
from agentopsd.envs.webshop.reward import (
    attribute_matches,
    fuzzy_ratio,
    normalize_color,
    option_matches,
    product_text,
    type_reward,
    webshop_score,
)
from agentopsd.envs.webshop.search import BM25Index, search_asins
from agentopsd.rollout.skills import SkillBank

webshop.register_envs()
ENV_IDS = [webshop.ENV_ID]
CATEGORIES = {"beauty", "electronics", "fashion", "food", "furniture"}
# Pinned so the eval split is provably the same on every machine; regenerate on purpose only.
CATALOG_SHA256 = "2b71022870801c242a86f6fe6bcd83a08dd4fc6f79a77f2876662e50a1feaee8"


def _env(split: str = "eval") -> webshop.WebShopEnv:
    return webshop.WebShopEnv(split=split)


def _play_expert(env: webshop.WebShopEnv, task_index: int, limit: int = 15) -> tuple[int, dict]:
    _, info = env.reset(options={"task_index": task_index})
    for steps in range(1, limit + 1):
        _, _, terminated, _, info = env.step(env.expert_action())
        assert info["action_valid"]
        if terminated:
            return steps, info
    return limit + 1, info


# ---------------------------------------------------------------- contract
@pytest.mark.parametrize("env_id", ENV_IDS)
def test_check_env_passes(env_id: str) -> None:
    check_env(gym.make(env_id).unwrapped)


def test_registration_is_idempotent_with_default_horizon() -> None:
    webshop.register_envs()
    env = gym.make(webshop.ENV_ID)
    assert env.spec.max_episode_steps == 15
    assert env.unwrapped.split == "train"


def test_reset_info_keys_and_split_sizes() -> None:
    env = _env("train")
    obs, info = env.reset(seed=0)
    for key in ("task", "admissible_actions", "skill_key", "task_type", "task_index", "won", "action_valid",
                "expert_steps"):
        assert key in info
    assert info["task"] in obs and info["skill_key"] in CATEGORIES
    assert info["admissible_actions"] == ["search[<your query>]"]
    assert info["action_valid"] and not info["won"] and 1 <= info["expert_steps"] <= 15
    assert env.num_tasks == 500 and _env("eval").num_tasks == 100
    assert env.reset(options={"task_index": np.int64(5)})[1]["task_index"] == 5  # numpy ints from samplers


def test_bad_options_raise_clear_errors() -> None:
    env = _env()
    with pytest.raises(ValueError, match=r"\[0, 99\]"):
        env.reset(options={"task_index": 100})
    with pytest.raises(ValueError, match="task_index"):
        env.reset(options={"task_index": "3"})
    with pytest.raises(ValueError, match="train.*eval"):
        webshop.WebShopEnv(split="test")
    with pytest.raises(ValueError, match="render_mode"):
        webshop.WebShopEnv(render_mode="human")


def test_seed_determinism() -> None:
    def rollout(seed: int) -> list[str]:
        env = _env("train")
        obs, _ = env.reset(seed=seed)
        seen = [obs]
        for _ in range(4):
            seen.append(env.step(env.expert_action())[0])
        return seen

    assert rollout(7) == rollout(7)
    tasks = {_env("train").reset(seed=s)[1]["task_index"] for s in range(8)}
    assert len(tasks) > 1  # the seed really draws the task


# ---------------------------------------------------------------- pages and grammar
def test_navigation_pages_and_clicks() -> None:
    env = _env()
    env.reset(options={"task_index": 0})
    obs, _, _, _, info = env.step("search[shoes]")
    assert info["page"] == "results" and "Page 1 of 5 (Total results: 50)" in obs
    assert "click[next >]" in info["admissible_actions"] and "click[< prev]" not in info["admissible_actions"]
    assert sum(a.startswith("click[b0") for a in info["admissible_actions"]) == 10
    obs2, _, _, _, info = env.step("click[next >]")
    assert "Page 2 of 5" in obs2 and "click[< prev]" in info["admissible_actions"]
    title_line = obs2.splitlines()[obs2.splitlines().index("[Next >]") + 2]
    obs3, _, _, _, info = env.step(f"click[{title_line}]")  # a product by its title works too
    assert info["page"] == "item" and "Selected options: none" in obs3 and "click[buy now]" in info["admissible_actions"]
    option = next(a for a in info["admissible_actions"] if a.startswith("click[us "))
    obs4, _, _, _, info = env.step(option)
    assert info["action_valid"] and f"Selected options: size: {option[6:-1]}" in obs4
    for action, page in (("click[description]", "description"), ("click[< prev]", "item"),
                         ("click[features]", "features"), ("click[< prev]", "item"),
                         ("click[< prev]", "results"), ("click[back to search]", "search")):
        _, reward, terminated, _, info = env.step(action)
        assert info["action_valid"] and info["page"] == page and reward == 0.0 and not terminated


def test_invalid_actions_change_nothing() -> None:
    env = _env()
    obs, _ = env.reset(options={"task_index": 1})
    for bad in ("", "   ", "click[buy now]", "search[]", "buy it", "x" * 10_000, "search[shoes] please",
                "\x00\x07click[next >]\x1b", "clíck[ünïcode]"):
        obs2, reward, terminated, truncated, info = env.step(bad)
        assert not info["action_valid"] and reward == 0.0 and not terminated and not truncated
        assert obs2.endswith(obs) and info["page"] == "search"
        assert env.observation_space.contains(obs2)
    env.step("search[hair serum]")
    _, _, _, _, info = env.step("search[shampoo]")
    assert not info["action_valid"] and info["page"] == "results"  # no search box on results


@settings(max_examples=80, deadline=None)
@given(action=st.one_of(
    st.text(max_size=300),
    st.text(alphabet=st.characters(max_codepoint=31), max_size=50),
    st.builds(lambda a, b: a + "click[next >]" + b, st.text(max_size=20), st.text(max_size=20)),
    st.sampled_from(["click[b0]", "click[]", "search[" + "q" * 2000 + "]", "click[< prev]"]),
))
def test_step_never_raises(action: str) -> None:
    env = _env()
    env.reset(options={"task_index": 2})
    env.step("search[lipstick]")
    obs, reward, terminated, truncated, info = env.step(action)
    assert env.observation_space.contains(obs)
    assert isinstance(reward, float) and isinstance(info["action_valid"], bool)


# ---------------------------------------------------------------- expert and reward in the env
def test_expert_wins_every_eval_task_within_horizon() -> None:
    env = _env("eval")
    for i in range(env.num_tasks):
        _, info0 = env.reset(options={"task_index": i})
        steps, info = _play_expert(env, i)
        assert info["won"] and info["score"] == 1.0, (i, info["task"])
        assert steps == info0["expert_steps"] <= 15


def test_expert_wins_every_train_task() -> None:
    env = _env("train")
    for i in range(env.num_tasks):  # all 500: about half a second
        steps, info = _play_expert(env, i)
        assert info["won"] and steps <= 15, (i, info["task"])


def test_reward_only_at_buy_and_wrong_option_loses() -> None:
    env = _env()
    env.reset(options={"task_index": 3})
    goal = env.catalog.goals[env.catalog.eval[3]]
    rewards = []
    while True:
        action = env.expert_action()
        if action == "click[buy now]":
            break
        rewards.append(env.step(action)[1])
    assert rewards and all(r == 0.0 for r in rewards)
    product = env.catalog.by_asin[env._state.asin]
    name, wanted = goal.options[0]
    other = next(v for n, vals in product.options if n == name for v in vals if v != wanted)
    env.step(f"click[{other}]")
    _, reward, terminated, _, info = env.step("click[buy now]")
    n = len(goal.attributes) + len(goal.options) + 1
    assert terminated and not info["won"] and reward == pytest.approx((n - 1) / n) and info["score"] == reward
    assert env.step("click[buy now]")[4]["action_valid"] is False


# ---------------------------------------------------------------- catalogue
def test_catalog_sizes_and_splits() -> None:
    cat = build_catalog()
    assert len(cat.products) >= 1000 and len(cat.goals) >= 500
    assert {p.category for p in cat.products} == CATEGORIES
    assert len({p.asin for p in cat.products}) == len(cat.products)
    assert all(len(p.category_path) >= 2 and p.nouns and p.attributes and p.options and p.bullet_points
               for p in cat.products)
    assert len(cat.eval) == 100 and set(cat.eval).isdisjoint(cat.train)
    assert sorted(cat.eval + cat.train) == list(range(len(cat.goals)))
    assert {cat.goals[i].category for i in cat.eval} == CATEGORIES
    for goal in cat.goals:
        product = cat.by_asin[goal.asin]
        assert product.price <= goal.price_upper and f"{goal.price_upper:.2f} dollars" in goal.instruction
        assert set(goal.attributes) <= set(product.attributes)


def test_catalog_is_deterministic_fast_and_cached() -> None:
    start = time.perf_counter()
    first = generate_catalog()
    assert time.perf_counter() - start < 2.0
    assert catalog_hash(first) == catalog_hash(generate_catalog()) == CATALOG_SHA256
    assert build_catalog() is build_catalog()


def test_distractors_really_lose_points() -> None:
    """Pools do not fuzzy-match internally and no product text leaks an attribute/option it lacks."""
    by_name = {t.name: t for t in PRODUCT_TYPES}
    for ptype in PRODUCT_TYPES:
        for a, b in itertools.combinations(ptype.attributes, 2):
            assert fuzzy_ratio(a, b) <= 85, (a, b)
        for name, values in ptype.options:
            for a, b in itertools.combinations(values, 2):
                assert name == "size" or fuzzy_ratio(normalize_color(a), normalize_color(b)) <= 85, (a, b)
    for product in build_catalog().products:
        texts, ptype = product_text(product), by_name[product.query]
        for _, values in ptype.options:
            assert not any(normalize_color(v) in t for v in values for t in texts), product.asin
        for attr in set(ptype.attributes) - set(product.attributes):
            assert not any(attr in t for t in texts), (product.asin, attr)
            assert all(fuzzy_ratio(p, attr) <= 85 for p in product.attributes)


def test_search_is_bm25_and_deterministic() -> None:
    index = BM25Index(["red red shoe", "red shoe", "blue hat", "red shoe"])
    assert index.search("red shoe") == [0, 1, 3]  # tf first, then catalogue order on ties
    assert index.search("zebra") == []
    assert search_asins("wireless earbuds noise cancelling") == search_asins("noise cancelling wireless earbuds")
    assert len(search_asins("hoodie")) == 30  # only products sharing a term: the 30 hoodies
    assert len(search_asins("clothing")) == 50  # capped at 50, like the original


# ---------------------------------------------------------------- reward unit tests (hand computed)
def _product(**kw: object) -> Product:
    base = dict(asin="B0TEST0001", title="Acme Pro Hair Serum, Long Lasting", category="beauty",
                category_path=("beauty & personal care", "hair care", "hair serums"), query="hair serum",
                nouns=("hair", "serum"), attributes=("long lasting", "argan oil"),
                options=(("size", ("1 fl oz", "2 fl oz")), ("color", ("navy", "black"))), price_cents=1999,
                bullet_points=("Argan Oil: made to last",), description="Key features: heat protection.")
    base.update(kw)
    return Product(**base)  # type: ignore[arg-type]


def _goal(**kw: object) -> Goal:
    base = dict(index=0, instruction="i need ...", asin="B0TEST0001", category="beauty",
                category_path=("beauty & personal care", "hair care", "hair serums"), query="hair serum",
                name="Acme Pro Hair Serum", nouns=("hair", "serum"), attributes=("long lasting", "argan oil"),
                options=(("size", "2 fl oz"), ("color", "navy")), price_upper=30.0)
    base.update(kw)
    return Goal(**base)  # type: ignore[arg-type]


def test_score_perfect_and_partial() -> None:
    p, g = _product(), _goal()
    assert webshop_score(p, g, {"size": "2 fl oz", "color": "navy"}) == 1.0
    # (2 attrs + 1 option + price) / (2 + 2 + 1): the wrong size gets no point
    assert webshop_score(p, g, {"size": "1 fl oz", "color": "navy"}) == pytest.approx(4 / 5)
    # over budget: (2 + 2 + 0) / 5
    assert webshop_score(_product(price_cents=3001), g, {"size": "2 fl oz", "color": "navy"}) == pytest.approx(4 / 5)
    # nothing selected, one attribute missing: (1 + 0 + 1) / 5
    assert webshop_score(_product(attributes=("long lasting",), bullet_points=()), g, {}) == pytest.approx(2 / 5)


def test_attribute_matching_fuzzy_and_text() -> None:
    p = _product(attributes=("lasting long",), bullet_points=(), title="Acme Serum")
    assert attribute_matches(p, ["long lasting"]) == 1  # token-set ratio 100
    assert attribute_matches(p, ["heat protection"]) == 1  # found in the description
    assert attribute_matches(p, ["paraben free", "argan oil"]) == 0
    assert fuzzy_ratio("Long-Lasting!", "long lasting") == 100.0 and fuzzy_ratio("", "x") == 0.0


def test_option_matching_rules() -> None:
    p = _product()
    assert option_matches(p, ["2 fl oz"], {"size": "2 fl oz"}) == 1
    assert option_matches(p, ["2 fl oz"], {"size": "2 fl oz (pack of 2)"}) == 0  # size is exact
    assert option_matches(p, ["dark navy"], {"color": "navy"}) == 1  # colours normalized, then fuzzy
    assert option_matches(p, ["navy"], {"color": "black"}) == 0
    # goal.py quirk: a selected value found in the product text counts even if not asked
    assert option_matches(_product(title="Acme Navy Serum"), ["black"], {"color": "navy"}) == 1


def test_normalize_color() -> None:
    assert normalize_color("black forest") == "black"
    assert normalize_color("dark navy") == "navy"
    assert normalize_color("unscented") == "unscented"
    assert normalize_color("") == ""


def test_type_reward_levels() -> None:
    g = _goal()
    other_path = ("electronics", "audio", "speakers")
    assert type_reward(_product(), g).r_type == 1.0
    # only half the nouns shared, other query and path: title score 0.5 > 0.2 -> 1.0
    assert type_reward(_product(query="x", category_path=other_path, nouns=("hair", "oil")), g).r_type == 1.0
    # 1 of 5 nouns = 0.2 is not > 0.2 -> 0.5
    g5 = _goal(nouns=("a", "b", "c", "d", "hair"))
    assert type_reward(_product(query="x", category_path=other_path, nouns=("hair",)), g5).r_type == 0.5
    # 1 of 12 < 0.1 -> 0.1 even though the query matches
    g12 = _goal(nouns=tuple("abcdefghijk") + ("hair",))
    assert type_reward(_product(nouns=("hair",)), g12).r_type == 0.1
    # no shared noun -> 0, which zeroes the score
    p0 = _product(nouns=("speaker",))
    assert type_reward(p0, g).r_type == 0.0 and webshop_score(p0, g, {"size": "2 fl oz", "color": "navy"}) == 0.0
    # two category levels shared counts as a match
    assert type_reward(_product(query="x", nouns=("hair", "x", "y", "z", "w", "v")), g).category_match


# ---------------------------------------------------------------- adapter
class _FakeServer:
    def __init__(self) -> None:
        self.goals = [{"category": "fashion", "asin": f"B{i:09d}", "name": "red shoe",
                       "goal_options": {"size": "9"}} for i in range(600)]
        self.user_sessions: dict[str, dict] = {}


class _FakeOriginal:
    """Just the surface of web_agent_site's WebAgentTextEnv that the adapter touches."""

    def __init__(self) -> None:
        self.server, self.session, self.page, self.steps = _FakeServer(), "", "search", 0
        self.instruction_text = ""

    def reset(self, session: int) -> tuple[str, None]:
        self.session, self.page = str(session), "search"
        self.server.user_sessions[self.session] = {"goal": self.server.goals[session]}
        self.instruction_text = f"buy goal {session}"
        return f"WebShop [SEP] Instruction: [SEP] {self.instruction_text} [SEP] Search", None

    def get_available_actions(self) -> dict:
        asin = self.server.goals[int(self.session)]["asin"].lower()
        clickables = {"search": ["search"], "results": ["back to search", asin],
                      "item": ["back to search", "9", "10", "buy now"]}[self.page]
        return {"has_search_bar": self.page == "search", "clickables": clickables}

    def step(self, action: str) -> tuple[str, float, bool, None]:
        self.steps += 1
        self.page = {"search": "results", "results": "item", "item": "item"}[self.page]
        done = action == "click[buy now]"
        return f"page {self.page}", (1.0 if done else 0.0), done, None


def test_adapter_reports_missing_original_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "web_agent_site", None)  # force "not installed"
    with pytest.raises(ImportError, match="princeton-nlp/WebShop"):
        WebShopAdapter()


def test_adapter_maps_the_original_to_the_contract() -> None:
    fake = _FakeOriginal()
    env = WebShopAdapter(split="eval", env=fake)
    assert env.num_tasks == 500 and WebShopAdapter(split="train", env=fake).num_tasks == 100
    obs, info = env.reset(options={"task_index": 4})
    assert info["task"] == "buy goal 4" and info["skill_key"] == "fashion" and info["expert_steps"] == -1
    assert info["admissible_actions"] == ["search[<your query>]"]
    _, _, _, _, bad = env.step("click[buy now]")
    assert not bad["action_valid"] and fake.steps == 0  # rejected without touching the original
    for _ in range(4):
        obs, reward, terminated, _, info = env.step(env.expert_action())
        assert info["action_valid"]
    assert terminated and reward == 1.0 and info["won"] and info["admissible_actions"] == []
    with pytest.raises(ValueError, match="task_index"):
        env.reset(options={"task_index": 500})


# ---------------------------------------------------------------- skills
def test_skills_match_the_env_categories() -> None:
    bank = SkillBank.for_env("webshop")
    assert {c.name for c in bank.categories} == CATEGORIES
    env = _env()
    seen = set()
    for i in range(0, env.num_tasks, 5):
        _, info = env.reset(options={"task_index": i})
        assert bank.retrieve(info["skill_key"], info["task"]).categories[0] == info["skill_key"]
        # the task text alone (unknown key) still finds the right category
        assert bank.retrieve("unknown", info["task"]).categories[:1] == (info["skill_key"],)
        seen.add(info["skill_key"])
    assert seen == CATEGORIES
    unrelated = bank.retrieve("maze", "go to the red door and pick up the key")
    assert unrelated.categories == () and unrelated.general
