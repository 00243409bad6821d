"""Fault injection for tests: an env wrapper that raises at random, reproducibly."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class FaultInjectionWrapper(gym.Wrapper):
    """Raises ``RuntimeError("injected fault ...")`` in ``reset`` with probability
    ``p_reset`` and in ``step`` with probability ``p_step``.

    The draws come from the wrapper's own ``numpy`` Generator seeded with ``seed``, so a
    fault pattern is the same on every run and independent of the env's ``np_random``.
    The fault is raised before the wrapped env is called: its state is untouched.
    """

    def __init__(self, env: gym.Env, p_reset: float = 0.0, p_step: float = 0.0, seed: int = 0) -> None:
        for name, p in (("p_reset", p_reset), ("p_step", p_step)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
        super().__init__(env)
        self.p_reset, self.p_step = p_reset, p_step
        self.fault_rng = np.random.default_rng(seed)
        self.injected = 0
        """How many faults this wrapper has raised."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        if self.fault_rng.random() < self.p_reset:
            self.injected += 1
            raise RuntimeError(f"injected fault in reset (seed={seed}, options={options})")
        return self.env.reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        if self.fault_rng.random() < self.p_step:
            self.injected += 1
            raise RuntimeError(f"injected fault in step (action={str(action)[:40]!r})")
        return self.env.step(action)
