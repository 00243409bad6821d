"""Pieces every text environment shares: the text spaces and action cleaning."""

from __future__ import annotations

import string

from gymnasium import spaces

# Gymnasium's default Text charset is alphanumeric only: it rejects spaces and brackets.
CHARSET = frozenset(string.printable)
MAX_OBS_CHARS = 16_384
MAX_ACTION_CHARS = 1_024


def observation_space(max_length: int = MAX_OBS_CHARS) -> spaces.Text:
    return spaces.Text(min_length=0, max_length=max_length, charset=CHARSET)


def action_space(max_length: int = MAX_ACTION_CHARS) -> spaces.Text:
    return spaces.Text(min_length=0, max_length=max_length, charset=CHARSET)


def clean_text(text: str, max_length: int = MAX_OBS_CHARS) -> str:
    """Keep an observation inside the observation space: printable ASCII, bounded length."""
    out = "".join(ch if ch in CHARSET else "?" for ch in text)
    return out[:max_length]


def normalize_action(action: object) -> str:
    """Lower-case, strip, collapse whitespace; any non-string becomes ''."""
    if not isinstance(action, str):
        return ""
    return " ".join(action.strip().lower().split())
