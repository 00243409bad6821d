"""How the trainer's weights reach its rollout worker (``rollout.weight_transport``), and where that worker runs
(``rollout.devices``).

Two transports behind one small interface (trainer side: ``publish(model, version)``; worker side: ``start(device)``,
``available()``, ``load_into(model, have) -> version``, and ``model``, the full weights that cross the spawn):

- ``shared_memory`` (:class:`agentopsd.rollout.async_rollout.SharedWeights`): a CPU copy in shared memory and a
  version counter. The default with the worker beside the trainer (on its CPU or on its own GPU).
- ``collective`` (:class:`CollectiveSender` / :class:`CollectiveReceiver`): a broadcast over a private process
  group of two members, the trainer (0) and its worker (1), built from its own ``TCPStore`` on a free port, never
  the training's default group. NCCL when both ends are on CUDA (the worker on a GPU of its own,
  ``rollout.devices``), gloo on CPU. The default under ``rollout.devices``.

The collective protocol (control plane through the store, data plane through the group, as the peers push weights
to their inference engines: a request names the version, then the tensors are broadcast)::

    trainer: store["publish/n"] = version  ->  broadcast(bucket) per dtype  ->  returns once the buckets are sent
    worker receiver thread: waits for "publish/n", joins the broadcasts into its incoming buffers, then, under a
                            lock, swaps them with the staged ones and marks the staged version
    worker main thread, between turns: load_into copies the staged buffers into the policy (under the same lock)
    close: store["publish/n"] = -1 (the sentinel): the receiver ends

Why the version goes through the store and not a header broadcast: between two publishes lie an update and maybe an
evaluation, of unbounded length, and a collective that waits that long would pass its timeout and break the group.
A receiver that polls the store waits without a timeout; once a version is announced, the trainer is already in the
broadcast, so the broadcast itself is bounded (:data:`TRANSFER_SECONDS`).

The trainer never waits for the worker's turn: the receiver thread is always ready for the next broadcast (it
holds the lock only for a swap of two lists). A dead peer ends the other side in bounded time: the trainer polls
its broadcast with the worker's liveness and a deadline; the receiver's store calls fail once the trainer's store
is gone, and the worker's loop checks that its parent lives.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

TRANSFER_SECONDS = 120.0
"""Longest wait for one publish's broadcasts before it fails."""
CONNECT_SECONDS = 1800.0
"""Longest wait for the worker to join the private group (its handshake done), counted from ``connect``; the producer
passes ``rollout.worker_stall_seconds``."""
GROUP_TIMEOUT_FACTOR = 2.0
"""The private group's own timeout (gloo's, NCCL's watchdog) is this many times the longest Python-side deadline: the
Python side sees a hang first and fails in one line, before the watchdog aborts the process."""
RECEIVER_POLL_SECONDS = 0.02
"""How often the worker's receiver asks the store for the next version."""
SENTINEL = -1
"""The version that tells the receiver to end."""
TRANSPORTS = ("auto", "shared_memory", "collective")
KEY = "publish/{}"
STORE_PREFIX = "agentopsd-weights"


class WeightTransferError(RuntimeError):
    """A publish could not reach the worker in time (one line)."""


def published_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters an update changes (trainable ones: under LoRA only the adapters), by name."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# ------------------------------------------------------------------ choices made from the config (pure)


def resolve_transport(transport: str, devices: Sequence[int] | None) -> str:
    """``auto``: ``collective`` when the worker has a GPU of its own (``rollout.devices``), ``shared_memory``
    otherwise."""
    if transport == "auto":
        return "collective" if devices else "shared_memory"
    return transport


def collective_backend(trainer_device: str, worker_device: str) -> str:
    """NCCL when both ends are on CUDA, gloo otherwise (on CPU: the path the tests run)."""
    return "nccl" if trainer_device.startswith("cuda") and worker_device.startswith("cuda") else "gloo"


def local_rank(rank: int, env: dict[str, str] | None = None) -> int:
    """This process' rank on its node: ``LOCAL_RANK`` (set by torchrun and Lightning), else the global rank."""
    env = os.environ if env is None else env
    value = env.get("LOCAL_RANK")
    return int(value) if value not in (None, "") else rank


