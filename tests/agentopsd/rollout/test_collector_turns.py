"""agentopsd/rollout/collector.py: each recorded turn is aligned with the step it took. Turn k of an episode has
index k; the prompt of both views built from the observation it acted on and the turns before it; its action; the
state it acted in; the observation, reward, validity and penalty that its own action caused (a format error steps
nothing and keeps the state). And one row per turn in the collated batch, in that order, holding that turn's tokens.

A scripted generator plays every episode the same way: turn 0 ``right``, turn 1 a format error, turn 2 ``jump`` (an
invalid action, which steps the env), then ``right`` until the goal: an episode towards goal g has g + 2 turns."""

from __future__ import annotations

import pytest
import torch

from agentopsd.config import EnvConfig
from agentopsd.rollout import factory
from agentopsd.rollout.base import Generation, SamplingConfig
from agentopsd.rollout.collector import Collector, format_error_note, history_entry
from agentopsd.rollout.prompts import PromptBuilder
from agentopsd.training.data import collate_trajectories
from agentopsd.types import TaskSpec
from tests.conftest import TOY_ID, WALK_SKILLS

SCRIPT = {0: "<action>right</action>", 1: "no tags here", 2: "<action>jump</action>"}
PENALTY = 0.1
GOALS = [2, 3, 4, 5]  # WalkEnv's training goals by task index


class ScriptedGenerator:
    """Turn t's text for every prompt (t counted by calls: one call per wave per turn, empty waves included)."""

    def __init__(self, tokenizer, waves: int) -> None:
        self.tokenizer, self.waves, self.calls = tokenizer, waves, 0

    def generate(self, prompts, sampling):
        turn = self.calls // self.waves
        self.calls += 1
        text = SCRIPT.get(turn, "<action>right</action>")
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return [Generation(ids, tuple(-0.01 * (i + 1) for i in range(len(ids))), text, "stop") for _ in prompts]


def expected_turns(goal: int) -> list[dict]:
    """(state acted in, action, observation after, reward, valid, penalty) of each turn towards ``goal``; the
    observation None: the format error note."""
    def at(pos: int) -> str:
        return f"You are at position {pos}. The goal is at position {goal}."

    out = [dict(state=at(0), action="right", observation=at(1), reward=0.0, valid=True, penalty=0.0),
           dict(state=at(1), action="", observation=None, reward=0.0, valid=False, penalty=PENALTY),  # a format error
           dict(state=at(1), action="jump", observation="Unknown action 'jump'. " + at(1), reward=0.0, valid=False, penalty=PENALTY)]
    for pos in range(1, goal):  # the state is the env's last observation: the invalid step's, before the first right
        out.append(dict(state=out[-1]["observation"], action="right", observation=at(pos + 1), reward=float(pos + 1 == goal), valid=True, penalty=0.0))
    return out


@pytest.mark.parametrize("waves", [1, 2])
def test_every_turn_records_its_own_step(tiny_walk_policy, waves):
    _, tokenizer = tiny_walk_policy
    prompts = PromptBuilder(tokenizer, output_format="action")
    bank = factory.skill_bank(EnvConfig(id=TOY_ID, skills=WALK_SKILLS))
    collector = Collector(TOY_ID, ScriptedGenerator(tokenizer, waves), prompts, SamplingConfig(max_new_tokens=8), max_turns=10,
                          invalid_penalty=PENALTY, skill_bank=bank, num_threads=2, overlap_waves=waves)
    tasks = [TaskSpec(TOY_ID, "train", seed=c, task_index=c % 4, group_id=c) for c in range(6)]
    try:
        trajectories = collector.collect(tasks, with_teacher=True)
    finally:
        collector.close()
    assert collector.waves == waves
    note = format_error_note(prompts)
    reference = PromptBuilder(tokenizer, output_format="action")  # an independent builder: no shared caches
    for traj, task in zip(trajectories, tasks):
        goal = GOALS[task.task_index]
        want = expected_turns(goal)
        assert traj.success and not traj.truncated and traj.fault is None
        assert len(traj.turns) == len(want) == goal + 2, f"goal {goal}: {len(traj.turns)} turns recorded, {goal + 2} played"
        history, shown = [], want[0]["state"]
        for k, (turn, w) in enumerate(zip(traj.turns, want)):
            where = f"goal {goal}, turn {k}"
            assert turn.index == k, f"{where}: recorded with index {turn.index}"
            assert turn.state == w["state"], f"{where}: state {turn.state!r}, acted in {w['state']!r}"
            assert turn.parsed_action == w["action"], f"{where}: action {turn.parsed_action!r}, played {w['action']!r}"
            assert turn.observation == (w["observation"] or note), f"{where}: observation {turn.observation!r}"
            assert (turn.reward, turn.valid, turn.penalty) == (w["reward"], w["valid"], w["penalty"]), where
            assert turn.action_text == SCRIPT.get(k, "<action>right</action>"), where
            task_text = f"walk to position {goal}"
            skill = bank.block("walk", task_text, w["state"])  # the skill scope is the turn's: its own state's lines
            views = reference.build_views(task_text, history, shown, ["left", "right"], skill=skill)
            assert list(turn.prompt_ids) == views.student, f"{where}: the student prompt is not the one built from its own observation and history"
            assert list(turn.teacher_prompt_ids) == views.teacher, f"{where}: the teacher prompt is not this turn's"
            history.append(history_entry(shown, turn.parsed_action or None, turn.action_text))
            shown = turn.observation
    # the collated batch: one row per turn, trajectory by trajectory, turn by turn, each with that turn's tokens
    rb = collate_trajectories(trajectories, tokenizer.pad_token_id)
    rows = [(i, turn) for i, t in enumerate(trajectories) for turn in t.turns]
    assert rb.turn_traj.tolist() == [i for i, _ in rows]
    assert rb.turn_index.tolist() == [turn.index for _, turn in rows] == [k for t in trajectories for k in range(len(t.turns))]
    for r, (_, turn) in enumerate(rows):
        assert rb.input_ids[r][rb.action_mask[r]].tolist() == list(turn.action_ids), r
        assert torch.equal(rb.old_logprobs[r][rb.action_mask[r]], torch.tensor(turn.behaviour_logprobs)), r
        assert rb.turn_penalties[r].item() == pytest.approx(turn.penalty) and bool(rb.turn_valid[r]) == turn.valid, r
