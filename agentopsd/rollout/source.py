"""Where a training iteration's episodes come from: the one interface the LightningModule calls.

Two placements, one contract (:class:`RolloutSource`):

- :class:`LockstepRollouts` plays the iteration's episodes now, with the weights of this very update, in this
  process (``rollout.max_staleness=0``);
- :class:`AheadRollouts` takes them from a worker process that played them while earlier updates ran
  (``rollout.max_staleness`` = k > 0, :mod:`agentopsd.rollout.async_rollout`); it owns the worker's start, the
  staleness checks and what a failed worker does to the job.

The module asks ``collect(batch, ...)`` once per iteration and ``publish(model, version)`` after each update; it
never learns which placement ran. The evaluation always plays in lockstep (greedy, on the current weights), so
both placements keep a lockstep collector for it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from agentopsd.config import EnvConfig, RolloutConfig
from agentopsd.rollout import factory
from agentopsd.rollout.async_rollout import (
    AsyncRollout,
    RolloutWorkerError,
    WorkerSpec,
    rank_tasks,
    worker_dtype,
)
from agentopsd.rollout.collector import Collector
from agentopsd.rollout.staleness import check_staleness, spanning_share, staleness_metrics
from agentopsd.training.distributed import rank_and_world, shard_groups
from agentopsd.training.preemption import Preempted, RolloutStopped, StopRequest
from agentopsd.types import TaskSpec, Trajectory


@dataclass(frozen=True)
class Collected:
    """This rank's episodes of one training iteration."""

    trajectories: list[Trajectory]
    metrics: dict[str, float]
    """The rollout's metrics of this rank (rates per episode, counters, throughput; staleness when ahead)."""
    seconds: float
    """Seconds spent playing them (lockstep) or waiting for them (ahead)."""
    row_staleness: Tensor | None = None
    """Per row of the collated batch (the turns of the unfaulted trajectories, in order), the updates between its
    generating weights and this update; None when every row is fresh."""


@dataclass(frozen=True)
class Placement:
    """What the source needs of the trainer when it collects: the current weights and where they live."""

    model: nn.Module
    version: int
    """Updates done so far: the weights' version."""
    device: torch.device
    sharded: bool = False
    """The policy is sharded (FSDP2): no whole copy of the weights exists on one rank."""
    loader: object = None
    """The training loader (the task stream a worker plays ahead of)."""
    per_node: int | None = None
    """The strategy's processes per node (Lightning's devices per node): which ``rollout.devices`` entry is whose."""


