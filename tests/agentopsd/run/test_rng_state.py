"""The RNG state a checkpoint carries: a resumed process draws what the saved one would have drawn next."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from agentopsd.run import rng_state


def _draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_restore_replays_the_draws_after_capture_even_through_a_weights_only_load():
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    _draws()  # move every generator off its seed
    buf = io.BytesIO()
    torch.save({"rng": rng_state.capture()}, buf)
    expected = _draws()
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    buf.seek(0)
    # the checkpoint loader's setting: plain types and tensors only
    rng_state.restore(torch.load(buf, weights_only=True)["rng"])
    assert _draws() == expected
