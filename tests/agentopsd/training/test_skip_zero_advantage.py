"""``optim.skip_zero_advantage``: rows whose advantage is 0 run no forward or backward, and the gradient stays the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentopsd.credit.algorithms import AgentOPSD, Algorithm
from agentopsd.training.objective import signal_rows
from tests.agentopsd.training.test_module import _task_batch, make_module


def test_signal_rows_are_those_with_a_nonzero_advantage_on_an_action_token():
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.3, 0.0, 0.0], [0.0, 0.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 1, 1], [0, 0, 1]], dtype=torch.bool)
    # row 2's advantage sits off its action tokens: it is not signal (its loss there is masked out)
    assert signal_rows(adv, mask).tolist() == [1, 3]
    assert signal_rows(torch.zeros(2, 3), mask[:2]).tolist() == []


def _prepared(policy, **optim):
    module = make_module(policy, algorithm=Algorithm(), ppo_epochs=1, num_mini_batches=2, micro_batch_size=2, **optim)
    module.trainer = None
    batch = module.rollout(_task_batch(0))
    module.algorithm.assign(batch)
    opt = module.configure_optimizers()
    module.optimizers, module.lr_schedulers = (lambda: opt["optimizer"]), (lambda: opt["lr_scheduler"]["scheduler"])
    module.manual_backward = lambda loss: loss.backward()
    return module, batch


def _grads_and_rows(module, batch, monkeypatch, skip: bool):
    """The gradient each optimizer step gets, and the rows each micro-batch ran, with the option on or off."""
    module.optim_cfg = dataclasses.replace(module.optim_cfg, skip_zero_advantage=skip)
    steps: list[dict[str, torch.Tensor]] = []
    ran: list[int] = []
    real = module._micro_loss
    with monkeypatch.context() as m:
        m.setattr(module, "_optimizer_step", lambda *a: steps.append(
            {k: p.grad.clone() for k, p in module.model.named_parameters() if p.grad is not None}))
        m.setattr(module, "_micro_loss", lambda b, rows, *a: ran.extend(rows.tolist()) or real(b, rows, *a))
        metrics, _ = module.update(batch, 0)
    return steps, ran, metrics


def test_skipping_zero_advantage_rows_keeps_the_gradient(tiny_walk_policy, monkeypatch):
    """Half the rows with advantage 0: with the option they never reach the loss, and each mini-batch's gradient
    is the one the full mini-batch gives (the normaliser still counts the skipped rows' tokens)."""
    module, batch = _prepared(tiny_walk_policy)
    adv = torch.randn(batch.advantages.shape, generator=torch.Generator().manual_seed(0)) * batch.action_mask
    zero = torch.arange(batch.num_rows) % 2 == 0
    adv[zero] = 0.0
    batch.advantages = adv
    full_steps, full_rows, _ = _grads_and_rows(module, batch, monkeypatch, skip=False)
    skip_steps, skip_rows, metrics = _grads_and_rows(module, batch, monkeypatch, skip=True)
    assert sorted(full_rows) == list(range(batch.num_rows))
    assert sorted(skip_rows) == torch.nonzero(~zero).flatten().tolist()
    assert metrics["update/zero_advantage_share"] == pytest.approx(int(zero.sum()) / batch.num_rows)
    assert len(full_steps) == len(skip_steps) == 2
    for full, skipped in zip(full_steps, skip_steps):
        assert full.keys() == skipped.keys() and any(g.abs().max() > 0 for g in full.values())
        for k, g in full.items():
            torch.testing.assert_close(skipped[k], g, atol=1e-6, rtol=1e-4, msg=k)


def test_a_mini_batch_without_signal_makes_no_step(tiny_walk_policy):
    """Every advantage 0 after a real step: without the option AdamW's momentum still moves the weights; with it,
    no row runs and no weight moves."""
    moved = {}
    for skip in (False, True):
        module, batch = _prepared(tiny_walk_policy, skip_zero_advantage=skip)
        batch.advantages = torch.randn(batch.advantages.shape, generator=torch.Generator().manual_seed(0)) * batch.action_mask
        module.update(batch, 0)  # builds AdamW's momentum
        batch.advantages = torch.zeros_like(batch.advantages)
        before = [p.detach().clone() for p in module.model.parameters()]
        module.update(batch, 1)
        moved[skip] = max(float((p.detach() - b).abs().max()) for p, b in zip(module.model.parameters(), before))
    assert moved[False] > 1e-5 and moved[True] == 0.0, moved


@pytest.mark.parametrize("algorithm", [AgentOPSD(kl_coef=0.01), AgentOPSD(entropy_coef=0.001)])
def test_a_loss_not_zero_at_zero_advantage_is_refused(tiny_walk_policy, algorithm):
    with pytest.raises(ValueError, match="skip_zero_advantage=false"):
        make_module(tiny_walk_policy, algorithm=algorithm, skip_zero_advantage=True)
