"""PreemptionCallback: on SIGTERM or SIGUSR1, stop at the next safe point, save, and exit.

Safe points, each reached by every rank together (the stop request is agreed by a collective):
- between turns of a rollout: the iteration is abandoned (its update never started) and the
  task stream is rewound so that a resumed run plays it again with the same tasks;
- after an iteration's update and every callback's batch-end work (rollout shard, evaluation,
  checkpoint): the iteration is kept (``AgentRLModule.on_train_batch_end``, the last batch hook);
- between turns of an evaluation: the evaluation is dropped, and a resumed run makes it up before its next
  iteration (``EvaluationCallback.on_train_start``).
A stop raised after an update writes that iteration's metrics to the loggers first (Lightning would have
written them after the batch-end hooks the stop leaves).
The wait is bounded by one turn of generation, or by the rest of one update when the signal
arrives during it. Then ``last.ckpt`` is written and the run raises
:class:`agentopsd.training.preemption.Preempted`, which ``train.py`` turns into a message and exit status
128 + the signal number. ``ckpt_path=last`` resumes.

A stop never waits forever: a second signal, or ``grace_s`` seconds after the first without a safe
point (ranks stuck in a collective never reach one), ends the process at once with 128 + the
signal number; the last good checkpoint stays.

This replaces Lightning's own SIGTERM handling for the fit (which raised at the next batch
without saving, or waited for a long rollout to end) and restores the previous handlers after.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import lightning as L

from agentopsd.callbacks.checkpoint import IterationCheckpoint
from agentopsd.training.preemption import STOP_SIGNALS, Preempted, StopRequest

log = logging.getLogger(__name__)


class PreemptionCallback(L.Callback):
    """Installs handlers for ``signals`` during fit; saves through ``checkpoint`` when one arrives."""

    def __init__(self, checkpoint: IterationCheckpoint, signals: tuple[str, ...] = STOP_SIGNALS, grace_s: float = 600.0) -> None:
        unknown = [s for s in signals if not isinstance(getattr(signal, s, None), signal.Signals)]
        if unknown:
            raise ValueError(f"unknown signal names {unknown}; use names like SIGTERM, SIGUSR1")
        self.checkpoint, self.signals, self.grace_s = checkpoint, tuple(signals), float(grace_s)
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    @staticmethod
    def _request(pl_module: L.LightningModule) -> StopRequest:
        request = getattr(pl_module, "stop_request", None)
        if request is None:
            request = pl_module.stop_request = StopRequest()
        return request

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # on_train_start, not earlier: Lightning installs its own SIGTERM handler after on_fit_start
        # (it raises at the next batch without saving); ours replaces it for the fit. Put this
        # callback first so that it is in place before a pre-training evaluation starts.
        request = self._request(pl_module)
        request.clear()
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: SIGTERM/SIGUSR1 will not stop this run cleanly")
            return

        rank = trainer.global_rank
        received: list[str] = []  # this process's own signals (a stop agreed from another rank is not one)

        def handler(signum: int, frame: object) -> None:
            name = signal.Signals(signum).name
            received.append(name)
            if len(received) > 1:  # a second signal: the user (or the cluster) will not wait
                _exit_now(rank, name, 128 + signum, "a second signal")
            log.warning(
                "rank %d received %s: stopping at the next safe point (the next turn of a rollout, or the "
                "end of the current update), then saving a checkpoint; a second signal exits at once", rank, name,
            )
            request.set(name)
            self._timer = threading.Timer(self.grace_s, _exit_now, (rank, name, 128 + signum, f"no safe point within {self.grace_s:.0f} s"))
            self._timer.daemon = True  # a process that ends in time does not wait for it
            self._timer.start()

        for name in self.signals:
            num = getattr(signal, name)
            self._previous[num] = signal.getsignal(num)
            signal.signal(num, handler)

    def _restore(self) -> None:
        self._cancel_timer()
        for num, previous in self._previous.items():
            signal.signal(num, previous)
        self._previous.clear()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            self._restore()

    def _cancel_timer(self) -> None:
        if self._timer is not None:  # the stop was reached (or the fit ended): no forced exit later
            self._timer.cancel()
            self._timer = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._cancel_timer()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # the safe point was reached (Lightning does not call teardown on this path): the forced exit is off
        self._cancel_timer()
        if not isinstance(exception, Preempted):
            return
        if not exception.update_done:
            # the abandoned iteration's tasks were drawn but never trained on: play them again on resume
            stream = getattr(trainer.datamodule, "stream", None) if trainer.datamodule is not None else None
            if stream is not None:
                stream.position = exception.iteration
        else:
            _log_the_kept_iteration(trainer, pl_module)
        done = pl_module.iterations_done
        if self.checkpoint.saved_at != done:
            self.checkpoint.save(trainer)
        if trainer.is_global_zero:
            log.warning("%s: checkpoint with %d completed iterations at %s", exception.signal_name, done, self.checkpoint.last_path)


def _log_the_kept_iteration(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Hand the kept iteration's metrics to the loggers. Lightning does so only after every batch-end hook, and
    the stop was raised in one (the module's, or a periodic evaluation dropped by it): without this the iteration
    stays in the checkpoint and its row is missing from the CSV and TensorBoard of the resumed run."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    metrics = dict(getattr(pl_module, "step_metrics", None) or {})
    if progress.processed <= progress.completed or not metrics:
        return  # the batch ended before the stop (the end-of-run evaluation was dropped): its row is written
    step = int(metrics.pop("step", pl_module.iterations_done))
    for logger in trainer.loggers:
        logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)


def _exit_now(rank: int, signal_name: str, code: int, why: str) -> None:
    """End the process at once (``os._exit``: a thread stuck in a collective would block a normal exit)."""
    print(f"rank {rank}: {signal_name}, {why}: exiting now with {code}; resume from the last checkpoint with ckpt_path=last",
          file=sys.stderr, flush=True)
    os._exit(code)
