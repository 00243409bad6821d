"""Asynchronous rollouts' refusals that the config alone decides fire in ``validate_config``, before any model loads
(the producer itself would refuse them only at the first training rollout: after loading, sharding, the engine's start
and the first evaluation)."""

from __future__ import annotations

import pytest

from agentopsd.run.validation import ConfigError, validate_config
from tests.test_configs import _resolve, cfg_for

NO_MODEL = ["model=qwen2.5-3b", "model.path=/nonexistent/Qwen2.5-3B-Instruct"]
"""A model that does not exist: a check that comes after the model's resolution (or its load) fails on it instead."""


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer=cpu", "rollout.devices=[1]"], r"needs the trainer on GPUs and trainer.accelerator=cpu: drop rollout.devices"),
    (["trainer=gpu", "rollout.weight_transport=collective"], r"collective on GPUs needs rollout.devices"),
    (["trainer=gpu", "rollout.devices=[1,2]"], r"lists 2 GPUs for 1 training processes per node"),
    (["trainer=ddp", "trainer.accelerator=gpu", "trainer.devices=2", "rollout.devices=[2]"], r"lists 1 GPUs for 2 training"),
    (["trainer=gpu", "rollout.devices=[0]"], r"shares GPU 0 with the training"),
    (["trainer=ddp", "trainer.accelerator=gpu", "trainer.devices=[2,3]", "rollout.devices=[3,4]"], r"shares GPU 3"),
])
def test_rollout_worker_placement_is_refused_before_any_model_loads(overrides, message):
    cfg = _resolve(cfg_for("experiment=babyai_tiny", *NO_MODEL, "rollout.max_staleness=1", *overrides))
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["trainer=gpu", "rollout.devices=[1]"],
    ["trainer=ddp", "trainer.accelerator=gpu", "trainer.devices=2", "rollout.devices=[2,3]"],
    ["trainer=ddp", "rollout.devices=[2,3]"],  # devices=auto: known only once the strategy starts (checked there)
    ["trainer=cpu", "rollout.weight_transport=collective"],  # gloo on CPU
])
def test_rollout_worker_placements_that_hold_pass(overrides):
    validate_config(_resolve(cfg_for("experiment=babyai_tiny", "rollout.max_staleness=1", *overrides)))
