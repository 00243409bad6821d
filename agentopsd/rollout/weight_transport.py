"""How the trainer's weights reach its rollout worker (``rollout.weight_transport``), and where that worker runs
(``rollout.devices``).

The worker builds its own policy (:class:`PolicyBlueprint`: the trainer's config, on the worker's device, in the
worker's dtype: bf16 on a GPU) and the trainer's first publish fills every parameter of it; later publishes send the
trainable ones (under LoRA the adapters). No copy of the trainer's model is ever made. Every publish streams byte
buckets of at most a fixed size (:func:`plan_buckets`; a tensor larger than one spans several), in the worker's
dtype, and the worker copies each one straight into its policy: each end holds one bucket and, on the trainer's, one
whole tensor (under FSDP2 gathered from the shards, :func:`whole`, one at a time as the colocated vLLM sync gathers).

Two transports behind one small interface (trainer side: ``publish(model, version, alive) -> bool``; worker side:
``start(device)`` and ``load_into(model, have) -> version``, between turns):

- ``shared_memory`` (:class:`agentopsd.rollout.async_rollout.SharedWeights`): one bucket of
  :data:`SHARED_BUCKET_BYTES` in shared memory, reused, and a handshake. The default with the worker beside the
  trainer (on its CPU or on its own GPU).
- ``collective`` (:class:`CollectiveSender` / :class:`CollectiveReceiver`): a broadcast per bucket over a private
  process group of two members, the trainer (0) and its worker (1), built from its own ``TCPStore`` on a free port,
  never the training's default group. NCCL when both ends are on CUDA (the worker on a GPU of its own,
  ``rollout.devices``), gloo on CPU. The default under ``rollout.devices``.

The collective protocol (control plane through the store, data plane through the group, as the peers push weights
to their inference engines: a request names the version, then the tensors are broadcast)::

    trainer: store["publish/n"] = version  ->  waits for store["ready/n"]  ->  gather, broadcast(bucket) per bucket
    worker, between turns (load_into): sees "publish/n", sets "ready/n", receives each bucket into its policy
    close: store["publish/n"] = -1 (the sentinel)

Why the version goes through the store and not a header broadcast: between two publishes lie an update and maybe an
evaluation, of unbounded length, and a collective that waits that long would pass its timeout and break the group.
A worker that polls the store waits without a timeout; once it is ready, the broadcasts are bounded
(:data:`TRANSFER_SECONDS`).

A publish waits for the worker's turn in flight to end (the worker takes weights only between turns, into the policy
it generates with), as the peers pause generation for a sync; it waits before its first gather, so that under FSDP2
the other ranks wait in a gather only for the transfer itself. A dead peer ends the other side in bounded time: the
trainer polls with the worker's liveness and a deadline; the worker's store calls fail once the trainer's store is
gone, and the worker's loop checks that its parent lives.
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
BUCKET_BYTES = 256 * 2**20
"""The largest bucket the collective sends: big enough that a broadcast's fixed cost is small beside its bytes (a
7B model in bf16 is about 60 of them), small beside a GPU's memory, which holds one on each end during a publish."""
SHARED_BUCKET_BYTES = 16 * 2**20
"""The shared-memory transport's one bucket: well inside a container's default 64 MB ``/dev/shm``."""
CONNECT_SECONDS = 1800.0
"""Longest wait for the worker to join the private group (its handshake done), counted from ``connect``; the producer
passes ``rollout.worker_stall_seconds``."""
GROUP_TIMEOUT_FACTOR = 2.0
"""The private group's own timeout (gloo's, NCCL's watchdog) is this many times the longest Python-side deadline: the
Python side sees a hang first and fails in one line, before the watchdog aborts the process."""
SENTINEL = -1
"""The version that tells the receiver to end."""
TRANSPORTS = ("auto", "shared_memory", "collective")
KEY = "publish/{}"
READY = "ready/{}"
"""Set by the worker once it is between turns and receiving publish n."""
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


# ------------------------------------------------------------------ buckets: bounded byte ranges, streamed


