"""credit_rules: every turn-level rule recomputed on one logged group, against hand-worked cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from agentopsd.credit import grpo_advantages
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


def _paper_multipliers(evidence: list[float], sign: float, prior: float, *, gamma: float = 0.95, band: float = 0.2,
                       mode: str = "belief") -> list[float]:
    """The paper's steps 4-9 written out again in plain Python, one trajectory at a time (a second
    implementation, not the package's): l0 = logit(prior), c_k = gamma c_{k-1} + e_k, B_k = sigmoid(l0 + c_k),
    dB_k = B_k - B_{k-1}, q_k = sign dB_k, z = (q - mean) / (population std + 1e-4), w = clip(1 + b z)."""
    l0 = 0.0 if mode == "no_prior" else math.log(prior / (1 - prior))
    acc, previous, q = 0.0, 1 / (1 + math.exp(-l0)), []
    for e in evidence:
        acc = gamma * acc + e
        belief = 1 / (1 + math.exp(-(l0 + acc)))
        q.append(sign * (belief - previous))
        previous = belief
    mean = sum(q) / len(q)
    std = math.sqrt(sum((v - mean) ** 2 for v in q) / len(q))
    return [min(1 + band, max(1 - band, 1 + band * (v - mean) / (std + 1e-4))) for v in q]


def test_the_paper_rule_on_a_hand_worked_group() -> None:
    """Winner [0, 2, 0] and loser [0, -1], prior 1/2 (l0 = 0), gamma 0.95, band 0.2, worked by hand:
    winner: c = [0, 2, 1.9], B = [0.5, 0.880797, 0.869892], dB = [0, 0.380797, -0.010906]; mean 0.123297,
      population std 0.182134, z = [-0.67659, 1.41302, -0.73643], w = [0.864683, 1.2 (clipped 1.2826), 0.852714];
    loser: B = [0.5, 0.268941], dB = [0, -0.231059], q = -dB = [0, 0.231059], z = [-0.99914, 0.99914],
      w = [0.800173, 1.199827], ordered by sign(A) w = [-0.800173, -1.199827]."""
    got = rule_orderings(_group([True, False], [[0.0, 2.0, 0.0], [0.0, -1.0]]))["agentopsd"]
    np.testing.assert_allclose(got[0], [0.864683, 1.2, 0.852714], atol=1e-6)
    np.testing.assert_allclose(got[1], [-0.800173, -1.199827], atol=1e-6)


def test_the_token_rules_are_the_paper_recursion_and_rlsd_per_token_averaged_over_each_turn() -> None:
    """``token``: the recursion over the trajectory's tokens in order (one accumulator across turns);
    ``rlsd``: clip(exp(sign(A) delta_t), 0.8, 1.2); each turn ordered by sign(A) times its tokens' mean w."""
    gaps = [[[0.2, -0.1], [1.0], [0.0, 0.3, -0.2]], [[-0.5], [0.4, 0.1]], [[0.0]]]
    group = _group([True, False, True], [[sum(t) for t in g] for g in gaps], token_gaps=gaps)
    got = rule_orderings(group)
    for i, g in enumerate(gaps):
        s = 1.0 if group.success[i] else -1.0  # sign(A_seq): 2 of 3 won
        flat = [d for t in g for d in t]
        w = _paper_multipliers(flat, s, 2 / 3)
        w_rlsd = [min(1.2, max(0.8, math.exp(s * d))) for d in flat]
        bounds = np.cumsum([0] + [len(t) for t in g])
        spans = list(zip(bounds[:-1], bounds[1:]))
        np.testing.assert_allclose(got["token"][i], [s * np.mean(w[a:b]) for a, b in spans], rtol=1e-12)
        np.testing.assert_allclose(got["rlsd"][i], [s * np.mean(w_rlsd[a:b]) for a, b in spans], rtol=1e-12)
    # the last trajectory has one token: z = 0, w = 1; RLSD's exp(0) = 1
    assert got["token"][2].tolist() == [1.0] and got["rlsd"][2].tolist() == [1.0]
    # the first turn of the loser: one token of gap -0.5, sign -1: exp(0.5) = 1.6487 clipped to 1.2
    assert got["rlsd"][1][0] == pytest.approx(-1.2)


def test_the_paper_rule_and_its_prior_free_ablation_match_a_second_implementation() -> None:
    """The prior is the group's success rate (3 of 4); ``no_prior`` starts the belief at 1/2."""
    group = _group([True, False, True, True], [[0.1, 1.5, -0.2], [0.0, -2.0, 0.3, 0.1], [0.4], [-0.3, 0.2]])
    got = rule_orderings(group)
    for i, e in enumerate(group.evidence):
        s = 1.0 if group.success[i] else -1.0
        np.testing.assert_allclose(got["agentopsd"][i], [s * w for w in _paper_multipliers(list(e), s, 0.75)], rtol=1e-12)
        np.testing.assert_allclose(got["no_prior"][i], [s * w for w in _paper_multipliers(list(e), s, 0.75, mode="no_prior")],
                                   rtol=1e-12)
    assert got["agentopsd"][2].tolist() == [1.0]  # a single turn: w = 1
    # the prior matters: with l0 = logit(3/4) the same evidence moves the belief less than from 1/2
    assert not np.allclose(got["agentopsd"][0], got["no_prior"][0])


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
