"""``model.dtype`` (agentopsd/training/precision.py): bf16 chosen only where the processor computes it natively (the flags
faked here), float32 forced, and with a bf16 base the LoRA adapters and their AdamW states stay float32."""

from __future__ import annotations

import logging

import pytest
import torch

from agentopsd.models import loading as models
from agentopsd.models.loading import build_tiny_policy, load_policy
from agentopsd.training import precision
from agentopsd.training.precision import (
    FLOAT32_PLAN,
    PrecisionChoice,
    WeightPlan,
    choose_precision,
    copy_weights,
    half_copy,
    loading_dtype,
    native_bf16,
    read_cpu_flags,
    weight_plan,
)
from agentopsd.training.strategies import prepare_policy
from tests.agentopsd.models.test_loading import TINY, tok  # noqa: F401  (the module-scoped tokenizer fixture)

# this development machine's flags (an Intel Xeon with AVX-512 but no bf16: bf16 matmuls 2.5x slower than float32)
NO_BF16 = frozenset("fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_vbmi2 avx512ifma".split())
SAPPHIRE_RAPIDS = NO_BF16 | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
ZEN4 = NO_BF16 | {"avx512_bf16"}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert read_cpu_flags(cpuinfo) == {"fpu", "avx512f", "avx512_bf16", "amx_bf16"}  # the first processor's
    assert read_cpu_flags(tmp_path / "missing") == frozenset()  # macOS, Windows: no file, float32


@pytest.mark.parametrize(("flags", "expected"), [(SAPPHIRE_RAPIDS, "bfloat16"), (ZEN4, "bfloat16"), (NO_BF16, "float32"),
                                                 (frozenset(), "float32")])
def test_auto_chooses_bf16_only_where_the_cpu_has_it_natively(flags, expected):
    choice = choose_precision("auto", "cpu", flags)
    assert choice.dtype == expected and native_bf16(flags) is (expected == "bfloat16")
    # the log line's reason names the flags it went by
    assert ("avx512_bf16" in choice.reason) and (("natively" in choice.reason) is (expected == "bfloat16"))


def test_an_explicit_dtype_is_forced_whatever_the_cpu():
    assert choose_precision("float32", "cpu", SAPPHIRE_RAPIDS) == PrecisionChoice("float32", "model.dtype=float32 forces it")
    assert choose_precision("bfloat16", "cpu", NO_BF16).dtype == "bfloat16"
    # a GPU: auto stays the checkpoint's dtype, trainer.precision sets the compute (as before)
    assert choose_precision("auto", "cuda", frozenset()).dtype == "auto"


def test_an_unknown_dtype_fails_in_one_line_naming_the_fix():
    with pytest.raises(ValueError, match=r"model.dtype='fp8' is not one of .*set model.dtype=auto") as err:
        choose_precision("fp8", "cpu", NO_BF16)
    assert "\n" not in str(err.value)


def test_the_validation_fails_on_an_unknown_dtype_before_any_weights_load(tmp_path):
    from agentopsd.run.validation import ConfigError, validate_config
    from tests.test_smollm2_recipe import recipe

    with pytest.raises(ConfigError, match="model.dtype='bf32'.*set model.dtype=auto"):
        validate_config(recipe("model.dtype=bf32", f"output_dir={tmp_path / 'run'}"))


def test_the_smollm2_recipe_asks_for_auto_and_its_plan_follows_the_flags(monkeypatch):
    from agentopsd.training import precision
    from tests.test_smollm2_recipe import recipe

    cfg = recipe()
    assert cfg.model.dtype == "auto" and cfg.trainer.precision == "32-true"
    monkeypatch.setattr(precision, "read_cpu_flags", lambda: ZEN4)
    assert precision.plan_for_config(cfg) == WeightPlan(frozen_half=True, generation_dtype=torch.bfloat16)  # LoRA: bf16 base, merged copy
    assert precision.plan_for_config(recipe("model.lora=null")) == WeightPlan(generation_dtype=torch.bfloat16)
    assert precision.plan_for_config(recipe("model.dtype=float32")) == FLOAT32_PLAN
    monkeypatch.setattr(precision, "read_cpu_flags", lambda: NO_BF16)
    assert precision.plan_for_config(cfg) == FLOAT32_PLAN


