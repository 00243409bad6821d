"""The memory plan counts the asynchronous rollout worker (``rollout.max_staleness`` >= 1) where it lives: its bf16
policy copy, its engine (never asleep) and its weight-staging buckets, on the trainer's GPU beside every phase or on a
GPU of its own (``rollout.devices``), with one line per GPU."""

from __future__ import annotations

import pytest

from agentopsd.tools import memory
from agentopsd.tools.architecture import QWEN25
from agentopsd.tools.memory import GIB, RUNTIME_MARGIN_BYTES, compose_config, plan_memory
from agentopsd.tools.worker_memory import MIB, STAGING_BUCKET_BYTES

ALFWORLD_3B_DDP = ["+experiment=alfworld_3b", "trainer=ddp", "trainer.devices=1"]
ALFWORLD_7B_ROLLOUT_GPUS = ["+experiment=alfworld_7b", "trainer.devices=4", "rollout.max_staleness=1", "rollout.devices=[4,5,6,7]"]


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    # the plan must not depend on the machine the tests run on
    monkeypatch.setattr(memory, "_cuda_device_count", lambda: 1)
    monkeypatch.setattr(memory, "_cuda_available", lambda: False)


def test_a_worker_beside_its_trainer_is_counted_in_every_phase_by_hand():
    """alfworld_3b under DDP on one 80 GiB GPU with k = 1: the lockstep plan says 79.65 GiB "fits"; the worker adds its
    bf16 policy copy, vLLM's whole share (it never sleeps), one 256 MiB receive bucket (the 594 MiB embedding travels
    in pieces) and its own CUDA context, to every phase. Planted defect: the
    plan without the worker (the old one) fits in 79.65 GiB."""
    lockstep = plan_memory(compose_config(ALFWORLD_3B_DDP), gpu_memory_gib=80)
    plan = plan_memory(compose_config([*ALFWORLD_3B_DDP, "rollout.max_staleness=1"]), gpu_memory_gib=80)
    params = QWEN25["qwen/qwen2.5-3b"].parameters
    staging = 256 * MIB
    assert STAGING_BUCKET_BYTES == staging
    worker = params * 2 + int(0.4 * 80 * GIB) + staging + RUNTIME_MARGIN_BYTES
    assert plan.worker is not None and not plan.worker.own_gpu
    assert plan.worker.total == plan.colocated_worker == worker
    assert {p: v - lockstep.phases[p] for p, v in plan.phases.items()} == dict.fromkeys(lockstep.phases, worker)
    assert lockstep.total <= lockstep.gpu_memory < plan.total  # 79.65 GiB "fits"; 119.65 GiB with the worker
    assert not plan.fits
    report = plan.report()
    assert "worker vLLM share (gpu_memory_utilization; never asleep), on the trainer's GPU" in report
    assert "GPU 0: trainer local rank 0 + its rollout worker" in report and "DOES NOT FIT" in report
    assert "rollout.devices=[...]" in plan.warnings[0] and "rollout.max_staleness=0" in plan.warnings[0]


def test_the_7b_plan_with_rollout_gpus_plans_each_gpu():
    """The issue's command: trainer ranks on GPUs 0-3 as in lockstep (no worker there), each worker on GPUs 4-7 with its
    policy copy, vLLM share and its 256 MiB receive bucket."""
    plan = plan_memory(compose_config(ALFWORLD_7B_ROLLOUT_GPUS), gpu_memory_gib=80)
    lockstep = plan_memory(compose_config(ALFWORLD_7B_ROLLOUT_GPUS[:2]), gpu_memory_gib=80)
    assert plan.phases == lockstep.phases and plan.colocated_worker == 0
    assert plan.trainer_gpus == (0, 1, 2, 3) and plan.worker_gpus == (4, 5, 6, 7)
    w = plan.worker
    assert w.own_gpu and w.policy_dtype == "bfloat16" and w.policy_copy == QWEN25["qwen/qwen2.5-7b"].parameters * 2
    assert w.engine == int(0.4 * 80 * GIB) and w.staging == 256 * MIB and w.margin == RUNTIME_MARGIN_BYTES
    report = plan.report()
    assert "memory plan per trainer GPU (GPUs 0, 1, 2, 3)" in report
    assert "memory plan per rollout worker GPU (GPUs 4, 5, 6, 7, rollout.devices)" in report
    gpu_lines = [line.strip() for line in report.splitlines() if line.strip().startswith("GPU ")]
    assert [line.split(":")[0] for line in gpu_lines] == [f"GPU {g}" for g in range(8)]
    assert all("trainer local rank" in line for line in gpu_lines[:4])
    assert all("rollout worker of local rank" in line for line in gpu_lines[4:])
    assert plan.fits


def test_the_staging_cap_is_a_parameter_and_a_flag(capsys):
    """One 256 MiB bucket by default; another cap counts one of it (never more than the whole bf16 model)."""
    cfg = compose_config(["+experiment=alfworld_7b", "trainer.devices=4", "rollout.max_staleness=1", "rollout.devices=[4]"])
    assert plan_memory(cfg, staging_bucket_bytes=2 * GIB).worker.staging == 2 * GIB
    assert plan_memory(cfg, staging_bucket_bytes=1 * MIB).worker.staging == 1 * MIB
    assert plan_memory(cfg, staging_bucket_bytes=10**6 * GIB).worker.staging == QWEN25["qwen/qwen2.5-7b"].parameters * 2
    memory.main([*ALFWORLD_7B_ROLLOUT_GPUS, "--staging-bucket-mib", "2048", "--gpu-memory-gib", "80"])
    out = capsys.readouterr().out
    assert "worker weight staging (1 bucket, 2048 MiB cap), on its own GPU" in out
    assert "    2.00 GiB" in out


def test_a_transformers_worker_counts_its_kv_cache_for_the_rows_it_generates():
    """rollout=hf: the KV cache of this rank's 16 x 8 episodes (2 ranks: 64 rows) at 2,560 tokens, 36 layers, K and V of
    2 heads x 128 in bf16, plus one 8,192-token prefill chunk's MLP and one decode step's logits."""
    cfg = compose_config(["+experiment=alfworld_3b", "trainer.devices=2", "rollout=hf", "rollout.max_new_tokens=512",
                          "rollout.max_staleness=1", "rollout.devices=[2,3]"])
    w = plan_memory(cfg, gpu_memory_gib=80).worker
    assert w.backend == "hf" and w.generating_rows == 64
    kv = 64 * 2560 * 36 * 2 * 256 * 2
    assert w.engine == kv + 8192 * (2 * 2048 + 3 * 11008) * 2 + 64 * 151936 * 10


def test_the_plans_bucket_is_the_one_the_push_sends():
    from agentopsd.rollout.weight_transport import BUCKET_BYTES

    assert STAGING_BUCKET_BYTES == BUCKET_BYTES


def test_lockstep_plans_no_worker():
    plan = plan_memory(compose_config(ALFWORLD_3B_DDP), gpu_memory_gib=80)
    assert plan.worker is None and plan.colocated_worker == 0
    assert "per GPU (each node)" not in plan.report()
