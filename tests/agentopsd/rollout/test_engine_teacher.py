"""``rollout.teacher_scoring=worker``: the rollout engine scores each turn's teacher view right after generating it,
with the weights that generated it, and the trainer then runs no teacher forward.

What must hold: the engine's teacher log-probs are the scorer's teacher view (same numbers as the trainer's
forward on the same weights); each turn is scored by its own version's weights, not by newer ones loaded
between turns; the evidence pairs those with the behaviour log-probs of the same version, not with the
trainer's recompute; a batch is scored all by the engine or all by the trainer; and the settings refuse the
combinations where it cannot hold.
"""

from __future__ import annotations

import copy

import pytest
import torch

from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig, resolve_teacher_scoring
from agentopsd.credit.algorithms import GRPOOPSD, AgentOPSD
from agentopsd.rollout import factory
from agentopsd.rollout.base import SamplingConfig
from agentopsd.rollout.collector import Collector
from agentopsd.rollout.hf import HFGenerator
from agentopsd.rollout.prompts import PromptBuilder
from agentopsd.rollout.scoring import Scorer, continuation_logprobs
from agentopsd.training.data import collate_trajectories, engine_teacher_scored
from agentopsd.training.module import AgentRLModule
from agentopsd.types import TaskSpec
from tests.conftest import TOY_ID, WALK_SKILLS

SAMPLING = SamplingConfig(max_new_tokens=4, temperature=0.7, stop_strings=(), seed=3)


def collector_for(policy, *, teacher_in_engine: bool) -> Collector:
    model, tokenizer = policy
    bank = factory.skill_bank(EnvConfig(id=TOY_ID, skills=WALK_SKILLS))
    return Collector(TOY_ID, HFGenerator(model, tokenizer), PromptBuilder(tokenizer, output_format="action"), SAMPLING,
                     max_turns=4, skill_bank=bank, teacher_in_engine=teacher_in_engine)


