"""The algorithm objects write the advantages each one specifies, through the tested credit functions."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

import agentopsd.credit.advantages as credit
import agentopsd.credit.algorithms as algorithms
from agentopsd.credit import (
    MODES,
    group_success_rate,
    mix_advantages,
    reshape_advantages,
    rlsd_token_advantages,
    stepopsd_multipliers,
)
from agentopsd.credit.algorithms import GRPOOPSD, RLSD, SDAR, AgentOPSD, Algorithm, GiGPO, SkillSD, StepOPSD
from agentopsd.credit.losses import sdar_loss, skill_sd_loss


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


def multi_token_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Four trajectories (two groups) of 1-4 turns, 1-5 action tokens per turn after a prompt of 2-4 tokens."""
    g = torch.Generator().manual_seed(seed)
    turns = [3, 1, 4, 2]
    rows, traj, index, states = [], [], [], []
    width = 12
    for i, k_max in enumerate(turns):
        for k in range(k_max):
            prompt = 2 + (i + k) % 3
            n = 1 + (3 * i + k) % 5
            rows.append(torch.arange(width).ge(prompt) & torch.arange(width).lt(prompt + n))
            traj.append(i)
            index.append(k)
            states.append(k if i != 2 else k + 1)  # trajectories 0, 1, 3 share states; 2 is shifted by one
    mask = torch.stack(rows)
    m = mask.shape[0]
    return {
        "seq_advantages": torch.tensor([1.2, -0.8, 0.6, -1.0]),
        "action_mask": mask,
        "turn_traj": torch.tensor(traj),
        "turn_index": torch.tensor(index),
        "teacher_logprobs": -torch.rand(m, width, generator=g) * mask,
        "student_logprobs": -torch.rand(m, width, generator=g) * mask,
        "old_logprobs": -torch.rand(m, width, generator=g) * mask,
        "success": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "turn_state": torch.tensor(states),
    }