class LockstepRollouts:
    """Episodes played now, with the weights of this update, by the collector of this process."""

    off_policy = False
    """Some rows may come from older weights than the update's (the ratio then needs the proximal log-probs)."""

    def __init__(self, build_collector: Callable[[], Collector], *, with_teacher: bool, stop_request: StopRequest,
                 release_memory: Callable[[], None] = lambda: None, restore_memory: Callable[[], None] = lambda: None) -> None:
        self._build = build_collector
        self._collector: Collector | None = None
        self.with_teacher = with_teacher
        self.stop_request = stop_request
        self.release_memory, self.restore_memory = release_memory, restore_memory
        """Around generation: what the update holds that the engine may use (``optim.offload_optimizer``), and back."""

    @property
    def built_collector(self) -> Collector | None:
        """The lockstep collector if built yet (a worker running ahead builds it only for the evaluation)."""
        return self._collector

    @property
    def collector(self) -> Collector:
        """The lockstep collector, built on first use (:func:`agentopsd.rollout.factory.make_collector`)."""
        if self._collector is None:
            self._collector = self._build()
        return self._collector

    def collect(self, tasks: Sequence[TaskSpec], iteration: int, at: Placement) -> Collected:
        """This rank's whole groups of ``tasks`` (iteration ``iteration``'s), played now with ``at.model``."""
        collector = self.collector
        self.release_memory()
        factory.engine_sync(collector.generator, at.model, at.version)
        rank, world = rank_and_world()
        if world > 1:  # each rank plays whole groups of its own
            tasks = tuple(tasks[i] for i in shard_groups([t.group_id for t in tasks], rank, world))
        t0 = time.perf_counter()
        collector.policy_version = at.version
        try:
            trajectories = collector.collect(tasks, with_teacher=self.with_teacher)
        except RolloutStopped:
            raise Preempted(self.stop_request.signal_name or "SIGTERM", iteration, update_done=False) from None
        factory.engine_sleep(collector.generator)
        self.restore_memory()
        return Collected(trajectories, factory.rollout_metrics(trajectories, collector), time.perf_counter() - t0)

    def evaluate(self, tasks: Sequence[TaskSpec], at: Placement, sampling, *, sampled_copies: int = 0,
                 sampled_with=None) -> tuple[list[Trajectory], list[Trajectory]]:
        """The evaluation's episodes, always in lockstep on the current weights: ``tasks`` played with ``sampling``
        (greedy unless set), then ``sampled_copies`` copies of each with ``sampled_with`` from a fixed random stream
        that leaves the training's untouched. A stop raises :class:`RolloutStopped`."""
        collector = self.collector
        collector.policy_version = at.version
        self.release_memory()
        factory.engine_sync(collector.generator, at.model, at.version)
        trajectories = collector.collect(tasks, with_teacher=False, sampling=sampling)
        sampled: list[Trajectory] = []
        if sampled_copies:
            copies = [t for t in tasks for _ in range(sampled_copies)]
            devices = [at.device.index or 0] if at.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(len(copies) + 1_000_003 * rank_and_world()[0])
                sampled = collector.collect(copies, with_teacher=False, sampling=sampled_with)
        factory.engine_sleep(collector.generator)
        return trajectories, sampled

    def publish(self, model: nn.Module, version: int) -> None:
        """Lockstep: nothing to hand on (the next collect syncs the generator itself)."""

    def close(self) -> None:
        if self._collector is not None:
            self._collector.close()
            self._collector = None


@dataclass(frozen=True)
class WorkerSettings:
    """The parts of the run a rollout worker is built from (besides the weights and the task stream)."""

    tokenizer: object
    env: EnvConfig
    rollout: RolloutConfig
    seed: int
    num_iterations: int
    model_path: str | None = None
    weights_as_loaded: bool = True
    generation_dtype: torch.dtype | None = None
    """The lockstep path's generation dtype on a CPU (:class:`agentopsd.training.precision.WeightPlan`): the worker's."""