def local_world(world: int, env: dict[str, str] | None = None, per_node: int | None = None) -> int:
    """The processes on this node: ``LOCAL_WORLD_SIZE`` when set (torchrun), else ``per_node`` (the strategy's
    processes per node: Lightning's own launcher and SLURM set no ``LOCAL_WORLD_SIZE``), else SLURM's
    ``SLURM_NTASKS_PER_NODE`` (``2`` or ``2(x3)``), else the world (one node)."""
    env = os.environ if env is None else env
    value = env.get("LOCAL_WORLD_SIZE")
    if value not in (None, ""):
        return int(value)
    if per_node:
        return int(per_node)
    slurm = (env.get("SLURM_NTASKS_PER_NODE") or "").split("(", 1)[0].split(",", 1)[0]
    return int(slurm) if slurm.isdigit() else world


def check_devices_setting(devices: object, max_staleness: int, transport: str) -> list[int] | None:
    """Config-time checks of ``rollout.devices`` and ``rollout.weight_transport``; the devices as a list of ints."""
    if transport not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport == "collective" and max_staleness < 1:
        raise ValueError("rollout.weight_transport=collective needs rollout.max_staleness >= 1 (colocated rollouts stay "
                         "lockstep and need no transport): set rollout.max_staleness=1 or drop the transport")
    if devices is None:
        return None
    if isinstance(devices, (str, bytes, dict)) or not hasattr(devices, "__iter__"):  # a list, or Hydra's ListConfig
        raise ValueError(f"rollout.devices must be a list of GPU indices, e.g. [2,3], got {devices!r}")
    listed = list(devices)
    if not listed or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in listed):
        raise ValueError(f"rollout.devices must be non-negative GPU indices, e.g. [2,3], got {listed!r}")
    if len(set(listed)) != len(listed):
        raise ValueError(f"rollout.devices must name each GPU once (one rollout worker per GPU), got {listed!r}")
    if max_staleness < 1:
        raise ValueError("rollout.devices needs rollout.max_staleness >= 1 (colocated rollouts stay lockstep): set "
                         "rollout.max_staleness=1, or drop rollout.devices")
    # with rollout.weight_transport=shared_memory the worker reads the CPU copy onto its GPU: slower, but it works
    return listed


def check_devices_at_start(devices: Sequence[int] | None, transport: str, trainer_device: str, rank: int, world: int,
                           visible_gpus: int | None, env: dict[str, str] | None = None,
                           per_node: int | None = None) -> int | None:
    """Producer-start checks, where the trainer's device and ranks are known; this rank's rollout GPU (an index into
    the trainer's visible devices), or None when the worker stays beside the trainer. ``per_node``: the strategy's
    processes per node (:func:`local_world`)."""
    on_cuda = trainer_device.startswith("cuda")
    if transport == "collective" and on_cuda and not devices:
        raise ValueError("rollout.weight_transport=collective on a GPU needs rollout.devices (NCCL cannot connect two "
                         "processes on one GPU): set rollout.devices, or rollout.weight_transport=shared_memory")
    if not devices:
        return None
    if not on_cuda:
        raise ValueError(f"rollout.devices needs the trainer on CUDA (it is on {trainer_device}): drop rollout.devices, "
                         "or train on GPUs (trainer.accelerator=gpu)")
    count = local_world(world, env, per_node)
    if len(devices) != count:
        raise ValueError(f"rollout.devices lists {len(devices)} GPUs for {count} training processes on this node: list "
                         "one rollout GPU per local rank")
    mine = list(devices)[local_rank(rank, env)]
    trainer_index = int(trainer_device.split(":", 1)[1]) if ":" in trainer_device else 0
    if mine == trainer_index:
        raise ValueError(f"rollout.devices[{local_rank(rank, env)}]={mine} is the trainer's own GPU (cuda:{trainer_index}): "
                         "give the rollout workers GPUs the training does not use")
    if visible_gpus is not None and mine >= visible_gpus:
        raise ValueError(f"rollout.devices[{local_rank(rank, env)}]={mine} but the trainer sees {visible_gpus} GPUs: "
                         "indices count within CUDA_VISIBLE_DEVICES")
    return mine