def shuffled(batch: dict[str, torch.Tensor], perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same batch with its turn rows in another order (per-trajectory fields untouched)."""
    rowwise = ("action_mask", "turn_traj", "turn_index", "teacher_logprobs", "student_logprobs", "old_logprobs", "turn_state", "turn_penalties")
    outputs = ("advantages", "turn_advantages", "credit")
    return {k: (v[perm] if k in rowwise else v.clone()) for k, v in batch.items() if k not in outputs}


def evidence_and_mask(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """e_k by hand: a plain loop over rows summing the turn's token gaps."""
    b, k = batch["seq_advantages"].shape[0], int(batch["turn_index"].max()) + 1
    gaps, mask = torch.zeros(b, k), torch.zeros(b, k, dtype=torch.bool)
    for r in range(batch["action_mask"].shape[0]):
        i, t = int(batch["turn_traj"][r]), int(batch["turn_index"][r])
        sel = batch["action_mask"][r]
        gaps[i, t] = float((batch["teacher_logprobs"][r][sel] - batch["student_logprobs"][r][sel]).sum())
        mask[i, t] = True
    return gaps, mask


CONF_ALGORITHMS = Path(__file__).resolve().parents[3] / "conf" / "algorithm"


def _configured() -> list[Algorithm]:
    """One algorithm per file of conf/algorithm/ (what a run can choose), built as Hydra builds it."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    return [instantiate(OmegaConf.load(path)) for path in sorted(CONF_ALGORITHMS.glob("*.yaml"))]


CONFIGURED = _configured()
VARIANTS = [GiGPO(norm="mean")]
"""Settings no yaml file chooses but the tests cover (a knob that changes the code path)."""
ALL = [cls() for cls in algorithms.ALGORITHMS.values()] + CONFIGURED + VARIANTS
"""Every registered algorithm at its defaults, every configured one, and the extra variants: what the
layout-independence and penalty tests iterate over. A new algorithm joins by being registered."""


def test_every_registered_algorithm_has_a_yaml_and_every_yaml_a_registered_class():
    configured = {type(a) for a in CONFIGURED}
    assert configured == set(algorithms.ALGORITHMS.values()), "register the class (@register) and give it a conf/algorithm/ file"
    for algo in CONFIGURED:
        assert algorithms.ALGORITHMS[type(algo).name] is type(algo)
    modes = {a.mode for a in CONFIGURED if isinstance(a, AgentOPSD) and not a.token_level}
    assert modes == set(MODES), "every AgentOPSD mode (the ablations) has its own yaml"

# ---------------------------------------------------------------- hand cases (one-token and two-token turns)


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


# ---------------------------------------------------------------- the trainer runs the tested functions


@pytest.mark.parametrize("mode", MODES)
def test_agentopsd_is_reshape_advantages_on_multi_token_turns(mode):
    b = multi_token_batch(1)
    AgentOPSD(mode=mode, mult_lambda=0.7, mult_band=0.3, gap_decay_gamma=0.9).assign(b)
    gaps, mask = evidence_and_mask(b)
    prior = group_success_rate(b["success"], b["group_ids"])
    want = reshape_advantages(b["seq_advantages"], gaps, mask, prior, gamma=0.9, lam=0.7, band=0.3, mode=mode)
    for r in range(b["action_mask"].shape[0]):
        i, k = int(b["turn_traj"][r]), int(b["turn_index"][r])
        sel = b["action_mask"][r]
        assert torch.allclose(b["advantages"][r][sel], want[i, k].expand(int(sel.sum())), atol=1e-6)  # every token of the turn alike
        assert torch.all(b["advantages"][r][~sel] == 0)
        assert b["turn_advantages"][r].item() == pytest.approx(want[i, k].item(), abs=1e-6)


def test_stepopsd_and_rlsd_are_their_credit_functions_on_multi_token_turns():
    b = multi_token_batch(2)
    StepOPSD(mult_lambda=0.4, mult_band=0.25).assign(b)
    gaps, mask = evidence_and_mask(b)
    counts = torch.zeros_like(gaps)
    for r in range(b["action_mask"].shape[0]):
        counts[b["turn_traj"][r], b["turn_index"][r]] = b["action_mask"][r].sum()
    w = stepopsd_multipliers(b["seq_advantages"], gaps / counts.clamp_min(1), mask, band=0.25)
    want = mix_advantages(b["seq_advantages"], w, 0.4)
    assert torch.allclose(b["turn_advantages"], want[b["turn_traj"], b["turn_index"]], atol=1e-6)
    r = multi_token_batch(2)
    RLSD(mult_lambda=0.4, mult_band=0.25).assign(r)
    rows_adv = r["seq_advantages"][r["turn_traj"]]
    want_tokens = rlsd_token_advantages(rows_adv, r["teacher_logprobs"], r["student_logprobs"], r["action_mask"], lam=0.4, band=0.25)
    assert torch.allclose(r["advantages"], want_tokens)


def test_every_mixing_algorithm_mixes_through_the_one_helper(monkeypatch):
    calls = []
    real = credit.mix_advantages

    def spy(seq_advantages, multipliers, lam):
        calls.append(lam)
        return real(seq_advantages, multipliers, lam)

    monkeypatch.setattr(credit, "mix_advantages", spy)
    monkeypatch.setattr(algorithms, "mix_advantages", spy)
    for algo in (AgentOPSD(mult_lambda=0.3), AgentOPSD(mult_lambda=0.3, token_level=True), RLSD(mult_lambda=0.3), StepOPSD(mult_lambda=0.3)):
        calls.clear()
        algo.assign(multi_token_batch())
        assert calls == [0.3], f"{algo.name} must mix through credit.mix_advantages"


# ---------------------------------------------------------------- row order


@pytest.mark.parametrize("algo", ALL, ids=lambda a: f"{a.name}-{getattr(a, 'mode', '')}-{getattr(a, 'norm', '')}")
def test_shuffled_rows_give_the_same_advantages(algo):
    b = multi_token_batch(3)
    b["turn_penalties"] = torch.linspace(0.0, 0.3, b["action_mask"].shape[0])
    algo.assign(b)
    if getattr(algo, "token_level", False):
        # per-token accumulation: trajectories may be interleaved, each one's rows stay in turn order
        perm = _interleave_keeping_turn_order(b)
    else:
        perm = torch.randperm(b["action_mask"].shape[0], generator=torch.Generator().manual_seed(5))
    s = shuffled(b, perm)
    algo.assign(s)
    assert torch.allclose(s["advantages"], b["advantages"][perm], atol=1e-6)
    assert not torch.equal(perm, torch.arange(perm.numel()))


def _interleave_keeping_turn_order(b: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rows of trajectories 3, 0, 2, 1 round-robin: interleaved, but each trajectory's rows in turn order."""
    queues = {i: [r for r in range(b["turn_traj"].numel()) if int(b["turn_traj"][r]) == i] for i in (3, 0, 2, 1)}
    out = []
    while any(queues.values()):
        for q in queues.values():
            if q:
                out.append(q.pop(0))
    return torch.tensor(out)


def test_per_token_accumulation_raises_on_rows_out_of_turn_order():
    b = multi_token_batch()
    rows = list(range(b["turn_traj"].numel()))
    rows[0], rows[1] = rows[1], rows[0]  # trajectory 0: turn 1 before turn 0
    with pytest.raises(ValueError, match="not in turn order"):
        AgentOPSD(token_level=True).assign(shuffled(b, torch.tensor(rows)))
    AgentOPSD().assign(shuffled(b, torch.tensor(rows)))  # the turn-level method reads turn_index: any order is fine


def test_per_token_accumulation_is_the_recursion_over_the_trajectory_tokens():
    """The documented reading: one accumulator through all of a trajectory's tokens, in turn order."""
    b = multi_token_batch(4)
    AgentOPSD(token_level=True).assign(b)
    prior = group_success_rate(b["success"], b["group_ids"])
    for i in range(4):
        rows = [r for r in range(b["turn_traj"].numel()) if int(b["turn_traj"][r]) == i]
        rows.sort(key=lambda r: int(b["turn_index"][r]))
        deltas = torch.cat([(b["teacher_logprobs"][r] - b["student_logprobs"][r])[b["action_mask"][r]] for r in rows])
        want = reshape_advantages(b["seq_advantages"][i : i + 1], deltas[None], torch.ones(1, deltas.numel(), dtype=torch.bool), prior[i : i + 1])
        got = torch.cat([b["advantages"][r][b["action_mask"][r]] for r in rows])
        assert torch.allclose(got, want[0], atol=1e-6)
        assert got.unique().numel() > 1 or deltas.numel() == 1  # tokens of one turn get their own multipliers


def test_token_layout_per_token_accumulation_matches_the_row_layout():
    b = multi_token_batch(5)
    rows = AgentOPSD(token_level=True)
    rows.assign(b)
    width = 40
    token_turn = torch.full((4, width), -1)
    teacher, student = torch.zeros(4, width), torch.zeros(4, width)
    fill = [0, 0, 0, 0]
    for r in sorted(range(b["turn_traj"].numel()), key=lambda r: (int(b["turn_traj"][r]), int(b["turn_index"][r]))):
        i, sel = int(b["turn_traj"][r]), b["action_mask"][r]
        n = int(sel.sum())
        token_turn[i, fill[i] : fill[i] + n] = b["turn_index"][r]
        teacher[i, fill[i] : fill[i] + n] = b["teacher_logprobs"][r][sel]
        student[i, fill[i] : fill[i] + n] = b["student_logprobs"][r][sel]
        fill[i] += n + 1  # a prompt token between turns
    tok = {"teacher_logprobs": teacher, "student_logprobs": student, "token_turn": token_turn,
           **{k: b[k] for k in ("seq_advantages", "success", "group_ids")}}
    AgentOPSD(token_level=True).assign(tok)
    for i in range(4):
        got = torch.cat([b["advantages"][r][b["action_mask"][r]] for r in sorted(
            (r for r in range(b["turn_traj"].numel()) if int(b["turn_traj"][r]) == i), key=lambda r: int(b["turn_index"][r]))])
        assert torch.allclose(tok["advantages"][i][token_turn[i] >= 0], got, atol=1e-6)


# ---------------------------------------------------------------- penalties


@pytest.mark.parametrize("algo", ALL, ids=lambda a: f"{a.name}-{getattr(a, 'mode', '')}-{getattr(a, 'norm', '')}")
def test_a_penalty_moves_only_its_own_turn(algo):
    base = multi_token_batch(6)
    algo.assign(base)
    hit = 4
    pen = multi_token_batch(6)
    pen["turn_penalties"] = torch.zeros(pen["action_mask"].shape[0])
    pen["turn_penalties"][hit] = 0.1
    algo.assign(pen)
    moved = (pen["advantages"] - base["advantages"]).abs() > 1e-7
    assert moved.any(dim=1).nonzero().flatten().tolist() == [hit]
    assert torch.allclose(pen["advantages"][hit][pen["action_mask"][hit]], base["advantages"][hit][pen["action_mask"][hit]] - 0.1)


def test_token_layout_penalties_stay_on_their_turn():
    tt = torch.tensor([[-1, 0, 0, -1, 1, 1], [-1, 0, -1, 1, 2, -1]])
    batch = {"seq_advantages": torch.tensor([0.0, 0.0]), "token_turn": tt, "success": torch.tensor([1.0, 1.0]),
             "group_ids": torch.tensor([0, 0]), "turn_penalties": torch.tensor([[0.0, 0.1, 0.0], [0.0, 0.0, 0.2]])}
    Algorithm().assign(batch)
    assert torch.allclose(batch["advantages"], torch.tensor([[0, 0, 0, 0, -0.1, -0.1], [0, 0, 0, 0, -0.2, 0]]))


# ---------------------------------------------------------------- RLSD warm-down, knobs


def test_rlsd_lambda_warms_down_to_grpo():
    algo = RLSD(lambda_warmdown_steps=100)
    assert [algo.lambda_at(s) for s in (0, 50, 100, 150)] == pytest.approx([0.5, 0.25, 0.0, 0.0])
    late, grpo = multi_token_batch(), multi_token_batch()
    algo.assign(late, step=100)
    Algorithm().assign(grpo)
    assert torch.allclose(late["advantages"], grpo["advantages"])
    half = multi_token_batch()
    algo.assign(half, step=50)
    want = rlsd_token_advantages(half["seq_advantages"][half["turn_traj"]], half["teacher_logprobs"], half["student_logprobs"],
                                 half["action_mask"], lam=0.25)
    assert torch.allclose(half["advantages"], want)
    assert RLSD().lambda_at(10_000) == 0.5  # no warm-down by default: constant lambda


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: AgentOPSD(mult_band=1.0), "mult_band"),
        (lambda: AgentOPSD(mode="beleif"), "mode"),
        (lambda: StepOPSD(mult_lambda=1.5), "mult_lambda"),
        (lambda: StepOPSD(mult_band=0.0), "mult_band"),
        (lambda: RLSD(mult_band=1.2), "mult_band"),
        (lambda: RLSD(lambda_warmdown_steps=-1), "lambda_warmdown_steps"),
        (lambda: SDAR(gate_beta=-1.0), "gate_beta"),
        (lambda: SkillSD(distill_coef=-0.1), "distill_coef"),
        (lambda: GRPOOPSD(distill_coef=-0.1), "distill_coef"),
        (lambda: GiGPO(norm="std"), "norm"),
        (lambda: GiGPO(gamma=1.5), "gamma"),
        (lambda: Algorithm(entropy_coef=-0.001), "entropy_coef"),
    ],
)
def test_bad_hyperparameters_are_named(make, field):
    with pytest.raises(ValueError, match=field):
        make()


