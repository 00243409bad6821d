"""Decoupled PPO for stale rollouts (``rollout.max_staleness``): the ratio is clipped against the proximal policy
(the weights at the start of the update, recomputed by the trainer's forward) and a truncated importance weight
``min(exp(log pi_prox - log pi_behaviour), cap)`` carries the behaviour policy's data to it. Checked by hand on
plain tensors, through :meth:`Scorer.score_rollout` on a small real model, and the settings that switch it on."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agentopsd.config import OptimConfig, RolloutConfig
from agentopsd.credit.losses import clipped_policy_loss, truncated_is_weights
from agentopsd.rollout.scoring import (
    Scorer,
    effective_tis_cap,
    engine_gap_metrics,
    tis_applies,
    warn_on_logprob_gap,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28


def hand_loss(current, proximal, behaviour, adv, mask, cap, aggregation="token-mean"):
    """The decoupled objective token by token in plain floats: ``w * max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``,
    ``r = exp(current - proximal)``, ``w = min(exp(proximal - behaviour), cap)`` (``cap`` None: w = 1), averaged
    over the masked tokens (``token-mean``) or per row, then over rows with tokens (``seq-mean-token-mean``)."""
    rows = []
    for i in range(len(mask)):
        row = []
        for t in range(len(mask[i])):
            if not mask[i][t]:
                continue
            a = adv[i]
            r = math.exp(current[i][t] - proximal[i][t])
            w = 1.0 if cap is None else min(math.exp(proximal[i][t] - behaviour[i][t]), cap)
            row.append(w * max(-a * r, -a * min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)))
        rows.append(row)
    if aggregation == "token-mean":
        tokens = [x for row in rows for x in row]
        return sum(tokens) / len(tokens)
    per_row = [sum(row) / len(row) for row in rows if row]
    return sum(per_row) / len(per_row)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_the_decoupled_loss_equals_a_hand_computation(aggregation):
    """Tokens chosen to hit every branch: ratio inside and outside the clip range for positive and negative
    advantages, importance weights below 1, between 1 and the cap, and capped; a masked-out token with huge
    values that must not count; a row without tokens."""
    behaviour = [[-1.0, -2.0, -0.5, -3.0], [-1.5, -0.2, -2.5, 0.0], [-1.0, -1.0, -1.0, -1.0]]
    proximal = [[-1.2, -1.0, -0.5, -2.5], [-0.5, -0.9, -2.5, 0.0], [-1.0, -1.0, -1.0, -1.0]]
    current = [[-1.1, -0.5, -0.9, -2.5], [-0.8, -0.3, -2.0, 9.0], [-1.0, -1.0, -1.0, -1.0]]
    mask = [[True, True, True, True], [True, True, True, False], [False, False, False, False]]
    adv = [1.5, -0.7, 2.0]
    cap = 2.0
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    weights = truncated_is_weights(t(proximal), t(behaviour), cap)
    # the weights span the cases the test is about: under 1, between 1 and the cap, capped
    m = t(mask).bool()
    assert (weights[m] < 1).any() and ((weights[m] > 1) & (weights[m] < cap)).any() and (weights[m] == cap).any()
    loss, stats = clipped_policy_loss(t(current), t(proximal), t(adv), m, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                                      aggregation=aggregation, is_weights=weights)
    assert stats.clip_frac > 0  # some ratio leaves the clip range
    expected = hand_loss(current, proximal, behaviour, adv, mask, cap, aggregation)
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    # the weights matter here: the same loss without them is another number
    assert abs(expected - hand_loss(current, proximal, behaviour, adv, mask, None, aggregation)) > 0.05


def _policy(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def _rollout_batch(rows: list[list[int]], actions: list[int]):
    """A RolloutBatch whose rows are ``rows``, right-padded, with their last ``actions[r]`` tokens as the action."""
    width = max(len(r) for r in rows) + 2
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    amask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (r, n) in enumerate(zip(rows, actions)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        amask[i, len(r) - n : len(r)] = True
    rb, _ = Scorer(None, 0, 1.0, 1, 0, torch.device("cpu")).placeholder_batch(with_reference=False)
    rb.input_ids, rb.attention_mask, rb.action_mask = ids, attn, amask
    rb.old_logprobs = torch.zeros(ids.shape)
    return rb


def _plain_logprobs(model, rb) -> torch.Tensor:
    """log pi(token) at every action position from one plain forward of the whole model ``[M, L]`` (0 elsewhere),
    computed apart from the Scorer's shared-prefix path."""
    with torch.no_grad():
        logits = model(input_ids=rb.input_ids, attention_mask=rb.attention_mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, rb.input_ids[:, 1:, None])[..., 0]
    out = torch.zeros(rb.action_mask.shape)
    out[:, 1:] = lp
    return out * rb.action_mask


