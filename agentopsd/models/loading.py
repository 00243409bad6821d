"""Loading a policy (any transformers causal LM) and building the tiny from-scratch one.

The weights check runs before ``from_pretrained``: on a machine without hub access a missing
model must fail in seconds with a message that says what to set, not after a minute of retries.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from agentopsd.models.pretrained import ModelNotFoundError
from agentopsd.models.tokenizer import IM_END, tiny_qwen2_config
from agentopsd.training.precision import (
    check_dtype,
    choose_precision,
    describe,
    loading_dtype,
    read_cpu_flags,
)

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}
LORA_KEYS = frozenset({"r", "alpha", "dropout", "target_modules"})
_PROBE_TIMEOUT_S = 5.0
_TRUE = frozenset({"1", "true", "yes", "on"})


def _offline() -> bool:
    env = any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    from huggingface_hub import constants

    return env or bool(constants.HF_HUB_OFFLINE)


def _not_found(path: str, why: str) -> ModelNotFoundError:
    from huggingface_hub import constants

    return ModelNotFoundError(
        f"model.path={path!r}: {why}. It must be a local folder with config.json and the weights, "
        f"or a hub id already in the hub cache (HF_HOME={os.environ.get('HF_HOME', '<unset>')}, "
        f"cache {constants.HF_HUB_CACHE}; HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '<unset>')}). "
        "Fix: point model.path at a downloaded folder, or download it on a machine with hub access "
        "(`hf download <id>`) and copy HF_HOME here, or unset HF_HUB_OFFLINE where the hub is "
        "reachable."
    )


def resolve_model_path(path: str) -> str:
    """A folder or hub id that ``from_pretrained`` can load without waiting on the network.

    A local folder is returned as is; a cached hub id becomes its cached snapshot folder (no
    network at all); otherwise the hub is probed once with a short timeout. A name in
    :data:`agentopsd.models.pretrained.PREPARED` (``smollm2-135m``) is its prepared cache folder, prepared on first
    use. Raises :class:`ModelNotFoundError` with a fix in the message.
    """
    if os.path.isdir(path):
        return path
    from agentopsd.models import pretrained

    if path in pretrained.PREPARED:
        return str(pretrained.prepare(path))
    from huggingface_hub import model_info, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        raise _not_found(path, "no such local folder, and not a valid hub id") from None
    cached = try_to_load_from_cache(path, "config.json")
    if isinstance(cached, str):
        return os.path.dirname(cached)
    if _offline():
        raise _not_found(path, "no such local folder, and not in the hub cache while offline")
    try:
        # One request, no retries: huggingface_hub's own download retries for ~25 s without a network.
        model_info(path, timeout=_PROBE_TIMEOUT_S)
    except Exception as exc:  # any network or hub error means the same thing to the user
        raise _not_found(path, f"no such local folder, not in the hub cache, and the hub lookup failed "
                         f"({type(exc).__name__}: {exc})") from exc
    return path


def _dtype_kwargs(dtype: str) -> dict[str, Any]:
    check_dtype(dtype)
    # transformers renamed torch_dtype to dtype in 4.56.
    name = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {name: DTYPES[dtype]}


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None) -> None:
    """Set pad = eos when the tokenizer has no pad token (Qwen base and Llama tokenizers ship none).

    Padding is always masked out, so the id only has to exist; the model config follows the tokenizer.
    """
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if model is not None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation checkpointing (works with LoRA's frozen inputs)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_lora(model: PreTrainedModel, lora: dict[str, Any]) -> PreTrainedModel:
    """Wrap ``model`` with LoRA adapters; ``lora`` = {r, alpha, dropout, target_modules}."""
    unknown = set(lora) - LORA_KEYS
    if unknown:
        raise ValueError(f"model.lora has unknown keys {sorted(unknown)}; valid keys: {sorted(LORA_KEYS)}")
    try:
        import peft
    except ImportError as exc:
        raise ImportError("model.lora needs peft: pip install 'agentopsd[lora]' (or pip install peft)") from exc
    config = peft.LoraConfig(
        r=int(lora.get("r", 16)),
        lora_alpha=int(lora.get("alpha", 32)),
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=lora.get("target_modules", "all-linear"),
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def local_rank() -> int:
    """This process's rank on its node, from the launcher's environment (Lightning, torchrun, SLURM); 0 alone."""
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def _pipeline(tokenizer_json: dict) -> dict:
    return {"normalizer": tokenizer_json.get("normalizer"), "pre_tokenizer": tokenizer_json.get("pre_tokenizer")}


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(path)``, unless that tokenizes differently from the folder's tokenizer.json.

    transformers 5 builds the tokenizer class of the model type (``Qwen2Tokenizer`` for any qwen2 config) with
    that family's own normaliser and pre-tokenizer, whatever tokenizer.json says: right for Qwen2.5's own
    tokenizer, wrong for one trained for the task (the tiny model's splits numbers its own way), whose
    exported folder would then be prompted with other token ids than in training. Such a folder is loaded as
    its tokenizer.json is written (``PreTrainedTokenizerFast``), with its tokenizer_config (chat template, specials).
    """
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    written = Path(path) / "tokenizer.json"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not written.is_file() or backend is None:
        return tokenizer
    if _pipeline(json.loads(backend.to_str())) == _pipeline(json.loads(written.read_text())):
        return tokenizer
    log.info("%s: %s builds another pre-tokenizer than tokenizer.json; loading tokenizer.json as written", path, type(tokenizer).__name__)
    return PreTrainedTokenizerFast.from_pretrained(path)


