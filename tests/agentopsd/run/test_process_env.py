"""The vLLM preamble sets its defaults without importing torch (it must run before torch loads)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_set_vllm_defaults_imports_no_torch_and_keeps_what_the_caller_set():
    code = ("import os, sys; os.environ['HF_HUB_OFFLINE'] = '0'; from agentopsd.run.process_env import set_vllm_defaults; "
            "set_vllm_defaults(VLLM_CPU_OMP_THREADS_BIND='nobind'); assert 'torch' not in sys.modules and 'vllm' not in "
            "sys.modules; print(os.environ['HF_HUB_OFFLINE'], os.environ['VLLM_CPU_KVCACHE_SPACE'], "
            "os.environ['OMP_WAIT_POLICY'], os.environ['VLLM_CPU_OMP_THREADS_BIND'])")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "OMP_WAIT_POLICY", "VLLM_CPU_OMP_THREADS_BIND")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.split()
    assert out == ["0", "1", "PASSIVE", "nobind"]
