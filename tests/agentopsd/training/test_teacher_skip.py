"""``rollout.teacher_skip_zero_advantage``: no teacher forward on the trajectories whose sequence advantage is 0,
where the algorithm's credit only scales that advantage; every advantage stays the one full scoring gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentopsd.callbacks.credit import credit_statistics
from agentopsd.callbacks.rollout_logging import trajectory_records
from agentopsd.credit.algorithms import RLSD, SDAR, AgentOPSD, StepOPSD
from tests.agentopsd.training.test_module import _task_batch, make_module


def _module(policy, algorithm, skip: bool):
    module = make_module(policy, algorithm=algorithm)
    module.rollout_cfg = dataclasses.replace(module.rollout_cfg, teacher_skip_zero_advantage=skip)
    module.trainer = None
    return module


def _rescored(module, batch, seq_advantages: torch.Tensor):
    """``batch`` with ``seq_advantages`` as its A_seq, its teacher view scored again as the module scores it, and
    its credit assigned: the advantages and the teacher log-probs."""
    batch.seq_advantages = seq_advantages.clone()
    batch.teacher_scored = module.teacher_scored(batch)
    rows = None if batch.teacher_scored is None else batch.teacher_scored[batch.turn_traj]
    with torch.no_grad():
        module.scorer.score_rollout(batch, recompute_old=False, with_teacher=True, tis_cap=None, teacher_rows=rows)
    module.algorithm.assign(batch, 0)
    return batch.advantages.clone(), batch.teacher_logprobs.clone()


@pytest.mark.parametrize("algorithm", [AgentOPSD(), StepOPSD(), RLSD(), AgentOPSD(token_level=True)],
                         ids=["agentopsd", "stepopsd", "rlsd", "agentopsd-token"])
def test_skipping_the_teacher_where_a_seq_is_0_keeps_every_advantage(tiny_walk_policy, algorithm):
    """Half the trajectories given A_seq = 0: with the option their teacher view is not scored (its log-probs are
    the student's, a gap of 0), the others' are scored as before, and every row's advantage is the one full
    scoring gives."""
    module = _module(tiny_walk_policy, algorithm, skip=False)
    batch = module.rollout(_task_batch(0))
    g = torch.Generator().manual_seed(1)
    seq = torch.randn(batch.num_trajectories, generator=g)
    seq[torch.arange(batch.num_trajectories) % 2 == 0] = 0.0
    full_adv, full_teacher = _rescored(module, batch, seq)
    module.rollout_cfg = dataclasses.replace(module.rollout_cfg, teacher_skip_zero_advantage=True)
    skip_adv, skip_teacher = _rescored(module, batch, seq)
    assert batch.teacher_scored.tolist() == (seq != 0).tolist()
    skipped = ~batch.teacher_scored[batch.turn_traj]
    assert torch.equal(skip_teacher[skipped], batch.student_logprobs[skipped])
    assert not torch.allclose(full_teacher[skipped], batch.student_logprobs[skipped], atol=1e-4)  # there was a gap to skip
    torch.testing.assert_close(skip_teacher[~skipped], full_teacher[~skipped])
    assert bool(full_adv[~skipped].abs().sum() > 0)  # (a skipped row's advantage is its turn penalty alone)
    torch.testing.assert_close(skip_adv, full_adv)


def test_the_rollout_skips_the_groups_that_all_won_or_all_lost(tiny_walk_policy, monkeypatch):
    """In a rollout (one group given a win, so that it alone has A_seq != 0) the trajectories scored are those with
    A_seq != 0, the others' teacher log-probs are the student's, and the share skipped is logged."""
    import agentopsd.training.module as module_mod
    from agentopsd.credit.advantages import grpo_advantages

    collate = module_mod.collate_trajectories

    def one_win(trajectories, pad_id):
        rb = collate(trajectories, pad_id)
        rb.rewards = torch.zeros_like(rb.rewards)
        rb.rewards[0] = 1.0
        rb.seq_advantages = grpo_advantages(rb.rewards, rb.group_ids)
        return rb

    monkeypatch.setattr(module_mod, "collate_trajectories", one_win)
    module = _module(tiny_walk_policy, AgentOPSD(), skip=True)
    batch = module.rollout(_task_batch(0))
    scored = batch.group_ids == batch.group_ids[0]
    assert batch.teacher_scored.tolist() == scored.tolist() and 0 < int(scored.sum()) < batch.num_trajectories
    skipped = ~batch.teacher_scored[batch.turn_traj]
    assert torch.equal(batch.teacher_logprobs[skipped], batch.student_logprobs[skipped])
    assert not torch.equal(batch.teacher_logprobs[~skipped], batch.student_logprobs[~skipped])
    share = float((~scored).float().mean())
    assert module.rollout_metrics["rollout/teacher_skipped_share"] == pytest.approx(share)


def test_an_algorithm_that_distils_the_teacher_or_the_option_off_scores_every_trajectory(tiny_walk_policy):
    """SDAR's loss reads the teacher view on every row whatever its advantage; with the option off nothing is
    skipped either."""
    for algorithm, skip in ((SDAR(), True), (AgentOPSD(), False)):
        module = _module(tiny_walk_policy, algorithm, skip=skip)
        batch = module.rollout(_task_batch(0))
        assert batch.teacher_scored is None
        assert "rollout/teacher_skipped_share" not in module.rollout_metrics


def test_the_credit_statistics_and_the_shards_leave_out_the_trajectories_not_scored(tiny_walk_policy):
    """The evidence of a trajectory whose teacher was skipped is 0 by omission: the ``credit/`` statistics are
    those of the scored trajectories alone, and its shard record says so and logs no evidence."""
    module = _module(tiny_walk_policy, AgentOPSD(), skip=False)
    batch = module.rollout(_task_batch(0))
    seq = torch.randn(batch.num_trajectories, generator=torch.Generator().manual_seed(2))
    seq[:2] = 0.0
    module.rollout_cfg = dataclasses.replace(module.rollout_cfg, teacher_skip_zero_advantage=True)
    _rescored(module, batch, seq)
    credit, scored = batch.credit, batch.teacher_scored
    only = {k: v[scored] for k, v in credit.items()}
    stats = credit_statistics(credit, batch.success, 0.2, scored)
    assert stats == credit_statistics(only, batch.success[scored], 0.2)
    assert stats["credit/evidence_mean"] != credit_statistics(credit, batch.success, 0.2)["credit/evidence_mean"]
    records = trajectory_records(batch, max_samples=batch.num_trajectories, iteration=1)
    for record, on in zip(records, scored.tolist()):
        assert record.get("teacher_scored", True) == on
        for turn in record["turns"]:
            assert all((key in turn) == on for key in ("gaps", "evidence", "belief", "revision", "multiplier")), turn
