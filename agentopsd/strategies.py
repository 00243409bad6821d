"""FSDP2 through Lightning's ModelParallelStrategy, and the precision of the weights the optimizer updates.

``AgentRLModule.configure_model`` calls :func:`prepare_policy`: float32 master weights where the
precision asks for them, and under ``trainer=fsdp`` ``fully_shard`` on each decoder layer and the
root (the policy's and the KL reference's), rank 0's weights broadcast into ranks built on meta.
"""

from __future__ import annotations

import itertools
import logging

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn

from agentopsd import distributed
from agentopsd.distributed import rank_and_world

log = logging.getLogger(__name__)


class FSDP2Strategy(ModelParallelStrategy):
    """Pure FSDP2: every process holds one data-parallel shard, no tensor parallelism.

    Lightning's ``data_parallel_size="auto"`` means one data-parallel group per *node* (it expects
    tensor parallelism inside a node); sharding across every process needs world-size groups.
    :func:`prepare_policy` (from ``AgentRLModule.configure_model``) applies ``fully_shard`` to each
    decoder layer and the root. Works on GPUs (NCCL) and on CPU (gloo).
    """

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(**kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


def fsdp_mixed_precision(precision: str):
    """FSDP2's policy for ``bf16-mixed``: float32 master weights and gradient reduction, bf16 compute.

    Lightning's ``bf16-mixed`` only autocasts ``training_step``; FSDP2 would then all-gather float32
    shards and the rollout (outside ``training_step``) would run in float32. With this policy every
    forward, rollouts included, computes in bf16 from bf16 all-gathers, while the optimizer updates
    float32 weights: with ``bf16-true`` weights, an update below ~1/256 of a weight (Adam at lr 1e-6)
    rounds away and the model never moves.
    """
    if precision != "bf16-mixed":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def needs_float32_master(precision: str) -> bool:
    """Precisions whose optimizer must see float32 weights (all but the ``*-true`` half ones)."""
    return precision not in ("bf16-true", "16-true", "bf16", "16", "half")


def rank0_weights(model: nn.Module) -> dict[str, Tensor]:
    """What rank 0 broadcasts, taken before sharding: its state dict plus the buffers the state dict
    leaves out (non-persistent ones, e.g. rotary ``inv_freq``), which ``set_model_state_dict`` skips
    and ``to_empty`` allocates without writing. The values are the model's own tensors, not copies."""
    full = dict(model.state_dict())
    for name, buf in model.named_buffers():
        full.setdefault(name, buf)
    return full


def fill_from_rank0(model: nn.Module, full: dict[str, Tensor], device: str | torch.device) -> None:
    """Give a ``fully_shard``-ed model rank 0's weights. Every rank calls it; rank 0 passes
    :func:`rank0_weights` of the unsharded model (other ranks' ``full`` is ignored). A model with
    meta tensors first gets this rank's shards and buffers allocated (``to_empty``: FSDP2's recipe
    for a model sharded on meta; tied parameters stay tied). Parameters and persistent buffers
    then travel one tensor at a time, each rank keeping its shard
    (``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``), and the
    non-persistent buffers are broadcast whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        model.to_empty(device=device)
    in_state_dict = set(model.state_dict())
    # A new dict: set_model_state_dict puts this rank's shards into the dict it is given, and rank 0
    # passes the same full weights again for the reference model.
    state = {k: v for k, v in full.items() if k in in_state_dict}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, state, options=options)
    _broadcast_unsaved_buffers(model, full, in_state_dict)


@torch.no_grad()
def _broadcast_unsaved_buffers(model: nn.Module, full: dict[str, Tensor], in_state_dict: set[str]) -> None:
    """Rank 0's values (from ``full``) of the buffers outside the state dict, to every rank. FSDP2
    leaves buffers plain (replicated) tensors, so a plain broadcast fills them; named_buffers' order
    is the same on every rank."""
    import torch.distributed as dist

    buffers = [(name, buf) for name, buf in model.named_buffers() if name not in in_state_dict]
    is_rank0 = dist.get_rank() == 0
    if is_rank0 and (missing := [name for name, _ in buffers if name not in full]):
        raise ValueError(f"rank 0's weights lack the buffers {missing}: pass rank0_weights(model), not its state dict")
    for name, buf in buffers:
        if is_rank0:
            buf.copy_(full[name])  # the policy's, also for the reference: the same values on rank 0
        dist.broadcast(buf, src=0)


def upcast_half_params(model: nn.Module) -> bool:
    """Make a model with bf16/fp16 parameters float32 (``Module.float``, which FSDP2 supports after
    ``fully_shard`` and before the first forward: each rank converts its shard); True if it did."""
    if not any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()):
        return False
    model.float()
    return True


def prepare_policy(model: nn.Module, ref_model: nn.Module | None, precision: str, mesh=None, *, sharded: bool = False) -> bool:
    """Float32 master weights where ``precision`` asks for them, then, given a data-parallel ``mesh``
    (``trainer=fsdp``) and a model not ``sharded`` yet, FSDP2: shard each decoder layer, then the root,
    of the policy and of the KL reference. Returns whether the policy is sharded now (its forwards
    are collectives from then on)."""
    # Weights may load in bf16 (half the host memory), but under a mixed or float32 precision the
    # optimizer must update float32 weights. Sharded, each rank converts only its own shard.
    upcast = needs_float32_master(precision)
    if sharded or mesh is None:
        if not sharded and any(p.is_meta for p in model.parameters()):
            raise RuntimeError("the policy was built on the meta device (model.meta_on_other_ranks=true), which only "
                               "trainer=fsdp fills (rank 0 broadcasts the weights after sharding): set it false here")
        if upcast and upcast_half_params(model):
            log.info("trainer.precision=%s: half-precision weights upcast to float32 master weights", precision)
        return sharded
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh}
    policy = fsdp_mixed_precision(precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    # model.meta_on_other_ranks: a node's other processes built the policy on the meta device (no host
    # memory); after sharding, rank 0 broadcasts its weights into every rank's shards, the reference's too
    on_meta = any(p.is_meta for p in model.parameters())
    from_rank0 = distributed.any_rank(on_meta, "model/meta-build")
    full_state: dict[str, Tensor] = {}
    if from_rank0:
        if on_meta and rank_and_world()[0] == 0:
            raise RuntimeError("global rank 0 built the policy on the meta device: it must hold the weights it broadcasts")
        # The reference is a frozen copy of this very policy (agentopsd.module.frozen_copy): the same weights
        # fill it. Rank 0 shards its own copy as it is: ``to("meta")`` would untie its tied weights
        # (one new parameter per module), and its peak, two full copies, came with the copy anyway.
        full_state = {} if on_meta else rank0_weights(model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers if layers is not None else []:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if ref_model is not None:
        # the KL reference is a whole second model: unsharded, every rank would hold all of it
        for layer in getattr(getattr(ref_model, "model", None), "layers", None) or []:
            fully_shard(layer, **kwargs)
        fully_shard(ref_model, **kwargs)
    if from_rank0:
        for m in (model, ref_model):
            if m is not None:
                fill_from_rank0(m, full_state, mesh.device_type)
        del full_state
    if upcast and upcast_half_params(model):
        log.info("trainer.precision=%s: half-precision weight shards upcast to float32 master weights", precision)
    return True
