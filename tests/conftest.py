"""Shared fixtures: a toy text environment and a tiny policy for trainer tests."""

from __future__ import annotations

import importlib.util
import os
import sys

# OpenMP threads that spin while waiting made torch work 10-40x slower whenever another process
# shared the cores (measured here); passive waiting costs nothing on an idle machine. Must be set
# before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from pathlib import Path

import gymnasium as gym
import pytest
import torch

from agentopsd.envs.base import action_space, observation_space

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine OpenMP's
# spinning threads made a tiny rollout 15x slower (21 s against 1.3 s, measured here).
torch.set_num_threads(int(os.environ.get("AGENTOPSD_TEST_THREADS", "1")))

TOY_ID = "tests/Walk-v0"
WALK_SKILLS = str(Path(__file__).parent / "data" / "walk_skills.json")


class WalkEnv(gym.Env):
    """Walk right from 0 to the goal on a line. Actions ``left``/``right``; success at the goal."""

    metadata = {"render_modes": []}

    def __init__(self, split: str = "train") -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.observation_space, self.action_space = observation_space(), action_space()
        self.goals = [2, 3, 4, 5] if split == "train" else [2, 3, 4]
        self.num_tasks = len(self.goals)
        self.pos = self.goal = 0

    def _info(self, valid: bool = True) -> dict:
        return {"task": f"walk to position {self.goal}", "admissible_actions": ["left", "right"], "skill_key": "walk",
                "task_type": "walk", "won": self.pos == self.goal, "action_valid": valid, "expert_steps": self.goal}

    def _obs(self) -> str:
        return f"You are at position {self.pos}. The goal is at position {self.goal}."

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        idx = (options or {}).get("task_index", int(self.np_random.integers(self.num_tasks)))
        self.goal, self.pos = self.goals[idx], 0
        return self._obs(), self._info()

    def step(self, action):
        action = str(action).strip().lower()
        if action not in ("left", "right"):
            return f"Unknown action {action[:20]!r}. " + self._obs(), 0.0, False, False, self._info(False)
        self.pos = max(0, self.pos + (1 if action == "right" else -1))
        won = self.pos == self.goal
        return self._obs(), float(won), won, False, self._info()

    def expert_action(self) -> str:
        return "right" if self.pos < self.goal else "left"


if TOY_ID not in gym.registry:
    gym.register(TOY_ID, entry_point=WalkEnv, max_episode_steps=10)


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    """``train.py experiment=<name>_tiny`` once per test session, shared by every test that reads such a run
    (babyai_tiny also writes its report): returns ``run(experiment) -> (output folder, stdout)``."""
    done: dict[str, tuple[Path, str]] = {}

    def run(experiment: str) -> tuple[Path, str]:
        if experiment not in done:
            from tests.test_train import run_train

            out = tmp_path_factory.mktemp("tiny") / experiment
            extra = ["report=true"] if experiment == "babyai_tiny" else []
            proc = run_train(f"experiment={experiment}", f"output_dir={out}", "trainer.enable_progress_bar=false", *extra)
            done[experiment] = (out, proc.stdout)
        return done[experiment]

    return run


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture()
def tiny_walk_policy(tiny_cache):
    from agentopsd.models.tiny import tiny_policy

    return tiny_policy(TOY_ID, skills=WALK_SKILLS, vocab_size=450, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, text_episodes=6, cache_dir=tiny_cache)


@pytest.fixture(scope="module")
def smollm2_recipe_bench():
    """benchmarks/smollm2_recipe.py as a module (the benchmark and the recipe's tests read it)."""
    spec = importlib.util.spec_from_file_location("smollm2_recipe", Path(__file__).resolve().parents[1] / "benchmarks" / "smollm2_recipe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["smollm2_recipe"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(config, items):
    """The end-to-end (``slow``) tests first, in their usual order: with ``-n 2`` a run of several minutes then
    starts early beside the other worker, and the last minutes hold short tests that spread over both workers,
    instead of one worker finishing a 5-minute test alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
