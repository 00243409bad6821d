"""FSDP2 through Lightning's ModelParallelStrategy, and the precision of the weights the optimizer updates.

``AgentRLModule.configure_model`` calls :func:`prepare_policy`: float32 master weights where the
precision asks for them, and under ``trainer=fsdp`` ``fully_shard`` on each decoder layer and the
root (the policy's and the KL reference's), rank 0's weights broadcast into ranks built on meta.
A peft LoRA policy is sharded the same way (its decoder layers found through the wrapper,
:func:`decoder_layers`); under ``bf16-mixed`` only its adapters become float32, the frozen base keeps
its dtype (FSDP2 units mix trainable and frozen parameters: measured on torch 2.13, CPU/gloo).
"""

from __future__ import annotations

import copy
import itertools
import logging

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn

from agentopsd.training import distributed
from agentopsd.training.distributed import rank_and_world

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


HALF = (torch.bfloat16, torch.float16)


def upcast_half_params(model: nn.Module, *, trainable_only: bool = False) -> bool:
    """Make a model's bf16/fp16 parameters float32 (through ``Module._apply``, which FSDP2 supports after
    ``fully_shard`` and before the first forward: each rank converts its shard); True if it did.
    ``trainable_only``: only those with ``requires_grad`` (a LoRA model's adapters), frozen ones keep their dtype."""
    if not any(p.dtype in HALF and (p.requires_grad or not trainable_only) for p in model.parameters()):
        return False
    if not trainable_only:
        model.float()
        return True
    model._apply(lambda t: t.float() if t.requires_grad and t.dtype in HALF else t)
    return True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM, each one FSDP unit; a peft model is unwrapped first.

    Found by the model's own ``_no_split_modules`` (the block classes transformers never splits across
    devices: ``Qwen2DecoderLayer``, ``LlamaDecoderLayer``...), outermost ones only, in module order; else the
    ``layers`` ModuleList of the model or its ``.model``. A peft wrapper (``PeftModelForCausalLM`` ->
    ``LoraModel`` -> ``XForCausalLM``) hides both from a plain ``model.model.layers`` lookup.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    block_classes = set(getattr(base, "_no_split_modules", None) or ())
    found: list[tuple[str, nn.Module]] = []
    for name, module in base.named_modules():
        if type(module).__name__ in block_classes and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    if found:
        return [module for _, module in found]
    for owner in (base, getattr(base, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    return []


def _shard(model: nn.Module, what: str, fully_shard, **kwargs) -> None:
    """``fully_shard`` each decoder layer, then the root (inner units first, as FSDP2 requires)."""
    layers = decoder_layers(model)
    if not layers:
        log.warning("FSDP2: no decoder layers found in the %s (%s): only the root is sharded, so every forward "
                    "gathers the whole model", what, type(model).__name__)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def prepare_policy(model: nn.Module, ref_model: nn.Module | None, precision: str, mesh=None, *, sharded: bool = False,
                   frozen_half: bool = False) -> bool:
    """Float32 master weights where ``precision`` asks for them, then, given a data-parallel ``mesh``
    (``trainer=fsdp``) and a model not ``sharded`` yet, FSDP2: shard each decoder layer, then the root,
    of the policy and of the KL reference. Returns whether the policy is sharded now (its forwards
    are collectives from then on). ``frozen_half`` (unsharded; :class:`agentopsd.training.precision.WeightPlan`): only the
    trainable weights become float32, a LoRA base loaded in bf16 stays bf16 (a CPU computes it natively; a GPU
    computes it under autocast, and needs no float32 copy of weights nothing updates)."""
    # Weights may load in bf16 (half the host memory), but under a mixed or float32 precision the
    # optimizer must update float32 weights. Sharded, each rank converts only its own shard.
    upcast = needs_float32_master(precision)
    if sharded or mesh is None:
        if not sharded and any(p.is_meta for p in model.parameters()):
            raise RuntimeError("the policy was built on the meta device (model.meta_on_other_ranks=true), which only "
                               "trainer=fsdp fills (rank 0 broadcasts the weights after sharding): set it false here")
        if upcast and upcast_half_params(model, trainable_only=frozen_half):
            log.info("trainer.precision=%s: half-precision %sweights upcast to float32 master weights", precision,
                     "trainable " if frozen_half else "")
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
        # The reference is a frozen copy of this very policy (frozen_copy below): the same weights
        # fill it. Rank 0 shards its own copy as it is: ``to("meta")`` would untie its tied weights
        # (one new parameter per module), and its peak, two full copies, came with the copy anyway.
        full_state = {} if on_meta else rank0_weights(model)
    _shard(model, "policy", fully_shard, **kwargs)
    if ref_model is not None:
        # the KL reference is a whole second model: unsharded, every rank would hold all of it
        _shard(ref_model, "KL reference", fully_shard, **kwargs)
    if from_rank0:
        for m in (model, ref_model):
            if m is not None:
                fill_from_rank0(m, full_state, mesh.device_type)
        del full_state
    # Frozen weights (a LoRA model's base) need no float32 master: under the bf16 mixed-precision policy
    # FSDP2 computes with bf16 all-gathers of them anyway, so float32 copies would only double their memory.
    trainable_only = policy is not None and any(not p.requires_grad for p in model.parameters())
    if upcast and upcast_half_params(model, trainable_only=trainable_only):
        log.info("trainer.precision=%s: half-precision %sweight shards upcast to float32 master weights", precision,
                 "trainable " if trainable_only else "")
    return True


def frozen_copy(model: nn.Module) -> nn.Module:
    """The KL reference: a frozen copy of the policy as built. A policy built on the meta device
    (``model.meta_on_other_ranks``) gives a meta copy (no memory); :func:`agentopsd.training.strategies.prepare_policy`
    then fills it from rank 0's policy weights."""
    return copy.deepcopy(model).requires_grad_(False).eval()


def place_reference(ref: nn.Module | None, model: nn.Module, *, keep_half: bool = False) -> None:
    """The frozen reference on the policy's device and dtype (it is not a registered submodule of the module, so
    Lightning does not move it). ``keep_half`` (:attr:`agentopsd.training.precision.WeightPlan.frozen_as_loaded`): a
    half-precision reference is not upcast to float32 master weights, only moved."""
    p = next(model.parameters(), None)
    q = next(ref.parameters(), None) if ref is not None else None
    if p is None or q is None:
        return
    dtype = q.dtype if keep_half and q.dtype in HALF and p.dtype == torch.float32 else p.dtype
    if q.device != p.device or q.dtype != dtype:
        ref.to(device=p.device, dtype=dtype)