def test_bf16_storage_only_on_a_cpu_under_a_float32_trainer_precision_without_fsdp():
    bf16 = PrecisionChoice("bfloat16", "")
    cpu = {"device": "cpu", "trainer_precision": "32-true", "sharded": False}
    assert weight_plan(bf16, **cpu, lora=True) == WeightPlan(frozen_half=True, generation_dtype=torch.bfloat16)
    assert weight_plan(bf16, **cpu, lora=False) == WeightPlan(generation_dtype=torch.bfloat16)
    assert weight_plan(bf16, **cpu, lora=True).half_rollout and not FLOAT32_PLAN.half_rollout
    # one float32 policy: a float32 choice, a mixed precision (autocast over float32 master weights), FSDP2; a GPU keeps
    # its frozen weights as loaded (tests/agentopsd/training/test_frozen_dtype.py)
    assert weight_plan(PrecisionChoice("float32", ""), **cpu, lora=True) == FLOAT32_PLAN
    assert weight_plan(bf16, **{**cpu, "device": "cuda"}, lora=True) == WeightPlan(frozen_as_loaded=True)
    assert weight_plan(bf16, **{**cpu, "trainer_precision": "bf16-mixed"}, lora=True) == FLOAT32_PLAN
    assert weight_plan(bf16, **{**cpu, "sharded": True}, lora=False) == FLOAT32_PLAN


def test_auto_loads_a_lora_base_in_bf16_but_full_fine_tuning_master_weights_in_float32():
    bf16 = PrecisionChoice("bfloat16", "")
    assert loading_dtype(bf16, "auto", lora=True) == "bfloat16"
    assert loading_dtype(bf16, "auto", lora=False) == "float32"
    assert loading_dtype(bf16, "bfloat16", lora=False) == "bfloat16"  # explicit: the loading dtype, as before
    assert loading_dtype(PrecisionChoice("float32", ""), "auto", lora=True) == "float32"


@pytest.fixture(scope="module")
def folder(tok, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("policy")
    build_tiny_policy(tok, TINY, seed=1).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _dtypes(model: torch.nn.Module, trainable: bool) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if p.requires_grad is trainable}