# ---------------------------------------------------------------- SDAR, Skill-SD


def test_sdar_and_skill_sd_keep_grpo_advantages_and_add_their_loss():
    b = multi_token_batch(7)
    lp = b["student_logprobs"].clone().requires_grad_(True)
    for algo, want in (
        (SDAR(), 0.01 * sdar_loss(lp, b["teacher_logprobs"], b["action_mask"], beta=5.0)),
        (SkillSD(), 0.001 * skill_sd_loss(lp, b["teacher_logprobs"], b["old_logprobs"], b["action_mask"])),
    ):
        batch, grpo = multi_token_batch(7), multi_token_batch(7)
        algo.assign(batch)
        Algorithm().assign(grpo)
        assert torch.equal(batch["advantages"], grpo["advantages"])
        got = algo.token_distill_loss(lp, b["teacher_logprobs"], b["old_logprobs"], b["action_mask"], None)
        assert got.item() == pytest.approx(want.item()) and got.requires_grad
    assert Algorithm().token_distill_loss(lp, None, b["old_logprobs"], b["action_mask"], None) is None
    with pytest.raises(ValueError, match="teacher"):
        SDAR().token_distill_loss(lp, None, b["old_logprobs"], b["action_mask"], None)


# ---------------------------------------------------------------- GiGPO


