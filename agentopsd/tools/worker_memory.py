"""What an asynchronous rollout worker (``rollout.max_staleness`` >= 1) holds on its GPU, for the memory plan
(:mod:`agentopsd.tools.memory`), from the config alone.

Where it lives: beside its trainer rank on the trainer's GPU when ``rollout.devices`` is unset, on
``rollout.devices[local rank]`` otherwise. What it holds there:

- its own policy copy in the generation dtype (:data:`WORKER_DTYPE`: the worker builds its model in bf16 on a GPU,
  not a copy of the float32 master weights);
- its engine: vLLM's share (``rollout.vllm.gpu_memory_utilization`` x the GPU's memory; the worker's engine never
  sleeps), or transformers' KV cache for the rows it generates at once, one prefill chunk and one decode step's logits;
- its weight staging: one reused receive bucket of at most ``bucket_bytes`` (:data:`STAGING_BUCKET_BYTES` by
  default, the collective push's 256 MiB; the shared-memory push's is 16 MiB): a tensor larger than the bucket travels
  in pieces, copied straight into the policy;
- its CUDA context, caching-allocator slack (and NCCL buffers under the collective push):
  :data:`agentopsd.tools.memory.RUNTIME_MARGIN_BYTES`, an estimate.

No GPU has run an asynchronous worker yet: these are counts of what the code allocates, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from agentopsd.tools.architecture import Architecture

MIB = 2**20
WORKER_DTYPE = "bfloat16"
"""The dtype of the worker's policy copy on a GPU (the generation dtype: bf16, as the peers' engines load)."""
STAGING_BUCKET_BYTES = 256 * MIB
"""The cap of the worker's receive bucket the plan assumes (``bucket_bytes`` overrides it): the collective push's
``agentopsd.rollout.weight_transport.BUCKET_BYTES`` (a test keeps the two equal; this module stays free of torch)."""
STAGING_BUCKETS = 1
"""Buckets the worker holds at once: one, reused; each bucket's bytes are copied into the policy before the next."""
HALF_BYTES = 2
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class WorkerPlan:
    """Bytes one rollout worker holds on its GPU, item by item."""

    device: str
    """Where it lives, in words: ``GPU 4 (its own)`` or ``the trainer's GPU``."""
    own_gpu: bool
    """``rollout.devices`` gives it a GPU of its own (else it shares its trainer rank's)."""
    backend: str
    """``vllm`` or ``hf``."""
    policy_dtype: str
    policy_copy: int
    engine: int
    """vLLM's share, or transformers' KV cache, prefill chunk and decode logits."""
    generating_rows: int
    """Rows one generate call holds at once (transformers; 0 under vLLM, whose share bounds its KV cache)."""
    staging: int
    bucket_bytes: int
    """The staging cap per bucket assumed (default :data:`STAGING_BUCKET_BYTES`)."""
    margin: int
    gpu_memory: int

    @property
    def total(self) -> int:
        return self.policy_copy + self.engine + self.staging + self.margin

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) per item, each saying where it lives."""
        where = self.device
        engine = ("vLLM share (gpu_memory_utilization; never asleep)" if self.backend == "vllm" else
                  f"transformers KV cache, prefill chunk, decode logits ({self.generating_rows} rows)")
        cap = f"{self.bucket_bytes / MIB:.0f} MiB"
        return [
            (f"worker policy copy ({self.policy_dtype}), on {where}", self.policy_copy),
            (f"worker {engine}, on {where}", self.engine),
            (f"worker weight staging ({STAGING_BUCKETS} bucket, {cap} cap), on {where}", self.staging),
            (f"worker CUDA context, NCCL, fragmentation: an estimate, on {where}", self.margin),
        ]


def staleness(cfg: DictConfig) -> int:
    """``rollout.max_staleness`` (0: lockstep, no worker)."""
    return int(OmegaConf.select(cfg, "rollout.max_staleness", default=0) or 0)


def rollout_devices(cfg: DictConfig) -> list[int]:
    """``rollout.devices`` as a list (empty: each worker beside its trainer rank)."""
    devices = OmegaConf.select(cfg, "rollout.devices", default=None)
    return [int(d) for d in devices] if devices else []


def staging_bytes(arch: Architecture, bucket_bytes: int) -> int:
    """:data:`STAGING_BUCKETS` buckets of ``bucket_bytes``, never more than the whole model in the worker's dtype (a
    tensor larger than a bucket travels in pieces)."""
    return STAGING_BUCKETS * min(bucket_bytes, arch.parameters * HALF_BYTES)


def hf_engine_bytes(arch: Architecture, rows: int, sequence: int, prefill_chunk: int) -> int:
    """Transformers generation in the worker's bf16 copy: the KV cache of ``rows`` rows of ``sequence`` tokens, one
    prefill chunk's MLP (``prefill_chunk`` tokens, the largest layer transient) and one decode step's logits (bf16,
    their float32 log-softmax and probabilities)."""
    kv_cache = rows * sequence * arch.num_layers * 2 * arch.kv_dim * HALF_BYTES
    prefill = prefill_chunk * (2 * arch.hidden_size + 3 * arch.intermediate_size) * HALF_BYTES
    logits = rows * arch.vocab_size * (HALF_BYTES + 2 * FLOAT32_BYTES)
    return kv_cache + prefill + logits


def generating_rows(cfg: DictConfig, world: int) -> int:
    """The rows one transformers generate call holds: this rank's episodes of an iteration (its share of
    ``data.tasks_per_batch`` x ``data.group_size``), split over ``rollout.overlap_waves``."""
    episodes = int(cfg.data.tasks_per_batch) * int(cfg.data.group_size)
    per_rank = -(-episodes // max(1, world))
    waves = int(OmegaConf.select(cfg, "rollout.overlap_waves", default=1) or 1)
    return -(-per_rank // max(1, waves))


def plan_worker(cfg: DictConfig, arch: Architecture, gpu_memory: int, *, world: int, sequence: int, device: str,
                own_gpu: bool, margin: int, bucket_bytes: int = STAGING_BUCKET_BYTES) -> WorkerPlan:
    """One rollout worker's plan on a GPU of ``gpu_memory`` bytes (``device`` says which, in words)."""
    from agentopsd.rollout.hf import PREFILL_CHUNK_TOKENS

    backend = str(OmegaConf.select(cfg, "rollout.backend", default="hf"))
    if backend == "vllm":
        share = float(OmegaConf.select(cfg, "rollout.vllm.gpu_memory_utilization", default=0.5))
        engine, rows = int(share * gpu_memory), 0
    else:
        rows = generating_rows(cfg, world)
        engine = hf_engine_bytes(arch, rows, sequence, PREFILL_CHUNK_TOKENS)
    return WorkerPlan(device=device, own_gpu=own_gpu, backend=backend, policy_dtype=WORKER_DTYPE,
                      policy_copy=arch.parameters * HALF_BYTES, engine=engine, generating_rows=rows,
                      staging=staging_bytes(arch, bucket_bytes), bucket_bytes=bucket_bytes, margin=margin,
                      gpu_memory=gpu_memory)
