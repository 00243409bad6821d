"""Ranks with engines of their own (vLLM, one per rank: generating is no collective) play their rollouts
alone and agree once at the end, not every turn; a stop requested on one rank still stops every rank."""

from __future__ import annotations

import pytest

from agentopsd.rollout.base import SamplingConfig
from agentopsd.rollout.collector import Collector
from agentopsd.rollout.hf import HFGenerator
from agentopsd.rollout.prompts import PromptBuilder
from agentopsd.training.distributed import SimulatedWorld
from agentopsd.training.preemption import RolloutStopped
from agentopsd.types import TaskSpec
from tests.conftest import TOY_ID


class OwnEngine(HFGenerator):
    """A generator whose calls are no collectives (as a vLLM engine per rank)."""

    collective = False


def _collect(policy, rank: int, max_turns: int, stop_at_turn: int | None, generator_cls):
    model, tokenizer = policy
    calls = {"n": 0}
    generator = generator_cls(model, tokenizer)
    real = generator.generate

    def counted(prompts, sampling):
        calls["n"] += 1
        return real(prompts, sampling)

    generator.generate = counted
    collector = Collector(TOY_ID, generator, PromptBuilder(tokenizer, output_format="action"),
                          SamplingConfig(max_new_tokens=4), max_turns=max_turns,
                          stop_requested=lambda: stop_at_turn is not None and calls["n"] >= stop_at_turn)
    # unequal data: rank 0 plays 4 episodes of goal 3, rank 1 one episode of goal 1
    tasks = [TaskSpec(TOY_ID, "train", seed=10 * rank + c, task_index=3 if rank == 0 else 1, group_id=rank) for c in range(4 - 3 * rank)]
    return collector.collect(tasks, with_teacher=False)


def run_two(policy, *, max_turns=(6, 2), stop_rank: int | None = None, generator_cls=OwnEngine) -> tuple[SimulatedWorld, dict]:
    world = SimulatedWorld(2, timeout=30)
    outcome = world.run(lambda r: _collect(policy, r, max_turns[r], 1 if r == stop_rank else None, generator_cls),
                        expected=(RolloutStopped,))
    return world, outcome


def test_own_engines_agree_once_per_rollout_not_every_turn(tiny_walk_policy):
    world, outcome = run_two(tiny_walk_policy)
    assert all(isinstance(v, list) for v in outcome.values()), outcome
    assert len(outcome[0]) == 4 and len(outcome[1]) == 1
    for log in world.logs:
        assert log == [("agree", "rollout/end")], log


def test_a_stop_on_one_rank_stops_both(tiny_walk_policy):
    world, outcome = run_two(tiny_walk_policy, stop_rank=1)
    assert all(isinstance(v, RolloutStopped) for v in outcome.values()), outcome


@pytest.mark.parametrize("stop_rank", [None, 0])
def test_collective_generators_still_agree_every_turn(tiny_walk_policy, stop_rank):
    class Synced(HFGenerator):
        def __init__(self, model, tokenizer):
            super().__init__(model, tokenizer, synced_gpus=False)  # no real forwards to pair in threads

        collective = True

    world, outcome = run_two(tiny_walk_policy, max_turns=(3, 3), stop_rank=stop_rank, generator_cls=Synced)
    turns = [log.count(("agree", "rollout/turn")) for log in world.logs]
    assert turns[0] == turns[1] >= 2 and all(("agree", "rollout/end") not in log for log in world.logs)
    if stop_rank is not None:
        assert all(isinstance(v, RolloutStopped) for v in outcome.values()), outcome
