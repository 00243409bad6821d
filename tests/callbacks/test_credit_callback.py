"""The CreditCallback inside someone else's Lightning RL code."""

from __future__ import annotations

import csv
import math

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from agentopsd.callbacks.credit import CreditCallback
from agentopsd.credit import group_success_rate, reshape_advantages, rlsd_token_advantages, turn_evidence
from agentopsd.credit.algorithms import RLSD, AgentOPSD, Algorithm, GiGPO


def foreign_batch(seed: int) -> dict[str, torch.Tensor]:
    """A batch in the token layout another RL codebase might have: [B, T] per-token log-probs."""
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 20
    token_turn = torch.full((b, t), -1)
    for i in range(b):
        turns = 1 + i % 3
        for k in range(turns):
            token_turn[i, 2 + 5 * k : 5 + 5 * k] = k  # 3 action tokens per turn, prompt tokens between
    success = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    return {
        "teacher_logprobs": -torch.rand(b, t, generator=g),
        "student_logprobs": -torch.rand(b, t, generator=g),
        "token_turn": token_turn,
        "seq_advantages": torch.tensor([1.0, -1.0, 0.5, 0.5, -1.0, -0.5]),
        "success": success,
        "group_ids": torch.tensor([0, 0, 1, 1, 2, 2]),
    }


class _Batches(Dataset):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return foreign_batch(i)


