"""The optimizer's states off the accelerator between updates (``optim.offload_optimizer``).

AdamW keeps two float32 tensors per weight (``exp_avg``, ``exp_avg_sq``): for Qwen2.5-3B on one GPU, 23 GiB,
twice the master weights. The update needs them only at its optimizer steps; the rollout never touches them.
Moving them to host memory after the update and back before the next one, as verl's ``optimizer_offload``
does, keeps vLLM's share and the states off the GPU at the same time.

Both functions always move (copy) every state they find: the caller knows whether the states are out (a flag
beside the optimizer), so a second offload or restore is the caller's to skip.

Under FSDP2 the states are DTensors holding this rank's shard: each keeps its placements and only its local
shard moves. Where CUDA is available the host copies are pinned, so both copies run asynchronously.
``step`` (a 0-dim tensor AdamW keeps on the host unless ``capturable``) stays where it is.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[dict, str, Tensor]]:
    """``(state dict, key, tensor)`` of every per-weight state tensor (not the 0-dim ``step`` counters)."""
    return [(state, key, value) for state in optimizer.state.values() for key, value in state.items()
            if isinstance(value, Tensor) and value.dim() > 0]


def _local(value: Tensor) -> Tensor:
    """The tensor's own storage: a DTensor's local shard, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _copied(value: Tensor, device: torch.device, pin: bool) -> Tensor:
    """A copy of ``value`` on ``device`` (pinned on the host when ``pin``); a DTensor stays a DTensor with the
    same placements, only its local shard copied (``DTensor.from_local`` would move it back to the mesh's device)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return DTensor(_copied(value.to_local(), device, pin), value._spec, requires_grad=False)
    if device.type == "cpu" and pin:
        out = torch.empty_like(value, device="cpu", pin_memory=True)
        return out.copy_(value, non_blocking=True)
    return value.to(device, non_blocking=value.is_pinned(), copy=True)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's per-weight optimizer states (local shards under FSDP2)."""
    return sum(_local(v).nbytes for _, _, v in _state_tensors(optimizer))


def offload_optimizer_states(optimizer: torch.optim.Optimizer, *, pin_memory: bool | None = None) -> int:
    """Move every per-weight state tensor of ``optimizer`` (a Lightning-wrapped one too: it shares ``state``) to
    host memory, pinned when ``pin_memory`` (default: where CUDA is available). Returns the bytes moved (0 before
    the first step, when AdamW has no states yet). The device copies are freed once nothing else holds them; the
    caller releases PyTorch's cached blocks (``torch.cuda.empty_cache``) before another allocator wants them."""
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    host = torch.device("cpu")
    moved = 0
    from_device = False
    for state, key, value in _state_tensors(optimizer):
        from_device = from_device or _local(value).device.type != "cpu"
        state[key] = _copied(value, host, pin and _local(value).device.type == "cuda")
        moved += _local(value).nbytes
    if from_device and torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies are done before the device blocks are reused
    return moved


def restore_optimizer_states(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Move every per-weight state tensor of ``optimizer`` back to ``device`` (before its next step); the host
    copies are dropped. Returns the bytes moved. The copies from pinned memory run asynchronously on the current
    stream, ahead of the optimizer step that reads them."""
    device = torch.device(device)
    moved = 0
    for state, key, value in _state_tensors(optimizer):
        state[key] = _copied(value, device, pin=False)
        moved += _local(value).nbytes
    return moved