def gigpo_batch() -> dict[str, torch.Tensor]:
    """One group of three: trajectories 0 and 2 win through states (s0, s1), trajectory 1 fails through (s0, s2, s1)."""
    states = [0, 1, 0, 2, 1, 0, 1]
    traj = [0, 0, 1, 1, 1, 2, 2]
    index = [0, 1, 0, 1, 2, 0, 1]
    mask = torch.ones(7, 2, dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0, 1.0])
    return {"seq_advantages": credit.grpo_advantages(rewards, torch.zeros(3, dtype=torch.long)), "rewards": rewards, "success": rewards,
            "group_ids": torch.tensor([5, 5, 5]), "action_mask": mask, "turn_traj": torch.tensor(traj), "turn_index": torch.tensor(index),
            "turn_state": torch.tensor(states)}


def test_gigpo_hand_case():
    b = gigpo_batch()
    GiGPO().assign(b)
    r = [1.0, 0.0, 1.0]
    ep = [(x - statistics.mean(r)) / (statistics.stdev(r) + 1e-6) for x in r]
    s0 = [0.95, 0.0, 0.95]  # gamma^(K-1-k) R of the turns at s0: trajectory 1 needs two more turns but failed
    s1 = [1.0, 0.0, 1.0]
    norm0 = [(x - statistics.mean(s0)) / (statistics.stdev(s0) + 1e-6) for x in s0]
    norm1 = [(x - statistics.mean(s1)) / (statistics.stdev(s1) + 1e-6) for x in s1]
    want = [ep[0] + norm0[0], ep[0] + norm1[0], ep[1] + norm0[1], ep[1] + 0.0, ep[1] + norm1[1], ep[2] + norm0[2], ep[2] + norm1[2]]
    assert b["turn_advantages"].tolist() == pytest.approx(want, abs=1e-5)  # s2 is reached once: no step signal
    assert torch.allclose(b["advantages"], b["turn_advantages"][:, None].expand(7, 2))
    groups = GiGPO().assign(gigpo_batch())["step_groups"]
    assert groups[1, 1].item() != groups[1, 0].item() and groups[0, 0].item() == groups[1, 0].item()
    assert "credit" not in b  # the per-turn belief records are AgentOPSD's; GiGPO returns its own for statistics