# ------------------------------------------------------------------ buckets: one flat buffer per dtype


@dataclass(frozen=True)
class Bucket:
    """Trainable tensors of one dtype, laid end to end in one flat buffer (one broadcast instead of one per tensor)."""

    dtype: torch.dtype
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(int(torch.Size(s).numel()) for s in self.shapes)

    @property
    def total(self) -> int:
        return sum(self.numels)


def bucket_layout(model: nn.Module) -> tuple[Bucket, ...]:
    """The trainable tensors grouped by dtype, in parameter order (both ends compute the same from the same model)."""
    groups: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    for name, p in published_params(model):
        groups.setdefault(p.dtype, []).append((name, tuple(p.shape)))
    return tuple(Bucket(dtype, tuple(n for n, _ in items), tuple(s for _, s in items)) for dtype, items in groups.items())


def flatten(model: nn.Module, layout: Sequence[Bucket], device: str | torch.device) -> list[torch.Tensor]:
    """Each bucket's tensors of ``model`` as one flat buffer on ``device``."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        return [torch.cat([params[n].detach().reshape(-1) for n in b.names]).to(device) for b in layout]


def unflatten_into(model: nn.Module, layout: Sequence[Bucket], flats: Sequence[torch.Tensor]) -> None:
    """Copy each bucket's flat buffer back into ``model``'s tensors."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for bucket, flat in zip(layout, flats, strict=True):
            for name, shape, part in zip(bucket.names, bucket.shapes, flat.split(list(bucket.numels)), strict=True):
                params[name].copy_(part.view(shape))


# ------------------------------------------------------------------ the private two-member group


def _broadcast_options() -> object:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


def group_timeout(*deadlines: float) -> float:
    """The private group's own timeout: longer than every Python-side deadline polled on it (see
    :data:`GROUP_TIMEOUT_FACTOR`)."""
    return GROUP_TIMEOUT_FACTOR * max(deadlines)


