"""SplitMix64 (Steele et al. 2014): a tiny, version-proof generator for the generated content.

``random`` and numpy streams may change between versions; the generated catalogues and corpora
must be byte-identical on every machine, so they draw from this one instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")
_MASK = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK

    def next64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next64() % n  # modulo bias is about n / 2**64: irrelevant here

    def choice(self, seq: Sequence[T]) -> T:
        return seq[self.below(len(seq))]

    def shuffle(self, items: list) -> None:
        """In-place Fisher-Yates."""
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]

    def sample(self, seq: Sequence[T], k: int) -> list[T]:
        """k distinct items, kept in the order of ``seq`` (partial Fisher-Yates on indices)."""
        idx = list(range(len(seq)))
        for i in range(k):
            j = i + self.below(len(idx) - i)
            idx[i], idx[j] = idx[j], idx[i]
        return [seq[i] for i in sorted(idx[:k])]
