"""The baselines and the shared loss terms inside the real update: GiGPO, SDAR, Skill-SD, the entropy bonus."""

from __future__ import annotations

import math

import pytest

from agentopsd.credit.algorithms import RLSD, SDAR, GiGPO, SkillSD
from tests.agentopsd.training.test_module import RatioRecorder, _task_batch, fit, make_module


@pytest.mark.parametrize(
    "algo, extra",
    [
        (SDAR(entropy_coef=0.001), ("loss/distill_loss", "loss/entropy")),
        (SkillSD(), ("loss/distill_loss",)),
        (GiGPO(entropy_coef=0.001), ("loss/entropy",)),
        (RLSD(lambda_warmdown_steps=2), ()),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_baseline_trains_on_policy_and_logs_its_terms(tiny_walk_policy, algo, extra):
    module = make_module(tiny_walk_policy, algorithm=algo, iterations=2)
    recorder = RatioRecorder()
    fit(module, 2, recorder)
    assert max(recorder.devs) < 1e-5  # the entropy path scores the same log-probs as the plain one
    batch = module.rollout(_task_batch(1))
    algo.assign(batch, step=1)
    assert batch.turn_state.shape == batch.turn_index.shape and batch.turn_penalties.shape == batch.turn_index.shape
    metrics, loss = module.update(batch, 1)
    assert math.isfinite(float(loss))
    for key in extra:
        assert key in metrics and math.isfinite(metrics[key]), key
    if "loss/entropy" in extra:
        assert metrics["loss/entropy"] > 0
    assert ("loss/distill_loss" in metrics) == ("loss/distill_loss" in extra)
    assert module.algorithm.needs_teacher == (batch.teacher_logprobs is not None)
