"""IterationCheckpoint: a fit that stops early keeps what it trained."""

from __future__ import annotations

import lightning as L
import torch

from agentopsd.callbacks.checkpoint import IterationCheckpoint
from agentopsd.callbacks.credit import CreditCallback
from agentopsd.data import TaskDataModule
from tests.agentopsd.test_module import make_module
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
