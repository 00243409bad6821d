"""The generation protocol every backend implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import nn


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample one turn's action."""

    max_new_tokens: int = 64
    """Hard cap on generated tokens per turn."""
    temperature: float = 1.0
    """Softmax temperature; the reported log-probs are those of softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    greedy: bool = False
    """Argmax decoding (evaluation); log-probs are then reported at temperature 1."""
    stop_strings: tuple[str, ...] = ("</action>",)
    """Generation of a sequence stops once its decoded text ends with one of these (or at EOS)."""
    seed: int | None = None
    """Seed for the sampler (None = the global torch RNG)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"sampling.temperature must be > 0 (or set greedy=true), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")

    @property
    def scoring_temperature(self) -> float:
        """The temperature the trainer must use to score these tokens consistently."""
        return 1.0 if self.greedy else self.temperature


@dataclass(frozen=True)
class Generation:
    """One sequence's output."""

    token_ids: tuple[int, ...]
    """Generated tokens, through the stop string or EOS, without padding."""
    logprobs: tuple[float, ...]
    """log softmax(logits / scoring_temperature) of each generated token (before top-p truncation)."""
    text: str
    """Decoded ``token_ids`` (special tokens skipped)."""
    finish_reason: str
    """``stop`` (stop string), ``eos`` or ``length``."""


@runtime_checkable
class Generator(Protocol):
    """A generation backend. Prompts are token ids (chat template already applied)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Generation]:
        """One batched call for all prompts; returns one :class:`Generation` per prompt, in order."""
        ...

    def sync_weights(self, model: nn.Module) -> None:
        """Make the backend generate with ``model``'s current weights (after an optimizer step)."""
        ...


def release_device_cache() -> None:
    """Hand the blocks PyTorch's caching allocator keeps back to the GPU (nothing to do without CUDA).

    Why: a colocated vLLM engine sleeps and wakes through its own allocator, outside PyTorch's; blocks the
    update freed stay reserved in PyTorch's cache (the update's peak), so waking the engine beside them runs
    out of memory. TRL empties the cache right before ``wake_up``; verl on entering rollout mode.
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