class ForeignModule(L.LightningModule):
    """Knows nothing of agentopsd: its batch already holds the two views' log-probs."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        assert "advantages" in batch, "the callback must write advantages before training_step"
        self.seen.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})
        return (self.layer(torch.ones(1, 1)) * batch["advantages"].sum()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_callback_on_a_foreign_module():
    module = ForeignModule()
    callback = CreditCallback(AgentOPSD())
    trainer = L.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(_Batches(), batch_size=None))
    assert len(module.seen) == 3
    for i, seen in enumerate(module.seen):
        batch = foreign_batch(i)
        e = turn_evidence(batch["teacher_logprobs"], batch["student_logprobs"], batch["token_turn"], 3)
        mask = torch.arange(3)[None] < (batch["token_turn"].max(1).values + 1)[:, None]
        prior = group_success_rate(batch["success"], batch["group_ids"])
        want = reshape_advantages(batch["seq_advantages"], e, mask, prior)
        tt = batch["token_turn"]
        expected_tokens = torch.where(tt >= 0, torch.gather(want, 1, tt.clamp_min(0)), torch.zeros(()))
        assert torch.allclose(seen["advantages"], expected_tokens.float(), atol=1e-6)
        assert torch.all(seen["advantages"][tt < 0] == 0)
    assert "credit/mean_abs_revision" in callback.last_stats
    assert 0.0 <= callback.last_stats["credit/frac_at_band_edge"] <= 1.0


def test_row_layout_matches_token_layout():
    """Our own layout (one row per turn) gives the same turn advantages as the token layout."""
    batch = foreign_batch(7)
    tt = batch["token_turn"]
    rows, traj, idx = [], [], []
    for i in range(tt.shape[0]):
        for k in range(int(tt[i].max()) + 1):
            rows.append(tt[i] == k)
            traj.append(i)
            idx.append(k)
    action_mask = torch.stack(rows)
    traj_t = torch.tensor(traj)
    row_batch = {
        "teacher_logprobs": batch["teacher_logprobs"][traj_t] * action_mask,
        "student_logprobs": batch["student_logprobs"][traj_t] * action_mask,
        "action_mask": action_mask,
        "turn_traj": traj_t,
        "turn_index": torch.tensor(idx),
        "seq_advantages": batch["seq_advantages"],
        "success": batch["success"],
        "group_ids": batch["group_ids"],
    }
    AgentOPSD().assign(row_batch)
    AgentOPSD().assign(batch)
    for r in range(len(traj)):
        assert torch.allclose(row_batch["turn_advantages"][r], batch["turn_advantages"][traj[r], idx[r]], atol=1e-6)


def test_lambda_zero_is_grpo_in_the_callback():
    batch = foreign_batch(3)
    AgentOPSD(mult_lambda=0.0).assign(batch)
    grpo = foreign_batch(3)
    Algorithm().assign(grpo)
    assert torch.allclose(batch["advantages"], grpo["advantages"])


def test_missing_field_names_the_fields():
    batch = foreign_batch(0)
    del batch["teacher_logprobs"]
    try:
        AgentOPSD().assign(batch)
    except KeyError as err:
        assert "teacher_logprobs" in str(err) and "seq_advantages" in str(err)
    else:
        raise AssertionError("a batch without teacher log-probs must raise")


def test_rlsd_lambda_warms_down_with_the_training_step():
    """A module without an ``iteration`` attribute: the schedule counts the trainer's steps."""
    module = ForeignModule()
    callback = CreditCallback(RLSD(lambda_warmdown_steps=2))
    lambdas = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            lambdas.append(callback.last_stats["credit/lambda"])

    trainer = L.Trainer(max_epochs=1, callbacks=[callback, Spy()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, DataLoader(_Batches(), batch_size=None))
    assert lambdas == [0.5, 0.25, 0.0]
    for i, (seen, lam) in enumerate(zip(module.seen, lambdas)):
        b = foreign_batch(i)
        want = rlsd_token_advantages(b["seq_advantages"], b["teacher_logprobs"], b["student_logprobs"], b["token_turn"] >= 0, lam=lam)
        assert torch.allclose(seen["advantages"], want.float())


def test_the_module_iteration_drives_the_schedule():
    class Iterating(ForeignModule):
        iteration = 40

    module = Iterating()
    callback = CreditCallback(RLSD(lambda_warmdown_steps=100), log_stats=False)
    trainer = L.Trainer(max_steps=1, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, DataLoader(_Batches(), batch_size=None))
    assert callback.last_stats["credit/lambda"] == 0.3


def test_gigpo_statistics_in_the_callback():
    batch = {
        "seq_advantages": torch.tensor([0.7, -0.7]), "rewards": torch.tensor([1.0, 0.0]), "success": torch.tensor([1.0, 0.0]),
        "group_ids": torch.tensor([0, 0]), "action_mask": torch.ones(4, 2, dtype=torch.bool), "turn_traj": torch.tensor([0, 0, 1, 1]),
        "turn_index": torch.tensor([0, 1, 0, 1]), "turn_state": torch.tensor([0, 1, 0, 2]),
    }

    class Holder(L.LightningModule):
        algorithm = GiGPO()
        iteration = 0

        def log_dict(self, *args, **kwargs):
            pass

    callback = CreditCallback()
    callback.on_train_batch_start(None, Holder(), batch, 0)  # no algorithm given: the module's own
    assert callback.last_stats["credit/step_group_shared"] == 0.5  # the first turns share state 0, the second ones do not
    assert callback.last_stats["credit/step_advantage_std"] > 0


def test_a_statistic_an_iteration_lacks_is_logged_as_nan(tmp_path):
    """Lightning would log the last iteration's value again (agentopsd.training.step_log)."""
    batches = [foreign_batch(i) for i in range(3)]
    batches[1]["success"] = torch.zeros(6)  # every episode lost: the evidence-outcome correlation is undefined
    trainer = L.Trainer(max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[CreditCallback(AgentOPSD())])
    trainer.fit(ForeignModule(), DataLoader(batches, batch_size=None))
    (path,) = tmp_path.glob("**/metrics.csv")
    with path.open() as f:
        corr = [float(r["credit/evidence_outcome_corr"]) for r in csv.DictReader(f)]
    assert len(corr) == 3 and math.isfinite(corr[0]) and math.isfinite(corr[2])
    assert math.isnan(corr[1])
