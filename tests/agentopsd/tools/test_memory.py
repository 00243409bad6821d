"""The memory plan: numbers against hand arithmetic, shapes against transformers, warnings, the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from agentopsd.tools import memory
from agentopsd.tools.architecture import QWEN25, architecture_of
from agentopsd.tools.memory import GIB, MemoryPlan, compose_config, measure_cpu_peak, plan_memory

ROOT = Path(__file__).resolve().parents[3]
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
    # the unchunked LM head and the 4-row micro-batches (no token budget) of the arithmetic below; the levers after it
    unchunked = ["optim.logits_chunk_tokens=0", "optim.max_tokens_per_micro_batch=0"]
    cfg = compose_config(["+experiment=webshop_7b", "trainer.devices=8", "trainer.precision=bf16-mixed", "model.dtype=float32",
                          "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.001", *unchunked])
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
    # bf16 copies under bf16-mixed (FSDP2 gathers and computes gradients in bf16): the root and two layers, with
    # gradients for the root and one layer (float32 was the old count, 2x over)
    assert plan.gathered == (2 * root + 3 * layer) * 2 == 5_758_340_096
    tokens = 4 * (2048 + 512)  # micro_batch_size x (max_prompt_tokens + max_new_tokens)
    per_token = 8 * h + 2 * kv_dim + 4 * inter  # 105,472 values a layer saves per token
    outside = h + 2 * 128  # the final norm's output, RoPE's cos and sin (head dim 128): 3,840
    # checkpointed: each layer's bf16 input, plus one layer recomputed and its gradients, and what is outside the layers
    assert plan.activations == layers * tokens * h * 2 + 2 * tokens * per_token * 2 + tokens * outside * 2 == 6_453_985_280
    # the head runs at the 4 x 512 action positions only (sharded too: logits_to_keep): 16 bytes per logit for the
    # log-probs (the float32 copy the logsumexp keeps, then the backward's float32 gradients) and 8 for the
    # entropy's float32 log-softmax and probabilities (measured: test_bytes_per_logit_are_what_the_scorer_holds)
    actions = 4 * 512
    assert plan.head_positions == actions
    assert plan.logits == vocab * actions * (16 + 8) == 7_474_249_728
    assert plan.reference == params * 4 // 8 == 3_807_808_256  # the frozen copy as loaded (float32), sharded like the policy
    # the literals below are worked by hand from the sizes above, not from the plan's formulas:
    assert plan.vllm == 34_359_738_368  # rollout.vllm.gpu_memory_utilization 0.4 of 80 GiB = 32 x 2**30
    assert plan.vllm_weights == 15_231_233_024  # vLLM's bf16 copy: 7,615,616,512 x 2 bytes
    assert plan.margin == 2_147_483_648  # 2 GiB
    # the sync: two full bf16 copies of the largest weight, the 152,064 x 3,584 embedding (or head):
    # 544,997,376 values x 2 bytes x 2 copies
    assert plan.sync_temporary == 2_179_989_504
    # update: weights 3,807,808,256 + gradients 3,807,808,256 + AdamW 7,615,616,512 + gathered 5,758,340,096
    #   + activations 6,453,985,280 + logits 7,474,249,728 + reference 3,807,808,256 = 38,725,616,384,
    #   + vLLM asleep 1 GiB (1,073,741,824) + margin 2 GiB (2,147,483,648) = 41,946,841,856
    # resident between updates: weights + AdamW + reference + margin = 15,231,233,024 + 2,147,483,648 = 17,378,716,672
    # sync: resident + vLLM's bf16 weights 15,231,233,024 + 2,179,989,504 = 34,789,939,200
    # rollout: resident + vLLM's 34,359,738,368 = 51,738,455,040 (the peak; / 2**30 = 48.186)
    # optimizer step: weights + gradients + AdamW 15,231,233,024 + foreach AdamW's sqrt(exp_avg_sq) 3,807,808,256
    #   + reference 3,807,808,256 + vLLM asleep + margin 3,221,225,472 = 26,068,075,008
    assert plan.step_temporary == 3_807_808_256
    # scoring (no gradient, whole-model passes of 4 x 2,560 tokens): the root and 2 layers gathered in bf16
    #   (1,089,998,336 + 2 x 233,057,792) x 2 = 3,112,227,840, one layer's MLP 10,240 x (2 x 3,584 + 3 x 18,944) x 2
    #   = 1,310,720,000, the action positions' hidden states 2,048 x 3,584 x 2 = 14,680,064 and the head's bf16
    #   logits, float32 copy and logsumexp temporary 2,048 x 152,064 x 10 = 3,114,270,720: 7,551,898,624;
    #   + weights, AdamW, reference and margin 17,378,716,672 + vLLM asleep 1,073,741,824 = 26,004,357,120
    assert plan.scoring == 7_551_898_624
    assert plan.sleep_mode and plan.phases == {"update": 41_946_841_856, "optimizer step": 26_068_075_008,
                                               "scoring": 26_004_357_120, "sync": 34_789_939_200, "rollout": 51_738_455_040}
    assert plan.margins["rollout"] == 80 * GIB - 51_738_455_040
    assert plan.total == 51_738_455_040
    assert round(plan.total / GIB, 2) == 48.19
    assert plan.warnings == []  # fits
    report = plan.report()
    assert "7.62B parameters" in report and "FSDP2 over 8 device(s)" in report and "48.19 GiB of 80.00 GiB" in report
    assert "fits, margin 31.81 GiB" in report and re.search(r"rollout +48\.19 GiB +margin +31\.81 GiB", report)
    # chunks of 1,024: one chunk's 24 bytes per logit, 1,024 x 152,064 x 24 = 3,737,124,864, the head's bf16 weight
    # and its gradient summed over chunks 2 x 152,064 x 3,584 x 2 = 2,179,989,504, and every position's bf16
    # hidden state and two float32 scores 2,048 x (3,584 x 2 + 8) = 14,696,448: 5,931,810,816
    chunked = plan_memory(compose_config(["+experiment=webshop_7b", "trainer.devices=8", "trainer.precision=bf16-mixed",
                                          "model.dtype=float32", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.001",
                                          "optim.logits_chunk_tokens=1024", "optim.max_tokens_per_micro_batch=0"]), 80)
    assert chunked.logits_chunk == 1024 and chunked.logits == 5_931_810_816
    # without sleep mode vLLM's share sits beside the update, as before
    awake = plan_memory(compose_config(["+experiment=webshop_7b", "trainer.devices=8", "trainer.precision=bf16-mixed",
                                        "model.dtype=float32", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.001",
                                        "rollout.vllm.enable_sleep_mode=false", *unchunked]), gpu_memory_gib=80)
    # 38,725,616,384 (the update above) + vLLM awake 34,359,738,368 + margin 2,147,483,648
    expected_total = 75_232_838_400
    assert not awake.sleep_mode and awake.total == expected_total and round(awake.total / GIB, 2) == 70.07
    # the shipped setting loads bf16 weights: the reference copy is bf16, the master weights float32
    shipped = plan_memory(compose_config(["+experiment=webshop_7b", "trainer.devices=8", "rollout.vllm.enable_sleep_mode=false",
                                          *unchunked]), 80)
    assert shipped.param_dtype == "float32" and shipped.reference == params * 2 // 8
    # the float32 reference (3,807,808,256 over 8 shards) becomes bf16: 7,615,616,512 x 2 / 8 = 1,903,904,128
    assert shipped.phases["update"] == 75_232_838_400 - 3_807_808_256 + 1_903_904_128


def test_alfworld_3b_fits_one_80_gib_gpu_with_sleep_mode_and_not_without() -> None:
    """Issue 28: 99.44 GiB planned with vLLM awake through the update; sleep mode frees its 32 GiB there."""
    plan = plan_memory(compose_config(["+experiment=alfworld_3b", "trainer.devices=1"]), gpu_memory_gib=80)
    assert plan.sleep_mode and plan.total <= 80 * GIB and plan.warnings == []
    assert "fits" in plan.report() and "wakes its weights for the sync" in plan.report()
    awake = plan_memory(compose_config(["+experiment=alfworld_3b", "trainer.devices=1", "rollout.vllm.enable_sleep_mode=false"]),
                        gpu_memory_gib=80)
    assert awake.total > 80 * GIB and "enable_sleep_mode=auto" in awake.warnings[0]


def test_alfworld_3b_on_one_gpu_plans_at_most_72_gib_with_its_levers_and_not_without() -> None:
    """Issue 36: the levers in conf/experiment/alfworld_3b.yaml (chunked log-softmax, AdamW offloaded during the
    rollout) bring the plan to at most 72 of 80 GiB, with the logits counted at every position the token budget
    admits; without them it does not fit (96 GiB: the update's logits), and each lever alone is not enough."""
    proc = subprocess.run([sys.executable, "-m", "agentopsd.tools.memory", "+experiment=alfworld_3b", "trainer.devices=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    total = float(re.search(r"total \(largest phase\) +([\d.]+) GiB of 80\.00 GiB", proc.stdout).group(1))
    assert total <= 72.0, proc.stdout
    assert "in chunks of 1024" in proc.stdout and "in host memory during sync and rollout" in proc.stdout
    assert re.search(r"margin +\d+\.\d+ GiB", proc.stdout) and "WARNING" not in proc.stdout

    def planned(*overrides: str) -> MemoryPlan:
        return plan_memory(compose_config(["+experiment=alfworld_3b", "trainer.devices=1", *overrides]), gpu_memory_gib=80)

    levers = planned()
    assert levers.logits_chunk == 1024 and levers.offload_optimizer and levers.total <= 72 * GIB
    bare = planned("optim.logits_chunk_tokens=0", "optim.offload_optimizer=false")
    assert bare.head_positions == 10_220  # 20 rows of 512 tokens, 511 of them action tokens, in 10,240 tokens
    assert bare.logits == 10_220 * 151_936 * 24  # 34.7 GiB of float32 log-softmax, entropy and gradients
    assert bare.total > 80 * GIB and "optim.logits_chunk_tokens=1024" in bare.warnings[0]
    # the rollout holds vLLM's 32 GiB beside AdamW's 23 unless they are offloaded; the update, the logits
    assert planned("optim.offload_optimizer=false").total > 72 * GIB
    assert planned("optim.offload_optimizer=false").phases["rollout"] == levers.phases["rollout"] + levers.optimizer
    assert planned("optim.logits_chunk_tokens=0").total > 80 * GIB


def test_head_positions_are_the_most_a_micro_batch_can_hold() -> None:
    """The old plan counted the longest rows only (4 x 512 = 2,048 positions under a 10,240-token budget); short
    rows with long actions pack five times more."""
    from agentopsd.tools.memory import worst_case_head_positions

    assert worst_case_head_positions(4, 0, 2560, 512) == 4 * 512  # by rows: rows x max_new_tokens
    assert worst_case_head_positions(4, 10240, 2560, 512) == 20 * 511
    assert worst_case_head_positions(4, 100, 60, 8) == 11 * 8  # 11 rows of 9 tokens, 8 of them actions
    assert worst_case_head_positions(4, 100, 500, 512) == 499  # a row past the budget goes alone: 499 positions
    # by brute force over every way of filling the budget with rows of one length
    for budget, seq, new in ((64, 40, 10), (1000, 300, 32), (37, 50, 50)):
        best = max([(budget // n) * min(new, n - 1) for n in range(2, min(seq, budget) + 1)] + [min(new, seq - 1) if seq > budget else 0])
        assert worst_case_head_positions(1, budget, seq, new) == best


def test_bf16_true_halves_the_state_and_ddp_shards_nothing() -> None:
    bf16 = plan_memory(compose_config(["+experiment=alfworld_3b", "trainer.devices=4", "trainer.precision=bf16-true"]), 80)
    assert (bf16.param_dtype, bf16.compute_dtype) == ("bfloat16", "bfloat16")
    assert bf16.weights == -(-3_085_938_688 * 2 // 4)
    ddp = plan_memory(compose_config(["+experiment=alfworld_3b", "trainer=ddp", "trainer.devices=4", "model.dtype=float32"]), 80)
    assert ddp.strategy == "ddp" and ddp.weights == 3_085_938_688 * 4  # whole on each device
    assert ddp.gathered == ddp.gradients  # DDP's gradient buckets
    # the head runs only before action tokens; the 10,240-token budget admits 10,220 of them (was 4 x 512: the defect)
    assert ddp.head_positions == 10_220


def test_deferred_reduction_holds_every_gradient_unsharded_under_fsdp2_only() -> None:
    base = ["+experiment=alfworld_3b", "trainer.devices=8"]
    plain = plan_memory(compose_config(base), 80)
    deferred = plan_memory(compose_config([*base, "optim.defer_grad_reduction=true"]), 80)
    assert plain.gradients == -(-3_085_938_688 * 4 // 8) and deferred.gradients == 3_085_938_688 * 4
    assert deferred.phases["update"] - plain.phases["update"] == deferred.gradients - plain.gradients
    ddp = [*base, "trainer=ddp", "model.dtype=float32"]
    assert plan_memory(compose_config([*ddp, "optim.defer_grad_reduction=true"]), 80).gradients == plan_memory(compose_config(ddp), 80).gradients


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
    from agentopsd.models.tokenizer import tiny_qwen2_config

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
    # alfworld_3b offloads AdamW during the rollout: 68,106,915,225 - 2 x 1,542,969,344 = 65,020,976,537 = 60.56 GiB,
    # and so does alfworld_7b: 76,033,851,417 - 2 x 3,807,808,256 = 68,418,234,905 = 63.72 GiB
    totals = {"alfworld_3b": "60.56", "alfworld_7b": "63.72"}
    total = totals.get(experiment, "70.81" if experiment.endswith("7b") else "63.43")
    margin = f"{141 - float(total):.2f}"
    assert f" {total} GiB of 141.00 GiB (--gpu-memory-gib): fits, margin {margin} GiB\n" in out


def test_cli_runs_as_a_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentopsd.tools.memory", "+experiment=webshop_7b", "trainer.devices=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "DOES NOT FIT" in proc.stdout and "WARNING: memory plan" in proc.stdout


# ------------------------------------------------------------------ the plan against measured peaks on CPU
#
# measure_cpu_peak reads the CPU allocator's running total from the profiler's memory events: every tensor
# allocated and freed inside the step, kernel temporaries included, forward and backward (on a GPU the same
# figure is torch.cuda.max_memory_allocated). Tolerance: the plan may count up to 25% more than measured (it is a
# worst case, and its per-token activation counts are upper bounds), never more than 5% less.
LOW, HIGH = 0.75, 1.05


def _one_update_step(cfg) -> tuple[int, MemoryPlan]:
    """The measured peak (bytes, weights included) of one update step of ``cfg``'s policy and algorithm on the
    plan's worst-case micro-batch (rows of the longest length, every one ending in max_new_tokens action tokens):
    zero_grad, the objective (agentopsd.training.objective.micro_batch_loss through the Scorer), backward, gradient
    clipping and AdamW's first step (which creates its states); and the plan of ``cfg``."""
    from hydra.utils import instantiate

    from agentopsd.rollout.scoring import Scorer
    from agentopsd.training.objective import micro_batch_loss

    plan = plan_memory(cfg, gpu_memory_gib=80)
    model, _ = instantiate(cfg.model)
    model.train()
    algorithm, optim = instantiate(cfg.algorithm), instantiate(cfg.optim)
    rows, seq, new = plan.micro_batch_size, plan.sequence_tokens, int(cfg.rollout.max_new_tokens)
    g = torch.Generator().manual_seed(0)
    scorer = Scorer(model, 0, 1.0, optim.micro_batch_size, optim.max_tokens_per_micro_batch, torch.device("cpu"),
                    logits_chunk_tokens=optim.logits_chunk_tokens)
    rb, _ = scorer.placeholder_batch(with_reference=False)
    ids = torch.randint(1, model.config.vocab_size, (rows, seq), generator=g)
    amask = torch.zeros(rows, seq, dtype=torch.bool)
    amask[:, seq - new :] = True
    rb.input_ids, rb.attention_mask, rb.action_mask = ids, torch.ones_like(ids), amask
    rb.old_logprobs = rb.student_logprobs = rb.teacher_logprobs = torch.full((rows, seq), -3.0) * amask
    rb.advantages = torch.randn(rows, seq, generator=g) * amask
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss, _, _ = micro_batch_loss(algorithm, optim, scorer, rb, torch.arange(rows), float(amask.sum()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    weights = sum(t.untyped_storage().nbytes() for t in {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values())
    return weights + measure_cpu_peak(step)[1], plan


def _planned_update(plan: MemoryPlan) -> int:
    """The plan's update (forward, backward, optimizer step) without its margin, an estimate for CUDA's context."""
    return max(plan.phases["update"], plan.phases["optimizer step"]) - plan.margin


@pytest.mark.parametrize("overrides", [
    ["experiment=babyai_tiny"],
    ["experiment=babyai_tiny", "optim.logits_chunk_tokens=64", "+algorithm.entropy_coef=0.01"],
    # the quickstart with a quarter of its 128-row micro-batch (10 s, not 45: the plan is linear in rows)
    ["experiment=quickstart", "optim.micro_batch_size=32"],
    pytest.param(["experiment=quickstart"], marks=pytest.mark.slow),
], ids=["babyai_tiny", "babyai_tiny-chunked-entropy", "quickstart-32-rows", "quickstart"])
def test_the_plan_holds_the_measured_peak_of_an_update_on_cpu(overrides: list[str]) -> None:
    cfg = compose_config(overrides)
    measured, plan = _one_update_step(cfg)
    planned = _planned_update(plan)
    assert plan.strategy == "single" and plan.activations > plan.logits  # tiny sizes: the activations dominate
    assert LOW * planned <= measured <= HIGH * planned, (measured, planned, measured / planned)


def test_bytes_per_logit_are_what_the_scorer_holds() -> None:
    """The logits' share of the update, measured as the growth of the peak with the vocabulary (nothing else
    grows with it but the embedding), against memory.logits_bytes: all positions at once (16 bytes a logit, 24
    with the entropy bonus) and in chunks (one chunk's). The old plan's 2,048 positions at 24 bytes would pass
    the first; counting all positions when chunked would fail the last by 8x."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentopsd.rollout.scoring import Scorer
    from agentopsd.tools.memory import logits_bytes

    rows, prompt, actions, hidden = 4, 32, 128, 16
    positions = rows * actions

    def peak(vocab: int, *, entropy: bool, chunk: int) -> int:
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg).train()
        scorer = Scorer(model, 0, 1.0, rows, 0, torch.device("cpu"), logits_chunk_tokens=chunk)
        rb, _ = scorer.placeholder_batch(with_reference=False)
        ids = torch.randint(1, vocab, (rows, prompt + actions), generator=torch.Generator().manual_seed(1))
        rb.input_ids, rb.attention_mask = ids, torch.ones_like(ids)
        rb.action_mask = torch.zeros(ids.shape, dtype=torch.bool)
        rb.action_mask[:, prompt:] = True

        def step() -> None:
            lp, ent, _ = scorer.logprobs_and_entropy(rb, torch.arange(rows), entropy=entropy)
            (lp.sum() + ent.sum()).backward()

        return measure_cpu_peak(step)[1]

    small, large = 2048, 8192
    for entropy, chunk in ((False, 0), (True, 0), (True, 64)):
        measured = peak(large, entropy=entropy, chunk=chunk) - peak(small, entropy=entropy, chunk=chunk)
        planned = (logits_bytes(positions, large, hidden, 4, entropy=entropy, chunk=chunk)
                   - logits_bytes(positions, small, hidden, 4, entropy=entropy, chunk=chunk))
        assert 0.85 * planned <= measured <= 1.15 * planned, (entropy, chunk, measured, planned, measured / planned)


def test_a_prepared_model_is_planned_before_it_is_prepared() -> None:
    """model=smollm2-135m plans from the built-in shape (134,515,008 parameters, as the prepared folder's config),
    with no folder on disk and no download."""
    from agentopsd.tools.architecture import architecture_of

    arch, why = architecture_of({"path": "smollm2-135m"})
    assert why == "" and arch is not None and arch.parameters == 134_515_008 and not arch.qkv_bias
    plan = plan_memory(compose_config(["model=smollm2-135m", "trainer=gpu"]), 24)
    assert plan.architecture is arch and plan.weights == 134_515_008 * 4
