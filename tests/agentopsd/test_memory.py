"""The memory plan: numbers against hand arithmetic, shapes against transformers, warnings, the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from agentopsd import memory
from agentopsd.memory import GIB, QWEN25, MemoryPlan, architecture_of, compose_config, plan_memory

ROOT = Path(__file__).resolve().parents[2]
PAPER_EXPERIMENTS = [f"{env}_{size}" for env in ("alfworld", "webshop", "searchqa") for size in ("3b", "7b")]


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    # the plan must not depend on the machine the tests run on
    monkeypatch.setattr(memory, "_cuda_device_count", lambda: 1)
    monkeypatch.setattr(memory, "_cuda_available", lambda: False)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # the published sizes: 0.49B, 1.54B, 3.09B, 7.62B
        ("qwen/qwen2.5-0.5b", 494_032_768),
        ("qwen/qwen2.5-1.5b", 1_543_714_304),
        ("qwen/qwen2.5-3b", 3_085_938_688),
        ("qwen/qwen2.5-7b", 7_615_616_512),
    ],
)
def test_table_shapes_count_what_transformers_builds(name: str, expected: int) -> None:
    arch = QWEN25[name]
    assert arch.parameters == expected
    config = transformers.Qwen2Config(
        hidden_size=arch.hidden_size, num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads, intermediate_size=arch.intermediate_size, vocab_size=arch.vocab_size,
        tie_word_embeddings=arch.tie_word_embeddings,
    )
    with torch.device("meta"):  # shapes only: no memory
        model = transformers.Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_the_7b_arithmetic_by_hand() -> None:
    """Qwen2.5-7B, webshop_7b on 8 devices, bf16-mixed with float32 master weights, 80 GiB GPUs, with the
    public runs' KL penalty (0.01) and entropy bonus (0.001) pinned here."""
    cfg = compose_config(["+experiment=webshop_7b", "trainer.devices=8", "trainer.precision=bf16-mixed", "model.dtype=float32",
                          "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.001"])
    plan = plan_memory(cfg, gpu_memory_gib=80)
    h, layers, kv_dim, inter, vocab = 3584, 28, 4 * 128, 18944, 152064
    layer = (h * h + h) + 2 * (h * kv_dim + kv_dim) + h * h + 3 * h * inter + 2 * h  # q, k, v (biased), o, MLP, 2 norms
    assert layer == 233_057_792
    root = 2 * vocab * h + h  # untied embeddings and head, final norm
    params = layers * layer + root
    assert params == 7_615_616_512
    assert plan.weights == params * 4 // 8 == 3_807_808_256  # float32 master weights over 8 shards
    assert plan.gradients == 3_807_808_256
    assert plan.optimizer == 2 * 3_807_808_256  # exp_avg + exp_avg_sq
    # FSDP2: root params + root grads kept whole; 2 layers' params + 1 layer's gradient, float32
    assert plan.gathered == (2 * root + 3 * layer) * 4 == 11_516_680_192
    tokens = 4 * (2048 + 512)  # micro_batch_size x (max_prompt_tokens + max_new_tokens)
    per_token = 6 * h + 2 * kv_dim + 4 * inter  # 98,304 values a layer saves per token
    # checkpointed: each layer's bf16 input, plus one layer recomputed and its gradients
    assert plan.activations == layers * tokens * h * 2 + 2 * tokens * per_token * 2 == 6_081_740_800
    # the head runs at the 4 x 512 action positions only (sharded too: logits_to_keep): bf16 logits + bf16
    # gradient, a float32 copy + its gradient (8 bytes), and the entropy's log-softmax, probabilities and
    # gradient (12 bytes)
    actions = 4 * 512
    assert plan.logits == vocab * (actions * 2 * 2 + actions * 8 + actions * 12) == 7_474_249_728
    assert plan.reference == params * 4 // 8 == 3_807_808_256  # the frozen copy as loaded (float32), sharded like the policy
    # the literals below are worked by hand from the sizes above, not from the plan's formulas:
    assert plan.vllm == 34_359_738_368  # rollout.vllm.gpu_memory_utilization 0.4 of 80 GiB = 32 x 2**30
    assert plan.vllm_weights == 15_231_233_024  # vLLM's bf16 copy: 7,615,616,512 x 2 bytes
    assert plan.margin == 2_147_483_648  # 2 GiB
    # the sync: two full bf16 copies of the largest weight, the 152,064 x 3,584 embedding (or head):
    # 544,997,376 values x 2 bytes x 2 copies
    assert plan.sync_temporary == 2_179_989_504
    # update: weights 3,807,808,256 + gradients 3,807,808,256 + AdamW 7,615,616,512 + gathered 11,516,680,192
    #   + activations 6,081,740,800 + logits 7,474,249,728 + reference 3,807,808,256 = 44,111,712,000,
    #   + vLLM asleep 1 GiB (1,073,741,824) + margin 2 GiB (2,147,483,648) = 47,332,937,472
    # resident between updates: weights + AdamW + reference + margin = 15,231,233,024 + 2,147,483,648 = 17,378,716,672
    # sync: resident + vLLM's bf16 weights 15,231,233,024 + 2,179,989,504 = 34,789,939,200
    # rollout: resident + vLLM's 34,359,738,368 = 51,738,455,040 (the peak; / 2**30 = 48.186)
    assert plan.sleep_mode and plan.phases == {"update": 47_332_937_472, "sync": 34_789_939_200, "rollout": 51_738_455_040}
    assert plan.total == 51_738_455_040
    assert round(plan.total / GIB, 2) == 48.19
    assert plan.warnings == []  # fits
    report = plan.report()
    assert "7.62B parameters" in report and "FSDP2 over 8 device(s)" in report and "48.19 GiB of 80.00 GiB" in report
    # without sleep mode vLLM's share sits beside the update, as before
    awake = plan_memory(compose_config(["+experiment=webshop_7b", "trainer.devices=8", "trainer.precision=bf16-mixed",
                                        "model.dtype=float32", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.001",
                                        "rollout.vllm.enable_sleep_mode=false"]), gpu_memory_gib=80)
    # 44,111,712,000 (the update above) + vLLM awake 34,359,738,368 + margin 2,147,483,648
    expected_total = 80_618_934_016
    assert not awake.sleep_mode and awake.total == expected_total and round(awake.total / GIB, 2) == 75.08
    # the shipped setting loads bf16 weights: the reference copy is bf16, the master weights float32
    shipped = plan_memory(compose_config(["+experiment=webshop_7b", "trainer.devices=8", "rollout.vllm.enable_sleep_mode=false"]), 80)
    assert shipped.param_dtype == "float32" and shipped.reference == params * 2 // 8
    # the float32 reference (3,807,808,256 over 8 shards) becomes bf16: 7,615,616,512 x 2 / 8 = 1,903,904,128
    assert shipped.phases["update"] == 80_618_934_016 - 3_807_808_256 + 1_903_904_128


