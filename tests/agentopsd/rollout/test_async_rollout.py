"""Bounded-staleness asynchronous rollouts (``rollout.max_staleness``): a worker process plays ahead of the update.

In one process (the trainer) with a spawned worker: staleness never passes k, asserted per batch from the
versions the turns record; the worker really runs ahead (some turns are stale); every task of the loader is
played once; a failed or killed worker ends the run with one line, never a hang; evaluation uses the
trainer's current weights. Several processes, a signal and resume: tests/test_async_runs.py.
"""

from __future__ import annotations

import copy
import functools
import os
import signal
import threading
import time

import lightning as L
import pytest
import torch

from agentopsd.callbacks.credit import CreditCallback
from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig
from agentopsd.credit.algorithms import AgentOPSD
from agentopsd.rollout.async_rollout import RolloutWorkerError, SharedWeights, admitted
from agentopsd.rollout.weight_transport import policy_blueprint
from agentopsd.training.data import TaskDataModule, sample_tasks
from agentopsd.training.module import AgentRLModule
from tests.conftest import TOY_ID, WALK_SKILLS


def make_module(policy, iterations: int, max_staleness: int, weight_transport: str = "auto") -> AgentRLModule:
    model, tokenizer = policy
    return AgentRLModule(
        copy.deepcopy(model), tokenizer, algorithm=AgentOPSD(),
        env=EnvConfig(id=TOY_ID, skills=WALK_SKILLS, max_turns=4, output_format="action"),
        rollout=RolloutConfig(max_new_tokens=6, max_staleness=max_staleness, weight_transport=weight_transport),
        optim=OptimConfig(lr=1e-3, ppo_epochs=2, num_mini_batches=2, micro_batch_size=4),
        evaluation=EvalConfig(num_tasks=2),
        num_iterations=iterations,
    )


