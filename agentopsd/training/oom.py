"""Running out of device memory ends the whole job at once, with one line naming the rank and the phase.

Why not let the error travel: on one rank an out-of-memory error unwinds through Lightning while the
other ranks already wait in their next collective (a gather of the next layer, a metric reduction);
they would sit there until the process-group timeout (30 minutes by default) and the line that says
what happened would be lost among their timeout traces. So the failing rank prints the line, and under
several processes ends at once: torchrun's agent and SLURM (``srun --kill-on-bad-exit=1``) then stop
the others, and under Lightning's own launcher rank 0 kills its children first (a child's exit is seen
by Lightning's process observer, which kills the rest within seconds).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from agentopsd.training.distributed import rank_and_world

log = logging.getLogger(__name__)

EXIT_CODE = 3
"""The exit status of a process that ran out of device memory (distinct from errors, 1, and bad configs, 2)."""

ADVICE = {
    "rollout": "lower rollout.vllm.gpu_memory_utilization or data.tasks_per_batch, or turn on sleep mode",
    "scoring": "lower optim.max_tokens_per_micro_batch (or optim.micro_batch_size)",
    "update": "lower optim.max_tokens_per_micro_batch (or optim.micro_batch_size), or turn on gradient checkpointing",
    "evaluation": "lower evaluation.num_tasks per rank or rollout.vllm.gpu_memory_utilization",
}
"""What to lower first, per phase (``python -m agentopsd.tools.memory`` shows each phase's plan)."""


class DeviceOutOfMemory(RuntimeError):
    """A phase of the run ran out of device memory; the message is the one line printed."""


def is_out_of_memory(err: BaseException) -> bool:
    """torch's own error, or a RuntimeError from a library that reports it in words (cuBLAS, NCCL, vLLM)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def oom_line(err: BaseException, phase: str, rank: int, world: int) -> str:
    """``rank R of W ran out of device memory during PHASE: <the error's first line>; <what to lower>``."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return (f"rank {rank} of {world} ran out of device memory during {phase}: {first[:300]}; "
            f"{ADVICE.get(phase, 'see python -m agentopsd.tools.memory')}")


@contextmanager
def out_of_memory_ends_the_job(phase: str, stop_others: Callable[[], None] | None = None) -> Iterator[None]:
    """Run a phase; on an out-of-memory error print one line and, under several processes, end this process
    now (``os._exit``, after ``stop_others`` where this rank launched the others); alone, raise
    :class:`DeviceOutOfMemory` with that line."""
    try:
        yield
    except BaseException as err:
        if not is_out_of_memory(err) or isinstance(err, DeviceOutOfMemory):
            raise
        rank, world = rank_and_world()
        line = oom_line(err, phase, rank, world)
        print(f"error: {line}", file=sys.stderr, flush=True)
        if world > 1:
            if stop_others is not None:
                try:
                    stop_others()
                except Exception:  # ending this process matters more than a clean kill
                    log.exception("could not stop the other ranks")
            os._exit(EXIT_CODE)
        raise DeviceOutOfMemory(line) from None
