"""credit_rules: every turn-level rule recomputed on one logged group, against hand-worked cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentopsd.credit import grpo_advantages, rlsd_token_advantages, turn_multipliers
from agentopsd.study.credit_quality import (
    cluster_bootstrap_mean,
    paired_accuracy_difference,
    pairwise_accuracy,
)
from agentopsd.study.credit_rules import RULES, TOKEN_RULES, LoggedGroup, rule_orderings


def _group(success, evidence, tokens=None, states=None, token_gaps=None) -> LoggedGroup:
    bits = torch.tensor([float(s) for s in success])
    adv = grpo_advantages(bits, torch.zeros(len(success), dtype=torch.long)).tolist()
    return LoggedGroup(success=success, seq_advantages=adv, evidence=evidence,
                       tokens=tokens or [[1] * len(e) for e in evidence],
                       states=states or [[f"{i}:{k}" for k in range(len(e))] for i, e in enumerate(evidence)],
                       token_gaps=token_gaps)


def test_every_rule_is_returned_per_trajectory_and_turn() -> None:
    got = rule_orderings(_group([True, False], [[0.0, 2.0, 0.0], [0.0, -1.0]]))
    assert set(got) == set(RULES) - set(TOKEN_RULES)  # no token gaps logged: no per-token rule
    gaps = [[[0.0], [1.5, 0.5], [0.0, 0.0]], [[0.0], [-1.0]]]
    got = rule_orderings(_group([True, False], [[0.0, 2.0, 0.0], [0.0, -1.0]], token_gaps=gaps))
    assert set(got) == set(RULES)
    assert all([len(r) for r in got[rule]] == [3, 2] for rule in RULES)


def test_the_token_rules_are_the_trainings_token_multipliers_averaged_over_each_turn() -> None:
    """``token``: the recursion over the trajectory's tokens in order (one accumulator across turns);
    ``rlsd``: clip(exp(sign(A) delta_t)) as training's RLSD computes it; each turn ordered by its tokens' mean."""
    gaps = [[[0.2, -0.1], [1.0], [0.0, 0.3, -0.2]], [[-0.5], [0.4, 0.1]], [[0.0]]]
    group = _group([True, False, True], [[sum(t) for t in g] for g in gaps], token_gaps=gaps)
    got = rule_orderings(group)
    adv = torch.tensor(group.seq_advantages, dtype=torch.float64)
    flat = [[d for t in g for d in t] for g in gaps]
    width = max(map(len, flat))
    delta = torch.zeros(3, width, dtype=torch.float64)
    mask = torch.zeros(3, width, dtype=torch.bool)
    for i, f in enumerate(flat):
        delta[i, : len(f)] = torch.tensor(f)
        mask[i, : len(f)] = True
    _, _, w = turn_multipliers(adv, delta, mask, torch.full((3,), 2 / 3, dtype=torch.float64))
    lam = 0.5
    rlsd = rlsd_token_advantages(adv, delta, torch.zeros_like(delta), mask, lam=lam)
    w_rlsd = (rlsd / adv[:, None] - (1 - lam)) / lam
    for i, g in enumerate(gaps):
        bounds = np.cumsum([0] + [len(t) for t in g])
        spans = list(zip(bounds[:-1], bounds[1:]))
        s = float(torch.sign(adv[i]))
        np.testing.assert_allclose(got["token"][i], [s * w[i, a:b].mean().item() for a, b in spans])
        np.testing.assert_allclose(got["rlsd"][i], [s * w_rlsd[i, a:b].mean().item() for a, b in spans])


def test_the_paper_rule_is_sign_times_the_trainings_multiplier() -> None:
    """The recomputation is the training code's own function on the same inputs (prior = the group's rate)."""
    group = _group([True, False, True, True], [[0.1, 1.5, -0.2], [0.0, -2.0, 0.3, 0.1], [0.4], [-0.3, 0.2]])
    got = rule_orderings(group)["agentopsd"]
    adv = torch.tensor(group.seq_advantages, dtype=torch.float64)
    gaps = torch.zeros(4, 4, dtype=torch.float64)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for i, e in enumerate(group.evidence):
        gaps[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = True
    _, _, w = turn_multipliers(adv, gaps, mask, torch.full((4,), 0.75, dtype=torch.float64))
    for i, e in enumerate(group.evidence):
        np.testing.assert_allclose(got[i], (torch.sign(adv[i]) * w[i, : len(e)]).numpy())
    assert got[2].tolist() == [1.0]  # a single turn: w = 1


def test_the_decisive_turn_of_a_won_episode_ranks_first_under_the_evidence_rules() -> None:
    """Evidence only on turn 1 of the winner: the paper's rule, raw gap and StepOPSD all put it on top;
    in the loser, turn 1's negative evidence makes it the most blamed (lowest) turn."""
    got = rule_orderings(_group([True, False], [[0.0, 2.0, 0.0, 0.0], [0.0, -2.0, 0.0, 0.0]]))
    for rule in ("agentopsd", "no_prior", "raw_gap", "stepopsd"):
        assert int(np.argmax(got[rule][0])) == 1, rule
        assert int(np.argmin(got[rule][1])) == 1, rule
    # magnitude drops the outcome sign: it credits (or blames) whichever turn moved the belief most
    assert int(np.argmax(got["magnitude"][0])) == 1 and int(np.argmin(got["magnitude"][1])) == 1
    # a loser's turn with *positive* evidence: the paper's rule blames it least, magnitude most
    got = rule_orderings(_group([True, False], [[0.0, 0.0], [0.0, 2.0, 0.0]]))
    assert int(np.argmax(got["agentopsd"][1])) == 1 and int(np.argmin(got["magnitude"][1])) == 1


