"""A vLLM engine in an asynchronous worker on the trainer's own GPU never sleeps: validate_config refuses it, in one line
naming the fix, where the memory plan's arithmetic says that GPU cannot hold it beside the trainer."""

from __future__ import annotations

import importlib.util

import pytest

from agentopsd.run.validation import ConfigError, validate_config
from agentopsd.tools import memory
from agentopsd.tools.memory import colocated_async_engine_problem, compose_config
from tests.test_configs import _resolve, cfg_for

ONE_GPU_ASYNC = ["experiment=alfworld_3b", "trainer=ddp", "trainer.accelerator=gpu", "trainer.devices=1", "rollout.max_staleness=1"]


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    monkeypatch.setattr(memory, "_cuda_device_count", lambda: 1)
    monkeypatch.setattr(memory, "_cuda_available", lambda: False)


def _problem(*overrides: str) -> str:
    return colocated_async_engine_problem(compose_config([*ONE_GPU_ASYNC, *overrides]), gpu_memory_gib=80)


def test_validate_config_refuses_the_3b_worker_engine_on_the_trainers_gpu_in_one_line(monkeypatch):
    """The issue's case (alfworld_3b, DDP, one 80 GiB GPU, k = 1): 119.65 GiB in the update. Planted defect: the plan
    without the worker says 79.65 GiB fits, and nothing is refused."""
    pytest.importorskip("alfworld")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        validate_config(_resolve(cfg_for(*ONE_GPU_ASYNC)))
    message = str(err.value)
    assert "\n" not in message
    assert "119.65 GiB" in message and "80.00 GiB" in message
    assert "rollout.devices=[...]" in message and "rollout.max_staleness=0" in message


def test_where_the_worker_can_live_it_is_accepted():
    assert _problem()  # the refused case, for contrast
    assert _problem("rollout.devices=[1]") == ""  # a GPU of its own
    assert _problem("rollout.max_staleness=0") == ""  # lockstep: the colocated engine sleeps
    assert _problem("trainer.accelerator=cpu") == ""  # vLLM on CPU: no GPU memory to plan
    assert _problem("rollout=hf", "rollout.max_staleness=1") == ""  # transformers: planned and warned, not refused
    # a small model on a large GPU with small shares: the plan's arithmetic says it fits
    assert colocated_async_engine_problem(compose_config([*ONE_GPU_ASYNC, "model.path=Qwen/Qwen2.5-0.5B-Instruct",
                                                          "rollout.vllm.gpu_memory_utilization=0.2"]),
                                          gpu_memory_gib=141) == ""


def test_without_the_model_sizes_two_engine_shares_decide():
    """An unknown model: only the config's fractions can say it, two shares of half the GPU or more cannot coexist."""
    unknown = "model.path=/nowhere/a-model"
    assert "two shares of rollout.vllm.gpu_memory_utilization=0.5" in _problem(unknown, "rollout.vllm.gpu_memory_utilization=0.5")
    assert _problem(unknown, "rollout.vllm.gpu_memory_utilization=0.4") == ""
