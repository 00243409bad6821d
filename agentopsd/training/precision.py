"""Which precision the policy's weights are stored and run in (``model.dtype``), decided once from the device, the
processor's flags and what the config asks, with the reason said in one log line.

Why flags and not a probe: a bf16 matmul is fast on a CPU only where the processor computes in bf16 natively
(``avx512_bf16``, or AMX's ``amx_bf16``). Elsewhere oneDNN emulates it through float32 and it is slower than
float32 itself (an Intel Xeon with avx512_vnni but no avx512_bf16: 512x576 @ 576x1536 took 0.0294 s in bf16
against 0.0116 s in float32, 2 threads), while ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` still says True
there: it answers "can run", not "runs fast".

What a bf16 choice means on a CPU under ``trainer.precision=32-true`` (:func:`weight_plan`):

- LoRA: the frozen base (and with it the KL reference, a copy of the policy) is stored in bf16; the adapters and
  their AdamW states stay float32 (peft keeps adapters float32 over a half-precision base); the update runs this
  model. Generation and teacher scoring run a plain bf16 copy with the adapters merged into its weights,
  re-merged before each rollout (:func:`half_copy`, :func:`copy_weights`), as TRL merges adapters into its vLLM
  engine: the adapters' own float32 matmuls, casts and adds cost as much as the base's bf16 matmuls on a CPU
  (SmolLM2 with LoRA r=16 on every linear layer, one batched prefill: about 40% of the time).
- Full fine-tuning: float32 master weights (the update, the optimizer, the reference) and a bf16 copy that
  generates and scores the teacher view, refreshed from the master weights before each rollout
  (:func:`copy_weights`), as a vLLM engine is synced.

The LoRA policy over a bf16 base computes in bf16 throughout (:func:`compute_in_half`): its adapters (float32
weights, float32 gradients and AdamW states) multiply in bf16 under autocast, and attention runs in float32, whose
CPU backward is about twice as fast as bf16's. Together: an update micro-batch takes 27% less time (1.36x), a
warm-start step 18% less (1.21x) (SmolLM2-135M, one thread).

Either way the rollout's log-probs are not the update forward's numerics, so the module recomputes the old
log-probs in the update's precision (and weighs tokens by truncated importance weights where ``optim.tis_cap``
is set), as a GPU run does for its engine. GPUs and the mixed precisions keep ``model.dtype`` as a loading dtype
(``trainer.precision`` sets the compute there); on a GPU without FSDP2 the frozen weights (a LoRA base, the KL
reference) also stay in it (:attr:`WeightPlan.frozen_as_loaded`), consistent with the CPU's bf16 LoRA base above.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")
"""The values ``model.dtype`` takes."""

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 flags (``/proc/cpuinfo``) of a processor that computes bf16 matmuls natively."""

FLOAT32_PRECISIONS = ("32-true", "32")
"""``trainer.precision`` values without autocast: the weights' own dtype is the compute dtype."""


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``model.dtype`` resolved to: ``dtype`` is one of float32, bfloat16, float16 or auto (the checkpoint's
    own, on a GPU), and ``reason`` says why in words for the log line."""

    dtype: str
    reason: str


@dataclass(frozen=True)
class WeightPlan:
    """How the module holds and uses the weights (:func:`weight_plan`)."""

    frozen_half: bool = False
    """The frozen weights (a LoRA base) stay bf16: no float32 upcast of them before training."""
    generation_dtype: torch.dtype | None = None
    """A separate copy in this dtype generates and scores the teacher view (full fine-tuning); None: the policy."""
    frozen_as_loaded: bool = False
    """On a GPU outside FSDP2: the frozen weights keep the half dtype they load in (``model.dtype``: bf16 in the GPU
    configs), as the memory plan counts them: a LoRA base (only its adapters, and their AdamW states, become float32)
    and the KL reference (not upcast to the policy's float32 master weights; it scores in bf16, under the update's
    autocast or, under ``32-true``, in its own dtype).
    Nothing else changes: the policy itself generates, so the rollout is not :attr:`half_rollout`."""

    @property
    def half_rollout(self) -> bool:
        """The rollout's forwards run on bf16 weights, so its log-probs are not the update's: recompute them."""
        return self.frozen_half or self.generation_dtype is not None


FLOAT32_PLAN = WeightPlan()
"""Today's behaviour: one float32 policy does everything."""