@pytest.fixture()
def stale_batch():
    """A batch generated by older weights: the current policy, the behaviour policy (its weights perturbed, as a
    few updates would), the batch with the behaviour log-probs collated into ``old_logprobs`` as the generator
    reports them, and advantages."""
    policy = _policy(0)
    behaviour_policy = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in behaviour_policy.parameters():
            p.add_(0.15 * torch.randn(p.shape, generator=g))
    prompt = torch.randint(3, 96, (18,), generator=g).tolist()
    rows = [prompt + torch.randint(3, 96, (n,), generator=g).tolist() for n in (6, 9, 4)]
    rows.append(torch.randint(3, 96, (11,), generator=g).tolist())
    rb = _rollout_batch(rows, [5, 8, 3, 6])
    rb.old_logprobs = _plain_logprobs(behaviour_policy, rb)
    adv = torch.randn(rb.num_rows, generator=g)
    return policy, rb, adv


def test_an_off_policy_batch_is_scored_against_the_proximal_policy(stale_batch):
    """score_rollout(recompute_old=True, tis_cap=2) on a stale batch: the old log-probs become the current
    (proximal) weights', so the first step's ratio is exactly 1, and the importance weights are
    min(exp(prox - behaviour), 2). The objective then moves by those weights, not by the behaviour ratio:
    skipping the recompute (the behaviour log-probs kept as the old ones) fails here."""
    policy, rb, adv = stale_batch
    behaviour = rb.old_logprobs.clone()
    m = rb.action_mask
    scorer = Scorer(policy, 0, 1.0, 2, 0, torch.device("cpu"))
    scored, gap = scorer.score_rollout(rb, recompute_old=True, with_teacher=False, tis_cap=2.0)
    proximal = _plain_logprobs(policy, rb)
    torch.testing.assert_close(rb.old_logprobs[m], proximal[m], atol=1e-5, rtol=1e-5)
    # the update's own forward (with gradient) at the first step: ratio 1 against the proximal log-probs
    current, _, _ = scorer.logprobs_and_entropy(rb, torch.arange(rb.num_rows), entropy=False)
    ratio = torch.exp(current.detach() - rb.old_logprobs)[m]
    assert (ratio - 1).abs().max() < 1e-5, ratio
    # the weights: behaviour -> proximal, capped at 2, 0 off the action tokens
    expected_w = torch.exp(proximal - behaviour).clamp(max=2.0) * m
    torch.testing.assert_close(rb.is_weights, expected_w, atol=1e-5, rtol=1e-5)
    w = rb.is_weights[m]
    assert (w == 2.0).any() and (w < 1).any(), w  # the batch is stale enough to cap some weights and shrink others
    torch.testing.assert_close(gap, (behaviour - proximal)[m].abs(), atol=1e-5, rtol=1e-5)
    # against the behaviour log-probs the first ratio is far from 1: what the objective would clip without the fix
    behaviour_ratio = torch.exp(current.detach() - behaviour)[m]
    assert (behaviour_ratio - 1).abs().max() > 0.3, behaviour_ratio

    as_lists = lambda x: x.detach().tolist()  # noqa: E731
    decoupled, _ = clipped_policy_loss(current, rb.old_logprobs, adv, m, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                                       is_weights=rb.is_weights)
    coupled, _ = clipped_policy_loss(current, behaviour, adv, m, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    # ratio 1: each token's loss is -A w; the coupled loss is the behaviour ratio's, clipped
    hand_decoupled = hand_loss(as_lists(current), as_lists(proximal), as_lists(behaviour), adv.tolist(),
                               m.tolist(), 2.0)
    hand_coupled = hand_loss(as_lists(current), as_lists(behaviour), as_lists(behaviour), adv.tolist(), m.tolist(), None)
    decoupled, coupled = decoupled.detach(), coupled.detach()
    assert float(decoupled) == pytest.approx(-float((adv[:, None] * expected_w).sum() / m.sum()), abs=1e-5)
    assert float(decoupled) == pytest.approx(hand_decoupled, abs=1e-5)
    assert float(coupled) == pytest.approx(hand_coupled, abs=1e-5)
    assert float(decoupled - coupled) == pytest.approx(hand_decoupled - hand_coupled, abs=1e-5)
    assert abs(hand_decoupled - hand_coupled) > 0.01


def test_after_a_step_the_ratio_runs_from_the_proximal_policy(stale_batch):
    """Later steps of the same update: the clipped ratio is exp(current - proximal), still weighted by the
    behaviour -> proximal weights, as the hand formula says on the real model's log-probs."""
    policy, rb, adv = stale_batch
    behaviour = rb.old_logprobs.clone()
    m = rb.action_mask
    scorer = Scorer(policy, 0, 1.0, 2, 0, torch.device("cpu"))
    scorer.score_rollout(rb, recompute_old=True, with_teacher=False, tis_cap=2.0)
    policy.train()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    current, _, _ = scorer.logprobs_and_entropy(rb, torch.arange(rb.num_rows), entropy=False)
    loss, _ = clipped_policy_loss(current, rb.old_logprobs, adv, m, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                                  is_weights=rb.is_weights)
    loss.backward()
    optimizer.step()
    current, _, _ = scorer.logprobs_and_entropy(rb, torch.arange(rb.num_rows), entropy=False)
    assert (torch.exp(current.detach() - rb.old_logprobs)[m] - 1).abs().max() > 0.01  # the step moved the ratio
    loss, _ = clipped_policy_loss(current, rb.old_logprobs, adv, m, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                                  is_weights=rb.is_weights)
    expected = hand_loss(current.detach().tolist(), rb.old_logprobs.tolist(), behaviour.tolist(), adv.tolist(),
                         m.tolist(), 2.0)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-5)


