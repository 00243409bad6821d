"""Keeping ranks in step: every collective (FSDP all-gathers, DDP all-reduces) must be entered
by every rank the same number of times, while each rank rolls out its own tasks."""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def _collective_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo takes CPU tensors
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_max(value: int) -> int:
    """The largest ``value`` over ranks (the value itself when not distributed)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], device=_collective_device(), dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_rank(flag: bool) -> bool:
    """True when ``flag`` holds on at least one rank."""
    return all_max(int(flag)) > 0


def shard_groups(group_ids: list[int], rank: int, world: int) -> list[int]:
    """Positions of the items whose group falls to ``rank``: whole groups stay together, since
    GRPO compares the copies of one task."""
    order = sorted(set(group_ids))
    mine = {g for n, g in enumerate(order) if n % world == rank}
    return [i for i, g in enumerate(group_ids) if g in mine]
