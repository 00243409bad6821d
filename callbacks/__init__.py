"""Lightning callbacks: credit (the pluggable one), evaluation, rollout shards, checkpoints."""

from __future__ import annotations

from pathlib import Path

from agentopsd.callbacks.checkpoint import IterationCheckpoint
from agentopsd.callbacks.credit import CreditCallback
from agentopsd.callbacks.evaluation import EvaluationCallback
from agentopsd.callbacks.preemption import PreemptionCallback
from agentopsd.callbacks.rollout_logging import RolloutShardWriter

__all__ = ["CreditCallback", "EvaluationCallback", "IterationCheckpoint", "PreemptionCallback", "RolloutShardWriter", "default_callbacks"]


def default_callbacks(cfg, output_dir: Path) -> list:
    """The callbacks train.py attaches: credit, evaluation, checkpoints, rollout shards, progress bar."""
    from lightning.pytorch.callbacks import RichProgressBar

    checkpoint = IterationCheckpoint(str(output_dir / "checkpoints"), every_n_iterations=cfg.checkpoint.every_n_iterations,
                                     keep_policies=bool(cfg.checkpoint.get("keep_policies", False)))
    callbacks = [
        PreemptionCallback(checkpoint),  # first: its signal handlers cover the pre-training evaluation too
        CreditCallback(),
        # before the evaluation: a stop during the evaluation drops it and skips the batch-end hooks after it
        RolloutShardWriter(str(output_dir / "rollouts"), every_n_iterations=cfg.rollout_log.every_n_iterations, max_samples=cfg.rollout_log.max_samples),
        EvaluationCallback(every_n_iterations=cfg.evaluation.every_n_iterations, before_training=cfg.evaluation.get("before_training", True),
                           at_end=cfg.evaluation.get("at_end", True)),
        checkpoint,  # after the evaluation, so that an iteration's checkpoint holds the evaluation made after it
    ]
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(RichProgressBar(leave=True))
    return callbacks
