"""The credit module against the paper's recursion: hand cases, a spec loop, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentopsd.credit import (
    MODES,
    anchor_state_groups,
    apply_turn_penalties,
    belief_revisions,
    decayed_cumsum,
    discounted_turn_returns,
    gigpo_advantages,
    group_success_rate,
    grpo_advantages,
    lambda_at,
    mix_advantages,
    pack_turns,
    reshape_advantages,
    rlsd_token_advantages,
    stepopsd_multipliers,
    turn_evidence,
    unpack_turns,
)

# ---------------------------------------------------------------- spec loop (plain python)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def spec_turn_advantages(a_seq, gaps, prior, gamma=0.95, lam=0.5, band=0.2, mode="belief"):
    """One trajectory, written line by line from the spec's ten steps."""
    p = min(max(prior, 1e-4), 1 - 1e-4)
    l0 = 0.0 if mode == "no_prior" else math.log(p / (1 - p))
    c, prev, q = 0.0, _sigmoid(l0), []
    sign = (a_seq > 0) - (a_seq < 0)
    for e in gaps:
        c = gamma * c + e
        b = _sigmoid(l0 + c)
        db = b - prev
        prev = b
        q.append(sign * e if mode == "raw_gap" else abs(db) if mode == "magnitude" else sign * db)
    mean = sum(q) / len(q)
    std = math.sqrt(sum((x - mean) ** 2 for x in q) / len(q))
    out = []
    for x in q:
        z = (x - mean) / (std + 1e-4)
        w = min(max(1 + band * z, 1 - band), 1 + band)
        out.append(a_seq * ((1 - lam) + lam * w))
    return out


def _random_batch(seed: int, b: int = 64, k: int = 12, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, k + 1, (b,), generator=g)
    mask = torch.arange(k)[None, :] < lengths[:, None]
    gaps = torch.randn(b, k, generator=g, dtype=dtype) * 3
    adv = torch.randn(b, generator=g, dtype=dtype)
    adv[::7] = 0.0
    prior = torch.rand(b, generator=g, dtype=dtype)
    prior[::5] = 0.0
    prior[1::5] = 1.0
    return adv, gaps, mask, prior


# ---------------------------------------------------------------- hand-computed cases


def test_grpo_advantages_hand_case():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([7, 7, 7, 3, 3, 3])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    # group 7: mean 1/3, unbiased std sqrt(1/3)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert adv[0].item() == pytest.approx((2 / 3) / std)
    assert adv[1].item() == pytest.approx((-1 / 3) / std)
    assert torch.all(adv[3:] == 0)  # all-equal group


def test_grpo_single_member_group_is_zero():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 1, 1]))
    assert adv[0].item() == 0.0 and adv[1].item() < 0 < adv[2].item()