# --- the settings -------------------------------------------------------------------------------------------------


def _cap(backend="hf", max_staleness=0, tis_cap=0.0, recompute=False):
    return effective_tis_cap(OptimConfig(tis_cap=tis_cap),
                             RolloutConfig(backend=backend, max_staleness=max_staleness, recompute_old_logprobs=recompute))


def test_staleness_switches_truncated_importance_sampling_on():
    assert _cap("hf", 0) is None  # lockstep on transformers: the behaviour log-probs are the trainer's
    assert _cap("hf", 0, tis_cap=2.0, recompute=True) is None
    assert _cap("hf", 1) == 2.0  # stale turns are always corrected: the default cap
    assert _cap("hf", 3) == 2.0
    assert _cap("hf", 1, tis_cap=3.0) == 3.0  # a set cap is kept
    assert _cap("vllm", 0, tis_cap=2.0, recompute=True) == 2.0  # the engine/trainer mismatch, as before
    assert _cap("vllm", 0, tis_cap=2.0, recompute=False) is None
    assert _cap("vllm", 0, tis_cap=0.0, recompute=True) is None


@pytest.mark.parametrize("backend", ["hf", "vllm"])
@pytest.mark.parametrize("tis_cap", [0.0, 1.5])
@pytest.mark.parametrize("recompute", [False, True])
def test_lockstep_keeps_the_old_rule(backend, tis_cap, recompute):
    """max_staleness = 0: tis_applies is today's rule and the cap is optim.tis_cap."""
    optim, rollout = OptimConfig(tis_cap=tis_cap), RolloutConfig(backend=backend, recompute_old_logprobs=recompute)
    old_rule = bool(tis_cap > 0 and backend != "hf" and recompute)
    assert tis_applies(optim, rollout) is old_rule
    assert effective_tis_cap(optim, rollout) == (tis_cap if old_rule else None)


def test_staleness_settings_are_checked_in_one_line_naming_the_fix():
    assert RolloutConfig().max_staleness == 0 and RolloutConfig().worker_threads == 1
    assert RolloutConfig(max_staleness=2, worker_threads=3).max_staleness == 2
    cases = [
        (dict(max_staleness=-1), r"rollout.max_staleness must be an integer >= 0"),
        (dict(max_staleness=True), r"rollout.max_staleness must be an integer >= 0"),
        (dict(max_staleness=1.0), r"rollout.max_staleness must be an integer >= 0"),
        (dict(worker_threads=0), r"rollout.worker_threads must be an integer >= 1"),
        (dict(worker_threads=True), r"rollout.worker_threads must be an integer >= 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            RolloutConfig(**kwargs)
        assert "\n" not in str(err.value)
    RolloutConfig(backend="vllm", max_staleness=0)  # lockstep vLLM
    assert RolloutConfig(backend="vllm", max_staleness=1).max_staleness == 1  # the worker runs its own engine


def test_gap_metrics_read_the_fresh_rows_as_the_engine_and_the_stale_ones_apart(caplog):
    """With each row's staleness, logprob_diff_* (what the gap warning reads) cover the fresh rows only; the stale
    rows' gap, the weights' drift the importance weights correct, is logprob_diff_stale_mean."""
    rb = _rollout_batch([[5, 6, 7, 8], [5, 6, 9], [4, 4, 4, 4, 4]], [2, 1, 3])
    # row-major over the action tokens: row 0's two, row 1's one, row 2's three
    gap = torch.tensor([0.01, 0.03, 0.9, 0.5, 0.7, 0.2])
    rb.is_weights = torch.where(rb.action_mask, torch.tensor(1.0), torch.tensor(0.0))
    everything = engine_gap_metrics(gap, rb, 2.0)
    assert everything["rollout/logprob_diff_mean"] == pytest.approx(float(gap.mean()))
    split = engine_gap_metrics(gap, rb, 2.0, row_staleness=torch.tensor([0, 1, 2]))
    assert split["rollout/logprob_diff_mean"] == pytest.approx(0.02)
    assert split["rollout/logprob_diff_max"] == pytest.approx(0.03)
    assert split["rollout/logprob_diff_stale_mean"] == pytest.approx((0.9 + 0.5 + 0.7 + 0.2) / 4)
    assert split["rollout/tis_weight_mean"] == 1.0 and split["rollout/tis_capped_frac"] == 0.0
    all_stale = engine_gap_metrics(gap, rb, 2.0, row_staleness=torch.tensor([1, 1, 1]))
    assert "rollout/logprob_diff_mean" not in all_stale  # no fresh rows: no engine gap to warn about
    with caplog.at_level(logging.WARNING):
        warn_on_logprob_gap(all_stale.get("rollout/logprob_diff_mean"), 0.05, 3, tis_on=True)
        warn_on_logprob_gap(split["rollout/logprob_diff_mean"], 0.05, 3, tis_on=True)
    assert not caplog.records
