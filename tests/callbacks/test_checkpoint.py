"""IterationCheckpoint: a fit that stops early keeps what it trained."""

from __future__ import annotations

import lightning as L
import torch

from agentopsd.callbacks.checkpoint import IterationCheckpoint
from agentopsd.callbacks.credit import CreditCallback
from agentopsd.training.data import TaskDataModule
from tests.agentopsd.training.test_module import make_module
from tests.conftest import TOY_ID


def test_a_fit_stopped_by_max_steps_saves_its_iterations(tiny_walk_policy, tmp_path):
    module = make_module(tiny_walk_policy, iterations=4)  # 2 mini-batches per iteration
    checkpoint = IterationCheckpoint(str(tmp_path), every_n_iterations=100)  # no periodic save would come
    trainer = L.Trainer(max_epochs=1, max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[CreditCallback(), checkpoint])
    trainer.fit(module, datamodule=TaskDataModule(TOY_ID, tasks_per_batch=2, group_size=3, num_iterations=4))
    state = torch.load(checkpoint.last_path, weights_only=False)
    assert state["agentopsd"]["iterations_done"] == 1
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["position"] == 1
    # and a resume trains the remaining iterations
    resumed = make_module(tiny_walk_policy, iterations=4)
    seen = []

    class Seen(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seen.append(pl_module.iteration)

    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[CreditCallback(), Seen()])
    trainer.fit(resumed, datamodule=TaskDataModule(TOY_ID, tasks_per_batch=2, group_size=3, num_iterations=4),
                ckpt_path=str(checkpoint.last_path))
    assert seen == [1, 2, 3]


def test_the_previous_checkpoint_survives_a_corrupt_last(tiny_walk_policy, tmp_path):
    """Each save keeps the one before as previous.ckpt; a truncated last.ckpt fails in one line naming it."""
    import pytest

    from agentopsd.run.validation import ConfigError, checkpoint_problem, resolve_ckpt_path

    module = make_module(tiny_walk_policy, iterations=2)
    checkpoint = IterationCheckpoint(str(tmp_path / "checkpoints"), every_n_iterations=1)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[CreditCallback(), checkpoint])
    trainer.fit(module, datamodule=TaskDataModule(TOY_ID, tasks_per_batch=2, group_size=3, num_iterations=2))
    last, previous = checkpoint.last_path, checkpoint.previous_path
    assert torch.load(last, weights_only=False)["agentopsd"]["iterations_done"] == 2
    assert torch.load(previous, weights_only=False)["agentopsd"]["iterations_done"] == 1
    assert resolve_ckpt_path("last", tmp_path) == str(last)
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a disk that lost the second half
    with pytest.raises(ConfigError) as err:
        resolve_ckpt_path("last", tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(last) in message and f"ckpt_path={previous}" in message
    assert resolve_ckpt_path(str(previous), tmp_path) == str(previous)
    # a sharded (FSDP2) checkpoint missing its metadata is caught the same way
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "__0_0.distcp").write_bytes(b"x")
    assert "metadata" in checkpoint_problem(tmp_path / "sharded")