def test_group_success_rate_and_rejects_shaped_rewards():
    rate = group_success_rate(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert rate.tolist() == [0.5, 0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="0/1 bits"):
        group_success_rate(torch.tensor([10.0, 0.0]), torch.tensor([0, 0]))


def test_turn_evidence_sums_gaps_per_turn():
    teacher = torch.tensor([[-1.0, -2.0, -0.5, -0.1, 0.0]])
    student = torch.tensor([[-2.0, -2.5, -1.0, -0.1, -9.0]])
    token_turn = torch.tensor([[0, 0, 1, -1, -1]])
    e = turn_evidence(teacher, student, token_turn, num_turns=3)
    assert e.tolist() == [[1.5, 0.5, 0.0]]
    with pytest.raises(ValueError, match="num_turns"):
        turn_evidence(teacher, student, token_turn, num_turns=1)


def test_belief_revisions_hand_case():
    gaps = torch.tensor([[1.0, -2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    beliefs, rev = belief_revisions(gaps, mask, torch.tensor([0.5], dtype=torch.float64), gamma=0.5)
    b1, b2 = _sigmoid(1.0), _sigmoid(0.5 * 1.0 - 2.0)
    assert beliefs[0, :2].tolist() == pytest.approx([b1, b2])
    assert rev[0, :2].tolist() == pytest.approx([b1 - 0.5, b2 - b1])
    assert beliefs[0, 2].item() == 0.0 and rev[0, 2].item() == 0.0


def test_decayed_cumsum_long_rows_match_loop():
    x = torch.randn(3, 300, dtype=torch.float64)
    for gamma in (0.0, 0.3, 0.95, 1.0):
        out = decayed_cumsum(x, gamma)
        c = torch.zeros(3, dtype=torch.float64)
        for k in range(300):
            c = gamma * c + x[:, k]
            assert torch.allclose(out[:, k], c, atol=1e-9)


# ---------------------------------------------------------------- the spec loop, float64


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reshape_matches_spec_loop_float64(mode, seed):
    adv, gaps, mask, prior = _random_batch(seed)
    got = reshape_advantages(adv, gaps, mask, prior, gamma=0.9, lam=0.7, band=0.3, mode=mode)
    for i in range(adv.shape[0]):
        n = int(mask[i].sum())
        want = spec_turn_advantages(adv[i].item(), gaps[i, :n].tolist(), prior[i].item(), 0.9, 0.7, 0.3, mode)
        assert got[i, :n].tolist() == pytest.approx(want, abs=1e-9, rel=0)
        assert torch.all(got[i, n:] == 0)


def test_per_token_mode_is_the_same_function():
    # per-token accumulation: token gaps as the K axis
    adv, gaps, mask, prior = _random_batch(3, b=4, k=200)
    got = reshape_advantages(adv, gaps, mask, prior)
    n = int(mask[0].sum())
    assert got[0, :n].tolist() == pytest.approx(spec_turn_advantages(adv[0].item(), gaps[0, :n].tolist(), prior[0].item()), abs=1e-9)


# ---------------------------------------------------------------- properties (hypothesis)

finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False)


@st.composite
def batches(draw):
    b = draw(st.integers(1, 6))
    k = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, k), min_size=b, max_size=b))
    gaps = draw(st.lists(st.lists(finite, min_size=k, max_size=k), min_size=b, max_size=b))
    adv = draw(st.lists(st.one_of(st.just(0.0), st.floats(-5, 5)), min_size=b, max_size=b))
    prior = draw(st.lists(st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1)), min_size=b, max_size=b))
    mask = torch.arange(k)[None, :] < torch.tensor(lengths)[:, None]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(gaps, dtype=torch.float64), mask, torch.tensor(prior, dtype=torch.float64)


@settings(max_examples=150, deadline=None)
@given(batches(), st.floats(0, 1), st.floats(0.01, 0.99), st.floats(0, 1), st.sampled_from(MODES))
def test_properties(batch, lam, band, gamma, mode):
    adv, gaps, mask, prior = batch
    out = reshape_advantages(adv, gaps, mask, prior, gamma=gamma, lam=lam, band=band, mode=mode)
    assert torch.isfinite(out).all()
    assert torch.all(out[~mask] == 0)  # padded turns get 0
    a = adv[:, None].expand_as(out)
    m = mask & (a != 0)
    # multiplier (1-lam) + lam*w lies in [1 - lam*b, 1 + lam*b], so the sign of A is kept
    mult = out[m] / a[m]
    assert torch.all(mult >= 1 - lam * band - 1e-9) and torch.all(mult <= 1 + lam * band + 1e-9)
    assert torch.all(torch.sign(out[m]) == torch.sign(a[m]))
    assert torch.all(out[mask & (a == 0)] == 0)  # A = 0 gives 0
    single = mask.sum(1) == 1
    assert torch.allclose(out[single, 0], adv[single])  # one valid turn: w = 1
    grpo = reshape_advantages(adv, gaps, mask, prior, gamma=gamma, lam=0.0, band=band, mode=mode)
    assert torch.equal(grpo[mask], a[mask])  # lam = 0 is GRPO exactly


