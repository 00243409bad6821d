"""Every registered ``agentopsd/*`` environment keeps the contract the trainer reads (``agentopsd.envs.base.TextEnv``)."""

from __future__ import annotations

import gymnasium as gym
import pytest

import agentopsd.envs  # noqa: F401  (registers the ids)
from agentopsd.envs.base import TextEnv, check_contract, env_class, has_state_snapshot, steps_thread_safe

IDS = sorted(k for k in gym.registry if k.startswith("agentopsd/"))


def test_every_family_registers_ids():
    families = {i.split("/")[1].split("-")[0] for i in IDS}
    assert {"BabyAI", "ALFWorld", "WebShop", "SearchQA"} <= families


@pytest.mark.parametrize("env_id", [pytest.param(i, marks=pytest.mark.alfworld) if "ALFWorld" in i else i for i in IDS])
def test_registered_env_keeps_the_contract(env_id):
    if "ALFWorld" in env_id:
        pytest.importorskip("alfworld")
    check_contract(env_id)


def test_the_ground_truth_panel_is_offered_by_the_env_class_not_its_name():
    assert has_state_snapshot("agentopsd/BabyAI-PickupObj-v0")
    assert not has_state_snapshot("agentopsd/WebShop-v0")  # no snapshot: the report draws no panel
    assert not has_state_snapshot("agentopsd/ALFWorld-v0")  # exact but slow (replays its commands): the report skips it
    assert env_class("agentopsd/SearchQA-v0").__name__ == "SearchQAEnv"


def test_alfworld_opts_out_of_worker_threads():
    """ALFWorld swaps the process's ``random`` state around every engine call: it steps on the caller's thread
    (env.num_threads and rollout.overlap_waves fall back to serial); the other families step on worker threads."""
    assert not steps_thread_safe(env_class("agentopsd/ALFWorld-v0"))
    for env_id in ("agentopsd/BabyAI-PickupObj-v0", "agentopsd/WebShop-v0", "agentopsd/SearchQA-v0"):
        assert steps_thread_safe(env_class(env_id))


def test_a_broken_env_is_named():
    class NoSkillKey(gym.Env):
        num_tasks = 1

        def __init__(self, split="train"):
            self.split = split

        def reset(self, *, seed=None, options=None):
            return "start", {"task": "walk"}

        def step(self, action):
            return "x", 0.0, False, False, {"won": False, "action_valid": False}

        def expert_action(self):
            return "go"

    assert isinstance(NoSkillKey(), TextEnv)
    if "tests/NoSkillKey-v0" not in gym.registry:
        gym.register("tests/NoSkillKey-v0", entry_point=NoSkillKey)
    with pytest.raises(AssertionError, match=r"reset info\['skill_key'\]"):
        check_contract("tests/NoSkillKey-v0")