class BatchRecorder(L.Callback):
    """Per iteration: the turns' policy versions, the tasks played, the first ratio's deviation."""

    def __init__(self) -> None:
        self.versions: dict[int, list[int]] = {}
        self.tasks: dict[int, tuple] = {}
        self.metrics: dict[int, dict[str, float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        it = pl_module.iteration
        self.versions[it] = [turn.policy_version for t in batch.trajectories for turn in t.turns]
        self.tasks[it] = tuple(t.task for t in batch.trajectories)
        self.metrics[it] = dict(pl_module.rollout_metrics)


def fit(module: AgentRLModule, iterations: int, *callbacks, stream=None) -> L.Trainer:
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[CreditCallback(), *callbacks])
    dm = stream or TaskDataModule(TOY_ID, tasks_per_batch=2, group_size=3, num_iterations=iterations)
    trainer.fit(module, datamodule=dm)
    return trainer


def test_admission_control_bounds_staleness():
    # iteration i may start on version v only when i - v <= k
    assert admitted(3, 2, 1) and admitted(3, 3, 1) and not admitted(3, 1, 1)
    assert admitted(0, 0, 1) and admitted(1, 0, 1) and not admitted(2, 0, 1)
    assert admitted(2, 0, 2) and not admitted(3, 0, 2)


def _take_in_a_thread(shared: SharedWeights, policy, want: int) -> threading.Thread:
    """The worker's side between turns: take publishes until version ``want`` is in ``policy``."""
    def take() -> None:
        version = -1
        while version < want:
            version = shared.load_into(policy, version)
            time.sleep(0.001)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


def test_shared_memory_holds_one_small_bucket_and_hands_over_whole_versions(tiny_walk_policy):
    """Nothing model-sized in /dev/shm: one bucket, reused; the worker's own bf16 policy (built from the config, not
    a copy of the trainer's) takes the first publish whole, then each version's trainable weights."""
    import torch.multiprocessing as mp

    model = copy.deepcopy(tiny_walk_policy[0])
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shared = SharedWeights(model, mp.get_context("spawn"), torch.bfloat16, max_bytes=4096)
    assert shared.bucket.is_shared() and shared.bucket.numel() * shared.bucket.element_size() == 4096 < model_bytes / 10
    reader = policy_blueprint(model)("cpu", torch.bfloat16)
    assert {p.dtype for p in reader.parameters()} == {torch.bfloat16}
    assert [n for n, _ in reader.named_parameters()] == [n for n, _ in model.named_parameters()]
    shared.start("cpu")
    for version in (0, 1):
        thread = _take_in_a_thread(shared, reader, version)
        assert shared.publish(model, version, lambda: True)  # returns once the reader took the last bucket
        thread.join(30)
        assert not thread.is_alive()
        for (name, a), b in zip(model.named_parameters(), reader.parameters()):
            assert torch.equal(a.detach().to(torch.bfloat16), b), (version, name)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    assert shared.load_into(reader, 1) == 1  # nothing newer published: nothing taken


def test_the_worker_generates_in_the_runs_generation_dtype(tiny_walk_policy, monkeypatch):
    """bf16 on a GPU; on a CPU the lockstep path's choice (a bf16 copy where the CPU computes bf16 natively), else the
    policy's dtype: the producer is started with it."""
    from agentopsd.rollout import source
    from agentopsd.rollout.async_rollout import worker_dtype
    from agentopsd.training.precision import WeightPlan

    assert worker_dtype("cuda:1", None, torch.float32) == torch.bfloat16
    assert worker_dtype("cpu", torch.bfloat16, torch.float32) == torch.bfloat16
    assert worker_dtype("cpu", None, torch.float32) == torch.float32
    started = []

    class Captured(Exception):
        pass

    def capture(spec, model):
        started.append(spec.dtype)
        raise Captured

    monkeypatch.setattr(source, "AsyncRollout", capture)
    for plan, want in ((WeightPlan(generation_dtype=torch.bfloat16), torch.bfloat16), (WeightPlan(), torch.float32)):
        module = make_module(tiny_walk_policy, 2, 1)
        module.weight_plan = plan
        with pytest.raises(Captured):
            fit(module, 2)
        assert started[-1] == want
    # a sharded (FSDP2) policy starts its worker too: each rank gathers whole tensors from its shards
    from agentopsd.rollout.source import Placement
    from agentopsd.training.data import TaskStream

    module = make_module(tiny_walk_policy, 2, 1)
    with pytest.raises(Captured):
        module.rollouts.collect((), 0, Placement(module.model, 0, torch.device("cpu"), sharded=True,
                                                 loader=TaskStream(TOY_ID, 4, 2, 3, 2, 0)))
    assert started[-1] == torch.float32


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_never_exceeds_k_and_the_worker_runs_ahead(tiny_walk_policy, k):
    iterations = 4
    module = make_module(tiny_walk_policy, iterations, k)
    recorder = BatchRecorder()
    fit(module, iterations, recorder)
    assert sorted(recorder.versions) == list(range(iterations))
    stale = []
    for it, versions in recorder.versions.items():
        assert versions, it
        staleness = [it - v for v in versions]
        assert min(staleness) >= 0 and max(staleness) <= k, (it, versions)  # the bound, from the recorded versions
        stale.append(max(staleness))
        m = recorder.metrics[it]
        assert m["rollout/staleness_max"] == max(staleness)
        assert sum(m[f"rollout/staleness_share_{s}"] for s in range(k + 1)) == pytest.approx(1.0)
    # the worker played ahead: iteration 1 started on version 0 before the first update was published
    assert max(stale) >= 1, recorder.versions
    # every task of the loader's stream, once, in order: none lost, none repeated
    for it, tasks in recorder.tasks.items():
        assert tasks == sample_tasks(TOY_ID, module.trainer.datamodule.num_tasks, 2, 3, it, seed=0)
    assert module._rollouts is None  # teardown ended the worker


class TransportProbe(L.Callback):
    """Which transport the producer uses, and the versions its worker has received when each update starts."""

    def __init__(self) -> None:
        self.transport = None
        self.sent: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        producer = pl_module.rollouts.worker
        self.transport = producer.transport
        self.sent.append(producer.sender.count if producer.sender is not None else -1)


@pytest.mark.timeout(90)  # a publish that never reaches the worker would hold iteration 2's admission forever
def test_the_collective_transport_end_to_end(tiny_walk_policy):
    """rollout.weight_transport=collective on CPU (gloo): the run trains, every turn is within k of its update, and
    the worker admits iteration 2 only once version 1 has crossed the broadcast."""
    iterations, k = 3, 1
    module = make_module(tiny_walk_policy, iterations, k, "collective")
    recorder, probe = BatchRecorder(), TransportProbe()
    fit(module, iterations, recorder, probe)
    assert probe.transport == "collective" and probe.sent == [1, 2, 3]  # the full sync at start, then one per update
    for it, versions in recorder.versions.items():
        assert versions and all(0 <= it - v <= k for v in versions), (it, versions)
    assert min(recorder.versions[2]) >= 1  # version 1 reached the worker through the collective
    assert module._rollouts is None


def test_lockstep_turns_record_their_iteration(tiny_walk_policy):
    module = make_module(tiny_walk_policy, 2, 0)
    recorder = BatchRecorder()
    fit(module, 2, recorder)
    assert recorder.versions[0] and set(recorder.versions[0]) == {0}
    assert recorder.versions[1] and set(recorder.versions[1]) == {1}


def test_stale_turns_are_reweighted_against_the_proximal_policy(tiny_walk_policy):
    """The old log-probs the update uses are the trainer's own at the start of the update (the first ratio is 1
    on every iteration), and a truncated importance weight carries the behaviour policy's gap."""
    module = make_module(tiny_walk_policy, 3, 1)
    recorder = BatchRecorder()

    class Ratio(L.Callback):
        devs: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.devs.append(pl_module.first_ratio_dev)

    ratio = Ratio()
    fit(module, 3, recorder, ratio)
    assert len(ratio.devs) == 3 and max(ratio.devs) < 1e-4, ratio.devs
    assert all("rollout/tis_weight_mean" in m for m in recorder.metrics.values())
    # a stale turn's behaviour log-probs part from the proximal ones (the weights' drift: its own metric), while a
    # fresh turn's agree up to the engine's numerics (the gap the mismatch warning reads)
    stale = [m.get("rollout/logprob_diff_stale_mean", 0.0) for it, m in recorder.metrics.items() if m["rollout/staleness_max"] > 0]
    assert stale and max(stale) > 1e-4, recorder.metrics
    fresh = [m["rollout/logprob_diff_mean"] for m in recorder.metrics.values() if "rollout/logprob_diff_mean" in m]
    assert fresh and max(fresh) < 1e-4, recorder.metrics


def _tasks_then_crash(crash_at: int, env_id: str, num_tasks: int, tasks_per_batch: int, group_size: int, iteration: int,
                      seed: int):
    if iteration >= crash_at:
        raise ValueError(f"planted failure at iteration {iteration}")
    return sample_tasks(env_id, num_tasks, tasks_per_batch, group_size, iteration, seed)


class CrashingStream(TaskDataModule):
    def train_dataloader(self):
        stream = super().train_dataloader()
        stream.task_function = lambda: functools.partial(_tasks_then_crash, 1, stream.env_id, stream.num_tasks,
                                                         stream.tasks_per_batch, stream.group_size, seed=stream.seed)
        return stream


def test_a_failing_worker_ends_the_run_with_one_line(tiny_walk_policy):
    module = make_module(tiny_walk_policy, 3, 1)
    stream = CrashingStream(TOY_ID, tasks_per_batch=2, group_size=3, num_iterations=3)
    with pytest.raises(RolloutWorkerError) as err:
        fit(module, 3, stream=stream)
    message = str(err.value)
    assert "\n" not in message and "failed at iteration 1" in message and "planted failure" in message


class KillWorker(L.Callback):
    """SIGKILL the worker at the first update: the trainer must notice and stop, not wait forever."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.iteration == 0:
            os.kill(pl_module.rollouts.worker.process.pid, signal.SIGKILL)
            pl_module.rollouts.worker.process.join(10)


@pytest.mark.parametrize("transport", ["shared_memory", "collective"])
def test_a_killed_worker_ends_the_run_with_one_line(tiny_walk_policy, transport):
    module = make_module(tiny_walk_policy, 4, 1, transport)
    with pytest.raises(RolloutWorkerError) as err:
        fit(module, 4, KillWorker())
    message = str(err.value)
    assert "\n" not in message and "exited with code -9" in message


def test_evaluation_uses_the_current_weights(tiny_walk_policy):
    module = make_module(tiny_walk_policy, 2, 1)
    fit(module, 2)
    module.evaluate()
    # the evaluation's collector runs in this process on the policy itself, tagged with the updates done
    assert module.collector.generator.model is module.model
    assert module.collector.policy_version == module.iterations_done == 2


def test_a_gpu_worker_sees_only_its_ranks_gpu():
    from agentopsd.rollout.async_rollout import worker_device_env

    assert worker_device_env("cpu", "0,1") == {}
    assert worker_device_env("cuda:1", None) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert worker_device_env("cuda:1", "4,5,6") == {"CUDA_VISIBLE_DEVICES": "5"}  # the trainer's own numbering
    assert worker_device_env("cuda", "3") == {"CUDA_VISIBLE_DEVICES": "3"}


def test_tensor_parallel_engines_are_refused_with_staleness():
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        RolloutConfig(backend="vllm", max_staleness=1, vllm={"tensor_parallel_size": 2})
    RolloutConfig(backend="vllm", max_staleness=0, vllm={"tensor_parallel_size": 2})
