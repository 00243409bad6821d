"""A per-GPU memory plan of a run, from its config alone: no weights loaded, no GPU needed.

    python -m agentopsd.tools.memory +experiment=webshop_7b trainer.devices=8 [--gpu-memory-gib 141]

What it counts, per GPU (bytes; printed in GiB):

- weights, gradients and AdamW's two states, in the master-weight dtype, divided by the device count
  under FSDP2 (``trainer=fsdp``), whole on every device under DDP or on one device;
- what FSDP2 holds unsharded while it computes: the root unit (embeddings, LM head, final norm) and
  its gradient for the whole forward and backward (FSDP2 does not reshard the root after forward, and
  reduce-scatters its gradient last), plus two decoder layers (the one computing and the one
  prefetched) and one layer's gradient before its reduce-scatter; under DDP the gradient buckets;
- activations at ``optim.micro_batch_size`` rows (or, with ``optim.max_tokens_per_micro_batch``, the budget's
  tokens) of ``env.max_prompt_tokens + rollout.max_new_tokens`` tokens: with gradient checkpointing each
  layer's input plus one layer recomputed (its activations and their gradients), without it every layer's
  activations and one layer's backward;
- the LM head's logits at the most action positions a micro-batch can hold (``worst_case_head_positions``:
  under a token budget short rows with long actions pack far more than the longest rows), 16 bytes per logit
  for the log-probs and 8 more for the entropy bonus (float32 copies and their gradients, measured), or with
  ``optim.logits_chunk_tokens`` one chunk's (``logits_bytes``);
- AdamW's step: foreach on a GPU holds one more state-sized tensor (the square root of ``exp_avg_sq``);
- a no-grad scoring pass (old, reference and teacher log-probs) beside the resident state;
- a frozen reference copy of the policy when ``algorithm.kl_coef > 0``, in the dtype the weights load in
  (``model.dtype``), sharded like the policy under FSDP2;
- vLLM's share, ``rollout.vllm.gpu_memory_utilization`` x the GPU's memory (its weights, KV cache and
  activations all live inside it), and estimates for the CUDA context, NCCL and fragmentation
  (``RUNTIME_MARGIN_BYTES``) and for a sleeping engine (``VLLM_ASLEEP_BYTES``), named as such in the report;
- the weight sync's temporary memory: two full tensors of the largest weight in the dtype they travel in
  (the one being gathered and the one the engine is loading);
- with ``rollout.max_staleness`` >= 1, each rank's rollout worker (:mod:`agentopsd.tools.worker_memory`): its bf16
  policy copy, its engine (never asleep) and its weight-staging bucket (``--staging-bucket-mib``, one of 256 MiB by
  default), on the trainer's GPU beside every phase when ``rollout.devices`` is unset, else in a plan of its own
  GPU; the report then ends with one line per GPU of a node.

The plan is the largest of its phases (``MemoryPlan.phases``: the update's forward and backward, its
optimizer step, the scoring passes, and with vLLM the weight sync and the rollout); the report prints each
phase's margin (GPU memory minus the phase). With sleep mode (``rollout.vllm.enable_sleep_mode``: ``auto``/true,
on CUDA) the engine holds only its residual during the update and scoring, the sync runs with vLLM's weights
awake but not its KV cache, and the rollout holds vLLM's whole share beside the weights, the reference and
AdamW's states unless ``optim.offload_optimizer`` keeps them in host memory while the engine syncs and generates (the trainer
drops the gradients before waking the engine). Without sleep mode vLLM's share sits beside everything at every phase.

On CPU the plan of the tiny runs is checked against the allocator's measured peak of an update step
(``measure_cpu_peak``; ``tests/agentopsd/test_memory.py``): it counts 7-15% more. No GPU has run this code yet.

Assumed, not measured on a GPU: attention is a fused kernel (SDPA/flash: no sequence x sequence matrix;
``eager`` attention holds far more), and the per-layer activation count is the tensors a Qwen2 layer saves
for its backward (checked on CPU).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from agentopsd.tools.architecture import Architecture, architecture_of
from agentopsd.tools.worker_memory import (
    STAGING_BUCKET_BYTES,
    WorkerPlan,
    plan_worker,
    rollout_devices,
    staleness,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

GIB = 2**30
DEFAULT_GPU_MEMORY_GIB = 80.0
"""Planning default when no GPU is visible and none is named: an 80 GB A100/H100."""
RUNTIME_MARGIN_BYTES = 2 * GIB
"""CUDA context (about 0.5 GiB), NCCL buffers and the caching allocator's fragmentation: an estimate, not measured."""
VLLM_ASLEEP_BYTES = GIB
"""What a vLLM engine keeps after ``sleep(level=2)`` (CUDA graphs, sampler buffers): an estimate, not measured."""
ADAM_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq, each the size of the parameters."""
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}


# ---------------------------------------------------------------------------------------- config reading


def _precision(value: Any) -> str:
    """Lightning's precision names, with its short aliases spelled out."""
    text = str(value)
    return {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(text, text)


def _param_and_compute_dtype(precision: str, model_dtype: str, checkpoint_dtype: str) -> tuple[str, str]:
    """(master-weight dtype, compute dtype). ``*-true`` converts the module; under every other precision the
    trainer upcasts half-precision weights to float32 master weights (``AgentRLModule.configure_model``)
    and ``*-mixed`` computes in the half dtype."""
    if precision == "bf16-true":
        return "bfloat16", "bfloat16"
    if precision == "16-true":
        return "float16", "float16"
    if precision == "64-true":
        return "float64", "float64"
    loaded = checkpoint_dtype if model_dtype == "auto" else model_dtype
    if loaded not in DTYPE_BYTES or loaded in ("bfloat16", "float16"):
        loaded = "float32"  # the float32 master copy
    if precision == "bf16-mixed":
        return loaded, "bfloat16"
    if precision == "16-mixed":
        return loaded, "float16"
    return loaded, loaded  # 32-true: Lightning leaves the module as loaded


def _world_size(trainer: DictConfig | dict) -> tuple[int, str]:
    """trainer.devices x trainer.num_nodes, and a note when ``auto`` had to be guessed."""
    devices = trainer.get("devices", 1)
    nodes = int(trainer.get("num_nodes", 1) or 1)
    note = ""
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if OmegaConf.is_list(devices) or isinstance(devices, list | tuple):
        count = len(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    else:  # "auto" or -1: every visible GPU
        count = _cuda_device_count()
        note = f"trainer.devices={devices}: {count} visible GPU(s) assumed; set trainer.devices=N to plan for N"
    return max(1, count) * nodes, note


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 1
    except Exception:
        return 1


def _strategy_kind(trainer: DictConfig | dict) -> str:
    """``fsdp2`` (sharded), ``ddp`` (replicated with gradient buckets) or ``single``."""
    strategy = trainer.get("strategy")
    target = strategy.get("_target_", "") if isinstance(strategy, dict | DictConfig) else str(strategy or "")
    if "fsdp" in target.lower() or "modelparallel" in target.lower():
        return "fsdp2"
    if "ddp" in target.lower():
        return "ddp"
    return "single"


def gpu_memory(cfg: DictConfig | None = None, gpu_memory_gib: float | None = None) -> tuple[int, str]:
    """(bytes, where the figure came from): the argument, the ``gpu_memory_gib`` config key, the first
    CUDA device, or the planning default."""
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GIB), "--gpu-memory-gib"
    value = OmegaConf.select(cfg, "gpu_memory_gib", default=None) if cfg is not None else None
    if value is not None:
        return int(float(value) * GIB), "gpu_memory_gib"
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), props.name
    except Exception:  # no torch, or a broken driver: plan for the default
        pass
    return int(DEFAULT_GPU_MEMORY_GIB * GIB), f"planning default {DEFAULT_GPU_MEMORY_GIB:.0f} GiB (no GPU visible)"