def tasks(n: int = 4) -> list[TaskSpec]:
    # unequal goals: episodes of different lengths, so turns of one call have different prompt lengths
    return [TaskSpec(TOY_ID, "train", seed=c, task_index=1 + c % 3, group_id=c // 2) for c in range(n)]


def scorer_for(model, pad_id: int) -> Scorer:
    return Scorer(model, pad_id, SAMPLING.scoring_temperature, micro_batch_size=4, max_tokens_per_micro_batch=0,
                  device=torch.device("cpu"))


def test_the_engine_scores_the_teacher_view_as_the_trainers_forward_does(tiny_walk_policy):
    model, tokenizer = tiny_walk_policy
    trajectories = collector_for(tiny_walk_policy, teacher_in_engine=True).collect(tasks(), with_teacher=True)
    turns = [turn for t in trajectories for turn in t.turns]
    assert turns and all(len(turn.teacher_logprobs) == len(turn.action_ids) for turn in turns)
    # the skill block changes the prompt: the two views differ, so scoring the wrong one would show
    assert any(turn.teacher_prompt_ids != turn.prompt_ids for turn in turns)
    rb = collate_trajectories(trajectories, tokenizer.pad_token_id)
    assert rb.engine_teacher_logprobs is not None
    trainer_view = scorer_for(model, tokenizer.pad_token_id).action_logprobs(rb, "teacher")
    assert torch.allclose(rb.engine_teacher_logprobs, trainer_view, atol=1e-5), \
        (rb.engine_teacher_logprobs - trainer_view).abs().max()
    student_view = scorer_for(model, tokenizer.pad_token_id).action_logprobs(rb, "student")
    assert (student_view - rb.engine_teacher_logprobs)[rb.action_mask].abs().max() > 1e-3


def test_without_the_setting_turns_carry_no_engine_scores(tiny_walk_policy):
    trajectories = collector_for(tiny_walk_policy, teacher_in_engine=False).collect(tasks(2), with_teacher=True)
    assert all(turn.teacher_logprobs == () for t in trajectories for turn in t.turns)
    assert collate_trajectories(trajectories, tiny_walk_policy[1].pad_token_id).engine_teacher_logprobs is None


def test_each_turn_is_scored_by_the_weights_that_generated_it(tiny_walk_policy):
    model, tokenizer = tiny_walk_policy
    collector = collector_for(tiny_walk_policy, teacher_in_engine=True)
    versions: list = []

    def new_weights_each_turn() -> int:
        # as the rollout worker loads a newer version between turns: every turn gets its own weights
        if versions:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        versions.append(copy.deepcopy(model))
        return len(versions) - 1

    collector.before_turn = new_weights_each_turn
    trajectories = collector.collect(tasks(), with_teacher=True)
    checked = 0
    for t in trajectories:
        for turn in t.turns:
            own = continuation_logprobs(versions[turn.policy_version], [turn.teacher_prompt_ids], [turn.action_ids],
                                        pad_id=tokenizer.pad_token_id, temperature=SAMPLING.scoring_temperature)[0]
            assert torch.allclose(torch.tensor(turn.teacher_logprobs), torch.tensor(own), atol=1e-5)
            if turn.policy_version < len(versions) - 1:
                latest = continuation_logprobs(model, [turn.teacher_prompt_ids], [turn.action_ids],
                                               pad_id=tokenizer.pad_token_id, temperature=SAMPLING.scoring_temperature)[0]
                assert not torch.allclose(torch.tensor(turn.teacher_logprobs), torch.tensor(latest), atol=1e-4)
                checked += 1
    assert checked > 0 and len(versions) >= 3


def test_the_evidence_pairs_the_engines_teacher_with_the_behaviour_logprobs_not_the_recompute(tiny_walk_policy):
    model, tokenizer = tiny_walk_policy
    trajectories = collector_for(tiny_walk_policy, teacher_in_engine=True).collect(tasks(), with_teacher=True)
    rb = collate_trajectories(trajectories, tokenizer.pad_token_id)
    behaviour, engine_teacher = rb.old_logprobs.clone(), rb.engine_teacher_logprobs.clone()
    trainer = copy.deepcopy(model)  # the trainer's weights moved on since (the update ran meanwhile)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    scorer = scorer_for(trainer, tokenizer.pad_token_id)
    teacher_forwards = []
    real = scorer.action_logprobs
    scorer.action_logprobs = lambda batch, view, *a, **k: (teacher_forwards.append(view), real(batch, view, *a, **k))[1]
    scored, _ = scorer.score_rollout(rb, recompute_old=True, with_teacher=True, tis_cap=2.0)
    assert teacher_forwards == ["student"]  # the proximal recompute only: no teacher forward in the trainer
    assert scored == float(rb.attention_mask.sum())
    assert torch.equal(rb.teacher_logprobs, engine_teacher)
    assert torch.equal(rb.student_logprobs, behaviour)  # the same version as the engine's teacher
    assert (rb.old_logprobs - behaviour)[rb.action_mask].abs().max() > 1e-3  # the ratio's proximal policy moved on


def test_a_batch_is_scored_all_by_the_engine_or_all_by_the_trainer(tiny_walk_policy):
    import dataclasses

    trajectories = collector_for(tiny_walk_policy, teacher_in_engine=True).collect(tasks(2), with_teacher=True)
    turns = [turn for t in trajectories for turn in t.turns]
    assert engine_teacher_scored(turns)
    mixed = [dataclasses.replace(turns[0], teacher_logprobs=())] + turns[1:]
    with pytest.raises(ValueError, match="all or none"):
        engine_teacher_scored(mixed)
    short = [dataclasses.replace(turns[0], teacher_logprobs=turns[0].teacher_logprobs[:-1])] + turns[1:]
    with pytest.raises(ValueError, match="teacher log-probs for"):
        engine_teacher_scored(short)


@pytest.mark.parametrize("kwargs, message", [
    ({"teacher_scoring": "worker"}, "needs a rollout worker"),
    ({"teacher_scoring": "worker", "max_staleness": 1, "backend": "vllm"}, "rollout.backend=hf"),
    ({"teacher_scoring": "engine", "max_staleness": 1}, "must be 'auto', 'trainer' or 'worker'"),
])
def test_the_settings_refuse_what_cannot_hold(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)


def test_auto_scores_in_the_worker_only_where_it_applies():
    assert resolve_teacher_scoring("auto", 1, "hf", distils=False) == "worker"
    assert resolve_teacher_scoring("auto", 0, "hf", distils=False) == "trainer"  # lockstep: no worker
    assert resolve_teacher_scoring("auto", 2, "vllm", distils=False) == "trainer"  # the engine has no scorer here
    assert resolve_teacher_scoring("auto", 1, "hf", distils=True) == "trainer"  # the loss needs the update's view
    assert resolve_teacher_scoring("trainer", 1, "hf", distils=False) == "trainer"
    assert RolloutConfig().teacher_scoring == "auto"


def test_the_module_resolves_auto_and_hands_the_worker_its_choice(tiny_walk_policy):
    model, tokenizer = tiny_walk_policy
    env = EnvConfig(id=TOY_ID, skills=WALK_SKILLS, max_turns=4, output_format="action")
    common = dict(env=env, optim=OptimConfig(), evaluation=EvalConfig(num_tasks=2), num_iterations=1)
    ahead = AgentRLModule(model, tokenizer, algorithm=AgentOPSD(), rollout=RolloutConfig(max_staleness=1), **common)
    assert ahead.teacher_scoring == "worker"
    distilling = AgentRLModule(model, tokenizer, algorithm=GRPOOPSD(), rollout=RolloutConfig(max_staleness=1), **common)
    assert distilling.teacher_scoring == "trainer"
    assert AgentRLModule(model, tokenizer, algorithm=AgentOPSD(), rollout=RolloutConfig(), **common).teacher_scoring == "trainer"


def test_an_algorithm_distilling_the_teacher_into_its_loss_refuses_worker_scoring(tiny_walk_policy):
    model, tokenizer = tiny_walk_policy
    env = EnvConfig(id=TOY_ID, skills=WALK_SKILLS, max_turns=4, output_format="action")
    rollout = RolloutConfig(max_new_tokens=6, max_staleness=1, teacher_scoring="worker")
    common = dict(env=env, rollout=rollout, optim=OptimConfig(), evaluation=EvalConfig(num_tasks=2), num_iterations=1)
    with pytest.raises(ValueError, match="teacher_scoring=trainer"):
        AgentRLModule(model, tokenizer, algorithm=GRPOOPSD(), **common)
    AgentRLModule(model, tokenizer, algorithm=AgentOPSD(), **common)  # credit only: accepted


def test_a_generator_without_prompt_scoring_is_refused_in_one_line(tiny_walk_policy):
    model, tokenizer = tiny_walk_policy

    class NoScore:
        def generate(self, prompts, sampling):
            return []

    with pytest.raises(ValueError, match="has no score method"):
        Collector(TOY_ID, NoScore(), PromptBuilder(tokenizer, output_format="action"), SAMPLING, teacher_in_engine=True)


def test_a_run_one_update_ahead_takes_its_teacher_view_from_the_worker_by_default(tiny_walk_policy):
    import lightning as L

    from tests.agentopsd.rollout.test_async_rollout import fit, make_module

    seen = []

    class Seen(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.append((batch.engine_teacher_logprobs, batch.teacher_logprobs, batch.student_logprobs, batch.action_mask))

    module = make_module(tiny_walk_policy, iterations=2, max_staleness=1)  # rollout.teacher_scoring left at auto
    assert module.teacher_scoring == "worker"
    fit(module, 2, Seen())
    assert len(seen) == 2
    for engine, teacher, student, mask in seen:
        assert engine is not None and torch.equal(teacher, engine)
        assert teacher[mask].ne(student[mask]).any()  # the two views differ: a real teacher view, not a copy
