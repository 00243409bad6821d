"""The tiny byte-level BPE tokenizer, its cache, and the tiny Qwen2 config."""

from __future__ import annotations

import random

import pytest
import transformers

from agentopsd.models.tokenizer import (
    EOS_TOKEN,
    FORMAT_TAGS,
    IM_END,
    IM_START,
    load_or_train_tokenizer,
    tiny_qwen2_config,
    train_tiny_tokenizer,
)

WORDS = "go to the red ball key door open pick up box green blue left right forward wall".split()


def corpus(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(10)) + " <think>ok</think><action>go forward</action>" for _ in range(n)]


@pytest.fixture(scope="module")
def tok():
    return train_tiny_tokenizer(corpus(), vocab_size=400)


def test_special_tokens(tok):
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == EOS_TOKEN
    assert tok.eos_token_id == tok.pad_token_id
    for special in (IM_START, IM_END):
        ids = tok(special, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == special
    assert len(tok) <= 400


def test_format_tags_are_single_ordinary_tokens(tok):
    for tag in FORMAT_TAGS:
        ids = tok(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, (tag, tok.convert_ids_to_tokens(ids))
        # ordinary text: kept when special tokens are skipped, so the model must generate it
        assert tok.decode(ids, skip_special_tokens=True) == tag
    ids = tok("<think>go</think><action>pick up</action>", add_special_tokens=False)["input_ids"]
    assert len(ids) <= 7


@pytest.mark.parametrize("text", ["pick up the red ball", "  spaces\tand\nlines ", "ünïcödé → 漢字 🙂", "</action>x<act"])
def test_round_trip_any_text(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_chat_template_qwen_layout(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go to the door"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ngo to the door<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers >= 5 returns a BatchEncoding
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 3
    without_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not without_prompt.endswith("assistant\n")


def test_vocab_size_too_small_is_an_error():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tiny_tokenizer(corpus(10), vocab_size=100)


def test_cache_trains_once_then_reloads(tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return corpus()

    first = load_or_train_tokenizer(tmp_path, "walk-400", texts, vocab_size=400)

    def must_not_train():
        raise AssertionError("the cached tokenizer must be reused")

    second = load_or_train_tokenizer(tmp_path, "walk-400", must_not_train, vocab_size=400)
    assert calls == [1]
    sample = "<think>go</think><action>pick up the key</action>"
    assert first(sample)["input_ids"] == second(sample)["input_ids"]
    assert second.eos_token_id == first.eos_token_id == second.pad_token_id
    assert second.chat_template == first.chat_template
    assert sorted(p.name for p in tmp_path.iterdir()) == ["walk-400"]  # no temporary folder left


def test_cache_key_must_be_a_folder_name(tmp_path):
    for key in ("", "a/b", "..", "."):
        with pytest.raises(ValueError, match="key"):
            load_or_train_tokenizer(tmp_path, key, corpus, vocab_size=400)


def test_tiny_config_defaults_match_the_probe():
    config = tiny_qwen2_config(369)
    assert isinstance(config, transformers.Qwen2Config)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (192, 3, 4)
    assert config.num_key_value_heads == 4 and config.attention_dropout == 0.0 and config.tie_word_embeddings
    model = transformers.Qwen2ForCausalLM(config)
    assert abs(sum(p.numel() for p in model.parameters()) - 1.84e6) < 0.01e6
    assert tiny_qwen2_config(369, num_key_value_heads=2).num_key_value_heads == 2
    with pytest.raises(ValueError, match="divisible"):
        tiny_qwen2_config(100, hidden_size=66, num_heads=4)
