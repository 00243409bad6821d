"""agentopsd/rollout/async_rollout.py on the transformers path: the rollout worker tags each turn with the weight
version it generated with, including a version loaded between two turns of one episode, and (``rollout.teacher_scoring
=worker``, ``rollout.overlap_waves=2``) scores the turn's teacher view with that same version.

Deterministic, not timed: the worker holds after iteration 1's turn 0 (generated with version 0) until the trainer
has published version 1 (``WorkerSpec.worker_init``, the test seam), so turn 0 of iteration 1 is version 0's and
every later turn of it version 1's. The weights of each version are kept, and each turn's behaviour and teacher log-probs are compared
with a forward of its tagged version's weights and of the other's. (The vLLM path: tests/agentopsd/rollout/
test_async_vllm.py, through the fake engine.)"""

from __future__ import annotations

import copy
import functools
import os
import time
from pathlib import Path

import gymnasium as gym
import pytest
import torch

from agentopsd.config import EnvConfig, RolloutConfig
from agentopsd.rollout.async_rollout import AsyncRollout, WorkerSpec
from agentopsd.training.data import sample_tasks
from tests.agentopsd.rollout.async_vllm_probe import GAP_TOLERANCE, MOVED, moved, turn_gap
from tests.conftest import TOY_ID, WALK_SKILLS

TASKS_PER_BATCH, GROUP = 2, 2


def hold_after_turn_zero_of_iteration_one(gate: str, waves: int) -> None:
    """The worker's ``worker_init`` (it runs first in the spawned worker): once iteration 1's turn 0 has generated
    (its ``waves`` generate calls, with version 0), the worker says so with ``gate/waiting`` and waits for
    ``gate/go``, which the trainer writes once it has published version 1: turn 1's ``before_turn`` then loads it,
    whatever the timing. The generations themselves are untouched."""
    from agentopsd.rollout.collector import Collector
    from agentopsd.rollout.hf import HFGenerator

    state = {"collects": 0, "calls": 0}
    collect, generate = Collector.collect, HFGenerator.generate

    def counted_collect(self, *args, **kwargs):
        state["collects"], state["calls"] = state["collects"] + 1, 0
        return collect(self, *args, **kwargs)

    def held_generate(self, prompts, sampling):
        out = generate(self, prompts, sampling)
        state["calls"] += 1
        if state["collects"] == 2 and state["calls"] == waves:
            (Path(gate) / "waiting").touch()
            deadline = time.monotonic() + 60
            while not (Path(gate) / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return out

    Collector.collect, HFGenerator.generate = counted_collect, held_generate


def teacher_gap(model: torch.nn.Module, turn) -> float:
    """The largest per-token gap between the turn's engine teacher log-probs and ``model``'s on its teacher view."""
    ids = torch.tensor([list(turn.teacher_prompt_ids) + list(turn.action_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(turn.teacher_prompt_ids) - 1: -1].float()
    own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(turn.action_ids)[:, None])[:, 0]
    return float((own - torch.tensor(turn.teacher_logprobs)).abs().max())


def worker_spec(tokenizer, waves: int, gate: Path) -> WorkerSpec:
    return WorkerSpec(
        tokenizer=tokenizer,
        env=EnvConfig(id=TOY_ID, skills=WALK_SKILLS, max_turns=4, output_format="action", num_threads=2),
        rollout=RolloutConfig(max_new_tokens=6, max_staleness=1, overlap_waves=waves, teacher_scoring="worker"),
        seed=0, rank=0, world=1, with_teacher=True,
        task_fn=functools.partial(sample_tasks, TOY_ID, 4, TASKS_PER_BATCH, GROUP, seed=0),
        start=0, end=2, max_staleness=1, threads=1, parent_pid=os.getpid(), env_spec=gym.spec(TOY_ID),
        worker_init=functools.partial(hold_after_turn_zero_of_iteration_one, str(gate), waves))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("waves", [1, 2])
def test_a_version_loaded_mid_episode_tags_and_scores_the_turns_it_generates(tiny_walk_policy, tmp_path, waves):
    model, tokenizer = tiny_walk_policy
    v0 = copy.deepcopy(model).eval()
    v1 = moved(v0, 0.05, seed=2).eval()
    versions = {0: v0, 1: v1}
    producer = AsyncRollout(worker_spec(tokenizer, waves, tmp_path), v0)
    try:
        first, _ = producer.next_batch(0, lambda: False)
        deadline = time.monotonic() + 60
        while not (tmp_path / "waiting").exists():  # iteration 1's turn 0 is generated, with version 0
            assert producer.process.is_alive() and time.monotonic() < deadline, "the worker never finished iteration 1's turn 0"
            time.sleep(0.01)
        producer.publish(v1, 1)
        (tmp_path / "go").touch()
        second, _ = producer.next_batch(1, lambda: False)
    finally:
        producer.close()
    assert not producer.process.is_alive()
    tags = [[turn.policy_version for turn in t.turns] for t in second]
    assert all(turn.policy_version == 0 for t in first for turn in t.turns)
    assert all(len(t) >= 2 for t in tags), tags  # every goal is >= 2 steps away: each episode has a turn after the load
    assert tags == [[0] + [1] * (len(t) - 1) for t in tags], f"iteration 1's tags (version 1 was loaded before turn 1): {tags}"
    for t in (*first, *second):
        for turn in t.turns:
            v = turn.policy_version
            assert turn_gap(versions[v], turn) < GAP_TOLERANCE, (
                f"turn {turn.index} tagged {v} was generated by other weights (gap {turn_gap(versions[v], turn):.2e}; "
                f"to version {1 - v}: {turn_gap(versions[1 - v], turn):.2e})")
            assert turn_gap(versions[1 - v], turn) > MOVED  # the versions are told apart
            assert teacher_gap(versions[v], turn) < GAP_TOLERANCE, (
                f"turn {turn.index} of version {v}: its teacher view was scored by other weights (gap "
                f"{teacher_gap(versions[v], turn):.2e}; by version {1 - v}: {teacher_gap(versions[1 - v], turn):.2e})")