def test_an_all_failed_group_orders_nothing() -> None:
    """A_seq = 0: every multiplier rule gives 0 to every turn, and GiGPO's returns are all 0: chance exactly."""
    got = rule_orderings(_group([False, False], [[0.5, -1.0, 2.0], [0.3, 0.0]], states=[["s", "a", "b"], ["s", "c"]],
                                token_gaps=[[[0.5], [-1.0], [2.0]], [[0.3], [0.0]]]))
    assert set(got) == set(RULES)
    for rule in RULES:
        for row in got[rule]:
            assert np.all(row == 0.0), rule
            assert pairwise_accuracy(row, [0.0, 1.0, 2.0][: len(row)])[0] == 0.5


def test_stepopsd_divides_the_evidence_by_the_turns_tokens() -> None:
    """0.3 over one token is exp(0.3) > 1.2 (clipped); over three tokens exp(0.1) = 1.105."""
    got = rule_orderings(_group([True, False], [[0.3, 0.3], [0.0]], tokens=[[1, 3], [2]]))["stepopsd"]
    np.testing.assert_allclose(got[0], [1.2, np.exp(0.1)])


def test_gigpo_credits_the_turn_whose_shared_state_led_to_the_win() -> None:
    """Both copies start in state s; the winner's turn there gets a positive step advantage, the loser's a
    negative one; states only one copy reached get A_step = 0 (the episode advantage alone)."""
    got = rule_orderings(_group([True, False], [[0.0, 0.0], [0.0, 0.0]], states=[["s", "x"], ["s", "y"]]))["gigpo"]
    adv = _group([True, False], [[0.0], [0.0]]).seq_advantages
    assert got[0][0] > adv[0] and got[1][0] < adv[1]
    assert got[0][1] == pytest.approx(adv[0]) and got[1][1] == pytest.approx(adv[1])


def test_a_group_with_mismatched_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="one entry per turn"):
        LoggedGroup(success=[True], seq_advantages=[0.0], evidence=[[0.1, 0.2]], tokens=[[1]], states=[["a", "b"]])
    with pytest.raises(ValueError, match="one row per trajectory"):
        LoggedGroup(success=[True, False], seq_advantages=[0.0], evidence=[[0.1]], tokens=[[1]], states=[["a"]])


def test_paired_difference_of_a_perfect_and_a_reversed_signal() -> None:
    truths = [[0.0, 1.0, 2.0], [3.0, 1.0], [1.0, 1.0]]  # the last trajectory has no pair: it drops out
    perfect = [t[:] for t in truths]
    reversed_ = [[-x for x in t] for t in truths]
    est = paired_accuracy_difference(perfect, reversed_, truths, resamples=200)
    assert (est.mean, est.low, est.high, est.n) == (1.0, 1.0, 1.0, 2)
    same = paired_accuracy_difference(perfect, perfect, truths, resamples=200)
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)


def test_cluster_bootstrap_resamples_whole_clusters() -> None:
    """Two clusters of very different means: the interval spans both; n counts clusters, not values."""
    values = [0.0] * 50 + [1.0] * 50
    est = cluster_bootstrap_mean(values, ["a"] * 50 + ["b"] * 50, resamples=500)
    assert est.n == 2 and est.mean == 0.5
    assert est.low == 0.0 and est.high == 1.0  # a resample of two clusters can draw one of them twice
    flat = paired_accuracy_difference([[0, 1]] * 4, [[1, 0]] * 4, [[0, 1]] * 4, clusters=["r1", "r1", "r2", "r2"])
    assert flat.n == 2 and flat.mean == 1.0
    with pytest.raises(ValueError, match="cluster labels"):
        cluster_bootstrap_mean([1.0, 2.0], ["a"])
