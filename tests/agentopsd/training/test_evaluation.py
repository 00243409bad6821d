"""Evaluation metrics from episode outcomes: overall, by horizon bucket and by the expert's exact path length."""

from __future__ import annotations

import pytest

from agentopsd.training.evaluation import EpisodeOutcome, evaluate_outcomes


def _outcome(won: bool, expert_steps: int) -> EpisodeOutcome:
    return EpisodeOutcome(won, float(won), 10, "unlock", expert_steps, False)


def test_success_by_exact_expert_length_counts_each_length_apart():
    outcomes = [_outcome(True, 9), _outcome(False, 9), _outcome(True, 9), _outcome(False, 10), _outcome(True, 17),
                _outcome(True, 0)]  # 0: the environment could not say; in no length
    m = evaluate_outcomes(outcomes)
    assert m["eval/success/expert_steps/9"] == pytest.approx(2 / 3) and m["eval/episodes/expert_steps/9"] == 3.0
    assert m["eval/success/expert_steps/10"] == 0.0 and m["eval/episodes/expert_steps/10"] == 1.0
    assert m["eval/success/expert_steps/17"] == 1.0 and m["eval/episodes/expert_steps/17"] == 1.0
    assert not any(k.endswith("/expert_steps/0") for k in m)
    # the buckets still pool lengths: 9 and 10 are one bucket
    assert m["eval/success/horizon/6-10"] == pytest.approx(2 / 4) and m["eval/episodes/horizon/6-10"] == 4.0
    assert m["eval/success"] == pytest.approx(4 / 6)
