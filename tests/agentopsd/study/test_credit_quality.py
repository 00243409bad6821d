"""Credit-quality metrics on hand-built cases whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest

from agentopsd.study.credit_quality import (
    CHANCE,
    average_ranks,
    bootstrap_mean,
    credit_quality,
    pair_classes,
    paired_accuracy_difference,
    pairwise_accuracy,
    spearman,
)


def test_average_ranks_share_ties():
    assert average_ranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_perfect_and_reversed_orderings():
    truth = [0.0, 1.0, 2.0, 5.0]
    assert spearman([10, 20, 30, 40], truth) == pytest.approx(1.0)
    assert spearman([4, 3, 2, 1], truth) == pytest.approx(-1.0)
    assert pairwise_accuracy([10, 20, 30, 40], truth) == (1.0, 6)
    assert pairwise_accuracy([4, 3, 2, 1], truth) == (0.0, 6)


def _counting_ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks by counting (an independent route): below + (equal + 1) / 2."""
    return np.array([np.sum(x < v) + (np.sum(x == v) + 1) / 2 for v in x])


def test_spearman_is_pearson_of_average_ranks_with_ties():
    rng = np.random.default_rng(3)
    checked = 0
    for _ in range(30):
        s, t = rng.integers(0, 4, 9).astype(float), rng.integers(0, 5, 9).astype(float)
        if np.all(s == s[0]) or np.all(t == t[0]):
            continue
        expected = np.corrcoef(_counting_ranks(s), _counting_ranks(t))[0, 1]
        assert spearman(s, t) == pytest.approx(expected, abs=1e-12)
        checked += 1
    assert checked > 20


def test_signal_ties_count_one_half():
    # pairs (0,1): tie -> 1/2; (0,2) and (1,2): right -> 1 each
    acc, n = pairwise_accuracy([1.0, 1.0, 2.0], [1.0, 2.0, 3.0])
    assert n == 3 and acc == pytest.approx(2.5 / 3)


def test_margin_drops_close_pairs():
    # truth gaps 0.5 (dropped at margin 1), 3 and 2.5: only the two wide pairs count, both reversed
    acc, n = pairwise_accuracy([3.0, 2.0, 1.0], [0.0, 0.5, 3.0], margin=1.0)
    assert n == 2 and acc == 0.0
    assert pairwise_accuracy([1.0, 2.0], [0.0, 0.5], margin=1.0) is None


def test_constant_truth_says_nothing():
    assert spearman([1.0, 2.0, 3.0], [2.0, 2.0, 2.0]) is None
    assert pairwise_accuracy([1.0, 2.0, 3.0], [2.0, 2.0, 2.0]) is None
    assert spearman([1.0], [1.0]) is None


