"""IterationCheckpoint: ``last.ckpt`` every N iterations, written atomically.

Under FSDP2 a checkpoint is a directory of shards written by every rank; otherwise one file
written by rank 0. Either way it is written under a temporary name and renamed, so a process
killed mid-write never leaves a truncated ``last.ckpt`` behind; the checkpoint it replaces stays
beside it as ``previous.ckpt``, for the day a disk corrupts ``last.ckpt`` after it was written
(``ckpt_path=last`` then fails in one line naming ``previous.ckpt``).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import lightning as L

log = logging.getLogger(__name__)

PREVIOUS_NAME = "previous.ckpt"


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class IterationCheckpoint(L.Callback):
    """Saves weights, optimizer, schedulers, RNG state and the task-stream position."""

    def __init__(self, dirpath: str, every_n_iterations: int = 10, keep_policies: bool = False) -> None:
        if every_n_iterations < 1:
            raise ValueError(f"checkpoint.every_n_iterations must be >= 1, got {every_n_iterations}")
        self.dirpath = Path(dirpath)
        self.every_n_iterations = every_n_iterations
        self.keep_policies = keep_policies
        """Also keep the policy's weights at every checkpoint, ``policy-<iterations done>.pt`` (never
        overwritten): the Monte Carlo ground truth of a later stage needs the policy that sampled it."""
        self.saved_at: int | None = None
        """Completed iterations in the last checkpoint this process wrote (None before the first)."""

    @property
    def last_path(self) -> Path:
        return self.dirpath / "last.ckpt"

    @property
    def _tmp(self) -> Path:
        return self.dirpath / ".last.ckpt.tmp"  # one name on every rank: shards of one checkpoint

    @property
    def previous_path(self) -> Path:
        return self.dirpath / PREVIOUS_NAME

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.dirpath.is_dir():
            _remove(self._tmp)  # left by a process killed while writing
        trainer.strategy.barrier()

    def save(self, trainer: L.Trainer) -> None:
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            _remove(self._tmp)
        trainer.strategy.barrier()
        trainer.save_checkpoint(str(self._tmp))
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            if self.last_path.exists():  # the last good checkpoint becomes the previous one
                _remove(self.previous_path)
                os.replace(self.last_path, self.previous_path)
            os.replace(self._tmp, self.last_path)  # killed between the renames: resume finds previous.ckpt
        trainer.strategy.barrier()
        self.saved_at = int(getattr(trainer.lightning_module, "iterations_done", -1))
        if self.keep_policies:
            self._keep_policy(trainer)

    def _keep_policy(self, trainer: L.Trainer) -> None:
        import torch

        if trainer.world_size > 1:  # sharded weights: gathering them here is not worth a stall on every rank
            if trainer.is_global_zero and self.saved_at == self.every_n_iterations:
                log.warning("checkpoint.keep_policies is for single-process runs; skipped (last.ckpt has the weights)")
            return

        path = self.dirpath / f"policy-{self.saved_at:06d}.pt"
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({k: v.detach().cpu() for k, v in trainer.lightning_module.model.state_dict().items()}, tmp)
        os.replace(tmp, path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        done = pl_module.iteration + 1
        # a fit about to stop before num_iterations (trainer.max_steps, an early stop) saves too, here and
        # not in on_train_end: there Lightning has closed the epoch, and a resume would train nothing
        stopping = trainer.should_stop or 0 < (trainer.max_steps or -1) <= trainer.global_step
        if done % self.every_n_iterations == 0 or done == pl_module.num_iterations or stopping:  # and at the end
            self.save(trainer)
