#!/usr/bin/env bash
# GPU check: 2 iterations in bf16 with a randomly initialized Qwen2 of about 0.5B parameters
# built from a config (no download); prints rollout and update tokens/s and peak device memory.
#   bash scripts/gpu_check.sh            (on a machine with a CUDA device)
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import time

import torch

if not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA device visible (torch.cuda.is_available() is False)")

import envs  # noqa: F401
from agentopsd.algorithms import AgentOPSD
from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig
from agentopsd.data import TaskBatch, sample_tasks
from agentopsd.module import AgentRLModule
from agentopsd.tiny import tiny_policy

env_id = "agentopsd/BabyAI-GoToLocal-v0"
# Qwen2.5-0.5B's shape: hidden 896, 24 layers, 14 heads (2 KV heads), intermediate 4864
_, tok = tiny_policy(env_id, skills="babyai", vocab_size=768)
from agentopsd.models import build_tiny_policy

model = build_tiny_policy(tok, {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864})
model = model.to(dtype=torch.bfloat16)
print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M")
module = AgentRLModule(
    model, tok, AgentOPSD(),
    EnvConfig(id=env_id, skills="babyai", max_turns=16, history_window=2),
    RolloutConfig(max_new_tokens=16), OptimConfig(lr=1e-6, num_mini_batches=2, micro_batch_size=16),
    EvalConfig(num_tasks=8), num_iterations=2,
)
module.trainer = None
module = module.to("cuda")  # moves the policy and sets module.device, which batches follow
cfg = module.configure_optimizers()
opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
module.optimizers, module.lr_schedulers = (lambda: opt), (lambda: sched)
module.manual_backward = lambda loss: loss.backward()
torch.cuda.reset_peak_memory_stats()
for it in range(2):
    batch = module.rollout(TaskBatch(it, sample_tasks(env_id, 1000, 8, 8, it, 0)))
    module.algorithm.assign(batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    metrics, _ = module.update(batch, it)
    torch.cuda.synchronize()
    print(f"iteration {it}: rollout {metrics['perf/rollout_tokens_per_s']:.0f} generated tokens/s, "
          f"update {metrics['perf/update_tokens_per_s']:.0f} tokens/s, teacher {metrics['perf/teacher_seconds']:.2f}s, "
          f"success {metrics['rollout/success']:.2f}")
print(f"peak device memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
PY
