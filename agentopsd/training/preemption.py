"""Stopping a run cleanly on a cluster's signal (SIGTERM, SLURM's early SIGUSR1).

A signal handler only records the request; the run acts on it at points where every rank
agrees and nothing is half done: between turns of a rollout (the iteration is abandoned and
will be replayed), after an iteration's update (the iteration is kept), between turns of an
evaluation (the evaluation is dropped; a resumed run makes it up). ``agentopsd.callbacks.preemption.PreemptionCallback`` installs
the handlers and writes the checkpoint.
"""

from __future__ import annotations

import signal

from agentopsd.training.distributed import any_rank, is_distributed

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")
"""What clusters send before killing a job: SIGTERM (SLURM preemption, spot instances, Kubernetes,
torchrun forwarding), SIGUSR1 (``sbatch --signal=USR1@<seconds>``, sent ahead of the time limit)."""


class RolloutStopped(Exception):
    """Raised by the collector between turns when a stop was requested on any rank."""


class Preempted(Exception):
    """The run stops for a signal; a checkpoint is written before the process exits.

    ``iteration``: the iteration in progress; ``update_done``: its update was made (keep it) or not
    (abandon it: a resumed run plays it again with the same tasks).
    """

    def __init__(self, signal_name: str, iteration: int, update_done: bool) -> None:
        super().__init__(f"{signal_name} received: stopping at iteration {iteration}")
        self.signal_name, self.iteration, self.update_done = signal_name, iteration, update_done

    @property
    def exit_code(self) -> int:
        """128 + the signal number, the shell's convention for "ended by this signal"."""
        return 128 + int(getattr(signal, self.signal_name, signal.SIGTERM))


class StopRequest:
    """Set from a signal handler; read between turns and iterations."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def set(self, signal_name: str) -> None:
        if self.signal_name is None:  # the first signal names the stop
            self.signal_name = signal_name

    def clear(self) -> None:
        self.signal_name = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def agreed(self) -> bool:
        """True on every rank when any rank was signalled (a collective: every rank must call it)."""
        if not is_distributed():
            return self.requested
        agreed = any_rank(self.requested, "stop-request")
        if agreed and self.signal_name is None:
            self.signal_name = "SIGTERM"  # signalled elsewhere (one rank's signal stops them all)
        return agreed
