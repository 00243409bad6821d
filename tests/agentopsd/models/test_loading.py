"""Policy loading (local folder, hub cache, fast failures) and the tiny from-scratch policy."""

from __future__ import annotations

import sys
import time

import huggingface_hub
import pytest
import torch

from agentopsd.models.loading import ModelNotFoundError, build_tiny_policy, load_policy, resolve_model_path
from agentopsd.models.tokenizer import IM_END, train_tiny_tokenizer

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}
WORDS = "go to the red ball key door open pick up box left right".split()


@pytest.fixture(scope="module")
def tok():
    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(9)) + " <action>go</action>" for i in range(200)]
    return train_tiny_tokenizer(texts, vocab_size=320)


@pytest.fixture(scope="module")
def saved(tok, tmp_path_factory):
    """A tiny policy saved like a downloaded checkpoint: (folder, model)."""
    folder = tmp_path_factory.mktemp("policy")
    model = build_tiny_policy(tok, TINY, seed=1)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model


def logits_of(model, ids=(5, 9, 12, 40, 7)):
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits.float()


def test_tiny_policy_is_deterministic_and_leaves_global_rng_alone(tok):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_policy(tok, TINY, seed=3)
    assert torch.equal(torch.rand(1), expected_next)
    b = build_tiny_policy(tok, TINY, seed=3)
    c = build_tiny_policy(tok, TINY, seed=4)
    assert torch.equal(logits_of(a), logits_of(b))
    assert not torch.equal(logits_of(a), logits_of(c))


def test_tiny_policy_takes_its_ids_from_the_tokenizer(tok):
    model = build_tiny_policy(tok, TINY)
    assert model.config.vocab_size == len(tok)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.config.pad_token_id == tok.pad_token_id and model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)]


def test_load_from_local_folder_round_trips(saved, tok):
    folder, original = saved
    model, tokenizer = load_policy(str(folder))
    assert torch.allclose(logits_of(model), logits_of(original))
    assert tokenizer("pick up the box")["input_ids"] == tok("pick up the box")["input_ids"]
    assert tokenizer.pad_token_id == tok.pad_token_id


def test_load_options(saved):
    folder, _ = saved
    model, _ = load_policy(str(folder), dtype="bfloat16", gradient_checkpointing=True)
    assert next(model.parameters()).dtype == torch.bfloat16
    flag = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    assert getattr(model, flag)  # transformers 5 renamed gradient to activation checkpointing
    with pytest.raises(ValueError, match="model.dtype"):
        load_policy(str(folder), dtype="fp8")


def test_lora_wraps_the_model(saved):
    folder, original = saved
    # float32 asked for: auto would store the base in bf16 on a processor with native bf16 (the logits then differ)
    model, _ = load_policy(str(folder), dtype="float32",
                           lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]})
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert torch.allclose(logits_of(model), logits_of(original))  # LoRA B starts at zero
    with pytest.raises(ValueError, match="rank"):
        load_policy(str(folder), lora={"rank": 4})


def test_missing_peft_is_a_clear_error(saved, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` raise ImportError
    with pytest.raises(ImportError, match=r"agentopsd\[lora\]"):
        load_policy(str(saved[0]), lora={"r": 4})


def test_tokenizer_without_pad_gets_eos(saved, tmp_path, tok):
    folder, model = saved
    model.save_pretrained(tmp_path)
    no_pad = tok.__class__.from_pretrained(folder)
    no_pad.pad_token = None
    no_pad.save_pretrained(tmp_path)
    loaded, tokenizer = load_policy(str(tmp_path))
    assert tokenizer.pad_token == tokenizer.eos_token
    assert loaded.config.pad_token_id == tokenizer.eos_token_id


def test_cached_hub_id_loads_offline_from_the_snapshot(saved, tmp_path, monkeypatch):
    folder, original = saved
    snapshot = tmp_path / "models--tiny-org--tiny-policy" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (tmp_path / "models--tiny-org--tiny-policy" / "refs").mkdir()
    (tmp_path / "models--tiny-org--tiny-policy" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("tiny-org/tiny-policy") == str(snapshot)
    model, _ = load_policy("tiny-org/tiny-policy")
    assert torch.allclose(logits_of(model), logits_of(original))


def assert_fails_fast(path: str, *fragments: str, limit_s: float = 5.0) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as err:
        load_policy(path)
    assert time.perf_counter() - t0 < limit_s
    message = str(err.value)
    assert "model.path" in message and path in message and "HF_HOME" in message and "HF_HUB_OFFLINE" in message
    for fragment in fragments:
        assert fragment in message
    assert isinstance(err.value, FileNotFoundError)


def test_missing_local_folder_fails_fast():
    assert_fails_fast("/nonexistent/models/Qwen2.5-3B-Instruct", "not a valid hub id")


def test_uncached_hub_id_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_fails_fast("Qwen/Qwen2.5-3B-Instruct", "offline")


def test_uncached_hub_id_online_fails_in_seconds(monkeypatch):
    """No hub here: the one probe fails at once (a made-up id also fails fast where the hub is up)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert_fails_fast("agentopsd-tests/no-such-model-7f3a", "hub lookup failed", limit_s=8.0)
