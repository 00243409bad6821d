"""Every precision the trainer configs offer works with the task and rollout batches."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision
from torch import nn

from agentopsd.training.data import TaskBatch, sample_tasks
from agentopsd.training.strategies import fsdp_mixed_precision, needs_float32_master, upcast_half_params
from tests.test_train import metrics_rows, run_train

ENV = "agentopsd/BabyAI-GoToLocal-v0"


@pytest.mark.parametrize("plugin", [HalfPrecision("bf16-true"), HalfPrecision("16-true"), MixedPrecision("bf16-mixed", "cpu")])
def test_task_batch_passes_precision_plugins_untouched(plugin):
    # Lightning converts every batch with apply_to_collection before any hook; a frozen dataclass
    # batch failed there ("A frozen dataclass was passed to apply_to_collection")
    batch = TaskBatch(3, sample_tasks(ENV, 100, 2, 4, 3, seed=0))
    out = plugin.convert_input(batch)
    assert out == batch and out.iteration == 3 and len(out.tasks) == 8


def test_task_batch_is_immutable():
    batch = TaskBatch(0, ())
    with pytest.raises(AttributeError, match="immutable"):
        batch.iteration = 1


def test_float32_master_weights_for_mixed_and_full_precision():
    assert needs_float32_master("bf16-mixed") and needs_float32_master("32-true") and needs_float32_master("16-mixed")
    assert not needs_float32_master("bf16-true") and not needs_float32_master("16-true")
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(torch.bfloat16)
    assert upcast_half_params(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not upcast_half_params(model)  # already float32: nothing to do


def test_bf16_weights_cannot_absorb_small_updates():
    # why bf16-mixed (float32 master weights) and not bf16-true is the FSDP default: an AdamW step at
    # the paper's lr 1e-6 moves float32 weights and rounds away entirely on bf16 ones
    torch.manual_seed(0)
    w32 = nn.Parameter(torch.randn(256) * 0.05)
    w16 = nn.Parameter(w32.detach().to(torch.bfloat16).clone())
    for w in (w32, w16):
        opt = torch.optim.AdamW([w], lr=1e-6, weight_decay=0.0)
        before = w.detach().clone()
        w.grad = torch.ones_like(w)
        opt.step()
        w.moved = int((w.detach() != before).sum())
    assert w32.moved == 256
    assert w16.moved < 10  # only weights within ~1e-4 of zero can move


def test_fsdp_policy_only_for_bf16_mixed():
    policy = fsdp_mixed_precision("bf16-mixed")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert fsdp_mixed_precision("bf16-true") is None and fsdp_mixed_precision("32-true") is None


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_one_process_trains_at_half_precision(precision, tmp_path):
    out = tmp_path / precision
    run_train(
        "experiment=babyai_tiny", f"trainer.precision={precision}", f"output_dir={out}", "num_iterations=1",
        "evaluation.num_tasks=2", "trainer.enable_progress_bar=false",
    )
    rows = [r for r in metrics_rows(out) if r.get("loss/first_ratio_dev")]
    assert len(rows) == 1
    # on-policy: the first mini-batch's ratio is 1 up to bf16 rounding of the forward
    assert float(rows[0]["loss/first_ratio_dev"]) < 0.05


@pytest.mark.parametrize("form", ["mask", "hook", "none"])
def test_whole_model_call_runs_the_head_at_action_positions_only(form, monkeypatch):
    """Every transformers version gets the same logits; the head runs at the action positions (``mask``), at the
    same positions picked by a pre-hook on the head (``hook``: versions before the boolean-mask form), or everywhere."""
    import transformers

    import agentopsd.rollout.scoring as module
    from agentopsd.rollout.scoring import _logits_to_keep_form, whole_model_action_logits

    config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    assert _logits_to_keep_form(model) == "mask"  # the installed transformers
    monkeypatch.setattr(module, "_logits_to_keep_form", lambda m: form)
    ids = torch.randint(0, 97, (3, 9))
    attn = torch.ones_like(ids)
    attn[2, 6:] = 0  # a right-padded row
    source = torch.zeros_like(ids, dtype=torch.bool)
    source[0, 4:8], source[1, 2:5], source[2, 3:6] = True, True, True
    calls = []
    model.lm_head.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    with torch.no_grad():
        picked = whole_model_action_logits(model, ids, attn, source)
        full = model(input_ids=ids, attention_mask=attn).logits[source]
    assert torch.allclose(picked, full, atol=1e-5)
    # the head saw the 10 action positions (mask, hook), or all 27
    assert calls[0].numel() // 32 == {"mask": 10, "hook": 10, "none": 27}[form]