def load_policy(
    path: str,
    *,
    dtype: str = "auto",
    gradient_checkpointing: bool = False,
    lora: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    meta_on_other_ranks: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local folder or hub id (see :func:`resolve_model_path`).

    ``dtype``: float32, bfloat16, float16 or auto: on a CPU bf16 where the processor computes it natively, else
    float32; on a GPU the checkpoint's (:func:`agentopsd.training.precision.choose_precision`, said in one log line; a LoRA
    base then loads in bf16, full fine-tuning's master weights in float32). Gradient checkpointing is the
    non-reentrant kind (works with LoRA's frozen inputs). A tokenizer without a pad token gets
    pad = eos (:func:`ensure_pad_token`).

    ``meta_on_other_ranks`` (FSDP2 only, ``trainer=fsdp``): only a node's local rank 0 reads the
    weights; the node's other processes build the model on the meta device (no host memory), and
    after sharding rank 0 broadcasts the weights into every rank's shards
    (:func:`agentopsd.training.strategies.fill_from_rank0`): one copy of the weights per node in host memory, not one per process.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where auto is decided: this machine
    choice = choose_precision(dtype, device, read_cpu_flags())
    log.info("%s", describe(choice, dtype, lora=lora is not None, device=device))
    kwargs = _dtype_kwargs(loading_dtype(choice, dtype, lora=lora is not None))
    resolved = resolve_model_path(path)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    tokenizer = load_tokenizer(resolved, trust_remote_code=trust_remote_code)
    if meta_on_other_ranks and local_rank() != 0:
        model = build_on_meta(resolved, trust_remote_code=trust_remote_code, **kwargs)
        log.info("local rank %d: policy %s built on the meta device (its weights come from rank 0 after sharding)", local_rank(), path)
    else:
        model = AutoModelForCausalLM.from_pretrained(resolved, trust_remote_code=trust_remote_code, **kwargs)
    ensure_pad_token(tokenizer, model)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if lora is not None:
        model = apply_lora(model, lora)
    log.info("loaded policy %s (%s) with %d parameters", path, resolved, sum(p.numel() for p in model.parameters()))
    return model, tokenizer


def _checkpoint_dtype(config: transformers.PretrainedConfig, resolved: str) -> torch.dtype:
    """The dtype ``from_pretrained(dtype="auto")`` picks from config.json (from_config takes no "auto")."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)  # renamed in 4.56
    if isinstance(value, str):
        value = getattr(torch, value, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"model.dtype=auto with model.meta_on_other_ranks=true: {resolved}/config.json names no "
                         "dtype for the ranks built on the meta device; set model.dtype explicitly")
    return value


def build_on_meta(resolved: str, *, trust_remote_code: bool = False, **kwargs: Any) -> PreTrainedModel:
    """The model ``from_pretrained(resolved, **kwargs)`` makes, without its weights: parameters and
    buffers on the meta device (no memory), to be filled after sharding
    (:func:`agentopsd.training.strategies.fill_from_rank0`).

    The rest must match rank 0's ``from_pretrained`` model, since every rank generates with its own:
    the folder's generation config (its eos ids end rollouts, its sampling defaults), eval mode, and
    the checkpoint's dtype for ``dtype=auto`` (the broadcast would silently cast into another dtype).
    """
    config = transformers.AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    kwargs = {k: _checkpoint_dtype(config, resolved) if k in ("dtype", "torch_dtype") and v == "auto" else v
              for k, v in kwargs.items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
    if model.can_generate():
        try:
            model.generation_config = transformers.GenerationConfig.from_pretrained(resolved)
        except OSError:  # no generation_config.json: from_pretrained keeps the one from config.json too
            pass
    return model.eval()


def build_tiny_policy(
    tokenizer: PreTrainedTokenizerBase,
    config_overrides: dict[str, Any] | None = None,
    seed: int = 0,
) -> PreTrainedModel:
    """A from-scratch ``Qwen2ForCausalLM`` sized for ``tokenizer`` (see ``tiny_qwen2_config``).

    The initialisation depends only on ``seed`` (the global RNG is left untouched). eos is the
    tokenizer's eos; generation also stops at ``<|im_end|>`` when the vocabulary has it, as
    Qwen2.5-Instruct's generation config does.
    """
    ensure_pad_token(tokenizer)
    config = tiny_qwen2_config(
        len(tokenizer),
        **(config_overrides or {}),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    set_chat_stops(model, tokenizer)
    return model


def set_chat_stops(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Generation stops at the tokenizer's eos and, when the vocabulary has it, at ``<|im_end|>``,
    as Qwen2.5-Instruct's generation config lists both."""
    eos_ids = [tokenizer.eos_token_id]
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end not in eos_ids:
        eos_ids.append(im_end)
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