def read_cpu_flags(path: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's feature flags (x86 ``flags``, ARM ``Features``); empty where the file is missing
    (macOS, Windows): there the choice falls back to float32."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(flags: frozenset[str]) -> bool:
    """The processor computes bf16 matmuls natively (:data:`NATIVE_BF16_FLAGS`)."""
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def device_type(accelerator: str) -> str:
    """``trainer.accelerator`` as the device type the forwards run on: ``cpu`` or ``cuda``."""
    if accelerator in ("gpu", "cuda"):
        return "cuda"
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


def check_dtype(requested: str) -> None:
    """One line naming the fix for an unknown ``model.dtype``."""
    if requested not in DTYPE_NAMES:
        raise ValueError(f"model.dtype={requested!r} is not one of {', '.join(DTYPE_NAMES)}: set model.dtype=auto "
                         "(bf16 where the CPU computes it natively, float32 otherwise) or model.dtype=float32")


def choose_precision(requested: str, device: str, flags: frozenset[str]) -> PrecisionChoice:
    """``model.dtype`` resolved for ``device`` (``cpu`` or ``cuda``) and a processor with ``flags``.

    An explicit dtype is kept as asked. ``auto`` on a CPU: bf16 where the processor has native bf16, else
    float32 (emulated bf16 is slower than float32); ``auto`` on a GPU: the checkpoint's own dtype, as
    ``from_pretrained`` reads it (``trainer.precision`` sets the compute there)."""
    check_dtype(requested)
    if requested != "auto":
        return PrecisionChoice(requested, f"model.dtype={requested} forces it")
    if device != "cpu":
        return PrecisionChoice("auto", f"on {device} the checkpoint's dtype; trainer.precision sets the compute")
    found = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if found:
        return PrecisionChoice("bfloat16", f"the CPU computes bf16 natively ({', '.join(found)})")
    return PrecisionChoice("float32", f"the CPU has no native bf16 ({' or '.join(NATIVE_BF16_FLAGS)}), "
                                      "where bf16 matmuls run slower than float32")


def loading_dtype(choice: PrecisionChoice, requested: str, *, lora: bool) -> str:
    """The dtype ``from_pretrained`` loads in. An explicit ``model.dtype`` is that dtype (as before: bfloat16 halves
    host memory, a mixed precision upcasts it). ``auto`` choosing bf16 loads a LoRA base in bf16, but full
    fine-tuning's weights in float32: they are the master weights, and the bf16 copy is made from them."""
    if requested != "auto" or choice.dtype != "bfloat16":
        return choice.dtype
    return "bfloat16" if lora else "float32"


def weight_plan(choice: PrecisionChoice, *, device: str, trainer_precision: str, lora: bool, sharded: bool) -> WeightPlan:
    """How a run holds its weights (see the module docstring): bf16 storage only for a bf16 choice on a CPU under
    a float32 ``trainer.precision`` without FSDP; on a GPU without FSDP the frozen weights stay as loaded
    (:attr:`WeightPlan.frozen_as_loaded`: float32 copies of weights no optimizer updates would only double their
    memory); everything else keeps one float32 policy (a mixed precision autocasts float32 master weights; FSDP2
    shards the policy and never upcasts the reference or, under bf16-mixed, a LoRA base)."""
    if device != "cpu" and not sharded:
        return WeightPlan(frozen_as_loaded=True)
    if choice.dtype != "bfloat16" or device != "cpu" or str(trainer_precision) not in FLOAT32_PRECISIONS or sharded:
        return FLOAT32_PLAN
    return WeightPlan(frozen_half=lora, generation_dtype=torch.bfloat16)


def describe(choice: PrecisionChoice, requested: str, *, lora: bool, device: str) -> str:
    """The one log line: which precision and why, and what it means for the weights."""
    if choice.dtype == "bfloat16" and device == "cpu":
        what = ("frozen base weights in bf16, LoRA adapters and optimizer states float32, a merged bf16 copy "
                "generates and scores" if lora else
                "float32 master weights, a bf16 copy generates and scores (under trainer.precision=32-true)")
    else:
        what = f"weights loaded as {choice.dtype}"
    return f"model.dtype={requested}: {choice.dtype} ({choice.reason}); {what}"


def plan_for_config(cfg) -> WeightPlan:
    """The :class:`WeightPlan` a composed run config describes (the same :func:`choose_precision` that
    ``load_policy`` made from ``model.dtype``, with ``trainer.accelerator``, ``trainer.precision`` and the strategy)."""
    model, trainer = cfg.model, cfg.trainer
    requested = str(model.get("dtype", "float32") or "float32")  # the tiny model has no dtype: float32
    device = device_type(str(trainer.get("accelerator", "cpu")))
    choice = choose_precision(requested, device, read_cpu_flags())
    strategy = trainer.get("strategy")
    target = str(strategy.get("_target_", "")) if hasattr(strategy, "get") else str(strategy or "")
    return weight_plan(choice, device=device, trainer_precision=str(trainer.get("precision", "32-true")),
                       lora=bool(model.get("lora")), sharded=target.endswith("FSDP2Strategy"))


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """A peft model's LoRA layers by their name in the transformers model under it (``{}`` without peft): each wraps
    a plain layer (``base_layer``) and adds its adapters' delta (``get_delta_weight``)."""
    get_base = getattr(model, "get_base_model", None)
    if not callable(get_base):
        return {}
    return {name: m for name, m in get_base().named_modules()
            if hasattr(m, "base_layer") and callable(getattr(m, "get_delta_weight", None))}


def half_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen copy of ``model`` with its parameters in ``dtype``, for generation and scoring (the master weights
    stay as they are). Buffers keep their dtype: the rotary ``inv_freq`` is float32 in a model loaded in bf16 too.

    A LoRA policy's copy is the plain transformers model with the adapters merged into its weights
    (:func:`copy_weights` merges them): no adapter runs at generation time."""
    lora = lora_layers(model)
    if lora:
        # deepcopy's memo stands each LoRA layer's plain base layer in for the LoRA layer: the copy holds no adapters
        memo = {id(layer): copy.deepcopy(layer.base_layer) for layer in lora.values()}
        out = copy.deepcopy(model.get_base_model(), memo)
    else:
        out = copy.deepcopy(model)
    out.requires_grad_(False).eval()
    if getattr(out.config, "_attn_implementation", None) == FLOAT32_ATTENTION:
        out.set_attn_implementation("sdpa")  # no backward runs on the copy: bf16 attention is as fast forward
    for p in out.parameters():  # each tied parameter once
        p.data = p.data.to(dtype)
    if lora:
        copy_weights(out, model)
    return out


@torch.no_grad()
def copy_weights(dst: nn.Module, src: nn.Module) -> None:
    """``dst``'s parameters and buffers made ``src``'s, cast to ``dst``'s dtypes (the two share one architecture).
    A LoRA ``src`` (:func:`lora_layers`) is merged: each wrapped layer's weight is its base weight plus its active
    adapters' deltas, summed in float32 and rounded once into ``dst``."""
    lora = lora_layers(src)
    if lora:
        src_state = src.get_base_model().state_dict(keep_vars=True)
        modules = dict(dst.named_modules())
        for name, layer in lora.items():
            merged = layer.base_layer.weight.float()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A and not layer.merged:
                    merged = merged + layer.get_delta_weight(adapter).float()
            modules[name].weight.copy_(merged)
        for key, tensor in dst.state_dict(keep_vars=True).items():
            owner, _, leaf = key.rpartition(".")
            source = src_state[f"{owner}.base_layer.{leaf}" if owner in lora else key]
            if owner in lora and leaf == "weight":
                continue  # merged above
            if tensor.data_ptr() != source.data_ptr():
                tensor.copy_(source)
        return
    for (name, a), (other, b) in zip(dst.state_dict(keep_vars=True).items(), src.state_dict(keep_vars=True).items()):
        if name != other:
            raise ValueError(f"the generation copy's {name} met the policy's {other}: not the same architecture")
        if a.data_ptr() != b.data_ptr():
            a.copy_(b)


FLOAT32_ATTENTION = "sdpa_float32"
"""The attention implementation :func:`compute_in_half` gives a bf16 policy: transformers' SDPA on float32 inputs."""

_HALF_COMPUTE = "_agentopsd_half_compute"


def float32_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention with query, key and value upcast to float32 and the output cast back.

    Why: on a CPU the fused attention's backward in bf16 takes about twice float32's time (SmolLM2-135M, an update
    micro-batch of 8 rows: 465 against 236 ms over the 30 layers, a fifth of the whole step), and the forward is no
    faster in bf16. The projections around it, where the flops are, stay bf16."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast(query.device.type, enabled=False):  # an enclosing autocast would cast them back to bf16
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(query.dtype), weights


def _register_float32_attention() -> None:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(FLOAT32_ATTENTION, float32_sdpa)
    AttentionMaskInterface.register(FLOAT32_ATTENTION, sdpa_mask)  # the same boolean masks SDPA takes


def _enter_autocast(layer: nn.Module, args: tuple) -> None:
    context = torch.autocast(layer.base_layer.weight.device.type, dtype=layer.base_layer.weight.dtype)
    context.__enter__()
    layer.__dict__.setdefault("_agentopsd_autocast", []).append(context)


def _exit_autocast(layer: nn.Module, args: tuple, output: object) -> None:
    layer.__dict__["_agentopsd_autocast"].pop().__exit__(None, None, None)


def compute_in_half(model: nn.Module) -> bool:
    """Make a LoRA policy over a half-precision base compute in that precision (a :class:`WeightPlan` with
    ``frozen_half``); returns whether it changed anything (a model without LoRA or with a float32 base, or one done
    before, is left alone).

    - Each LoRA layer's adapters multiply in the base's dtype under autocast, and peft no longer casts the layer's
      input to the adapters' float32 first: the adapter weights, their gradients and their AdamW states stay float32
      (autocast casts a weight per forward and its gradient back), as bf16 mixed precision trains on a GPU. In float32
      the adapters' skinny matmuls and the casts around them were about a fifth of an update micro-batch.
    - Attention runs :func:`float32_sdpa` in place of SDPA (other implementations are left as chosen).

    Every forward of this model does so, the update's, the recomputed old log-probs' and the warm start's alike,
    so the on-policy ratio stays 1. A :func:`half_copy` of it (generation, teacher scoring) runs SDPA in bf16 again:
    no backward there, and its forward is as fast in bf16."""
    lora = lora_layers(model)
    if not lora or getattr(model, _HALF_COMPUTE, False):
        return False
    if next(iter(lora.values())).base_layer.weight.dtype not in (torch.bfloat16, torch.float16):
        return False  # a float32 base: its adapters compute in float32 too, as they are stored
    for layer in lora.values():
        layer.cast_input_dtype_enabled = False
        layer.register_forward_pre_hook(_enter_autocast)
        layer.register_forward_hook(_exit_autocast, always_call=True)  # an exception inside leaves no autocast on
    base = model.get_base_model()
    if base.config._attn_implementation == "sdpa":
        _register_float32_attention()
        base.set_attn_implementation(FLOAT32_ATTENTION)
    object.__setattr__(model, _HALF_COMPUTE, True)
    return True