# ---------------------------------------------------------------------------------------- the plan

LOGIT_GRAD_BYTES = 16
"""Peak bytes per logit (positions x vocabulary) of the trainer's log-probs with gradient, forward and
backward: the float32 copy ``token_logprobs``' logsumexp keeps, then the backward's float32 gradients, which
outweigh the compute-dtype logits in bfloat16 and float32 alike. Measured with :func:`measure_cpu_peak` on the
trainer's own code (``tests/agentopsd/test_memory.py`` checks it); the same operators run on a GPU."""
LOGIT_ENTROPY_BYTES = 8
"""What the entropy bonus adds per logit: the float32 log-softmax and probabilities ``token_entropy`` keeps
(24 bytes per logit in all, measured as above)."""
LOGIT_DISTILL_BYTES = 16
"""What full-vocabulary distillation (``grpo_opsd``: the student's logits kept, the teacher's, both
log-softmaxes) adds per logit: an estimate, not measured."""


def logit_nograd_bytes(compute_bytes: int) -> int:
    """Peak bytes per logit of a no-grad scoring pass: the logits divided by the temperature, their float32 copy
    (none when they are float32 already) and the logsumexp's float32 temporary (measured as above)."""
    return compute_bytes + 4 + (4 if compute_bytes < 4 else 0)


def logits_bytes(positions: int, vocab: int, hidden: int, compute_bytes: int, *, entropy: bool, chunk: int = 0,
                 keeps_logits: bool = False) -> int:
    """Peak bytes of the LM head and its log-softmax in one micro-batch's forward and backward, at ``positions``
    action positions: every position's logits at once, or (``chunk`` > 0, :func:`agentopsd.rollout.scoring.
    chunked_scores`) one chunk's, plus the head's weight in the compute dtype and its gradient summed over the
    chunks, and every position's hidden state (kept for the recompute) and two float32 scores."""
    per_logit = LOGIT_GRAD_BYTES + (LOGIT_ENTROPY_BYTES if entropy else 0) + (LOGIT_DISTILL_BYTES if keeps_logits else 0)
    if chunk > 0 and not keeps_logits:
        chunk = min(chunk, positions)
        return chunk * vocab * per_logit + 2 * vocab * hidden * compute_bytes + positions * (hidden * compute_bytes + 8)
    return positions * vocab * per_logit


