"""The process's random generators (torch's CPU generator, numpy's global one, Python's) saved into a
checkpoint and restored from it, so a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture() -> dict:
    """The three generators' states in plain types: checkpoints load with torch.load(weights_only=True),
    which rejects numpy arrays."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "python": random.getstate()}


def restore(state: dict) -> None:
    """Set the three generators to a :func:`capture`'d state."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