def test_uniform_credit_is_exactly_chance():
    """GRPO's credit (A_seq on every turn) orders no pair: 0.5 and rho 0, with zero-width intervals."""
    rng = np.random.default_rng(0)
    truths = [rng.normal(size=int(k)).tolist() for k in rng.integers(2, 15, 200)]
    signals = [[float(a)] * len(t) for a, t in zip(rng.normal(size=200), truths)]
    q = credit_quality(signals, truths, resamples=500)
    assert q.pairwise_accuracy.mean == CHANCE and (q.pairwise_accuracy.low, q.pairwise_accuracy.high) == (CHANCE, CHANCE)
    assert q.rank_correlation.mean == 0.0 and q.rank_correlation.high == 0.0
    assert q.pairwise_accuracy.n == 200 and q.pairs == sum(len(t) * (len(t) - 1) // 2 for t in truths)


def test_informative_signal_beats_chance_and_noise_does_not():
    rng = np.random.default_rng(1)
    truths = [rng.normal(size=10) for _ in range(300)]
    good = credit_quality([t + 0.5 * rng.normal(size=10) for t in truths], truths, resamples=500)
    noise = credit_quality([rng.normal(size=10) for _ in truths], truths, resamples=500)
    assert good.pairwise_accuracy.low > 0.7 and good.rank_correlation.low > 0.6
    assert noise.pairwise_accuracy.low < CHANCE < noise.pairwise_accuracy.high
    assert noise.rank_correlation.low < 0.0 < noise.rank_correlation.high


def test_bootstrap_interval_brackets_the_mean():
    est = bootstrap_mean([0.0, 1.0] * 50, resamples=1000, seed=2)
    assert est.mean == 0.5 and est.low < 0.5 < est.high and est.n == 100
    assert 0.35 < est.low and est.high < 0.65  # sd of the mean is 0.05
    assert bootstrap_mean([]).n == 0 and bootstrap_mean([]).fmt() == "n/a"


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="one length"):
        spearman([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="margin"):
        pairwise_accuracy([1.0, 2.0], [1.0, 2.0], margin=-1)
    with pytest.raises(ValueError, match="truth rows"):
        credit_quality([[1.0]], [])


def test_among_counts_only_the_pairs_of_marked_turns():
    truth, signal = [0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 3.0, 2.0]  # the pair (2, 3) reversed
    assert pairwise_accuracy(signal, truth) == (pytest.approx(5 / 6), 6)
    # turn 2's pairs: (0, 2) and (1, 2) right, (2, 3) reversed
    assert pairwise_accuracy(signal, truth, among=[False, False, True, False]) == (pytest.approx(2 / 3), 3)
    assert pairwise_accuracy(signal, truth, among=[True, True, False, False]) == (pytest.approx(1.0), 5)
    assert pairwise_accuracy(signal, truth, among=[False] * 4) is None
    with pytest.raises(ValueError, match="must mark the 4 turns"):
        pairwise_accuracy(signal, truth, among=[True])
    q = credit_quality([signal, [3.0, 2.0, 1.0, 0.0]], [truth, truth], among=[[False, False, True, False], [False] * 4],
                       resamples=10)
    assert q.pairwise_accuracy.n == 1 and q.pairs == 3 and q.pairwise_accuracy.mean == pytest.approx(2 / 3)
    # paired: the uniform signal ties all three of turn 2's pairs (1/2 each)
    d = paired_accuracy_difference([signal], [[1.0] * 4], [truth], among=[[False, False, True, False]], resamples=10)
    assert d.mean == pytest.approx(2 / 3 - 1 / 2) and d.n == 1


def test_pair_classes_name_what_a_sharp_informed_evidence_gets_wrong():
    """Hand-built: a wasted no-op at an informed turn (truth 0) flagged -5, routine turns at exactly 0 evidence.
    It is rightly below routine progress (+1) and wrongly below a routine step away (-1)."""
    kinds = ["routine", "door", "routine", "routine"]
    truth = [1.0, 0.0, -1.0, 1.0]
    evidence = [0.0, -5.0, 0.0, 0.0]
    got = pair_classes(evidence, truth, kinds)
    assert got == {("door:0", "routine:+"): [1.0, 1.0], ("door:0", "routine:-"): [0.0]}
    # routine pairs never enter: their ordering says nothing about what the teacher view knew
    assert all("routine" not in a for a, _ in got)
    # the scores are pairwise_accuracy's over the pairs that touch an informed turn
    acc, n = pairwise_accuracy(evidence, truth, among=[k != "routine" for k in kinds])
    flat = [x for v in got.values() for x in v]
    assert n == len(flat) and acc == pytest.approx(sum(flat) / n)


def test_pair_classes_two_informed_turns_keep_their_order_and_ties_score_half():
    got = pair_classes([0.0, 0.0, 2.0], [1.0, -1.0, 0.0], ["key", "routine", "box"], margin=0.5)
    # key:+ vs routine:- tied evidence (1/2); key:+ vs box:0 reversed (0); box:0 vs routine:- right (1)
    assert got == {("key:+", "routine:-"): [0.5], ("key:+", "box:0"): [0.0], ("box:0", "routine:-"): [1.0]}
    assert pair_classes([0.0, 1.0], [0.0, 1.0], ["routine", "routine"]) == {}
    with pytest.raises(ValueError, match="one length"):
        pair_classes([0.0], [0.0, 1.0], ["routine", "key"])
