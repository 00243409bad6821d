"""A stand-in for vLLM's ``LLM`` with sleep mode, for rehearsing the colocated engine's dance on a CPU.

vLLM's CPU build has no sleep mode, so on a machine without a GPU nothing real can check the order of
the calls around an update: the trainer's gradients dropped and PyTorch's cached blocks released before
the engine wakes, the weights woken before they load and the KV cache after, the sync after every update,
sleep after every rollout. :func:`install` puts a fake ``vllm`` package in ``sys.modules`` whose ``LLM``:

- loads the model folder with transformers (its own copy, float32) and generates with the project's
  transformers generator, reporting each sampled token's log-prob as vLLM's processed log-probs do;
- exposes the in-process worker path (``llm_engine.engine_core.engine_core.model_executor.driver_worker
  .model_runner.model.load_weights``), so :class:`agentopsd.rollout.vllm_backend.VLLMGenerator`'s real
  sync code streams the weights into it;
- ``sleep(level=2)`` drops its weights (NaN: a generate before a fresh load gives garbage and says so)
  and its KV cache; ``wake_up(tags=...)`` brings them back;
- shares a :class:`SimulatedDevice` with the trainer: every optimizer step fills the "caching allocator"
  (as the update's peak stays reserved in PyTorch's cache on a GPU), the trainer's
  :func:`agentopsd.rollout.base.release_device_cache` empties it, and waking the weights while the
  cache is full raises ``torch.OutOfMemoryError``, as vLLM's ``wake_up`` does on a full GPU.

Every call is recorded in :attr:`FakeLLM.events` (and :data:`EVENTS`, across engines), so a test can
assert the order and a rehearsal can count sleeps, wakes and syncs. Nothing here touches a GPU.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from agentopsd.rollout.base import SamplingConfig

EVENTS: list[tuple] = []
"""Every fake engine's calls in order: ("release",), ("sleep", level), ("wake_up", tags), ("load", n_tensors),
("generate", n_prompts), ("reset_prefix_cache",), ("optimizer_step",)."""


@dataclass
class SimulatedDevice:
    """The memory the sleep-mode dance is about: PyTorch's cached blocks and the engine's share.

    ``cached_bytes`` is what the caching allocator keeps after the update (filled by each optimizer step,
    emptied by :func:`agentopsd.rollout.base.release_device_cache`); ``engine_bytes`` what the engine
    holds (its weights and KV cache awake, nothing asleep). Waking with a full cache is out of memory.
    """

    update_peak_bytes: int = 8 * 2**30
    cached_bytes: int = 0
    engine_bytes: int = 0
    freed_by_sleep: list[float] = field(default_factory=list)
    """Per sleep: the share of the engine's bytes it freed (1.0 = all)."""

    def fill(self) -> None:
        self.cached_bytes = self.update_peak_bytes

    def release(self) -> None:
        self.cached_bytes = 0


DEVICE = SimulatedDevice()


class _EngineModel:
    """The engine's model as its worker sees it: ``load_weights`` consumes (name, full tensor) pairs."""

    def __init__(self, owner: FakeLLM) -> None:
        self.owner = owner

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.owner.model.named_parameters())
        n = 0
        with torch.no_grad():
            for name, tensor in weights:
                if name in params:
                    params[name].copy_(tensor.to(params[name].dtype))
                    n += 1
        self.owner.weights_valid = True
        self.owner._record(("load", n))


