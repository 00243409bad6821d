"""The tiny policy of the embedded default and the tests: no download, built from a config.

A byte-level BPE tokenizer is trained on text the environment itself produces (expert
episodes rendered through the same prompt template, plus the skill file), then a
``Qwen2ForCausalLM`` (the class of Qwen2.5, so the code path is the real one) is built
from a small config. Both are cached under ``cache_dir``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym

from agentopsd.rollout.prompts import FORMATS, HistoryEntry, PromptBuilder
from agentopsd.rollout.skills import SkillBank

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path(os.environ.get("AGENTOPSD_CACHE", Path.home() / ".cache" / "agentopsd"))


def environment_texts(env_id: str, episodes: int = 40, max_steps: int = 60, output_format: str = "action", skills: str | None = None) -> Iterator[str]:
    """Rendered prompts and expert actions of a few expert episodes (train split)."""
    builder = PromptBuilder(tokenizer=None, output_format=output_format)
    env = gym.make(env_id, split="train", disable_env_checker=True)
    try:
        for ep in range(episodes):
            obs, info = env.reset(seed=ep)
            task = info["task"]  # a reset's info holds the task; a step's need not (envs/base.py: STEP_INFO_KEYS)
            history: list[HistoryEntry] = []
            for _ in range(max_steps):
                action = env.unwrapped.expert_action()
                yield builder.user_message(task, history[-2:], obs, info.get("admissible_actions"))
                yield f"<action>{action}</action>" if output_format != "search_r1" else action
                history.append(HistoryEntry(obs, action))
                obs, _, term, trunc, info = env.step(action)
                if term or trunc:
                    break
    finally:
        env.close()
    yield builder.system_prompt
    for instruction, _ in FORMATS.values():
        yield instruction
    if skills:
        yield SkillBank.for_env(skills).retrieve("", "").render()
        for group in (*SkillBank.for_env(skills).categories, *SkillBank.for_env(skills).situations):
            yield "\n".join(group.skills + group.mistakes)


def tiny_policy(
    env_id: str,
    skills: str | None = None,
    output_format: str = "action",
    vocab_size: int = 512,
    hidden_size: int = 192,
    num_layers: int = 3,
    num_heads: int = 4,
    intermediate_size: int = 768,
    num_kv_heads: int = 1,
    text_episodes: int = 40,
    seed: int = 0,
    cache_dir: str | None = None,
):
    """``(model, tokenizer)``: the cached tiny tokenizer and a freshly initialized tiny Qwen2.

    ``num_kv_heads`` < ``num_heads`` is grouped-query attention, as in every Qwen2.5 model (3B: 16
    query heads share 2 key/value heads): generation then runs the real models' GQA code paths, and
    each decode step reads a KV cache ``num_heads / num_kv_heads`` times smaller.
    """
    from agentopsd.models.loading import build_tiny_policy
    from agentopsd.models.tokenizer import load_or_train_tokenizer

    cache = Path(cache_dir) if cache_dir else DEFAULT_CACHE / "tokenizers"
    key = hashlib.sha1(f"{env_id}|{skills}|{output_format}|{vocab_size}|{text_episodes}|v1".encode()).hexdigest()[:12]
    if not (cache / key / "tokenizer_config.json").is_file():  # seconds, once per environment and size
        log.info("tiny policy: training a %d-token BPE tokenizer on %d expert episodes of %s (cached in %s)", vocab_size, text_episodes, env_id, cache)
    tokenizer = load_or_train_tokenizer(
        cache, key, lambda: environment_texts(env_id, text_episodes, output_format=output_format, skills=skills), vocab_size
    )
    overrides = {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
                 "intermediate_size": intermediate_size, "num_key_value_heads": num_kv_heads}
    model = build_tiny_policy(tokenizer, overrides, seed=seed)
    return model, tokenizer