@dataclass(frozen=True)
class Slot:
    """One tensor on the wire: its name in the model, its whole shape and the dtype it travels (and lives) in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


Piece = tuple[int, int, int]
"""``(slot index, first byte, one past the last byte)``: a byte range of one tensor inside a bucket."""


def wire_layout(model: nn.Module, dtype: torch.dtype, *, full: bool) -> tuple[Slot, ...]:
    """What one publish sends, in parameter order: every parameter (``full``, the start's sync; each tied one once)
    or the trainable ones (under LoRA the adapters), floating ones in ``dtype`` (the worker's). The shapes are whole
    ones: an FSDP2 shard (a DTensor) reports its whole shape. Buffers are not sent: the worker builds its own from the
    same config (a causal LM holds none that training changes)."""
    items = model.named_parameters() if full else published_params(model)
    return tuple(Slot(n, tuple(p.shape), dtype if p.dtype.is_floating_point else p.dtype) for n, p in items)


def plan_buckets(sizes: Sequence[int], max_bytes: int) -> list[list[Piece]]:
    """The tensors of ``sizes`` bytes laid end to end and cut every ``max_bytes``: each bucket holds at most
    ``max_bytes`` (a tensor larger than that spans several), so neither end ever holds more than one bucket beside
    one whole tensor, whatever the model's size. Both ends compute the same plan from the same layout."""
    if max_bytes < 1:
        raise ValueError(f"a weight bucket needs at least one byte, got {max_bytes}")
    buckets: list[list[Piece]] = []
    current: list[Piece] = []
    room = max_bytes
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(room, size - start)
            current.append((index, start, start + take))
            start += take
            room -= take
            if room == 0:
                buckets.append(current)
                current, room = [], max_bytes
    if current:
        buckets.append(current)
    return buckets


def bucket_capacity(layout: Sequence[Slot], max_bytes: int) -> int:
    """The bytes of the largest bucket of ``layout`` (never above ``max_bytes``)."""
    return min(max_bytes, sum(s.nbytes for s in layout)) if layout else 0


def whole(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor, detached, in ``dtype``: an FSDP2 shard (a DTensor) is cast on its own rank, then gathered
    (``full_tensor``, a collective every rank runs in the same order), as the colocated vLLM sync gathers."""
    from agentopsd.rollout.vllm_backend import _full

    return _full(tensor, dtype if tensor.dtype.is_floating_point else None)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat byte view of a contiguous tensor (no copy)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def send_buckets(model: nn.Module, layout: Sequence[Slot], max_bytes: int, device: str | torch.device,
                 send: Callable[[torch.Tensor], bool]) -> bool:
    """Stream ``model``'s tensors of ``layout`` through ``send``, one bucket of at most ``max_bytes`` at a time, in
    one reused buffer on ``device``; each tensor is gathered whole once, when its first bytes are due. A failed
    ``send`` (False) stops the sending but not the gathering: under FSDP2 every rank must run all its gathers."""
    params = dict(model.named_parameters())
    bucket = torch.empty(bucket_capacity(layout, max_bytes), dtype=torch.uint8, device=device)
    held, data = -1, None
    ok = True
    with torch.no_grad():
        for pieces in plan_buckets([s.nbytes for s in layout], max_bytes):
            offset = 0
            for index, start, stop in pieces:
                if index != held:
                    data = None  # the previous tensor is freed before the next is gathered
                    data = _bytes_of(whole(params[layout[index].name], layout[index].dtype))
                    held = index
                bucket[offset:offset + stop - start].copy_(data[start:stop])
                offset += stop - start
            ok = ok and send(bucket[:offset])
    return ok


def receive_buckets(model: nn.Module, layout: Sequence[Slot], max_bytes: int, device: str | torch.device,
                    receive: Callable[[torch.Tensor], None]) -> None:
    """The worker's half of :func:`send_buckets`: each bucket ``receive``d into one reused buffer on ``device``, then
    its byte ranges copied straight into ``model``'s tensors (which live in the wire's dtypes: no staging copy)."""
    params = dict(model.named_parameters())
    targets = []
    for slot in layout:
        p = params[slot.name]
        if p.dtype != slot.dtype or tuple(p.shape) != slot.shape or not p.is_contiguous():
            raise ValueError(f"the rollout worker's {slot.name} is {p.dtype} {tuple(p.shape)}, the trainer sends "
                             f"{slot.dtype} {slot.shape}: the worker's policy must be built in the wire's dtype")
        targets.append(p.detach().view(-1).view(torch.uint8))
    bucket = torch.empty(bucket_capacity(layout, max_bytes), dtype=torch.uint8, device=device)
    with torch.no_grad():
        for pieces in plan_buckets([s.nbytes for s in layout], max_bytes):
            used = sum(stop - start for _, start, stop in pieces)
            receive(bucket[:used])
            offset = 0
            for index, start, stop in pieces:
                targets[index][start:stop].copy_(bucket[offset:offset + stop - start])
                offset += stop - start


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


@dataclass(frozen=True)
class PolicyBlueprint:
    """How a rollout worker builds its own policy (picklable: it crosses the spawn): the trainer's transformers config,
    its generation config and, under LoRA, its adapters' config. Built in the worker on its device and in its dtype,
    it holds nothing worth keeping until the first (full) publish fills every parameter: no copy of the trainer's
    model is ever made, on its device or in shared memory."""

    config: object
    generation_config: object = None
    lora: object = None
    """The active adapter's ``peft`` config; None without LoRA."""

    def __call__(self, device: str, dtype: torch.dtype) -> nn.Module:
        import transformers

        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=dtype)
            if self.lora is not None:
                import peft

                model = peft.get_peft_model(model, self.lora)
        for p in model.parameters():  # peft makes float32 adapters: the worker runs (and receives) one dtype
            if p.dtype.is_floating_point and p.dtype != dtype:
                p.data = p.data.to(dtype)
        if self.generation_config is not None:
            (model.get_base_model() if self.lora is not None else model).generation_config = self.generation_config
        return model.requires_grad_(False).eval()


def policy_blueprint(model: nn.Module) -> PolicyBlueprint:
    """The :class:`PolicyBlueprint` of the trainer's policy (a transformers model, maybe a peft one around it)."""
    lora = None
    if callable(getattr(model, "get_base_model", None)):
        lora = model.peft_config[model.active_adapter]
        model = model.get_base_model()
    return PolicyBlueprint(model.config, getattr(model, "generation_config", None), lora)


class CollectiveReceiver:
    """The worker's end (picklable until :meth:`start`): between turns, :meth:`load_into` receives every version the
    trainer has announced, bucket by bucket, straight into the worker's policy."""

    def __init__(self, full: tuple[Slot, ...], trainable: tuple[Slot, ...], port: int, backend: str, timeout: float,
                 max_bytes: int) -> None:
        self.full, self.trainable = full, trainable
        self.port = port
        self.backend = backend
        self.timeout = timeout
        self.max_bytes = max_bytes

    def start(self, device: str) -> None:
        """Join the private group (its rendezvous waits for the trainer's :meth:`CollectiveSender.connect`), with
        buckets on ``device`` (the worker's: ``cuda:0`` of its visible GPU, or ``cpu``)."""
        import torch.distributed as dist

        self.device = device
        if device.startswith("cuda"):  # GPU only: never ran here
            torch.cuda.set_device(device)
        self._store = dist.TCPStore("127.0.0.1", self.port, 2, False, timeout=datetime.timedelta(seconds=self.timeout))
        self._group = private_group(self._store, 1, self.backend, self.timeout)
        handshake(self._group, device)  # the trainer's connect waits for this, with its deadline
        self._received = 0
        self.closed = False

    def load_into(self, model: nn.Module, have: int) -> int:
        """Receive every version announced so far into ``model`` (the first one: every parameter; later ones: the
        trainable ones); the version it holds now. Called between turns: a turn never sees half of a version. Raises
        :class:`WeightTransferError` when the trainer's store or the transfer fails."""
        try:
            while not self.closed and self._store.check([KEY.format(self._received)]):
                key = KEY.format(self._received)
                version = int(self._store.get(key))
                self._store.delete_key(key)
                if version == SENTINEL:
                    self.closed = True
                    break
                self._store.set(READY.format(self._received), "1")  # between turns: the trainer starts gathering
                layout = self.full if self._received == 0 else self.trainable
                receive_buckets(model, layout, self.max_bytes, self.device,
                                lambda bucket: self._group.broadcast([bucket], _broadcast_options()).wait())
                if self.device.startswith("cuda"):
                    torch.cuda.current_stream().synchronize()
                self._received += 1
                have = version
        except WeightTransferError:
            raise
        except Exception as err:  # noqa: BLE001  (one line: the worker reports it to the trainer)
            raise WeightTransferError(f"the weight receiver of the rollout worker failed: {type(err).__name__}: "
                                      f"{str(err).splitlines()[0] if str(err) else ''}") from None
        return have


class CollectiveSender:
    """The trainer's end: announces each version in its store and broadcasts its tensors to its worker in buckets of
    at most ``max_bytes``, in the worker's dtype (the first publish: every parameter; later ones: the trainable)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, trainer_device: str, worker_device: str,
                 timeout: float | None = None, max_bytes: int = BUCKET_BYTES, connect_timeout: float | None = None) -> None:
        self.timeout = TRANSFER_SECONDS if timeout is None else timeout
        self.connect_timeout = CONNECT_SECONDS if connect_timeout is None else connect_timeout
        self.full, self.trainable = wire_layout(model, dtype, full=True), wire_layout(model, dtype, full=False)
        self.max_bytes = max_bytes
        self.backend = collective_backend(trainer_device, worker_device)
        # gloo sends CPU tensors; NCCL the trainer's own CUDA ones
        self.device = trainer_device if self.backend == "nccl" else "cpu"
        # the store and the group outlast every deadline polled here: a hang fails in Python first, in one line
        self.group_timeout = group_timeout(self.timeout, self.connect_timeout)
        self.store = _free_store(self.group_timeout)
        self.receiver = CollectiveReceiver(self.full, self.trainable, self.store.port, self.backend, self.group_timeout,
                                           max_bytes)
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
        start = time.monotonic()
        deadline = start + self.timeout if deadline is None else deadline
        while not done():
            if not alive():
                return False
            if time.monotonic() > deadline:
                raise WeightTransferError(f"the rollout worker took over {deadline - start:.0f}s to {what}")
            time.sleep(0.002)
        return True

    def publish(self, model: nn.Module, version: int, alive: Callable[[], bool] = lambda: True) -> bool:
        """Send ``model``'s weights as ``version``, bucket by bucket; returns once the worker has taken them, which it
        does between turns (so a publish waits for the turn in flight, as the peers pause generation for a sync).
        False when the worker is dead (its owner reports that); raises when it hangs. Under FSDP2 every rank gathers
        every tensor even when its own worker is gone: the gathers are collectives of the training's group."""
        layout = self.full if self.count == 0 else self.trainable
        if not self.broken:
            if self._connector is None:
                self.connect()
            # connected() raises past its own deadline (counted from connect), before this wait's
            if not self._wait(self.connected, alive, "join the weight transfer group", deadline=float("inf")):
                self.broken = True
            elif self._group_error is not None:
                self.broken = True
                raise WeightTransferError(f"the weight transfer group failed: {type(self._group_error).__name__}: "
                                          f"{str(self._group_error).splitlines()[0]}")
            else:
                self.store.set(KEY.format(self.count), str(int(version)))
                # the worker takes it between turns: wait for that before the first gather, so that under FSDP2 the
                # other ranks wait in a gather for the transfer only
                ready = READY.format(self.count)
                # a turn in flight (or, for the first publish, the worker's start) may be slow: the stall deadline
                if self._wait(lambda: self.store.check([ready]), alive, f"be between turns and take weight version "
                              f"{version} (rollout.worker_stall_seconds bounds this wait: stuck, or only slow)",
                              deadline=time.monotonic() + self.connect_timeout):
                    self.store.delete_key(ready)
                else:
                    self.broken = True
        try:
            sent = send_buckets(model, layout, self.max_bytes, self.device,
                                lambda bucket: not self.broken and self._broadcast(bucket, version, alive))
        except WeightTransferError:
            self.broken = True
            raise
        if sent:
            self.count += 1
        return sent

    def _broadcast(self, bucket: torch.Tensor, version: int, alive: Callable[[], bool]) -> bool:
        """One bucket to the worker; False (and broken) when it died meanwhile."""
        try:
            work = self._group.broadcast([bucket], _broadcast_options())
            if not self._wait(work.is_completed, alive, f"receive weight version {version}"):
                self.broken = True
                return False
            work.wait()  # raises a failed transfer's error
        except WeightTransferError:
            raise
        except Exception as err:  # the transport's own error: a dead worker is its owner's to report
            self.broken = True
            if not alive():
                return False
            raise WeightTransferError(f"sending weight version {version} failed: {type(err).__name__}: "
                                      f"{str(err).splitlines()[0] if str(err) else ''}") from None
        return True

    def close(self) -> None:
        """Tell the receiver to end (it is between two broadcasts: the sentinel is only a store key)."""
        if not self.broken:
            self.store.set(KEY.format(self.count), str(SENTINEL))
        self.broken = True