class FakeLLM:
    """``vllm.LLM`` as far as :class:`~agentopsd.rollout.vllm_backend.VLLMGenerator` uses it."""

    instances: list[FakeLLM] = []

    def __init__(self, model: str, *, enable_sleep_mode: bool = False, seed: int = 0, **kwargs: Any) -> None:
        from transformers import AutoModelForCausalLM

        from agentopsd.models.loading import load_tokenizer
        from agentopsd.rollout.hf import HFGenerator

        self.kwargs = dict(kwargs, model=model, enable_sleep_mode=enable_sleep_mode, seed=seed)
        self.sleep_mode = enable_sleep_mode
        self.seed = seed
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.tokenizer = load_tokenizer(model)
        self._hf = HFGenerator(self.model, self.tokenizer)
        self.events: list[tuple] = []
        self.weights_valid = True
        self.generated_with: list[float] = []
        """Per generate call: :func:`weights_checksum` of the weights it generated with."""
        self.awake = {"weights": True, "kv_cache": True}
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.kv_bytes = self.weight_bytes  # any size: what matters is that sleep frees it and wake takes it back
        DEVICE.engine_bytes = self.weight_bytes + self.kv_bytes
        runner = types.SimpleNamespace(model=_EngineModel(self))
        worker = types.SimpleNamespace(model_runner=runner)
        executor = types.SimpleNamespace(driver_worker=worker)
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(engine_core=types.SimpleNamespace(model_executor=executor)))
        FakeLLM.instances.append(self)

    def _record(self, event: tuple) -> None:
        self.events.append(event)
        EVENTS.append(event)

    # ---- sleep mode
    def sleep(self, level: int = 1) -> None:
        if not self.sleep_mode:
            raise RuntimeError("sleep mode is off for this engine (enable_sleep_mode=False)")
        self._record(("sleep", level))
        before = DEVICE.engine_bytes
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))  # level 2 drops the weights: their buffers come back undefined
        self.weights_valid = False
        self.awake = {"weights": False, "kv_cache": False}
        DEVICE.engine_bytes = 0
        DEVICE.freed_by_sleep.append(1.0 - DEVICE.engine_bytes / max(before, 1))

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        tags = tuple(tags or ("weights", "kv_cache"))
        self._record(("wake_up", tags))
        if DEVICE.cached_bytes:
            raise torch.OutOfMemoryError(
                f"simulated: waking the engine's {'/'.join(tags)} while PyTorch's caching allocator still holds "
                f"{DEVICE.cached_bytes / 2**30:.1f} GiB from the update (release the cache before wake_up)")
        for tag in tags:
            self.awake[tag] = True
            DEVICE.engine_bytes += self.weight_bytes if tag == "weights" else self.kv_bytes

    def reset_prefix_cache(self) -> None:
        self._record(("reset_prefix_cache",))

    # ---- generation
    def generate(self, inputs: Sequence[Any], params: Sequence[Any], use_tqdm: bool = False) -> list[Any]:
        if not all(self.awake.values()):
            raise RuntimeError(f"generate on a sleeping engine: {self.awake}")
        if not self.weights_valid:
            raise RuntimeError("generate after sleep(level=2) without loading weights: they are undefined")
        self._record(("generate", len(inputs)))
        self.generated_with.append(weights_checksum(self.model))
        prompts = [list(p["prompt_token_ids"]) for p in inputs]
        p0 = params[0]
        greedy = p0.temperature == 0
        sampling = SamplingConfig(max_new_tokens=p0.max_tokens, temperature=1.0 if greedy else p0.temperature,
                                  greedy=greedy, stop_strings=tuple(p0.stop or ()), seed=p0.seed)
        out = []
        for g in self._hf.generate(prompts, sampling):
            steps = [{tid: types.SimpleNamespace(logprob=lp)} for tid, lp in zip(g.token_ids, g.logprobs)]
            stop = next((s for s in sampling.stop_strings if g.text.endswith(s)), None) if g.finish_reason == "stop" else None
            completion = types.SimpleNamespace(token_ids=list(g.token_ids), logprobs=steps,
                                               finish_reason="length" if g.finish_reason == "length" else "stop",
                                               stop_reason=stop)
            out.append(types.SimpleNamespace(outputs=[completion]))
        return out


def weights_checksum(model: torch.nn.Module) -> float:
    """A float64 sum of every parameter: equal for equal weights (what the engine generated with vs the policy)."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _sampling_params(**kw: Any) -> Any:
    return types.SimpleNamespace(**kw)


_saved: dict[str, Any] = {}


def fake_vllm_modules(llm_class: type, *, sleep_available: bool | Callable[[], bool]) -> dict[str, types.ModuleType]:
    """The modules of a fake ``vllm`` package, by name, with what the backend touches: ``LLM`` (``llm_class``),
    ``SamplingParams``, ``inputs.TokensPrompt``, ``EngineArgs``' ``logprobs_mode`` field and the platform's sleep
    mode (``sleep_available``, or a function asked each time). Each carries a spec, as ``importlib.util.find_spec("vllm")`` (train.py's check)
    reads it."""
    mod = types.ModuleType("vllm")
    mod.__version__ = "0.0.0-fake"
    mod.LLM = llm_class
    mod.SamplingParams = _sampling_params
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    engine = types.ModuleType("vllm.engine")
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = type("EngineArgs", (), {"__dataclass_fields__": {"logprobs_mode": None}})
    platforms = types.ModuleType("vllm.platforms")
    available = sleep_available if callable(sleep_available) else (lambda: sleep_available)
    platforms.current_platform = types.SimpleNamespace(is_sleep_mode_available=available)
    modules = {"vllm": mod, "vllm.inputs": inputs, "vllm.engine": engine, "vllm.engine.arg_utils": arg_utils,
               "vllm.platforms": platforms}
    for name, module in modules.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return modules


def install(*, sleep_available: bool = True) -> types.ModuleType:
    """Put the fake ``vllm`` in ``sys.modules`` (undone by :func:`uninstall`), hook the simulated device to
    every optimizer step and to the trainer's cache release, and return the fake package."""
    from agentopsd.rollout import base as rollout_base

    modules = fake_vllm_modules(FakeLLM, sleep_available=sleep_available)
    mod = modules["vllm"]
    if not _saved:
        _saved["modules"] = {name: sys.modules.get(name) for name in modules}
        _saved["release"] = rollout_base.release_device_cache
        _saved["hook"] = register_optimizer_step_post_hook(_after_optimizer_step)
    sys.modules.update(modules)
    original = _saved["release"]

    def release() -> None:
        EVENTS.append(("release",))
        DEVICE.release()
        original()

    rollout_base.release_device_cache = release
    reset()
    return mod


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    EVENTS.append(("optimizer_step",))
    DEVICE.fill()


def reset() -> None:
    """Forget the recorded events, the engines and the simulated memory."""
    EVENTS.clear()
    FakeLLM.instances = []
    DEVICE.cached_bytes = DEVICE.engine_bytes = 0
    DEVICE.freed_by_sleep.clear()


def uninstall() -> None:
    """Undo :func:`install`."""
    from agentopsd.rollout import base as rollout_base

    if not _saved:
        return
    for name, module in _saved["modules"].items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
    rollout_base.release_device_cache = _saved["release"]
    _saved["hook"].remove()
    _saved.clear()
