"""A metric an iteration does not measure is logged as NaN, not as the last iteration's value."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from agentopsd.callbacks.credit import CreditCallback
from agentopsd.training.data import TaskDataModule
from agentopsd.training.step_log import log_step
from tests.agentopsd.training.test_module import make_module
from tests.conftest import TOY_ID


def csv_rows(save_dir: Path) -> list[dict[str, str]]:
    (path,) = save_dir.glob("**/metrics.csv")
    with path.open() as f:
        return list(csv.DictReader(f))


class Sometimes(L.LightningModule):
    """Logs ``every`` at each step and ``first_only`` at step 0 only, through ``log_step`` or plain ``log_dict``."""

    def __init__(self, helper: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.automatic_optimization = False
        self.helper, self.seen = helper, set()

    def training_step(self, batch, batch_idx):
        metrics = {"every": float(batch_idx)} | ({"first_only": 123.0} if batch_idx == 0 else {})
        if self.helper:
            log_step(self, metrics, self.seen, batch_size=1)
        else:
            self.log_dict(metrics, on_step=True, batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit_sometimes(tmp_path: Path, helper: bool) -> list[dict[str, str]]:
    trainer = L.Trainer(max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Sometimes(helper), DataLoader(torch.zeros(3, 1), batch_size=1))
    return csv_rows(tmp_path)


def test_lightning_repeats_a_value_a_step_did_not_log(tmp_path):
    # the behaviour log_step exists for: if a Lightning release stops doing this, the helper can go
    rows = fit_sometimes(tmp_path, helper=False)
    assert [r["first_only"] for r in rows] == ["123.0"] * 3


def test_a_key_a_step_did_not_log_is_nan(tmp_path):
    rows = fit_sometimes(tmp_path, helper=True)
    assert [float(r["every"]) for r in rows] == [0.0, 1.0, 2.0]
    assert float(rows[0]["first_only"]) == 123.0
    assert all(math.isnan(float(r["first_only"])) for r in rows[1:])


def test_the_module_logs_nan_for_a_loss_term_an_iteration_did_not_measure(tiny_walk_policy, tmp_path, monkeypatch):
    """As when no row of an iteration has a nonzero advantage (``optim.skip_zero_advantage``): no micro-batch runs,
    so the update returns no ``loss/pg_loss``."""
    module = make_module(tiny_walk_policy, iterations=3)
    real = module.update
    calls = []

    def update(batch, batch_idx):
        metrics, loss = real(batch, batch_idx)
        calls.append(batch_idx)
        if len(calls) == 2:
            metrics = {k: v for k, v in metrics.items() if k != "loss/pg_loss"}
        return metrics, loss

    monkeypatch.setattr(module, "update", update)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=CSVLogger(tmp_path), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[CreditCallback()])
    trainer.fit(module, datamodule=TaskDataModule(TOY_ID, tasks_per_batch=2, group_size=3, num_iterations=3))
    rows = [r for r in csv_rows(tmp_path) if r.get("rollout/iteration")]
    assert [float(r["rollout/iteration"]) for r in rows] == [1.0, 2.0, 3.0]
    pg = [float(r["loss/pg_loss"]) for r in rows]
    assert math.isfinite(pg[0]) and math.isfinite(pg[2])
    assert math.isnan(pg[1]), f"iteration 2 measured no pg_loss but logged {pg[1]} (iteration 1's: {pg[0]})"