@settings(max_examples=60, deadline=None)
@given(batches())
def test_half_precision_inputs_compute_in_float32(batch):
    adv, gaps, mask, prior = batch
    for dtype in (torch.float16, torch.bfloat16):
        out = reshape_advantages(adv.to(dtype), gaps.clamp(-6e4, 6e4).to(dtype), mask, prior.to(dtype))
        assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_bad_arguments_raise():
    adv, gaps, mask, prior = _random_batch(0, b=2, k=3)
    with pytest.raises(ValueError, match="mode"):
        reshape_advantages(adv, gaps, mask, prior, mode="beleif")
    with pytest.raises(ValueError, match="band"):
        reshape_advantages(adv, gaps, mask, prior, band=1.0)
    with pytest.raises(ValueError, match="lam"):
        reshape_advantages(adv, gaps, mask, prior, lam=1.5)
    with pytest.raises(ValueError, match="prefix"):
        reshape_advantages(adv, gaps, torch.tensor([[False, True, True], [True, False, False]]), prior)


def test_rlsd_token_advantages():
    adv = torch.tensor([1.0, -2.0, 0.0])
    teacher = torch.tensor([[0.0, -1.0], [0.0, -1.0], [0.0, 0.0]])
    student = torch.tensor([[-1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    out = rlsd_token_advantages(adv, teacher, student, mask, lam=0.5, band=0.2)
    # delta = +1 -> exp(1) clipped to 1.2; delta = -1 -> exp(-1) clipped to 0.8
    assert out[0].tolist() == pytest.approx([1.0 * (0.5 + 0.5 * 1.2), 1.0 * (0.5 + 0.5 * 0.8)])
    assert out[1].tolist() == pytest.approx([-2.0 * (0.5 + 0.5 * 0.8), 0.0])  # sign(A) flips the gap
    assert out[2].tolist() == [0.0, 0.0]
    big = rlsd_token_advantages(adv, teacher * 1e4, student, mask)
    assert torch.isfinite(big).all()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7)), min_size=1, max_size=30, unique=True))
def test_pack_unpack_round_trip(pairs):
    traj = torch.tensor([p[0] for p in pairs])
    turn = torch.tensor([p[1] for p in pairs])
    values = torch.randn(len(pairs), dtype=torch.float64)
    padded, mask = pack_turns(values, traj, turn)
    assert int(mask.sum()) == len(pairs)
    assert torch.equal(unpack_turns(padded, traj, turn), values)


def test_pack_rejects_duplicates():
    with pytest.raises(ValueError, match="duplicate"):
        pack_turns(torch.ones(2), torch.tensor([0, 0]), torch.tensor([1, 1]))


def test_any_device_and_batch_vectorization_agree():
    adv, gaps, mask, prior = _random_batch(5, b=32, k=10, dtype=torch.float32)
    whole = reshape_advantages(adv, gaps, mask, prior)
    parts = torch.cat([reshape_advantages(adv[i : i + 1], gaps[i : i + 1], mask[i : i + 1], prior[i : i + 1]) for i in range(32)])
    assert torch.allclose(whole, parts, atol=1e-6)
    if torch.cuda.is_available():
        gpu = reshape_advantages(adv.cuda(), gaps.cuda(), mask.cuda(), prior.cuda())
        assert torch.allclose(gpu.cpu(), whole, atol=1e-5)


# ---------------------------------------------------------------- the shared pieces of the baselines


