"""Deterministic BM25 search over the generated catalogue (stands in for WebShop's Lucene index).

A product's document is its title, attributes, category path and type phrase. Ties are
broken by catalogue order, so the same query always returns the same ranking.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter, defaultdict

from agentopsd.envs.webshop.catalog import Product, build_catalog

TOP_K = 50
"""Results kept per query, as in the original (get_top_n_product_from_keywords, 50)."""
K1, B = 1.5, 0.75
_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def document_text(product: Product) -> str:
    return " ".join((product.title, *product.attributes, *product.category_path, product.query))


class BM25Index:
    """Okapi BM25 with an inverted index; ``search`` returns catalogue positions, best first."""

    def __init__(self, documents: list[str]) -> None:
        self.size = len(documents)
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        lengths = []
        for doc_id, text in enumerate(documents):
            counts = Counter(tokenize(text))
            lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                self.postings[term].append((doc_id, tf))
        self.lengths = lengths
        self.avg_length = sum(lengths) / max(len(lengths), 1)

    def idf(self, term: str) -> float:
        df = len(self.postings.get(term, ()))
        return math.log(1.0 + (self.size - df + 0.5) / (df + 0.5))

    def search(self, query: str, top_k: int = TOP_K) -> list[int]:
        scores: dict[int, float] = defaultdict(float)
        for term in sorted(set(tokenize(query))):  # fixed order: float sums identical everywhere
            idf = self.idf(term)
            for doc_id, tf in self.postings.get(term, ()):
                norm = K1 * (1.0 - B + B * self.lengths[doc_id] / self.avg_length)
                scores[doc_id] += idf * tf * (K1 + 1.0) / (tf + norm)
        ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
        return [doc_id for doc_id, _ in ranked[:top_k]]


@functools.lru_cache(maxsize=4)
def build_index(seed: int = 0) -> BM25Index:
    """The cached index of ``build_catalog(seed)``."""
    return BM25Index([document_text(p) for p in build_catalog(seed).products])


def search_asins(query: str, seed: int = 0, top_k: int = TOP_K) -> tuple[str, ...]:
    products = build_catalog(seed).products
    return tuple(products[i].asin for i in build_index(seed).search(query, top_k))
