"""IterationCheckpoint: ``last.ckpt`` (and numbered copies) every N iterations, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L


class IterationCheckpoint(L.Callback):
    """Saves weights, optimizer, schedulers, RNG state and the task-stream position.

    Writes go to a temporary name and are renamed, so a process killed mid-write never leaves
    a truncated ``last.ckpt`` behind.
    """

    def __init__(self, dirpath: str, every_n_iterations: int = 10, keep_numbered: bool = False) -> None:
        if every_n_iterations < 1:
            raise ValueError(f"checkpoint.every_n_iterations must be >= 1, got {every_n_iterations}")
        self.dirpath = Path(dirpath)
        self.every_n_iterations = every_n_iterations
        self.keep_numbered = keep_numbered

    @property
    def last_path(self) -> Path:
        return self.dirpath / "last.ckpt"

    def _save(self, trainer: L.Trainer, iteration: int) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        tmp = self.dirpath / f".last.ckpt.tmp{os.getpid()}"
        trainer.save_checkpoint(str(tmp))
        if trainer.is_global_zero:
            if self.keep_numbered:
                numbered = self.dirpath / f"iter-{iteration:06d}.ckpt"
                os.link(tmp, numbered) if not numbered.exists() else None
            os.replace(tmp, self.last_path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.dirpath.is_dir():
            for stale in self.dirpath.glob(".last.ckpt.tmp*"):  # left by a killed process
                stale.unlink()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (pl_module.iteration + 1) % self.every_n_iterations == 0:
            self._save(trainer, pl_module.iteration + 1)