def test_alfworld_3b_fits_one_80_gib_gpu_with_sleep_mode_and_not_without() -> None:
    """Issue 28: 99.44 GiB planned with vLLM awake through the update; sleep mode frees its 32 GiB there."""
    plan = plan_memory(compose_config(["+experiment=alfworld_3b", "trainer.devices=1"]), gpu_memory_gib=80)
    assert plan.sleep_mode and plan.total <= 80 * GIB and plan.warnings == []
    assert max(plan.phases, key=plan.phases.get) == "rollout"  # vLLM's share beside weights, AdamW, reference
    assert "fits" in plan.report() and "wakes its weights for the sync" in plan.report()
    awake = plan_memory(compose_config(["+experiment=alfworld_3b", "trainer.devices=1", "rollout.vllm.enable_sleep_mode=false"]),
                        gpu_memory_gib=80)
    assert awake.total > 80 * GIB and "enable_sleep_mode=auto" in awake.warnings[0]


def test_bf16_true_halves_the_state_and_ddp_shards_nothing() -> None:
    bf16 = plan_memory(compose_config(["+experiment=alfworld_3b", "trainer.devices=4", "trainer.precision=bf16-true"]), 80)
    assert (bf16.param_dtype, bf16.compute_dtype) == ("bfloat16", "bfloat16")
    assert bf16.weights == -(-3_085_938_688 * 2 // 4)
    ddp = plan_memory(compose_config(["+experiment=alfworld_3b", "trainer=ddp", "trainer.devices=4", "model.dtype=float32"]), 80)
    assert ddp.strategy == "ddp" and ddp.weights == 3_085_938_688 * 4  # whole on each device
    assert ddp.gathered == ddp.gradients  # DDP's gradient buckets
    assert ddp.head_positions == 4 * 512  # the head runs only before action tokens when not sharded


@pytest.mark.parametrize(
    ("precision", "dtype", "expected"),
    [
        ("bf16-true", "float32", ("bfloat16", "bfloat16")),
        ("bf16-mixed", "float32", ("float32", "bfloat16")),
        ("bf16-mixed", "bfloat16", ("float32", "bfloat16")),  # bf16 weights are upcast to float32 master weights
        ("32-true", "float32", ("float32", "float32")),
        ("32-true", "auto", ("float32", "float32")),  # Qwen2.5 checkpoints ship bf16; upcast for training
    ],
)
def test_precision_and_model_dtype(precision: str, dtype: str, expected: tuple[str, str]) -> None:
    assert memory._param_and_compute_dtype(memory._precision(precision), dtype, "bfloat16") == expected


def test_warns_when_it_cannot_fit_and_names_the_fixes() -> None:
    no_kl = ["algorithm.kl_coef=0", "algorithm.entropy_coef=0"]  # the reference copy does not shrink with devices
    cfg = compose_config(["+experiment=webshop_7b", "trainer.devices=1", "trainer.precision=bf16-mixed", "model.dtype=float32",
                          *no_kl])
    plan = plan_memory(cfg, gpu_memory_gib=80)
    assert plan.total > 80 * GIB
    (warning,) = plan.warnings
    assert "the GPU has 80.00 GiB" in warning
    for fix in ("trainer.devices x trainer.num_nodes >= ", "optim.micro_batch_size", "rollout.vllm.gpu_memory_utilization"):
        assert fix in warning
    assert "DOES NOT FIT" in plan.report()
    # the suggested device count is the smallest that fits
    need = int(re.search(r"trainer.num_nodes >= (\d+)", warning).group(1))

    def total(devices: int) -> int:
        return plan_memory(compose_config(["+experiment=webshop_7b", f"trainer.devices={devices}", "trainer.precision=bf16-mixed",
                                           "model.dtype=float32", *no_kl]), gpu_memory_gib=80).total

    assert total(need) <= 80 * GIB < total(need - 1)


def test_warns_when_vllm_share_cannot_hold_its_weights() -> None:
    cfg = compose_config(["+experiment=webshop_7b", "trainer.devices=8", "rollout.vllm.gpu_memory_utilization=0.1"])
    warnings = plan_memory(cfg, gpu_memory_gib=80).warnings
    assert any("less than its 14.19 GiB of weights" in w for w in warnings)


def test_reads_a_local_folder_config_json(tmp_path: Path) -> None:
    from agentopsd.tokenizer import tiny_qwen2_config

    config = tiny_qwen2_config(300, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    arch, why = architecture_of({"path": str(tmp_path)})
    assert why == "" and arch is not None and arch.tie_word_embeddings
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    assert arch.parameters == sum(p.numel() for p in model.parameters())
    untied = tiny_qwen2_config(300, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, tie_word_embeddings=False)
    untied.save_pretrained(tmp_path)  # transformers may leave the class default (untied) out of the file
    arch, _ = architecture_of({"path": str(tmp_path)})
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(untied)
    assert not arch.tie_word_embeddings and arch.parameters == sum(p.numel() for p in model.parameters())


def test_unknown_model_says_so_without_crashing() -> None:
    plan = plan_memory(compose_config(["+experiment=webshop_7b", "model.path=/nowhere/my-model"]), 80)
    assert plan.architecture is None and plan.total == 0 and plan.warnings == []
    assert "no estimate for /nowhere/my-model" in plan.report() and "neither a local folder" in plan.report()


def test_tiny_model_from_its_config_keys() -> None:
    cfg = compose_config(["experiment=quickstart"])
    plan = plan_memory(cfg, 80)
    assert plan.architecture is not None and plan.architecture.hidden_size == cfg.model.hidden_size
    assert plan.architecture.num_layers == cfg.model.num_layers and plan.strategy == "single"
    assert plan.param_dtype == "float32" and plan.vllm == 0


def test_print_memory_plan_only_for_gpu_runs_and_rank_zero(capsys, monkeypatch) -> None:
    cpu = compose_config(["experiment=quickstart"])
    assert memory.print_memory_plan(cpu) is None and capsys.readouterr().out == ""
    gpu = compose_config(["+experiment=webshop_3b", "trainer.accelerator=gpu", "trainer.devices=2"])
    assert isinstance(memory.print_memory_plan(gpu), MemoryPlan)
    assert "memory plan per GPU: Qwen/Qwen2.5-3B-Instruct" in capsys.readouterr().out
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert memory.print_memory_plan(gpu) is not None and capsys.readouterr().out == ""


@pytest.mark.parametrize("experiment", PAPER_EXPERIMENTS)
def test_cli_plans_every_paper_experiment(experiment: str, capsys) -> None:
    assert memory.main([f"+experiment={experiment}", "trainer.devices=8", "--gpu-memory-gib", "141"]) == 0
    out = capsys.readouterr().out
    size = "7.62B" if experiment.endswith("7b") else "3.09B"
    assert f"({size} parameters, built-in Qwen2.5 table), FSDP2 over 8 device(s)" in out
    # the rollout is the peak (sleep mode): float32 weights + AdamW over 8 shards, the bf16 reference over 8,
    # 2 GiB margin and vLLM's 0.4 x 141 GiB = 60,559,038,873 bytes.
    # 7B: 3,807,808,256 x 3 + 1,903,904,128 + 2,147,483,648 + 60,559,038,873 = 76,033,851,417 = 70.81 GiB
    # 3B: 1,542,969,344 x 3 + 771,484,672 + 2,147,483,648 + 60,559,038,873 = 68,106,915,225 = 63.43 GiB
    total = "70.81" if experiment.endswith("7b") else "63.43"
    assert f" {total} GiB of 141.00 GiB (--gpu-memory-gib): fits\n" in out


def test_cli_runs_as_a_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentopsd.memory", "+experiment=webshop_7b", "trainer.devices=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "DOES NOT FIT" in proc.stdout and "WARNING: memory plan" in proc.stdout