def private_group(store, rank: int, backend: str, timeout: float):
    """A process group of two (trainer 0, worker 1) on its own store: collectives here never mix with the training's.
    Gloo's constructor waits for the other member (the rendezvous); NCCL connects at the first collective, which
    :func:`handshake` makes happen at once. ``timeout``: the group's own (:func:`group_timeout`)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    delta = datetime.timedelta(seconds=timeout)
    if backend == "nccl":  # GPU only: never ran here (no GPU); the constructor documented by torch.distributed
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = delta
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    return dist.ProcessGroupGloo(prefixed, rank, 2, delta)


def handshake(group, device: str) -> None:
    """One one-element broadcast, waited for: the group is up at both ends (NCCL's communicator starts here, not
    inside the first publish's broadcast, where a worker dead before it would leave the trainer in its init)."""
    probe = torch.ones(1, device=device)
    group.broadcast([probe], _broadcast_options()).wait()
    if probe.is_cuda:  # GPU only: never ran here; NCCL's wait only orders the current stream
        torch.cuda.current_stream(probe.device).synchronize()


def _free_store(timeout: float):
    """The trainer's store on a free port of this host (its workers are local processes)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)


def shared_copy(model: nn.Module) -> nn.Module:
    """A CPU copy of the whole policy in shared memory: the worker's starting point, crossing the spawn."""
    import copy

    twin = copy.deepcopy(model).cpu().requires_grad_(False)
    for t in (*twin.parameters(), *twin.buffers()):
        t.share_memory_()
    return twin


class CollectiveReceiver:
    """The worker's end (picklable until :meth:`start`): a thread that receives every published version into staging
    buffers; :meth:`load_into` copies the newest staged version into the policy between turns."""

    def __init__(self, model: nn.Module, layout: tuple[Bucket, ...], port: int, backend: str, start_version: int,
                 timeout: float) -> None:
        self.model = model
        self.layout = layout
        self.port = port
        self.backend = backend
        self.start_version = start_version
        self.timeout = timeout

    def start(self, device: str) -> None:
        """Begin receiving, into buffers on ``device`` (the worker's: ``cuda:0`` of its visible GPU, or ``cpu``)."""
        self.device = device
        self._lock = threading.Lock()
        self._staged: list[torch.Tensor] | None = None
        self._staged_version = self.start_version
        self._error: str | None = None
        self._thread = threading.Thread(target=self._receive, name="agentopsd-weight-receiver", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            self._receive_all()  # its group and store are freed when it returns, before the thread counts as ended
        except BaseException as err:  # noqa: BLE001  (the main thread reports it, as one line)
            with self._lock:
                self._error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"

    def _receive_all(self) -> None:
        """Receive every version until the sentinel; raises when the trainer or the transfer fails."""
        import torch.distributed as dist

        if self.device.startswith("cuda"):  # GPU only: never ran here
            torch.cuda.set_device(self.device)
            # a stream of its own (the current stream is per thread): receiving never queues behind generation
            torch.cuda.set_stream(torch.cuda.Stream())
        store = dist.TCPStore("127.0.0.1", self.port, 2, False, timeout=datetime.timedelta(seconds=self.timeout))
        group = private_group(store, 1, self.backend, self.timeout)
        handshake(group, self.device)  # the trainer's connect waits for this, with its deadline
        incoming: list[torch.Tensor] | None = None
        n = 0
        while True:
            key = KEY.format(n)
            if not store.check([key]):
                time.sleep(RECEIVER_POLL_SECONDS)
                continue
            version = int(store.get(key))
            store.delete_key(key)
            if version == SENTINEL:
                return
            if incoming is None:
                incoming = [torch.empty(b.total, dtype=b.dtype, device=self.device) for b in self.layout]
            for flat in incoming:
                group.broadcast([flat], _broadcast_options()).wait()
            if self.device.startswith("cuda"):
                torch.cuda.current_stream().synchronize()  # received before the main thread reads it
            with self._lock:  # a swap, never a copy: the trainer's next broadcast is never held by a turn
                self._staged, incoming = incoming, self._staged
                self._staged_version = version
            n += 1

    def _raise_failed(self) -> None:
        if self._error is not None:
            raise WeightTransferError(f"the weight receiver of the rollout worker failed: {self._error}")

    def available(self) -> int:
        """The newest version received (staged, not yet loaded, or loaded): what the worker may play with."""
        with self._lock:
            self._raise_failed()
            return self._staged_version

    def load_into(self, model: nn.Module, have: int) -> int:
        """Copy the staged weights into ``model`` when they are newer than ``have``; the version it holds now."""
        with self._lock:
            self._raise_failed()
            if self._staged is None:  # nothing received yet: the policy holds the start version, from the spawn
                return max(have, self.start_version)
            if self._staged_version <= have:
                return have
            unflatten_into(model, self.layout, self._staged)
            if self.device.startswith("cuda"):  # the copies done before the receiver may reuse these buffers
                torch.cuda.current_stream().synchronize()
            return self._staged_version

    def ended(self, timeout: float) -> bool:
        """Whether the receiver thread has ended (after the sentinel or a failure), waiting up to ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


class CollectiveSender:
    """The trainer's end: announces each version in its store and broadcasts the trainable tensors, one flat buffer
    per dtype, to its worker."""

    def __init__(self, model: nn.Module, start_version: int, trainer_device: str, worker_device: str,
                 timeout: float | None = None, connect_timeout: float | None = None) -> None:
        self.timeout = TRANSFER_SECONDS if timeout is None else timeout
        self.connect_timeout = CONNECT_SECONDS if connect_timeout is None else connect_timeout
        self.layout = bucket_layout(model)
        self.backend = collective_backend(trainer_device, worker_device)
        # gloo sends CPU tensors; NCCL the trainer's own CUDA ones
        self.device = trainer_device if self.backend == "nccl" else "cpu"
        # the store and the group outlast every deadline polled here: a hang fails in Python first, in one line
        self.group_timeout = group_timeout(self.timeout, self.connect_timeout)
        self.store = _free_store(self.group_timeout)
        self.receiver = CollectiveReceiver(shared_copy(model), self.layout, self.store.port, self.backend, start_version,
                                           self.group_timeout)
        self.count = 0
        self.broken = False
        self._group = None
        self._group_error: BaseException | None = None
        self._connector: threading.Thread | None = None
        self._connect_deadline = float("inf")

    def connect(self) -> None:
        """Start the private group in a thread (gloo's rendezvous waits for the worker, which is still starting), and
        prove it with one small broadcast (:func:`handshake`); :meth:`connected` tells how that went."""

        def build() -> None:
            try:
                if self.backend == "nccl":
                    torch.cuda.set_device(self.device)
                group = private_group(self.store, 0, self.backend, self.group_timeout)
                handshake(group, self.device)
                self._group = group  # only once both ends have taken part in a collective
            except BaseException as err:  # noqa: BLE001  (reported by connected())
                self._group_error = err

        self._connect_deadline = time.monotonic() + self.connect_timeout
        self._connector = threading.Thread(target=build, name="agentopsd-weight-sender", daemon=True)
        self._connector.start()

    def connected(self) -> bool:
        """Never blocks: whether the worker has joined the private group. Raises :class:`WeightTransferError` when the
        group failed, or when the worker has not joined within ``connect_timeout`` of :meth:`connect`."""
        if self._group_error is not None:
            self.broken = True
            raise WeightTransferError(f"the weight transfer group failed: {type(self._group_error).__name__}: "
                                      f"{str(self._group_error).splitlines()[0] if str(self._group_error) else ''}")
        if self._group is not None:
            return True
        if self._connector is not None and time.monotonic() > self._connect_deadline:
            self.broken = True
            raise WeightTransferError(f"the rollout worker did not join the weight transfer group within "
                                      f"{self.connect_timeout:.0f}s (rollout.worker_stall_seconds bounds it): it is stuck "
                                      "starting, or its end of the group is")
        return False

    def _wait(self, done: Callable[[], bool], alive: Callable[[], bool], what: str, deadline: float | None = None) -> bool:
        """Poll ``done`` until it holds (True), the worker dies (False), or the deadline passes (raises): ``deadline``
        (a ``time.monotonic`` instant), else :attr:`timeout` from now."""
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        while not done():
            if not alive():
                return False
            if time.monotonic() > deadline:
                raise WeightTransferError(f"the rollout worker took over {self.timeout:.0f}s to {what}")
            time.sleep(0.002)
        return True

    def publish(self, model: nn.Module, version: int, alive: Callable[[], bool] = lambda: True) -> bool:
        """Send ``model``'s trainable weights as ``version``; returns once sent (the worker loads them between turns).
        False, sending nothing, when the worker is dead (its owner reports that); raises when it hangs."""
        if self.broken:
            return False
        if self._connector is None:
            self.connect()
        # connected() raises past its own deadline (counted from connect), before this wait's
        if not self._wait(self.connected, alive, "join the weight transfer group", deadline=float("inf")):
            self.broken = True
            return False
        flats = flatten(model, self.layout, self.device)
        self.store.set(KEY.format(self.count), str(int(version)))
        works = [self._group.broadcast([flat], _broadcast_options()) for flat in flats]
        try:
            if not self._wait(lambda: all(w.is_completed() for w in works), alive, f"receive weight version {version}"):
                self.broken = True
                return False
            for w in works:
                w.wait()  # raises a failed transfer's error
        except WeightTransferError:
            self.broken = True
            raise
        except Exception as err:  # the transport's own error: a dead worker is its owner's to report
            self.broken = True
            if not alive():
                return False
            raise WeightTransferError(f"sending weight version {version} failed: {type(err).__name__}: "
                                      f"{str(err).splitlines()[0] if str(err) else ''}") from None
        self.count += 1
        return True

    def close(self) -> None:
        """Tell the receiver to end (it is between two broadcasts: the sentinel is only a store key)."""
        if not self.broken:
            self.store.set(KEY.format(self.count), str(SENTINEL))
        self.broken = True
