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
        self.iterations_trained = 0
        """Iterations this process trained (0 when a resumed run had nothing left to do)."""

    def _run(self, trainer: L.Trainer, pl_module: L.LightningModule, when: str) -> None:
        metrics = pl_module.evaluate()
        self.results.append(metrics)
        # one numbering everywhere: completed iterations (0 before training), the loggers' step too
        done = int(pl_module.iterations_done)
        log_to_loggers(trainer, metrics, done)
        if trainer.is_global_zero:  # the metrics are pooled over ranks already: one line, not one per rank
            log.info("eval (%s, after %d iteration%s): success %.3f on %d episodes", when, done, "" if done == 1 else "s",
                     metrics["eval/success"], int(metrics.get("eval/episodes", 0)))

    @staticmethod
    def _evaluated_after(pl_module: L.LightningModule, done: int) -> bool:
        return any(int(m.get("eval/iteration", -1)) == done for m in pl_module.eval_history)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a resumed run already has its pre-training evaluation in the checkpoint
        if self.before_training and not pl_module.eval_history:
            self._run(trainer, pl_module, "before training")
        # A stop that came during a periodic evaluation dropped it and kept the iteration before it: the resumed
        # run evaluates now, where the evaluation was due, so its curve has no hole (before any training, as
        # the dropped one would have run, and from the same restored random state).
        done, n = int(pl_module.iterations_done), self.every_n_iterations
        if n and done and done % n == 0 and done < pl_module.num_iterations and not self._evaluated_after(pl_module, done):
            self._run(trainer, pl_module, "periodic, made up after the resume")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.iterations_trained += 1
        n = self.every_n_iterations
        if n and (pl_module.iteration + 1) % n == 0 and pl_module.iteration + 1 < pl_module.num_iterations:
            self._run(trainer, pl_module, "periodic")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a resumed run that had nothing left to train keeps the evaluation its checkpoint holds, unless a stop
        # dropped that end-of-run evaluation
        if self.at_end and (self.iterations_trained or not self._evaluated_after(pl_module, int(pl_module.iterations_done))):
            self._run(trainer, pl_module, "end")
