"""The outcome reward and the per-turn penalties, from the collector through collation to the advantages."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch

from agentopsd.config import EnvConfig
from agentopsd.credit.algorithms import AgentOPSD, Algorithm
from agentopsd.rollout.base import Generation, SamplingConfig
from agentopsd.rollout.collector import Collector
from agentopsd.rollout.prompts import PromptBuilder
from agentopsd.training.data import collate_trajectories
from agentopsd.types import TaskSpec
from tests.conftest import TOY_ID, WalkEnv

GRADED_ID = "tests/GradedWalk-v0"


class GradedWalkEnv(WalkEnv):
    """The walk, with a graded score: reaching the goal scores 1, stopping anywhere else scores pos/goal."""

    def step(self, action):
        if str(action).strip().lower() == "stop":
            score = self.pos / self.goal
            return self._obs(), score, True, False, {**self._info(), "won": score == 1.0, "score": score}
        obs, reward, term, trunc, info = super().step(action)
        return obs, reward, term, trunc, {**info, "score": float(info["won"])}


if GRADED_ID not in gym.registry:
    gym.register(GRADED_ID, entry_point=GradedWalkEnv, max_episode_steps=10)


class Scripted:
    """A generator that plays a fixed script: ``scripts[copy][turn]`` is the text copy ``copy`` writes at ``turn``."""

    def __init__(self, scripts: list[list[str]]) -> None:
        self.scripts, self.turn = scripts, 0

    def generate(self, prompts, sampling):
        # the collector passes the active copies in order; in these scripts every copy plays every turn
        out = [Generation((7, 8), (-0.5, -0.5), self.scripts[i][self.turn], "stop") for i in range(len(prompts))]
        self.turn += 1
        return out

    def sync_weights(self, model) -> None:
        pass


def collect(tok, env_id: str, scripts: list[list[str]], **collector_kwargs):
    prompts = PromptBuilder(tok, history_window=2)
    collector = Collector(env_id, Scripted(scripts), prompts, SamplingConfig(max_new_tokens=4), max_turns=len(scripts[0]), **collector_kwargs)
    tasks = [TaskSpec(env_id, "train", 0, 0, group_id=0) for _ in scripts]  # goal 2: two steps right
    try:
        return collector.collect(tasks, with_teacher=False)
    finally:
        collector.close()


def test_a_uniform_outcome_group_gets_zero_advantage_even_with_penalties(tiny_walk_policy):
    """Every copy wins; one wastes a turn on garbage, one on an invalid action. A_seq is 0 for all,
    and the only non-zero advantages are the two offending turns' own tokens."""
    _, tok = tiny_walk_policy
    right, bad_format, invalid = "<action>right</action>", "no tags", "<action>jump</action>"
    scripts = [[right, right, right], [bad_format, right, right], [invalid, right, right], [right, right, right]]
    trajs = collect(tok, TOY_ID, scripts, invalid_penalty=0.1)
    assert all(t.success and t.reward == 1.0 for t in trajs)
    assert [t.total_penalty for t in trajs] == pytest.approx([0.0, 0.1, 0.1, 0.0])
    batch = collate_trajectories(trajs, pad_id=0)
    assert batch.rewards.tolist() == [1.0] * 4 and batch.seq_advantages.tolist() == [0.0] * 4
    batch.student_logprobs = batch.old_logprobs
    batch.teacher_logprobs = batch.old_logprobs + 0.3 * batch.action_mask  # a teacher view with an opinion
    # (GiGPO is left out on purpose: its step level prefers the copies that won in fewer turns, by design)
    for algo in (Algorithm(), AgentOPSD()):
        algo.assign(batch)
        penalized = batch.turn_penalties > 0
        assert penalized.tolist() == [False, False, True, False, False, True, False, False, False, False]
        assert torch.all(batch.advantages[~penalized] == 0), algo.name
        assert torch.allclose(batch.advantages[penalized][batch.action_mask[penalized]], torch.tensor(-0.1))
    no_penalty = collate_trajectories(collect(tok, TOY_ID, scripts, invalid_penalty=0.0), pad_id=0)
    Algorithm().assign(no_penalty)
    assert torch.all(no_penalty.advantages == 0)  # the default reward: nothing distinguishes these copies


def test_penalties_never_reach_the_outcome_reward(tiny_walk_policy):
    """A mixed group: the penalty of a losing copy changes neither R nor A_seq of anyone."""
    _, tok = tiny_walk_policy
    right, left, bad = "<action>right</action>", "<action>left</action>", "garbage"
    scripts = [[right, right, right], [left, bad, left], [right, right, right], [left, left, left]]
    trajs = collect(tok, TOY_ID, scripts, invalid_penalty=0.5)
    batch = collate_trajectories(trajs, pad_id=0)
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert batch.seq_advantages[1].item() == pytest.approx(batch.seq_advantages[3].item())
    Algorithm().assign(batch)
    rows_of_1 = (batch.turn_traj == 1).nonzero().flatten()
    per_turn = [batch.advantages[r][batch.action_mask[r]].mean().item() for r in rows_of_1]
    a1 = batch.seq_advantages[1].item()
    assert per_turn == pytest.approx([a1, a1 - 0.5, a1])  # only the garbage turn moved


def test_graded_score_is_logged_and_a_switch_makes_it_the_reward(tiny_walk_policy):
    _, tok = tiny_walk_policy
    right, stop = "<action>right</action>", "<action>stop</action>"
    scripts = [[right, right, stop], [right, stop, stop], [stop, stop, stop]]  # scores 1, 0.5, 0
    by_success = collect(tok, GRADED_ID, scripts)
    assert [t.score for t in by_success] == [1.0, 0.5, 0.0] and [t.reward for t in by_success] == [1.0, 0.0, 0.0]
    by_score = collect(tok, GRADED_ID, scripts, reward="score")
    assert [t.reward for t in by_score] == [1.0, 0.5, 0.0] and [t.success for t in by_score] == [True, False, False]
    batch = collate_trajectories(by_score, pad_id=0)
    assert batch.success.tolist() == [1.0, 0.0, 0.0]  # the belief prior still reads the success bits
    assert batch.seq_advantages[1].item() == pytest.approx(0.0, abs=1e-6)  # 0.5 is the group mean
    AgentOPSD().assign({**{k: getattr(batch, k) for k in ("seq_advantages", "success", "group_ids", "action_mask", "turn_traj", "turn_index")},
                        "teacher_logprobs": batch.old_logprobs, "student_logprobs": batch.old_logprobs})
    with pytest.raises(ValueError, match="env.reward"):
        EnvConfig(id=TOY_ID, reward="shaped")


def test_turns_record_the_state_they_acted_on(tiny_walk_policy):
    """GiGPO's anchor state is the environment's: a format error (the env never stepped) leaves it as it was."""
    _, tok = tiny_walk_policy
    right, garbage = "<action>right</action>", "garbage"
    (traj,) = collect(tok, TOY_ID, [[right, garbage, right]])
    at = "You are at position {}. The goal is at position 2."
    assert [t.state for t in traj.turns] == [at.format(0), at.format(1), at.format(1)]
    assert traj.turns[0].observation == traj.turns[1].state and "did not follow the format" in traj.turns[1].observation
