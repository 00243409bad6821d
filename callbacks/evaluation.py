"""EvaluationCallback: the fixed evaluation list before training, every N iterations, at the end."""

from __future__ import annotations

import logging

import lightning as L

log = logging.getLogger(__name__)


def log_to_loggers(trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
    """Write metrics to every logger directly: ``self.log`` is not allowed in start/end hooks."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


class EvaluationCallback(L.Callback):
    """Calls ``pl_module.evaluate()`` (greedy or low temperature, never any skill text)."""

    def __init__(self, every_n_iterations: int = 0, before_training: bool = True, at_end: bool = True) -> None:
        self.every_n_iterations = every_n_iterations
        self.before_training = before_training
        self.at_end = at_end
        self.results: list[dict[str, float]] = []

    def _run(self, trainer: L.Trainer, pl_module: L.LightningModule, when: str) -> None:
        metrics = pl_module.evaluate()
        self.results.append(metrics)
        log_to_loggers(trainer, metrics, trainer.global_step)
        log.info("eval (%s, iteration %d): success %.3f on %d episodes", when, pl_module.iteration, metrics["eval/success"], int(metrics.get("eval/episodes", 0)))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a resumed run already has its pre-training evaluation in the checkpoint
        if self.before_training and not pl_module.eval_history:
            self._run(trainer, pl_module, "before training")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = self.every_n_iterations
        if n and (pl_module.iteration + 1) % n == 0 and pl_module.iteration + 1 < pl_module.num_iterations:
            self._run(trainer, pl_module, "periodic")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_end:
            self._run(trainer, pl_module, "end")
