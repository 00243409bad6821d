"""A generator wrapper that returns malformed text at a set rate (reliability tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from torch import nn

from agentopsd.rollout.base import Generation, Generator, SamplingConfig

GARBAGE = ("", "</action><action>", "\x00\x1b[31m", "<action>" + "x" * 500, "<think>never closed", "\u202e\u0000 junk")


class MalformedGenerator:
    """Replaces the decoded text of a share of generations with garbage; token ids are kept,
    so the rollout stays a valid training sample whose action simply does not parse."""

    def __init__(self, inner: Generator, rate: float, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rollout.malformed_rate must be in [0, 1], got {rate}")
        self.inner, self.rate = inner, rate
        self.rng = np.random.default_rng(seed)
        self.corrupted = 0

    @property
    def collective(self) -> bool:
        """As the wrapped generator's calls (see :class:`agentopsd.rollout.collector.Collector`)."""
        return getattr(self.inner, "collective", True)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Generation]:
        out = self.inner.generate(prompts, sampling)
        for i, gen in enumerate(out):
            if self.rng.random() < self.rate:
                out[i] = replace(gen, text=GARBAGE[int(self.rng.integers(len(GARBAGE)))])
                self.corrupted += 1
        return out

    def sync_weights(self, model: nn.Module) -> None:
        self.inner.sync_weights(model)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