def test_gigpo_mean_norm_omega_and_groups_never_mix():
    b = gigpo_batch()
    GiGPO(norm="mean", step_weight=0.5).assign(b)
    want_ep = [1 - 2 / 3, -2 / 3, 1 - 2 / 3]
    s0_mean = 0.95 * 2 / 3
    assert b["turn_advantages"][0].item() == pytest.approx(want_ep[0] + 0.5 * (0.95 - s0_mean))
    assert b["turn_advantages"][3].item() == pytest.approx(want_ep[1])
    # the same state text in another task group is another step group
    two = gigpo_batch()
    two["group_ids"] = torch.tensor([5, 5, 6])
    two["seq_advantages"] = credit.grpo_advantages(two["rewards"], two["group_ids"])
    GiGPO().assign(two)
    assert two["turn_advantages"][5].item() == pytest.approx(0.0)  # trajectory 2 is alone in its group, and at its states


def test_gigpo_needs_states():
    b = gigpo_batch()
    del b["turn_state"]
    with pytest.raises(KeyError, match="turn_state"):
        GiGPO().assign(b)
    assert not GiGPO.needs_teacher


def test_scale_by_std_false_centres_the_outcome_without_dividing_by_the_group_std():
    """One failure among 8 copies: by the group's std it gets -2.47 and each win +0.35 (as much weight as a half-won
    group); centred only, -0.875 and +0.125 (issue 38: single failures near full success)."""
    from agentopsd.credit.advantages import grpo_advantages
    from agentopsd.credit.algorithms import Algorithm

    rewards = torch.tensor([0.0] + [1.0] * 7)
    group_ids = torch.zeros(8, dtype=torch.long)

    def batch():  # row layout: one row per trajectory, two action tokens each
        return {"rewards": rewards, "group_ids": group_ids, "seq_advantages": grpo_advantages(rewards, group_ids),
                "turn_traj": torch.arange(8), "action_mask": torch.ones(8, 2, dtype=torch.bool)}

    scaled, centred = batch(), batch()
    Algorithm().assign(scaled)
    Algorithm(scale_by_std=False).assign(centred)
    assert scaled["advantages"][0, 0] == pytest.approx(-2.4749, abs=1e-3) and scaled["advantages"][1, 0] == pytest.approx(0.3536, abs=1e-3)
    assert torch.allclose(centred["advantages"][:, 0], torch.tensor([-0.875] + [0.125] * 7))
    assert torch.allclose(centred["seq_advantages"], torch.tensor([-0.875] + [0.125] * 7))


def test_scale_by_std_false_with_gigpo_needs_its_mean_norm():
    from agentopsd.credit.algorithms import GiGPO

    with pytest.raises(ValueError, match="algorithm.norm=mean"):
        GiGPO(scale_by_std=False)
    GiGPO(scale_by_std=False, norm="mean")