class AheadRollouts(LockstepRollouts):
    """Episodes from a worker process running at most ``rollout.max_staleness`` weight versions ahead of the update.

    The worker starts at the first training collect (from the weights then) and ends at :meth:`close`. Every batch is
    checked: the loader's tasks, none lost or repeated, and no turn older than the bound. A failed worker ends the
    job in one line; under several processes this rank ends the others too, which would otherwise wait in their
    next collective until the process group times out.
    """

    off_policy = True

    def __init__(self, build_collector: Callable[[], Collector], settings: WorkerSettings, *, with_teacher: bool,
                 stop_request: StopRequest, stop_other_ranks: Callable[[], None] = lambda: None, **memory) -> None:
        super().__init__(build_collector, with_teacher=with_teacher, stop_request=stop_request, **memory)
        self.settings = settings
        self.stop_other_ranks = stop_other_ranks
        self.worker: AsyncRollout | None = None
        """The producer (started at the first training collect)."""

    @property
    def max_staleness(self) -> int:
        return self.settings.rollout.max_staleness

    def collect(self, tasks: Sequence[TaskSpec], iteration: int, at: Placement) -> Collected:
        """This rank's episodes of iteration ``iteration`` from the worker, and the seconds waited for them."""
        worker = self._start(iteration, at)
        t0 = time.perf_counter()
        try:
            got = worker.next_batch(iteration, lambda: self.stop_request.requested)
        except RolloutWorkerError as err:
            self._failed(err)
        if got is None:  # the worker abandoned it for this rank's stop: every rank stops here (a collective)
            self.stop_request.agreed()
            raise Preempted(self.stop_request.signal_name or "SIGTERM", iteration, update_done=False)
        trajectories, metrics = got
        rank, world = rank_and_world()
        if tuple(t.task for t in trajectories) != rank_tasks(tasks, rank, world):  # none lost or repeated on the way
            raise RuntimeError(f"iteration {iteration}: the rollout worker played other tasks than the loader's")
        versions = [turn.policy_version for t in trajectories for turn in t.turns]
        check_staleness(iteration, versions, self.max_staleness)
        metrics = dict(metrics)
        metrics.update(staleness_metrics(iteration, versions, self.max_staleness))
        metrics["rollout/episodes_spanning_update"] = spanning_share([[turn.policy_version for turn in t.turns]
                                                                      for t in trajectories])
        rows = torch.tensor([iteration - turn.policy_version for t in trajectories if t.fault is None and t.turns
                             for turn in t.turns], dtype=torch.long)
        return Collected(trajectories, metrics, time.perf_counter() - t0, rows)

    def publish(self, model: nn.Module, version: int) -> None:
        """The weights after ``version`` updates, for the worker's turns from now on."""
        if self.worker is None:
            return
        try:
            self.worker.publish(model, version)
        except RolloutWorkerError as err:  # a transfer that hung: every rank ends, none waits in a collective
            self._failed(err)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        super().close()

    def _start(self, iteration: int, at: Placement) -> AsyncRollout:
        if self.worker is not None:
            return self.worker
        if not hasattr(at.loader, "task_function"):
            raise TypeError("rollout.max_staleness > 0 needs the task stream (agentopsd.training.data.TaskDataModule) as the "
                            "training loader: the worker plays iterations ahead of it")
        from agentopsd.envs.base import env_spec

        s = self.settings
        rank, world = rank_and_world()
        spec = WorkerSpec(tokenizer=s.tokenizer, env=s.env, seed=s.seed, rank=rank, rollout=s.rollout, world=world,
                          with_teacher=self.with_teacher, task_fn=at.loader.task_function(), start=iteration,
                          end=s.num_iterations, max_staleness=self.max_staleness, threads=s.rollout.worker_threads,
                          parent_pid=os.getpid(), env_spec=env_spec(s.env.id),
                          device=str(at.device),  # a GPU rank's worker generates on that rank's GPU
                          # rollout.backend=vllm: the worker runs its own engine on model.path; the evaluation keeps its
                          # lockstep collector here, so this process builds a second engine when it evaluates
                          model_path=s.model_path, weights_as_loaded=s.weights_as_loaded, per_node=at.per_node,
                          # the worker builds its own policy in this dtype; under FSDP2 each rank gathers whole tensors
                          dtype=worker_dtype(str(at.device), s.generation_dtype, _floating_dtype(at.model)))
        self.worker = AsyncRollout(spec, at.model)
        return self.worker

    def _failed(self, err: RolloutWorkerError):
        rank, world = rank_and_world()
        if world > 1:
            print(f"error: {err}", file=sys.stderr, flush=True)
            self.stop_other_ranks()
            os._exit(1)
        raise err


def _floating_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the policy's first floating parameter (its trainable ones under LoRA are float32 masters)."""
    return next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)


RolloutSource = LockstepRollouts
"""The interface: ``collect``, ``evaluate``, ``publish``, ``close``, ``collector`` and ``off_policy``."""


def make_rollout_source(build_collector: Callable[[], Collector], settings: WorkerSettings, *, with_teacher: bool,
                        teacher_scoring: str, stop_request: StopRequest, stop_other_ranks: Callable[[], None],
                        release_memory: Callable[[], None], restore_memory: Callable[[], None]) -> LockstepRollouts:
    """The source ``rollout.max_staleness`` asks for: lockstep at 0, a worker running ahead above."""
    memory = {"release_memory": release_memory, "restore_memory": restore_memory}
    if settings.rollout.max_staleness <= 0:
        return LockstepRollouts(build_collector, with_teacher=with_teacher, stop_request=stop_request, **memory)
    # the worker scores the teacher view where the run resolved it (rollout.teacher_scoring=auto settled)
    settings = dataclasses.replace(settings, rollout=dataclasses.replace(settings.rollout, teacher_scoring=teacher_scoring))
    return AheadRollouts(build_collector, settings, with_teacher=with_teacher, stop_request=stop_request,
                         stop_other_ranks=stop_other_ranks, **memory)