def worst_case_head_positions(micro_batch_size: int, budget: int, sequence: int, new_tokens: int) -> int:
    """The most action positions (the LM head's positions) one micro-batch can hold.

    By rows, ``micro_batch_size`` rows of at most ``new_tokens`` action tokens each. By tokens (``budget`` > 0),
    :func:`agentopsd.rollout.scoring.token_budget_groups` takes rows of padded length ``L`` while rows x ``L``
    fits the budget, each with at most ``min(new_tokens, L - 1)`` action positions: short rows with long
    actions pack the most (10,240 tokens hold 20 rows of 512 with 511 action tokens each, 10,220 positions,
    where 4 rows of the longest length hold 2,048). A row longer than the budget goes alone.
    """
    if budget <= 0:
        return micro_batch_size * new_tokens
    best = min(new_tokens, sequence - 1) if sequence > budget else 0  # one row alone, past the budget
    for length in range(2, min(sequence, budget) + 1):
        best = max(best, (budget // length) * min(new_tokens, length - 1))
    return best


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU bytes of one run, item by item (all 0 when the architecture is unknown)."""

    model: str
    """model.path, or ``tiny``."""
    architecture: Architecture | None
    unknown_reason: str
    """Why there is no estimate (``""`` when there is one)."""
    strategy: str
    """``fsdp2``, ``ddp`` or ``single``."""
    world_size: int
    precision: str
    param_dtype: str
    """Master weights, their gradients and AdamW's states."""
    compute_dtype: str
    micro_batch_size: int
    """Rows of the longest length one micro-batch holds."""
    sequence_tokens: int
    """env.max_prompt_tokens + rollout.max_new_tokens: the longest row of a micro-batch."""
    head_positions: int
    """The most positions the LM head runs at in one micro-batch (:func:`worst_case_head_positions`)."""
    gradient_checkpointing: bool
    weights: int
    gradients: int
    optimizer: int
    gathered: int
    """Unsharded copies while computing (FSDP2) or DDP's gradient buckets."""
    activations: int
    logits: int
    """The LM head and its log-softmax in the update, at ``head_positions`` (or one chunk of them)."""
    reference: int
    """The frozen reference policy (KL penalty on)."""
    vllm: int
    """vLLM's share of the GPU (0 with the transformers backend)."""
    vllm_weights: int
    """vLLM's own copy of the weights, which must fit inside its share."""
    entropy_bonus: bool
    """algorithm.entropy_coef > 0: the logits' float32 log-softmax kept twice."""
    margin: int
    gpu_memory: int
    gpu_memory_source: str
    notes: tuple[str, ...] = ()
    sleep_mode: bool = False
    """vLLM sleeps (level 2) during the update and scoring passes."""
    sync_temporary: int = 0
    """The weight sync's full tensors in flight (two of the largest weight)."""
    logits_chunk: int = 0
    """``optim.logits_chunk_tokens`` where it applies (0: the head runs over all positions at once)."""
    step_temporary: int = 0
    """AdamW's step: the temporaries beside weights, gradients and states (foreach on a GPU: one more
    state-sized tensor, the square root of ``exp_avg_sq``)."""
    scoring: int = 0
    """A no-grad scoring pass (old, reference, teacher log-probs) beyond the resident state."""
    deferred_reduction: bool = False
    """``optim.defer_grad_reduction`` under FSDP2: each rank holds every layer's gradient unsharded."""
    offload_optimizer: bool = False
    """``optim.offload_optimizer``: AdamW's states are in host memory while the engine syncs and generates."""
    vllm_asleep: int = 0
    """What a sleeping vLLM engine keeps (``VLLM_ASLEEP_BYTES``, an estimate)."""
    reference_dtype: str = ""
    """The KL reference's dtype: the one the weights load in (never upcast: :func:`frozen_dtype`)."""
    frozen_dtype: str = ""
    """A LoRA policy's frozen base's dtype (``""`` without LoRA): :func:`frozen_dtype`."""
    worker: WorkerPlan | None = None
    """The asynchronous rollout worker (``rollout.max_staleness`` >= 1) of each trainer rank; None in lockstep."""
    trainer_gpus: tuple[int, ...] = ()
    """The trainer ranks' GPUs on each node (indices of the visible devices)."""
    worker_gpus: tuple[int, ...] = ()
    """``rollout.devices``: the workers' own GPUs (empty: each worker on its trainer rank's GPU)."""

    @property
    def colocated_worker(self) -> int:
        """The worker's bytes on the trainer's GPU, beside every phase (its engine never sleeps); 0 on its own GPU."""
        return self.worker.total if self.worker is not None and not self.worker.own_gpu else 0

    @property
    def training(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.gathered + self.activations + self.logits + self.reference

    @property
    def _vllm_beside_update(self) -> int:
        """vLLM's memory while the trainer computes: its residual when asleep, else its whole share."""
        if not self.vllm:
            return 0
        return self.vllm_asleep if self.sleep_mode else self.vllm

    @property
    def resident(self) -> int:
        """Between updates: weights, AdamW's states (unless offloaded), the reference and the margin (the
        gradients are dropped before vLLM wakes)."""
        return self.weights + (0 if self.offload_optimizer else self.optimizer) + self.reference + self.margin

    @property
    def phases(self) -> dict[str, int]:
        """Per-GPU bytes in each phase of an iteration: the update's forward and backward (``update``), its
        optimizer step, the no-grad scoring passes after the rollout and, with vLLM, the weight sync and the
        rollout."""
        beside = self._vllm_beside_update + self.colocated_worker
        step_buckets = self.gathered if self.strategy == "ddp" else 0  # DDP's buckets outlive the backward
        out = {
            "update": self.training + beside + self.margin,
            "optimizer step": (self.weights + self.gradients + self.optimizer + step_buckets + self.step_temporary
                               + self.reference + beside + self.margin),
            # the states come back as soon as the engine sleeps: the scoring passes run beside them
            "scoring": self.weights + self.optimizer + self.reference + self.margin + self.scoring + beside,
        }
        if self.vllm:
            if self.sleep_mode:
                out["sync"] = self.resident + self.vllm_weights + self.sync_temporary + self.colocated_worker
                out["rollout"] = self.resident + self.vllm + self.colocated_worker
            else:
                out["sync"] = self.resident + self.vllm + self.sync_temporary + self.colocated_worker
        return out

    @property
    def margins(self) -> dict[str, int]:
        """GPU memory left in each phase (negative: it does not fit)."""
        return {phase: self.gpu_memory - value for phase, value in self.phases.items()}

    @property
    def total(self) -> int:
        """The largest phase: what the trainer's GPU must hold."""
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        """Every GPU of the run holds its plan: the trainer's, and a worker's own where it has one."""
        worker_own = self.worker.total if self.worker is not None and self.worker.own_gpu else 0
        return self.total <= self.gpu_memory and worker_own <= self.gpu_memory

    @property
    def sharded_state(self) -> int:
        return self.weights + self.gradients + self.optimizer

    @property
    def warnings(self) -> list[str]:
        """What will not fit, each with the settings that bring it down."""
        if self.architecture is None:
            return []
        out = []
        if self.total > self.gpu_memory:
            out.append(f"memory plan: about {_gib(self.total)} GiB per GPU needed, the GPU has {_gib(self.gpu_memory)} GiB; "
                       f"ways down: {'; '.join(self._remedies())}")
        if self.worker is not None and self.worker.own_gpu and self.worker.total > self.gpu_memory:
            out.append(f"memory plan: each rollout worker's GPU needs about {_gib(self.worker.total)} GiB, it has "
                       f"{_gib(self.gpu_memory)} GiB; ways down: a lower rollout.vllm.gpu_memory_utilization, fewer "
                       "data.tasks_per_batch per rank (transformers' KV cache)")
        if self.vllm and self.vllm < self.vllm_weights:
            out.append(f"memory plan: rollout.vllm.gpu_memory_utilization gives vLLM {_gib(self.vllm)} GiB, less than its "
                       f"{_gib(self.vllm_weights)} GiB of weights (it also needs KV cache): raise it")
        return out

    def _remedies(self) -> list[str]:
        out = []
        if self.colocated_worker:
            out.append(f"rollout.devices=[...] gives each rollout worker a GPU of its own (it holds "
                       f"{_gib(self.colocated_worker)} GiB on the trainer's), or rollout.max_staleness=0 (lockstep: "
                       "no worker; the colocated engine sleeps during the update)")
        if self.strategy == "fsdp2":
            need = self._devices_needed()
            if need:
                out.append(f"more devices: trainer.devices x trainer.num_nodes >= {need} (now {self.world_size}; "
                           f"weights, gradients and AdamW states take {_gib(self.sharded_state)} GiB)")
        else:
            out.append(f"trainer=fsdp shards weights, gradients and AdamW states ({_gib(self.sharded_state)} GiB) over the devices")
        if not self.logits_chunk and self.logits > GIB:
            out.append(f"optim.logits_chunk_tokens=1024 (the LM head's logits take {_gib(self.logits)} GiB at "
                       f"{self.head_positions} positions at once)")
        if not self.offload_optimizer and self.vllm and max(self.phases, key=self.phases.get) in ("rollout", "sync"):
            out.append(f"optim.offload_optimizer=true (AdamW's {_gib(self.optimizer)} GiB in host memory during the rollout)")
        if self.micro_batch_size > 1:
            out.append(f"a smaller optim.micro_batch_size or optim.max_tokens_per_micro_batch (now {self.micro_batch_size} rows; activations and logits "
                       f"take {_gib(self.activations + self.logits)} GiB, proportional to it)")
        if not self.gradient_checkpointing:
            out.append("model.gradient_checkpointing=true (keeps one layer's activations instead of all)")
        if self.vllm:
            out.append(f"a lower rollout.vllm.gpu_memory_utilization (vLLM takes {_gib(self.vllm)} GiB; it needs "
                       f"{_gib(self.vllm_weights)} GiB for weights plus KV cache)")
            if not self.sleep_mode:
                out.append("rollout.vllm.enable_sleep_mode=auto (on a GPU vLLM frees its share during the update)")
        if self.reference:
            out.append(f"algorithm.kl_coef=0 drops the reference copy ({_gib(self.reference)} GiB)")
        return out

    def _devices_needed(self) -> int:
        """The fewest devices at which every phase fits, sharding what FSDP2 shards (0: none does)."""
        held = self.weights + (0 if self.offload_optimizer else self.optimizer) + self.reference
        sharded = {"update": self.sharded_state + self.reference,
                   "optimizer step": self.sharded_state + self.step_temporary + self.reference,
                   "scoring": self.weights + self.optimizer + self.reference, "sync": held, "rollout": held}
        need = 0
        for phase, total in self.phases.items():
            rest = self.gpu_memory - (total - sharded[phase])
            if rest <= 0:
                return 0
            need = max(need, -(-sharded[phase] * self.world_size // rest))
        return need

    @property
    def _logits_label(self) -> str:
        a = self.architecture
        what = f"{self.head_positions} positions x {a.vocab_size if a else 0} vocab"
        if self.entropy_bonus:
            what += ", entropy bonus"
        if self.logits_chunk:
            what += f"; in chunks of {self.logits_chunk}"
        return f"LM-head logits ({what})"

    def report(self) -> str:
        """The table printed before training: one line per item, GiB per GPU, and each phase's margin."""
        if self.architecture is None:
            return f"memory plan: no estimate for {self.model}: {self.unknown_reason}"
        a = self.architecture
        shard = f"sharded /{self.world_size}" if self.strategy == "fsdp2" else "whole on each device"
        how = {"fsdp2": f"FSDP2 over {self.world_size} device(s)", "ddp": f"DDP over {self.world_size} device(s)",
               "single": "one device"}[self.strategy]
        if self.strategy == "fsdp2":
            gathered = "FSDP2 unsharded: root + 2 layers, with gradients"
        elif self.strategy == "ddp":
            gathered = "DDP gradient buckets"
        else:
            gathered = "nothing gathered"
        ckpt = "checkpointed" if self.gradient_checkpointing else "no checkpointing"
        offloaded = ", in host memory during sync and rollout" if self.offload_optimizer else ""
        weights = f"weights (LoRA's frozen base, {self.frozen_dtype}" if self.frozen_dtype else f"weights ({self.param_dtype}"
        rows = [
            (f"{weights}, {shard})", self.weights),
            (f"gradients ({self.param_dtype}, "
             f"{'unsharded until the last micro-batch (optim.defer_grad_reduction)' if self.deferred_reduction else shard})",
             self.gradients),
            (f"AdamW states (2 x {self.param_dtype}, {shard}{offloaded})", self.optimizer),
            ("AdamW step temporaries", self.step_temporary),
            (gathered, self.gathered),
            (f"activations ({ckpt}, {self.micro_batch_size} x {self.sequence_tokens} tokens)", self.activations),
            (self._logits_label, self.logits),
            ("scoring pass (no gradient)", self.scoring),
        ]
        if self.reference:
            rows.append((f"reference policy (KL penalty, frozen, {self.reference_dtype}, sharded like the policy)", self.reference))
        if self.vllm:
            rows.append((f"vLLM share (its weights: {_gib(self.vllm_weights)} GiB)", self.vllm))
            rows.append(("weight sync in flight (2 x the largest weight)", self.sync_temporary))
            if self.sleep_mode:
                rows.append(("vLLM asleep (CUDA graphs, buffers): an estimate", self.vllm_asleep))
        rows.append(("CUDA context, NCCL, fragmentation: an estimate", self.margin))
        if self.colocated_worker:  # the asynchronous worker shares this GPU: beside every phase
            rows += self.worker.rows()
        worker_rows = self.worker.rows() if self.worker is not None and self.worker.own_gpu else []
        width = max(len(r[0]) for r in rows + worker_rows) + 2
        which = f"per trainer GPU ({_gpu_list(self.trainer_gpus)})" if self.worker is not None else "per GPU"
        lines = [f"memory plan {which}: {self.model} ({a.parameters / 1e9:.2f}B parameters, {a.source}), {how}, "
                 f"precision {self.precision} (compute {self.compute_dtype})"]
        lines += [f"  {label:<{width}}{_gib(value):>8} GiB" for label, value in rows]
        if self.vllm:
            lines.append("  phases (" + ("vLLM sleeps during the update and scoring, wakes its weights for the sync, then its "
                                         "KV cache" if self.sleep_mode else "vLLM keeps its share throughout (no sleep mode)")
                         + "), margin = GPU memory - phase:")
        else:
            lines.append("  phases, margin = GPU memory - phase:")
        margins = self.margins
        lines += [f"    {phase:<{width - 2}}{_gib(value):>8} GiB   margin {_gib(margins[phase]):>7} GiB"
                  for phase, value in self.phases.items()]
        lines.append(f"  {'total (largest phase)':<{width}}{_gib(self.total):>8} GiB of {_gib(self.gpu_memory)} GiB "
                     f"({self.gpu_memory_source}): {_verdict(self.total, self.gpu_memory)}, margin "
                     f"{_gib(self.gpu_memory - self.total)} GiB")
        if worker_rows:
            lines.append(f"memory plan per rollout worker GPU ({_gpu_list(self.worker_gpus)}, rollout.devices): its engine "
                         "never sleeps, so every phase holds all of it")
            lines += [f"  {label:<{width}}{_gib(value):>8} GiB" for label, value in worker_rows]
            lines.append(f"  {'total':<{width}}{_gib(self.worker.total):>8} GiB of {_gib(self.gpu_memory)} GiB: "
                         f"{_verdict(self.worker.total, self.gpu_memory)}, margin {_gib(self.gpu_memory - self.worker.total)} GiB")
        lines += self._per_gpu_lines()
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _per_gpu_lines(self) -> list[str]:
        """One line per GPU of a node with an asynchronous worker: which process lives there, and its total."""
        if self.worker is None:
            return []
        trainer = "trainer local rank {r}" + ("" if self.worker.own_gpu else " + its rollout worker")
        out = ["per GPU (each node):"]
        for r, gpu in enumerate(self.trainer_gpus):
            out.append(f"  GPU {gpu}: {trainer.format(r=r):<42}{_gib(self.total):>8} GiB of {_gib(self.gpu_memory)} GiB: "
                       f"{_verdict(self.total, self.gpu_memory)}")
        for r, gpu in enumerate(self.worker_gpus):
            out.append(f"  GPU {gpu}: {f'rollout worker of local rank {r}':<42}{_gib(self.worker.total):>8} GiB of "
                       f"{_gib(self.gpu_memory)} GiB: {_verdict(self.worker.total, self.gpu_memory)}")
        return out


def _verdict(need: int, have: int) -> str:
    return "fits" if need <= have else "DOES NOT FIT"


def _gpu_list(gpus: tuple[int, ...]) -> str:
    return "GPU " + ", ".join(str(g) for g in gpus) if len(gpus) < 2 else "GPUs " + ", ".join(str(g) for g in gpus)


def _gib(n: int | float) -> str:
    return f"{n / GIB:.2f}"


def _algorithm_keeps_logits(cfg: DictConfig) -> bool:
    """The algorithm needs the full-vocabulary logits (``needs_teacher_logits``: ``grpo_opsd``), which no chunking
    can avoid."""
    target = str(OmegaConf.select(cfg, "algorithm._target_", default="") or "")
    name = str(OmegaConf.select(cfg, "algorithm.name", default="") or "")
    return target.endswith(".GRPOOPSD") or name == "grpo_opsd"


HALF_TRUE = ("bf16-true", "16-true")


def reference_dtype(precision: str, param_dtype: str, loaded: str) -> str:
    """The KL reference's dtype: a ``*-true`` half precision converts it with the policy; otherwise it keeps the dtype
    the weights load in (FSDP2 never upcasts it, nor, on a GPU, the unsharded module: :func:`agentopsd.training.
    precision.weight_plan`'s ``frozen_as_loaded``)."""
    return param_dtype if precision in HALF_TRUE else loaded


def lora_base_dtype(precision: str, param_dtype: str, loaded: str, *, strategy: str, on_cpu: bool) -> str:
    """A LoRA policy's frozen base's dtype: the loaded one where only the adapters become float32 master weights (a GPU
    outside FSDP2; FSDP2 under ``bf16-mixed``), the master dtype where the whole policy is upcast (FSDP2 under another
    precision). On a CPU the module keeps it bf16 only where ``model.dtype=auto`` finds native bf16, which this plan
    does not probe: it counts the master dtype there, an upper bound."""
    if precision in HALF_TRUE:
        return param_dtype
    if strategy == "fsdp2":
        return loaded if precision == "bf16-mixed" else param_dtype
    return param_dtype if on_cpu else loaded


def _local_gpus(trainer: DictConfig | dict) -> tuple[int, ...]:
    """The trainer ranks' GPU indices on one node: ``trainer.devices`` as a list, or the first N."""
    devices = trainer.get("devices", 1)
    if OmegaConf.is_list(devices) or isinstance(devices, list | tuple):
        return tuple(int(d) for d in devices)
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    count = devices if isinstance(devices, int) and devices > 0 else _cuda_device_count()
    return tuple(range(max(1, count)))


def plan_memory(cfg: DictConfig, gpu_memory_gib: float | None = None,
                staging_bucket_bytes: int = STAGING_BUCKET_BYTES) -> MemoryPlan:
    """The per-GPU memory plan of the composed config ``cfg`` (reads it only: nothing is loaded).
    ``staging_bucket_bytes``: the cap of an asynchronous worker's weight-staging bucket (one, reused)."""
    from agentopsd.rollout.scoring import SCORING_HEAD_POSITIONS, SCORING_ROWS_TOKENS

    model_cfg, trainer = cfg.model, cfg.trainer
    arch, unknown = architecture_of(model_cfg)
    world, world_note = _world_size(trainer)
    strategy = _strategy_kind(trainer)
    if strategy == "single" and world > 1:
        strategy = "ddp"  # Lightning's default for several devices
    precision = _precision(trainer.get("precision", "32-true"))
    model_dtype = str(model_cfg.get("dtype", "float32"))
    param_dtype, compute_dtype = _param_and_compute_dtype(precision, model_dtype, arch.checkpoint_dtype if arch else "float32")
    micro = int(cfg.optim.micro_batch_size)
    new_tokens = int(cfg.rollout.max_new_tokens)
    seq = int(cfg.env.get("max_prompt_tokens", 1024)) + new_tokens
    budget = int(OmegaConf.select(cfg, "optim.max_tokens_per_micro_batch", default=0) or 0)
    if budget > 0:  # a token budget: micro-batches hold as many longest rows as fit (a longer row goes alone)
        micro = max(1, budget // seq)
    tokens = max(budget, seq) if budget > 0 else micro * seq  # padded tokens of one micro-batch
    # the head runs only before action tokens (a sharded model's whole call passes them as logits_to_keep)
    head_positions = worst_case_head_positions(int(cfg.optim.micro_batch_size), budget, seq, new_tokens)
    keeps_logits = _algorithm_keeps_logits(cfg)
    chunk_setting = int(OmegaConf.select(cfg, "optim.logits_chunk_tokens", default=0) or 0)
    chunk = min(chunk_setting, head_positions) if chunk_setting > 0 and not keeps_logits else 0
    offload = bool(OmegaConf.select(cfg, "optim.offload_optimizer", default=False))
    defer = bool(OmegaConf.select(cfg, "optim.defer_grad_reduction", default=False)) and strategy == "fsdp2"
    checkpointing = bool(model_cfg.get("gradient_checkpointing", False))
    gpu_bytes, gpu_source = gpu_memory(cfg, gpu_memory_gib)
    rollout = cfg.rollout
    vllm_cfg = rollout.get("vllm") or {}
    uses_vllm = rollout.get("backend", "hf") == "vllm"
    lora = bool(model_cfg.get("lora"))
    lora_note = ("model.lora is set: the weights line counts the frozen base; gradients and AdamW states are counted "
                 "for every weight (an upper bound, which covers the adapters)") if lora else ""
    chunk_note = (f"optim.logits_chunk_tokens={chunk_setting} does not apply: the algorithm keeps the full logits"
                  if chunk_setting > 0 and keeps_logits else "")
    async_note = ("rollout.max_staleness >= 1: the trainer's own engine serves its evaluation only (its sync and rollout "
                  "phases are the evaluation's)" + ("; the workers' GPUs are taken to be the trainer's size"
                                                    if rollout_devices(cfg) else "") if staleness(cfg) >= 1 else "")
    notes = tuple(n for n in (world_note, lora_note, chunk_note, async_note) if n)
    common = dict(model=str(model_cfg.get("path") or "tiny"), architecture=arch, unknown_reason=unknown, strategy=strategy,
                  world_size=world, precision=precision, param_dtype=param_dtype, compute_dtype=compute_dtype,
                  micro_batch_size=micro, sequence_tokens=seq, head_positions=head_positions,
                  gradient_checkpointing=checkpointing, gpu_memory=gpu_bytes, gpu_memory_source=gpu_source, notes=notes,
                  logits_chunk=chunk, offload_optimizer=offload, deferred_reduction=defer)
    if arch is None:
        return MemoryPlan(**common, weights=0, gradients=0, optimizer=0, gathered=0, activations=0, logits=0, reference=0,
                          vllm=0, vllm_weights=0, entropy_bonus=False, margin=0)
    pb, cb = DTYPE_BYTES[param_dtype], DTYPE_BYTES[compute_dtype]
    shards = world if strategy == "fsdp2" else 1
    params = arch.parameters
    h, vocab = arch.hidden_size, arch.vocab_size
    # under bf16-mixed FSDP2 gathers bf16 copies and computes bf16 gradients (agentopsd.training.strategies.fsdp_mixed_precision)
    gb = cb if precision == "bf16-mixed" else pb
    if strategy == "fsdp2":
        # root params and grads stay whole through forward and backward; two layers' params
        # (computing + prefetched) and one layer's gradient before its reduce-scatter
        gathered = (2 * arch.root_parameters + 3 * arch.layer_parameters) * gb
    elif strategy == "ddp":
        gathered = params * pb  # gradient buckets: a second copy of every gradient
    else:
        gathered = 0
    layer_acts = tokens * arch.activation_elements_per_token * cb
    outside = tokens * arch.outside_layers_elements_per_token * cb
    if checkpointing:  # each layer's input kept; one layer recomputed in backward, with its gradients
        activations = arch.num_layers * tokens * h * cb + 2 * layer_acts + outside
    else:  # every layer's saved values, and the gradients of the one the backward is in
        activations = arch.num_layers * layer_acts + tokens * arch.backward_elements_per_token * cb + outside
    entropy = float(OmegaConf.select(cfg, "algorithm.entropy_coef", default=0.0) or 0.0) > 0
    logits = logits_bytes(head_positions, vocab, h, cb, entropy=entropy, chunk=chunk, keeps_logits=keeps_logits)
    # a no-grad scoring pass: a sharded policy scores micro-batches through the whole model; otherwise the shared
    # prefixes of up to SCORING_ROWS_TOKENS tokens run at once with their KV cache, and the head runs over
    # SCORING_HEAD_POSITIONS positions at a time (either: one chunk with the lever)
    if strategy == "fsdp2":
        score_tokens, score_positions = tokens, head_positions
        score_gathered, kv_cache = (arch.root_parameters + 2 * arch.layer_parameters) * gb, 0
    else:
        score_tokens, score_positions, score_gathered = SCORING_ROWS_TOKENS, SCORING_HEAD_POSITIONS, 0
        kv_cache = arch.num_layers * 2 * arch.kv_dim * score_tokens * cb
    layer_transient = score_tokens * (2 * h + 3 * arch.intermediate_size) * cb  # one layer's MLP at a time, no grad
    scoring = (score_gathered + kv_cache + layer_transient + head_positions * h * cb
               + (chunk or score_positions) * vocab * logit_nograd_bytes(cb))
    kl = float(OmegaConf.select(cfg, "algorithm.kl_coef", default=0.0) or 0.0)
    model_dtype_loaded = arch.checkpoint_dtype if model_dtype == "auto" else model_dtype
    ref_dtype = reference_dtype(precision, param_dtype, model_dtype_loaded)
    reference = -(-params * DTYPE_BYTES.get(ref_dtype, 4) // shards) if kl > 0 else 0
    vllm_dtype = str(vllm_cfg.get("dtype", "auto"))
    vllm_dtype = arch.checkpoint_dtype if vllm_dtype == "auto" else vllm_dtype
    vllm = int(float(vllm_cfg.get("gpu_memory_utilization", 0.5)) * gpu_bytes) if uses_vllm else 0
    # the sync's dtype: the engine's when float32/float16, else bfloat16 (agentopsd.rollout.vllm_backend)
    sync_bytes = DTYPE_BYTES.get(vllm_dtype, 2) if vllm_dtype in ("float32", "float", "float16", "half") else 2
    largest = max(arch.vocab_size * arch.hidden_size, arch.intermediate_size * arch.hidden_size)
    sleep_setting = str(vllm_cfg.get("enable_sleep_mode", "auto")).lower()
    on_cpu = str(trainer.get("accelerator", "auto")) == "cpu"
    # AdamW's step: foreach on a GPU holds sqrt(exp_avg_sq) of every weight at once; the per-tensor loop torch
    # takes on CPU holds that and its bias-corrected copy of the largest weight only
    step_temporary = 2 * largest * pb if on_cpu else -(-params * pb // shards)
    base_dtype = lora_base_dtype(precision, param_dtype, model_dtype_loaded, strategy=strategy, on_cpu=on_cpu) if lora else ""
    # a LoRA policy's weights are its frozen base (the float32 adapters are a sliver, inside the gradients' upper bound)
    weight_bytes = DTYPE_BYTES.get(base_dtype, 4) if lora else pb
    worker, worker_gpus = None, tuple(rollout_devices(cfg))
    if staleness(cfg) >= 1:
        where = "its own GPU" if worker_gpus else "the trainer's GPU"
        worker = plan_worker(cfg, arch, gpu_bytes, world=world, sequence=seq, device=where, own_gpu=bool(worker_gpus),
                             margin=RUNTIME_MARGIN_BYTES, bucket_bytes=staging_bucket_bytes)
    return MemoryPlan(
        **common,
        weights=-(-params * weight_bytes // shards),
        # optim.defer_grad_reduction: every layer's gradient stays unsharded until the mini-batch's last backward
        gradients=-(-params * pb // (1 if defer else shards)),
        optimizer=-(-params * ADAM_STATES * pb // shards),
        gathered=gathered,
        activations=activations,
        logits=logits,
        reference=reference,
        vllm=vllm,
        vllm_weights=params * DTYPE_BYTES.get(vllm_dtype, 2) if uses_vllm else 0,
        entropy_bonus=entropy,
        margin=RUNTIME_MARGIN_BYTES,
        sleep_mode=uses_vllm and sleep_setting not in ("false", "0", "no", "off"),
        sync_temporary=2 * largest * sync_bytes if uses_vllm else 0,
        step_temporary=step_temporary,
        scoring=scoring,
        vllm_asleep=VLLM_ASLEEP_BYTES if uses_vllm else 0,
        reference_dtype=ref_dtype,
        frozen_dtype=base_dtype,
        worker=worker,
        trainer_gpus=_local_gpus(trainer),
        worker_gpus=worker_gpus,
    )


def colocated_async_engine_problem(cfg: DictConfig, gpu_memory_gib: float | None = None) -> str:
    """Why a vLLM engine in an asynchronous worker beside its trainer rank (``rollout.max_staleness`` >= 1, no
    ``rollout.devices``, the trainer on a GPU) cannot run, in one line naming the fix; ``""`` when it can.

    The rule: that engine never sleeps (it generates while the trainer updates), so it holds its whole share beside
    every phase of the trainer, with the worker's policy copy and staging, and beside the trainer's own evaluation
    engine, whose sleep frees only its own share. With the model's sizes known the plan's arithmetic decides: refused
    when the trainer's GPU cannot hold its largest phase with the worker beside it. With them unknown only the config's
    fractions can: the two engines, ``gpu_memory_utilization`` of the GPU each, both awake while the trainer evaluates,
    cannot share one GPU at 2 x that >= 1. A CPU run is left alone (no GPU memory to plan, no sleep mode there).
    """
    rollout = cfg.rollout
    if rollout.get("backend") != "vllm" or staleness(cfg) < 1 or rollout_devices(cfg) or not _targets_gpu(cfg):
        return ""
    fix = ("set rollout.devices=[...] (a GPU of its own for each rank's worker), or rollout.max_staleness=0 (lockstep: "
           "the colocated engine sleeps during the update)")
    head = (f"rollout=vllm with rollout.max_staleness={staleness(cfg)} and no rollout.devices puts each rank's rollout "
            "worker and its never-sleeping engine on the trainer's GPU")
    plan = plan_memory(cfg, gpu_memory_gib)
    if plan.architecture is None:
        share = float((rollout.get("vllm") or {}).get("gpu_memory_utilization", 0.5))
        if 2 * share >= 1:
            return (f"{head}, beside the trainer's own evaluation engine: two shares of rollout.vllm.gpu_memory_utilization="
                    f"{share:g} cannot share one GPU; {fix}")
        return ""
    if plan.total > plan.gpu_memory:
        return (f"{head} ({_gib(plan.colocated_worker)} GiB): the trainer's GPU would need {_gib(plan.total)} GiB in its "
                f"largest phase ({max(plan.phases, key=plan.phases.get)}), it has {_gib(plan.gpu_memory)} GiB; {fix}")
    return ""


def _targets_gpu(cfg: DictConfig) -> bool:
    """The run trains on GPUs: ``trainer.accelerator`` gpu/cuda, or auto where CUDA is visible."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and _cuda_available())


def measure_cpu_peak(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn()``'s result and the peak of CPU memory it allocated through PyTorch's allocator above what was
    allocated when it started (bytes): what ``torch.cuda.max_memory_allocated`` minus its starting value
    gives on a GPU, measured on CPU.

    The profiler's memory profiling has the CPU allocator report every allocation and free with the running
    total, inside kernels too (a log-softmax's temporaries, an optimizer's), forward and backward alike;
    tensors that live before ``fn`` starts are not counted, nor memory outside PyTorch's allocator.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
    if not events:
        return result, 0
    events.sort()
    start = events[0][2] - events[0][1]  # the allocator's running total just before the first event
    return result, max(0, max(total for _, _, total in events) - start)


def _is_rank_zero() -> bool:
    return all(os.environ.get(v, "0") == "0" for v in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))


def print_memory_plan(cfg: DictConfig, *, force: bool = False, gpu_memory_gib: float | None = None) -> MemoryPlan | None:
    """Print the plan (rank 0) and log its warnings, for runs that target GPUs (or always with ``force``).

    Runs on CPU get no plan: GPU memory means nothing to them. Returns the plan, or None when skipped.
    """
    if not (force or _targets_gpu(cfg)):
        return None
    plan = plan_memory(cfg, gpu_memory_gib)
    if _is_rank_zero():
        print(plan.report(), flush=True)
        for warning in plan.warnings:
            log.warning(warning)
    return plan


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def compose_config(overrides: list[str], config_dir: str | Path | None = None) -> DictConfig:
    """The run's config as train.py composes it (``+experiment=X`` means ``experiment=X`` there too)."""
    from hydra import compose, initialize_config_dir

    conf = Path(config_dir) if config_dir else Path(__file__).parent.parent / "conf"  # a checkout's conf/ or the wheel's copy
    if not (conf / "config.yaml").is_file():
        raise FileNotFoundError(f"no Hydra config at {conf}/config.yaml: pass --config-dir <repo>/conf")
    overrides = [o.replace("+experiment=", "experiment=", 1) if o.startswith("+experiment=") else o for o in overrides]
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return compose(config_name="config", overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m agentopsd.tools.memory",
        description="Print the per-GPU memory plan of a training config (nothing is loaded). "
                    "Other arguments are Hydra overrides, as for train.py.",
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="plan for this much GPU memory per device")
    parser.add_argument("--config-dir", default=None, help="the Hydra config folder (default: the repository's conf/)")
    parser.add_argument("--staging-bucket-mib", type=float, default=STAGING_BUCKET_BYTES / 2**20,
                        help="rollout.max_staleness >= 1: the cap of the worker's one weight-staging bucket")
    args, overrides = parser.parse_known_args(argv)
    plan = plan_memory(compose_config(overrides, args.config_dir), args.gpu_memory_gib,
                       staging_bucket_bytes=int(args.staging_bucket_mib * 2**20))
    print(plan.report())
    for warning in plan.warnings:
        print(f"WARNING: {warning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
