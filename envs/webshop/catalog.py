"""Deterministic WebShop-style catalogue and instruction generator.

Everything is drawn from a SplitMix64 stream implemented here (not ``random``/``numpy``,
whose streams may change between versions), so the catalogue, its instructions and the
fixed eval split are byte-identical on every machine. ``build_catalog()`` is cached.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass

from agentopsd.envs.rng import SplitMix64
from agentopsd.envs.webshop.data import (
    BENEFITS,
    BRANDS,
    CARE_NOTES,
    DEPARTMENTS,
    LINES,
    OPENERS,
    PRODUCT_TYPES,
    ProductType,
)

PRODUCTS_PER_TYPE = 30
GOALS_PER_TYPE = 15
EVAL_EVERY = 6
"""Instruction i is in the eval split iff i % EVAL_EVERY == 0 (100 of 600)."""
PRICE_RANGE = tuple(10.0 * i for i in range(1, 100))
"""Budget grid of the original goal generator: the budget is a multiple of 10 above the price."""
CATEGORY_SEP = " › "

_ASIN_CHARS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class Product:
    asin: str
    title: str
    category: str
    """Top-level category (the skill_key)."""
    category_path: tuple[str, ...]
    query: str
    nouns: tuple[str, ...]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    price_cents: int
    bullet_points: tuple[str, ...]
    description: str

    @property
    def price(self) -> float:
        return self.price_cents / 100.0

    @property
    def product_category(self) -> str:
        """The path in the original's string form ('a › b › c')."""
        return CATEGORY_SEP.join(self.category_path)


@dataclass(frozen=True)
class Goal:
    """One instruction (a WebShop goal): the fields goal.py's reward reads."""

    index: int
    instruction: str
    asin: str
    category: str
    category_path: tuple[str, ...]
    query: str
    name: str
    """Title of the goal product (its nouns feed r_type)."""
    nouns: tuple[str, ...]
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str], ...]
    """(option name, wanted value) for every option of the goal product."""
    price_upper: float

    @property
    def product_category(self) -> str:
        return CATEGORY_SEP.join(self.category_path)


@dataclass(frozen=True)
class Catalog:
    products: tuple[Product, ...]
    goals: tuple[Goal, ...]
    train: tuple[int, ...]
    """Goal indices of the train split."""
    eval: tuple[int, ...]
    """Goal indices of the fixed eval split (disjoint from train)."""

    @functools.cached_property
    def by_asin(self) -> dict[str, Product]:
        return {p.asin: p for p in self.products}

    def split(self, name: str) -> tuple[int, ...]:
        if name == "train":
            return self.train
        if name == "eval":
            return self.eval
        raise ValueError(f"unknown split {name!r}: choose one of ['train', 'eval']")


def _title_case(text: str) -> str:
    return " ".join(w[:1].upper() + w[1:] for w in text.split())


def _new_asin(rng: SplitMix64, taken: set[str]) -> str:
    while True:
        asin = "B0" + "".join(rng.choice(_ASIN_CHARS) for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _make_product(ptype: ProductType, rng: SplitMix64, taken: set[str]) -> Product:
    brand, line = rng.choice(BRANDS), rng.choice(LINES)
    attrs = rng.sample(ptype.attributes, 3 + rng.below(2))
    options = tuple((name, tuple(rng.sample(values, min(len(values), 2 + rng.below(3)))))
                    for name, values in ptype.options)
    shown = rng.sample(attrs, 2)  # the title names two attributes, like real listings
    title = f"{brand} {line} {_title_case(ptype.name)}, " + ", ".join(_title_case(a) for a in shown)
    low, high = ptype.price
    price_cents = (low + rng.below(high - low)) * 100 + rng.choice((49, 95, 99))
    bullets = tuple(f"{_title_case(a)}: {rng.choice(BENEFITS)}" for a in attrs)
    description = f"The {brand} {line} {ptype.name}. Key features: {', '.join(attrs)}. {CARE_NOTES[ptype.category]}"
    return Product(
        asin=_new_asin(rng, taken), title=title, category=ptype.category,
        category_path=(DEPARTMENTS[ptype.category], *ptype.path), query=ptype.name, nouns=ptype.nouns,
        attributes=tuple(attrs), options=options, price_cents=price_cents,
        bullet_points=bullets, description=description,
    )


def _budget(price: float, rng: SplitMix64) -> float:
    """goal.py's rule: two of the first four grid prices above the price, keep the larger."""
    above = [p for p in PRICE_RANGE if p > price][:4]
    return max(rng.sample(above, 2))


def _article(article: str, words: str) -> str:
    """'a'/'an' agree with the word that follows; 'some'/'a pair of' stay."""
    if article not in ("a", "an"):
        return article
    return "an" if words[:1] in "aeiou" else "a"


def _instruction(ptype: ProductType, attrs: list[str], options: list[tuple[str, str]],
                 budget: float, rng: SplitMix64) -> str:
    opener = rng.choice(OPENERS)
    if rng.below(2):
        words = f"{' '.join(attrs)} {ptype.name}"
        head = f"{opener} {_article(ptype.article, words)} {words}"
    else:
        head = f"{opener} {_article(ptype.article, ptype.name)} {ptype.name}: {', '.join(attrs)}"
    # Option clause in the synthetic-goal style of the original: " with size: m, and color: navy".
    with_opts = " with " + ", and ".join(f"{k}: {v}" for k, v in options) if options else ""
    return f"{head}{with_opts}, and price lower than {budget:.2f} dollars"


def _make_goal(index: int, product: Product, ptype: ProductType, rng: SplitMix64) -> Goal:
    attrs = rng.sample(product.attributes, 1 + rng.below(3))
    options = [(name, rng.choice(values)) for name, values in product.options]
    budget = _budget(product.price, rng)
    return Goal(
        index=index, instruction=_instruction(ptype, attrs, options, budget, rng), asin=product.asin,
        category=product.category, category_path=product.category_path, query=product.query,
        name=product.title, nouns=product.nouns, attributes=tuple(attrs), options=tuple(options),
        price_upper=budget,
    )


def generate_catalog(seed: int = 0) -> Catalog:
    """Build the catalogue from scratch (about 0.1 s); prefer the cached ``build_catalog``."""
    rng = SplitMix64(seed)
    taken: set[str] = set()
    products: list[Product] = []
    goals: list[Goal] = []
    for ptype in PRODUCT_TYPES:
        batch = [_make_product(ptype, rng, taken) for _ in range(PRODUCTS_PER_TYPE)]
        for product in rng.sample(batch, GOALS_PER_TYPE):
            goals.append(_make_goal(len(goals), product, ptype, rng))
        products.extend(batch)
    eval_ids = tuple(i for i in range(len(goals)) if i % EVAL_EVERY == 0)
    train_ids = tuple(i for i in range(len(goals)) if i % EVAL_EVERY != 0)
    return Catalog(products=tuple(products), goals=tuple(goals), train=train_ids, eval=eval_ids)


@functools.lru_cache(maxsize=4)
def build_catalog(seed: int = 0) -> Catalog:
    """The shared, cached catalogue (seed 0 is the one every split and test uses)."""
    return generate_catalog(seed)


def catalog_hash(catalog: Catalog) -> str:
    """SHA-256 of a canonical JSON dump of products, goals and splits."""
    payload = {
        "products": [asdict(p) for p in catalog.products],
        "goals": [asdict(g) for g in catalog.goals],
        "train": list(catalog.train),
        "eval": list(catalog.eval),
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("ascii")).hexdigest()
