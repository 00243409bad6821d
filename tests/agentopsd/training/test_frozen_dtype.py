"""On a GPU outside FSDP2 the frozen weights stay in the half dtype they load in, as the memory plan counts them: the KL
reference is not upcast to the policy's float32 master weights, and a LoRA base is not upcast beside its float32
adapters. The GPU's decision is forced through :func:`agentopsd.training.precision.weight_plan` (``device="cuda"``)
and the module then runs on CPU: no CUDA needed. CPU plans are unchanged."""

from __future__ import annotations

import pytest
import torch

from agentopsd.credit.algorithms import AgentOPSD
from agentopsd.models.loading import apply_lora
from agentopsd.tools.memory import compose_config, plan_memory
from agentopsd.training import precision
from agentopsd.training.precision import FLOAT32_PLAN, PrecisionChoice, WeightPlan, weight_plan
from tests.agentopsd.training.test_module import fit, make_module

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
GPU_RUN = ["+experiment=babyai_tiny", "trainer=gpu", "algorithm.kl_coef=0.01", "+model.dtype=bfloat16"]
"""A tiny run aimed at one GPU (bf16-mixed, no FSDP), its weights loaded in bf16 as the Qwen configs load them."""


@pytest.mark.parametrize("requested", ["bfloat16", "auto", "float32"])
def test_a_gpu_without_fsdp_keeps_the_frozen_weights_as_loaded(requested):
    choice = precision.choose_precision(requested, "cuda", frozenset())
    for trainer_precision in ("bf16-mixed", "32-true", "bf16-true"):
        for lora in (True, False):
            plan = weight_plan(choice, device="cuda", trainer_precision=trainer_precision, lora=lora, sharded=False)
            assert plan == WeightPlan(frozen_as_loaded=True)
            assert not plan.half_rollout  # the policy itself generates: the rollout's numerics are unchanged
    # FSDP2 shards the policy and never upcasts the reference (nor, under bf16-mixed, a LoRA base): unchanged
    assert weight_plan(choice, device="cuda", trainer_precision="bf16-mixed", lora=True, sharded=True) == FLOAT32_PLAN


def test_cpu_plans_are_unchanged():
    bf16, fp32 = PrecisionChoice("bfloat16", ""), PrecisionChoice("float32", "")
    cpu = {"device": "cpu", "trainer_precision": "32-true", "sharded": False}
    assert weight_plan(bf16, **cpu, lora=True) == WeightPlan(frozen_half=True, generation_dtype=torch.bfloat16)
    assert weight_plan(fp32, **cpu, lora=True) == FLOAT32_PLAN
    assert weight_plan(bf16, **{**cpu, "trainer_precision": "bf16-mixed"}, lora=False) == FLOAT32_PLAN


def _frozen(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if not p.requires_grad}


def _trainable(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if p.requires_grad}


def _gpu_module(tiny_walk_policy, overrides: list[str], *, lora: bool):
    """The module of a GPU run's weight plan (from its config, as ``from_config`` takes it) over the tiny policy loaded in
    bf16, fitted one iteration on CPU; and the memory plan of the same config."""
    cfg = compose_config([*GPU_RUN, *overrides])
    model, tokenizer = tiny_walk_policy
    model = model.to(torch.bfloat16)
    if lora:
        model = apply_lora(model, LORA)
    module = make_module((model, tokenizer), algorithm=AgentOPSD(kl_coef=0.01), iterations=1)
    module.weight_plan = precision.plan_for_config(cfg)
    assert module.weight_plan.frozen_as_loaded  # trainer=gpu: the GPU's decision, here on CPU
    fit(module, 1)
    return module, plan_memory(cfg, gpu_memory_gib=80)


def test_the_reference_stays_bf16_beside_float32_master_weights_as_the_plan_counts(tiny_walk_policy):
    """Full fine-tuning: float32 master weights, the reference bf16. Planted defect: place_reference without
    keep_half (the float32 upcast) makes the reference float32, twice what the plan counts."""
    module, plan = _gpu_module(tiny_walk_policy, [], lora=False)
    assert _trainable(module.model) == {torch.float32}
    assert {p.dtype for p in module.ref_model.parameters()} == {torch.bfloat16}
    assert plan.reference_dtype == "bfloat16" and plan.param_dtype == "float32"
    assert plan.reference == plan.architecture.parameters * 2  # bf16 bytes, whole on the one GPU


def test_a_lora_base_and_its_reference_stay_bf16_and_the_adapters_and_their_states_float32(tiny_walk_policy):
    """LoRA: the frozen base bf16, the adapters and their AdamW states float32, the reference's base bf16; the plan counts
    the base and the reference in bf16. Planted defect: configure_model without frozen_as_loaded upcasts the base."""
    module, plan = _gpu_module(tiny_walk_policy, [f"+model.lora={{r: {LORA['r']}, alpha: {LORA['alpha']}}}"], lora=True)
    assert _frozen(module.model) == {torch.bfloat16}
    assert _trainable(module.model) == {torch.float32}
    opt = module.optimizers().optimizer
    assert {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    ref_base = {p.dtype for n, p in module.ref_model.named_parameters() if "lora_" not in n}
    assert ref_base == {torch.bfloat16}
    assert plan.frozen_dtype == "bfloat16" and plan.reference_dtype == "bfloat16"
    assert plan.weights == plan.architecture.parameters * 2  # the frozen base in bf16, not 4 bytes a weight
