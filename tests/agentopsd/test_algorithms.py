"""The algorithm objects write the advantages each one specifies."""

from __future__ import annotations

import pytest
import torch

from agentopsd.algorithms import RLSD, AgentOPSD, Algorithm, StepOPSD


def row_batch() -> dict[str, torch.Tensor]:
    # trajectory 0 has two turn rows, trajectory 1 one; the teacher is 0.5 nats more confident per token
    return {
        "seq_advantages": torch.tensor([1.0, -1.0]),
        "action_mask": torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 0]]).bool(),
        "turn_traj": torch.tensor([0, 0, 1]),
        "turn_index": torch.tensor([0, 1, 0]),
        "teacher_logprobs": torch.full((3, 3), -0.5),
        "student_logprobs": torch.full((3, 3), -1.0),
        "success": torch.tensor([1.0, 0.0]),
        "group_ids": torch.tensor([0, 0]),
    }


def test_grpo_spreads_the_sequence_advantage():
    b = row_batch()
    Algorithm().assign(b)
    assert b["advantages"].tolist() == [[0, 1, 1], [0, 1, 0], [-1, -1, 0]]


def test_stepopsd_scores_each_turn_by_its_own_gap():
    b = row_batch()
    StepOPSD().assign(b)
    # w = clip(exp(sign(A) * 0.5), 0.8, 1.2): 1.2 for A > 0, 0.8 for A < 0; At = A (0.5 + 0.5 w)
    assert b["turn_advantages"].tolist() == pytest.approx([1.1, 1.1, -0.9])


def test_rlsd_token_multiplier():
    b = row_batch()
    RLSD().assign(b)
    assert b["advantages"][0, 1].item() == pytest.approx(1.1) and b["advantages"][2, 0].item() == pytest.approx(-0.9)
    assert b["advantages"][0, 0].item() == 0.0


def test_agentopsd_token_level_matches_turn_level_for_one_token_turns():
    b = row_batch()
    b["action_mask"] = torch.tensor([[0, 1, 0], [0, 1, 0], [1, 0, 0]]).bool()
    turn, token = dict(b), dict(b)
    AgentOPSD().assign(turn)
    AgentOPSD(token_level=True).assign(token)
    assert torch.allclose(turn["advantages"], token["advantages"], atol=1e-6)


def test_bad_hyperparameters_are_named():
    with pytest.raises(ValueError, match="mult_band"):
        AgentOPSD(mult_band=1.0)
    with pytest.raises(ValueError, match="mode"):
        AgentOPSD(mode="beleif")
