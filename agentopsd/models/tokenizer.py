"""A tiny byte-level BPE tokenizer with a Qwen2-style chat template, and the tiny Qwen2 config.

Tests and the embedded default train their own tokenizer on environment text (about 1 s): a
151k vocabulary would make a tiny model's logits dominate memory and time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen2Config

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)
FORMAT_TAGS = ("<think>", "</think>", "<action>", "</action>")
"""Ordinary text (the model must generate them), but each kept whole by the pre-tokenizer and
trained into single tokens, so ``</action>`` costs one generation step, not five."""

# The same layout as Qwen2.5's template, without its default system message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# GPT-2's split pattern, with the format tags as whole pieces tried first. BPE never merges across
# pieces, so without the tag alternative "</action>" could never become one token.
_TAG_PATTERN = "|".join(t.replace("/", "\\/") for t in FORMAT_TAGS)
_SPLIT_PATTERN = (
    f"{_TAG_PATTERN}|'s|'t|'re|'ve|'m|'ll|'d| ?\\p{{L}}+| ?\\p{{N}}+| ?[^\\s\\p{{L}}\\p{{N}}]+|\\s+(?!\\S)|\\s+"
)
# Every prompt carries these role headers; training on them keeps each a token or two.
_ROLE_HEADERS = ("system\n", "user\n", "assistant\n")
# Repeating the tags this often makes their merges the most frequent pairs, so they always fit.
_TAG_REPEATS = 1000


def _with_tags(texts: Iterable[str]) -> Iterator[str]:
    yield from texts
    for piece in FORMAT_TAGS + _ROLE_HEADERS:
        yield from [piece] * _TAG_REPEATS


def train_tiny_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``.

    ``<|endoftext|>`` is eos and pad, ``<|im_start|>``/``<|im_end|>`` are special tokens, the chat
    template is Qwen2's layout, and the format tags are single ordinary tokens. ``vocab_size`` is
    an upper bound: a small corpus stops producing merges earlier.
    """
    n_base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < n_base + len(FORMAT_TAGS) * 8:
        raise ValueError(f"vocab_size must be at least {n_base + len(FORMAT_TAGS) * 8}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_with_tags(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=1_000_000,
    )
    # Registered as special so decode(skip_special_tokens=True) drops them.
    fast.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_or_train_tokenizer(
    cache_dir: Path | str,
    key: str,
    texts_fn: Callable[[], Iterable[str]],
    vocab_size: int = 512,
) -> PreTrainedTokenizerBase:
    """Load the tokenizer cached under ``cache_dir/key``, or train it on ``texts_fn()`` and cache it.

    ``key`` must name what the tokenizer was trained on (environment, vocabulary size, data
    version): a stale cache is never detected. The write is atomic (temporary folder + rename), so
    concurrent processes never read a half-written tokenizer.
    """
    if not key or os.sep in key or (os.altsep and os.altsep in key) or key in (".", ".."):
        raise ValueError(f"tokenizer cache key must be a plain folder name, got {key!r}")
    final = Path(cache_dir) / key
    if not (final / "tokenizer_config.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        tokenizer = train_tiny_tokenizer(texts_fn(), vocab_size=vocab_size)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
        try:
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its copy first (the target exists and is not empty): use that.
            shutil.rmtree(tmp, ignore_errors=True)
            if not (final / "tokenizer_config.json").is_file():
                raise
    return AutoTokenizer.from_pretrained(final)


def tiny_qwen2_config(
    vocab_size: int,
    hidden_size: int = 192,
    num_layers: int = 3,
    num_heads: int = 4,
    intermediate_size: int = 768,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    num_key_value_heads: int | None = None,
    **extra: object,
) -> Qwen2Config:
    """A small ``Qwen2Config`` (the defaults give 1.84M parameters at a 369-token vocabulary).

    ``extra`` goes to ``Qwen2Config`` unchanged (e.g. ``rms_norm_eps``).
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    return transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads if num_key_value_heads is None else num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        attention_dropout=0.0,
        **extra,
    )