def test_auto_with_native_bf16_keeps_the_lora_base_bf16_and_the_adapters_and_their_states_float32(folder, monkeypatch, caplog):
    monkeypatch.setattr(models, "read_cpu_flags", lambda: SAPPHIRE_RAPIDS)
    with caplog.at_level(logging.INFO, logger="agentopsd.models.loading"):
        model, _ = load_policy(folder, dtype="auto", lora=LORA)
    line = [r.getMessage() for r in caplog.records if "model.dtype=auto" in r.getMessage()]
    assert len(line) == 1 and "bfloat16" in line[0] and "avx512_bf16" in line[0], line
    # what the module's configure_model does before training (trainer.precision=32-true): the base stays bf16
    prepare_policy(model, None, "32-true", frozen_half=True)
    assert _dtypes(model, trainable=False) == {torch.bfloat16}
    assert _dtypes(model, trainable=True) == {torch.float32}
    ids = torch.tensor([[5, 9, 12, 40, 7]])
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    opt.step()
    states = {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"}
    assert states == {torch.float32}


def test_auto_without_native_bf16_and_float32_forced_load_float32(folder, monkeypatch, caplog):
    monkeypatch.setattr(models, "read_cpu_flags", lambda: NO_BF16)
    with caplog.at_level(logging.INFO, logger="agentopsd.models.loading"):
        model, _ = load_policy(folder, dtype="auto", lora=LORA)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert any("float32 (the CPU has no native bf16" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(models, "read_cpu_flags", lambda: SAPPHIRE_RAPIDS)
    model, _ = load_policy(folder, dtype="float32", lora=LORA)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_the_generation_copy_is_bf16_and_follows_the_master_weights(tok):  # noqa: F811
    master = build_tiny_policy(tok, TINY, seed=1)
    copy = half_copy(master, torch.bfloat16)
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in master.parameters()} == {torch.float32}  # the master weights untouched
    assert all(b.dtype == torch.float32 for n, b in copy.named_buffers() if "inv_freq" in n)  # RoPE stays float32
    assert not any(p.requires_grad for p in copy.parameters())
    with torch.no_grad():
        for p in master.parameters():
            p.add_(0.5)
    copy_weights(copy, master)
    for a, b in zip(copy.parameters(), master.parameters()):
        assert torch.equal(a, b.to(torch.bfloat16))


def test_a_lora_policys_generation_copy_is_plain_with_the_adapters_merged(folder):
    """No adapter runs at generation: the copy is the transformers model, each LoRA layer's weight its base weight
    plus the adapters' delta, re-merged by copy_weights after the adapters move (as before each rollout)."""
    model, _ = load_policy(folder, dtype="float32", lora=LORA)
    ids = torch.tensor([[5, 9, 12, 40, 7, 3]])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at 0: move it so that the adapters change the logits
                p.normal_(0, 0.05)
        copy = half_copy(model, torch.float32)
        assert not precision.lora_layers(copy) and not any("lora_" in n for n, _ in copy.named_parameters())
        assert not any(p.requires_grad for p in copy.parameters())
        assert (model(input_ids=ids).logits - copy(input_ids=ids).logits).abs().max() < 1e-4
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
        assert (plain - copy(input_ids=ids).logits).abs().max() > 1e-3  # the adapters do change what it plays
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.add_(0.1)
        copy_weights(copy, model)
        assert (model(input_ids=ids).logits - copy(input_ids=ids).logits).abs().max() < 1e-4
        # in bf16: each merged weight is the float32 sum rounded once
        half = half_copy(model, torch.bfloat16)
        name, layer = next(iter(precision.lora_layers(model).items()))
        expected = (layer.base_layer.weight.float() + layer.get_delta_weight("default").float()).to(torch.bfloat16)
        assert torch.equal(dict(half.named_modules())[name].weight, expected)


def _half_lora(folder: str, monkeypatch) -> torch.nn.Module:
    """What a run holds under model.dtype=auto on a CPU with native bf16: a bf16 base, float32 adapters."""
    monkeypatch.setattr(models, "read_cpu_flags", lambda: SAPPHIRE_RAPIDS)
    model, _ = load_policy(folder, dtype="auto", lora=LORA)
    prepare_policy(model, None, "32-true", frozen_half=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at 0: move it so that the adapters take part
                p.normal_(0, 0.05)
    return model


def test_a_half_lora_policy_multiplies_its_adapters_in_bf16_and_keeps_them_float32(folder, monkeypatch):
    """compute_in_half: each adapter's matmul runs in bf16 (its input no longer cast to float32), while the adapter
    weights, their gradients and AdamW's states stay float32; attention runs on float32 inputs; the logits stay
    within bf16's rounding of the float32-adapter forward. Planted defects: input casting left on casts the adapters'
    input to float32 (the dtype check fails); the attention left as SDPA never reaches the float32 one."""
    assert not precision.compute_in_half(load_policy(folder, dtype="float32", lora=LORA)[0])  # a float32 base: as it is
    assert not precision.compute_in_half(load_policy(folder, dtype="float32")[0])  # no LoRA
    model = _half_lora(folder, monkeypatch)
    ids = torch.tensor([[5, 9, 12, 40, 7, 3], [8, 2, 30, 6, 0, 0]])
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits.float()
    assert precision.compute_in_half(model)
    assert not precision.compute_in_half(model)  # once: the hooks are not stacked
    seen: dict[str, set[torch.dtype]] = {"adapter input": set(), "adapter output": set(), "attention": set()}
    layers = precision.lora_layers(model)
    def record(module, args, out) -> None:
        seen["adapter input"].add(args[0].dtype)
        seen["adapter output"].add(out.dtype)

    for layer in layers.values():
        layer.lora_A["default"].register_forward_hook(record)
    original = precision.float32_sdpa

    def spy(module, query, *args, **kwargs):
        out, weights = original(module, query, *args, **kwargs)
        seen["attention"].add(query.dtype)
        return out, weights

    from transformers.modeling_utils import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, precision.FLOAT32_ATTENTION, spy)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    assert seen == {"adapter input": {torch.bfloat16}, "adapter output": {torch.bfloat16}, "attention": {torch.bfloat16}}
    assert not torch.is_autocast_enabled("cpu")  # only inside the LoRA layers
    keep = mask.bool()
    assert (logits[keep] - before[keep]).abs().max() < 0.1 * before[keep].abs().max()
    assert (logits[keep] - before[keep]).abs().max() > 0  # they did change numerics: the check above can fail
    logits[keep].logsumexp(-1).mean().backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in trained} == {p.grad.dtype for p in trained} == {torch.float32}
    assert all(p.grad.abs().sum() > 0 for p in trained if p.ndim == 2 and "lora_A" not in str(p.shape))
    opt = torch.optim.AdamW(trained, lr=1e-3)
    opt.step()
    assert {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    assert _dtypes(model, trainable=False) == {torch.bfloat16}


def test_float32_attention_matches_sdpa_on_float32_inputs_and_returns_the_inputs_dtype():
    """Planted defect: without the upcast the bf16 output differs from float32 SDPA's by bf16 rounding (about 1e-2)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[1, :, :, 3:] = False
    expected, _ = sdpa_attention_forward(module, q, k, v, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an enclosing autocast must not cast the inputs back
        out, _ = precision.float32_sdpa(module, q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), mask)
    half, _ = precision.float32_sdpa(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    exact, _ = sdpa_attention_forward(module, q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), mask)
    assert out.dtype == torch.float32 and torch.allclose(out, exact, atol=1e-6)
    assert half.dtype == torch.bfloat16 and torch.equal(half, exact.bfloat16())
    assert (out - expected).abs().max() < 0.05


def test_an_error_inside_a_half_lora_layer_leaves_no_autocast_on(folder, monkeypatch):
    model = _half_lora(folder, monkeypatch)
    precision.compute_in_half(model)
    layer = next(iter(precision.lora_layers(model).values()))
    with pytest.raises(RuntimeError):
        layer(torch.zeros(1, 3, 7))  # the wrong width
    assert not torch.is_autocast_enabled("cpu")
    assert model(input_ids=torch.tensor([[5, 9, 12]])).logits.dtype == torch.bfloat16


def test_the_generation_copy_of_a_half_lora_policy_runs_plain_sdpa_and_no_adapter(folder, monkeypatch):
    """The bf16 copy that generates and scores the teacher view has no backward: bf16 SDPA is as fast forward."""
    model = _half_lora(folder, monkeypatch)
    precision.compute_in_half(model)
    assert model.get_base_model().config._attn_implementation == precision.FLOAT32_ATTENTION
    copy = half_copy(model, torch.bfloat16)
    assert copy.config._attn_implementation == "sdpa"
    assert model.get_base_model().config._attn_implementation == precision.FLOAT32_ATTENTION  # not shared
    ids = torch.tensor([[5, 9, 12, 40, 7, 3]])
    with torch.no_grad():
        assert (copy(input_ids=ids).logits.float() - model(input_ids=ids).logits.float()).abs().max() < 0.1

