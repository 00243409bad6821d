"""Process settings that must be in place before vLLM or torch is imported; this module imports neither.

The vLLM scripts and benchmarks call :func:`set_vllm_defaults` first thing, right after putting the checkout on
``sys.path``. Every value is a default: one the caller's environment already holds wins.
"""

from __future__ import annotations

import os

VLLM_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU: the default takes GiBs
    "VLLM_NO_USAGE_STATS": "1",  # no usage reporting
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",  # models come from local folders; nothing outside is reached
    "TOKENIZERS_PARALLELISM": "false",
    # this process's torch work shares the cores with the engine's worker process: libgomp's default
    # spin-waiting made both 10-40x slower on 2 busy cores
    "OMP_WAIT_POLICY": "PASSIVE",
}


def set_vllm_defaults(**extra: str) -> None:
    """``os.environ.setdefault`` for each of ``VLLM_DEFAULTS`` and ``extra`` (``extra`` wins over the defaults)."""
    for key, value in {**VLLM_DEFAULTS, **extra}.items():
        os.environ.setdefault(key, value)
