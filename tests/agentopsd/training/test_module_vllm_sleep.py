"""The colocated engine's dance around the update, at the module level, against a sleep-capable fake vLLM
(:mod:`tests.fakes.fake_engine`): every rollout and evaluation syncs the weights the update made (the
cache released before the engine wakes, weights woken before they load, the KV cache after), every use
ends in sleep; a warm-started policy reaches the engine before its first rollout; an out-of-memory error
names the rank and the phase."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from agentopsd.callbacks.evaluation import EvaluationCallback
from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig
from agentopsd.credit.algorithms import Algorithm
from agentopsd.rollout import base as rollout_base
from agentopsd.training.module import AgentRLModule
from agentopsd.training.oom import DeviceOutOfMemory
from tests.agentopsd.training.test_module import fit
from tests.conftest import TOY_ID, WALK_SKILLS
from tests.fakes import fake_engine


@pytest.fixture
def fake_vllm():
    fake_engine.install(sleep_available=True)
    yield fake_engine
    fake_engine.uninstall()


@pytest.fixture
def policy_folder(tiny_walk_policy, tmp_path):
    model, tokenizer = tiny_walk_policy
    folder = tmp_path / "policy"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer, str(folder)


def vllm_module(policy_folder, *, weights_as_loaded: bool = True, iterations: int = 2) -> AgentRLModule:
    model, tokenizer, folder = policy_folder
    return AgentRLModule(
        model, tokenizer, algorithm=Algorithm(),
        env=EnvConfig(id=TOY_ID, skills=WALK_SKILLS, max_turns=3, output_format="action"),
        rollout=RolloutConfig(backend="vllm", max_new_tokens=6, recompute_old_logprobs=True,
                              vllm={"enable_sleep_mode": True, "gpu_memory_utilization": 0.3, "dtype": "float32"}),
        optim=OptimConfig(lr=1e-2, ppo_epochs=1, num_mini_batches=2, micro_batch_size=4),
        evaluation=EvalConfig(num_tasks=2),
        num_iterations=iterations, model_path=folder, weights_as_loaded=weights_as_loaded,
    )


def kinds(events: list[tuple]) -> list[str]:
    """The events' names with repeats collapsed (a rollout's turns generate several times, an update steps
    several times): the order of the dance, not its counts."""
    names = [e[0] if e[0] != "wake_up" else f"wake_up:{'+'.join(e[1])}" for e in events]
    return [k for k, _ in itertools.groupby(names)]


WAKE = ["release", "wake_up:weights", "load", "release", "wake_up:kv_cache", "reset_prefix_cache"]
"""Before a sleeping engine generates: the update's cached blocks released, the weights woken and loaded, the
sync's own temporaries released, then the KV cache woken, and the prefix cache (keys of old weights) reset."""


def test_two_iterations_and_an_evaluation_sync_sleep_release_and_wake_in_order(fake_vllm, policy_folder):
    module = vllm_module(policy_folder)
    fit(module, 2, EvaluationCallback(before_training=False, at_end=True))
    # iteration 1: the engine loaded the run's own folder (step 0) and is awake (it reserved its memory at its start:
    # no cache to empty for it): nothing to sync, it generates, then sleeps;
    # iteration 2 and the evaluation: the update's weights go in before it generates, and it sleeps again
    assert kinds(fake_vllm.EVENTS) == (
        ["generate", "sleep", "optimizer_step"]
        + WAKE + ["generate", "sleep", "optimizer_step"]
        + WAKE + ["generate", "sleep"]
    ), " ".join(kinds(fake_vllm.EVENTS))
    (llm,) = fake_vllm.FakeLLM.instances
    assert fake_vllm.DEVICE.freed_by_sleep == [1.0, 1.0, 1.0]  # each sleep freed all the engine held
    # the evaluation generated with exactly the policy's trained weights (and iteration 2 with others)
    assert llm.generated_with[-1] == fake_vllm.weights_checksum(module.model)
    assert llm.generated_with[0] != llm.generated_with[-1]


def test_a_skipped_cache_release_runs_out_of_memory_when_the_engine_wakes(fake_vllm, policy_folder, monkeypatch):
    """The regression of waking the engine beside the update's cached blocks: the simulated device refuses."""
    monkeypatch.setattr(rollout_base, "release_device_cache", lambda: None)
    module = vllm_module(policy_folder)
    with pytest.raises(DeviceOutOfMemory, match=r"rank 0 of 1 ran out of device memory during rollout: simulated"):
        fit(module, 2)


def test_the_first_rollout_after_a_warm_start_uses_the_warm_started_weights(fake_vllm, policy_folder):
    model = policy_folder[0]
    with torch.no_grad():  # a warm start: the policy moved away from the folder the engine loads
        for p in model.parameters():
            p.add_(0.01)
    module = vllm_module(policy_folder, weights_as_loaded=False, iterations=1)
    module.evaluate()  # the evaluation before training
    # the engine is awake (just started): the weights go in with no cache emptied first
    assert kinds(fake_vllm.EVENTS)[:2] == ["load", "reset_prefix_cache"], kinds(fake_vllm.EVENTS)
    (llm,) = fake_vllm.FakeLLM.instances
    assert llm.generated_with[0] == fake_vllm.weights_checksum(model)


def test_a_fresh_run_needs_no_sync_before_its_first_rollout(fake_vllm, policy_folder):
    module = vllm_module(policy_folder, iterations=1)
    module.evaluate()
    assert "load" not in kinds(fake_vllm.EVENTS)  # the engine loaded these very weights from the folder


def test_optimizer_states_leave_the_device_between_updates(fake_vllm, policy_folder, monkeypatch):
    """optim.offload_optimizer: the states leave the device before the engine wakes (and the cache is released)
    and come back as soon as it sleeps, before the scoring, the update and any checkpoint."""
    from agentopsd.training import module as module_lib

    def record(name, real):
        def run(*args, **kwargs):
            fake_vllm.EVENTS.append((name,))
            return real(*args, **kwargs)
        return run

    monkeypatch.setattr(module_lib, "offload_optimizer_states", record("offload", module_lib.offload_optimizer_states))
    monkeypatch.setattr(module_lib, "restore_optimizer_states", record("restore", module_lib.restore_optimizer_states))
    module = vllm_module(policy_folder)
    module.optim_cfg = dataclasses.replace(module.optim_cfg, offload_optimizer=True)
    fit(module, 2)
    assert kinds(fake_vllm.EVENTS) == (
        ["offload", "generate", "sleep", "restore", "optimizer_step"]
        + ["offload"] + WAKE + ["generate", "sleep", "restore", "optimizer_step"]
    ), " ".join(kinds(fake_vllm.EVENTS))
    assert not module._states_offloaded