def test_mix_advantages_is_the_one_rule():
    adv = torch.tensor([2.0, -1.0, 0.0])
    w = torch.tensor([[0.8, 1.2], [1.2, 1.0], [0.9, 1.1]])
    assert torch.allclose(mix_advantages(adv, w, 0.5).float(), torch.tensor([[1.8, 2.2], [-1.1, -1.0], [0.0, 0.0]], dtype=torch.float32), atol=1e-6)
    assert torch.equal(mix_advantages(adv, w, 0.0), adv[:, None].expand(3, 2))  # lam = 0: GRPO exactly
    assert mix_advantages(adv, w[:, 0], 1.0).tolist() == pytest.approx([1.6, -1.2, 0.0])  # [B] multipliers too
    with pytest.raises(ValueError, match="lam"):
        mix_advantages(adv, w, 1.5)
    with pytest.raises(ValueError, match="multipliers"):
        mix_advantages(adv, w[:2], 0.5)


def test_lambda_at_warms_down_linearly():
    assert [lambda_at(0.5, s, 100) for s in (0, 25, 100, 400)] == pytest.approx([0.5, 0.375, 0.0, 0.0])
    assert lambda_at(0.5, 10_000) == 0.5
    with pytest.raises(ValueError, match="warmdown_steps"):
        lambda_at(0.5, 0, -1)


def test_stepopsd_multipliers_hand_case():
    adv = torch.tensor([1.0, -1.0])
    mean_gaps = torch.tensor([[0.1, -1.0], [0.1, 5.0]])
    mask = torch.tensor([[True, True], [True, False]])
    w = stepopsd_multipliers(adv, mean_gaps, mask, band=0.2)
    assert torch.allclose(w.float(), torch.tensor([[math.exp(0.1), 0.8], [math.exp(-0.1), 1.0]], dtype=torch.float32), atol=1e-6)


def test_grpo_mean_only_normalisation():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 5.0]), torch.tensor([0, 0, 0, 1]), scale_by_std=False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0])


def test_discounted_turn_returns():
    mask = torch.tensor([[True, True, True], [True, False, False]])
    ret = discounted_turn_returns(torch.tensor([1.0, 1.0]), mask, gamma=0.5)
    assert ret.tolist() == [[0.25, 0.5, 1.0], [1.0, 0.0, 0.0]]


def test_anchor_state_groups_and_gigpo_advantages():
    group_ids = torch.tensor([0, 0, 1])
    states = torch.tensor([[4, 7, -1], [4, 4, 7], [4, 7, -1]])
    mask = states >= 0
    groups = anchor_state_groups(group_ids, states, mask)
    assert groups[0, 0] == groups[1, 0] == groups[1, 1] and groups[0, 1] == groups[1, 2]
    assert groups[2, 0] != groups[0, 0] and groups[2, 1] != groups[0, 1]  # another task group: another step group
    assert groups[0, 2].item() == -1
    returns = torch.tensor([[0.5, 1.0, 0.0], [0.0, 0.0, 0.0], [0.9, 1.0, 0.0]])
    total, step = gigpo_advantages(torch.tensor([1.0, -1.0, 0.0]), returns, groups, mask, omega=2.0, scale_by_std=False)
    # state 4 of group 0 holds returns 0.5, 0, 0 (mean 1/6); state 7 holds 1, 0 (mean 1/2); group 1 is alone
    assert torch.allclose(step.float(), torch.tensor([[1 / 3, 0.5, 0.0], [-1 / 6, -1 / 6, -0.5], [0.0, 0.0, 0.0]], dtype=torch.float32), atol=1e-6)
    assert torch.allclose(total.float(), torch.tensor([[1 + 2 / 3, 2.0, 0.0], [-1 - 1 / 3, -1 - 1 / 3, -2.0], [0.0, 0.0, 0.0]], dtype=torch.float32), atol=1e-6)


def test_apply_turn_penalties():
    adv = torch.ones(2, 3)
    mask = torch.tensor([[False, True, True], [True, False, False]])
    assert apply_turn_penalties(adv, torch.tensor([0.1, 0.0]), mask).flatten().tolist() == pytest.approx([1, 0.9, 0.9, 1, 1, 1])
    with pytest.raises(ValueError, match="rows"):
        apply_turn_penalties(adv, torch.tensor([0.1]), mask)
