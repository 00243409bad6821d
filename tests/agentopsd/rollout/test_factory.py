"""The rollout a run's settings describe: the vLLM engine's arguments and the colocated engine's sync and sleep."""

from __future__ import annotations

import torch
from torch import nn

from agentopsd.config import EnvConfig, RolloutConfig
from agentopsd.rollout.factory import engine_sleep, engine_sync, vllm_engine_kwargs


def test_engine_arguments_name_the_loaded_weights_only_on_a_fresh_run():
    env = EnvConfig(id="toy", max_prompt_tokens=300)
    rollout = RolloutConfig(backend="vllm", max_new_tokens=20, vllm={"gpu_memory_utilization": 0.3, "enforce_eager": None})
    fresh = vllm_engine_kwargs(env, rollout, seed=7, iterations_done=0)
    # None settings are left to the engine's defaults; the prompt plus the reply bound the sequence
    assert fresh == {"seed": 7, "max_model_len": 320, "gpu_memory_utilization": 0.3, "loaded_step": 0}
    # a resumed run's engine loaded the base weights, not the checkpoint's: it must sync before step 1
    assert vllm_engine_kwargs(env, rollout, seed=7, iterations_done=3)["loaded_step"] is None
    # rollout.vllm may pin it
    pinned = RolloutConfig(backend="vllm", vllm={"loaded_step": 5})
    assert vllm_engine_kwargs(env, pinned, seed=0, iterations_done=3)["loaded_step"] == 5


class _Engine:
    def __init__(self, colocated: bool) -> None:
        self.calls: list = []
        if colocated:
            self.sleep = lambda: self.calls.append("sleep")

    def sync_weights(self, model, **kwargs) -> None:
        self.calls.append(("sync", kwargs))


def test_a_colocated_engine_drops_the_gradients_syncs_by_step_and_sleeps():
    model = nn.Linear(2, 2)
    model.weight.grad = torch.ones(2, 2)
    engine = _Engine(colocated=True)
    engine_sync(engine, model, step=4)
    engine_sleep(engine)
    assert model.weight.grad is None
    assert engine.calls == [("sync", {"step": 4}), "sleep"]
    # the transformers backend: a plain sync, gradients kept, nothing to put to sleep
    model.weight.grad = torch.ones(2, 2)
    plain = _Engine(colocated=False)
    engine_sync(plain, model, step=4)
    engine_sleep(plain)
    assert model.weight.grad is not None and plain.calls == [("sync", {})]


def test_a_warm_started_policy_is_synced_before_the_first_rollout():
    env, rollout = EnvConfig(id="x", max_prompt_tokens=100), RolloutConfig(backend="vllm", max_new_tokens=28)
    assert vllm_engine_kwargs(env, rollout, seed=0, iterations_done=0, weights_as_loaded=False)["loaded_step"] is None
    assert vllm_engine_kwargs(env, rollout, seed=0, iterations_done=0, weights_as_loaded=True)["loaded_step"] == 0


def test_the_vllm_rollout_config_sets_the_engine_step_token_budget():
    from pathlib import Path

    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(__file__).parents[3] / "conf" / "rollout" / "vllm.yaml")
    kwargs = vllm_engine_kwargs(EnvConfig(id="x"), instantiate(cfg), seed=0, iterations_done=0)
    assert kwargs["max_num_batched_tokens"] == 8192
