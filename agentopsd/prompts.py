"""Prompt views, output formats and the action parser.

The student view is what the agent sees: the task, a window of recent observations and
actions, the current observation, the admissible actions and the output format. The
teacher view is the same context with the retrieved skill block inserted: same weights,
a different prompt, the same history window (the paper's step 2).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

log = logging.getLogger(__name__)

FORMATS = {
    # name: (instruction shown to the model, stop strings)
    "action": ("Reply with the next action only, as <action>...</action>.", ("</action>",)),
    "think_action": (
        "Think step by step inside <think>...</think>, then give the next action as <action>...</action>.",
        ("</action>",),
    ),
    "search_r1": (
        "Reason inside <think>...</think> if needed. To search, write <search>query</search>; "
        "to finish, write <answer>answer</answer>.",
        ("</search>", "</answer>"),
    ),
}

_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL)
_SEARCH_R1 = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


class SkillLeakError(RuntimeError):
    """A skill string reached an evaluation prompt: skills are training-only."""


def parse_action(text: str, fmt: str) -> str | None:
    """The environment action in a generation, or None when the output does not follow ``fmt``.

    ``action``/``think_action``: the content of the first ``<action>...</action>``.
    ``search_r1``: the first complete ``<search>`` or ``<answer>`` tag, passed on whole
    (the Search-QA environment reads the tags itself).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown output format {fmt!r}; choose one of {sorted(FORMATS)}")
    if fmt == "search_r1":
        m = _SEARCH_R1.search(text)
        return m.group(0).strip() if m else None
    m = _ACTION.search(text)
    if m is None:
        return None
    action = " ".join(m.group(1).split())
    return action or None


@dataclass(frozen=True)
class HistoryEntry:
    observation: str
    action: str


class PromptViews(NamedTuple):
    """The two prompt views of one turn."""

    student: list[int]
    """h_k: what the policy acts on."""
    teacher: list[int]
    """h+_k: the same context with ``skill`` inserted (equal to ``student`` when ``skill`` is empty)."""
    skill: str
    """The skill block the teacher view holds: the retrieved one, or its first lines when it had to be shortened."""


@dataclass
class PromptBuilder:
    """Builds chat messages and token ids for both views, trimming history to fit the context."""

    tokenizer: object
    """A transformers tokenizer with a chat template."""
    output_format: str = "action"
    history_window: int = 2
    """How many past (observation, action) pairs the prompt shows."""
    max_prompt_tokens: int = 1024
    system_prompt: str = "You are an agent acting in a text environment. Solve the task in as few steps as possible."
    show_admissible: bool = True
    max_admissible: int = 50
    """At most this many admissible actions are listed (ALFWorld rooms list hundreds)."""
    stats: dict[str, int] = field(default_factory=lambda: {"history_trimmed": 0, "prompt_overflow": 0, "skill_trimmed": 0})

    def __post_init__(self) -> None:
        if self.output_format not in FORMATS:
            raise ValueError(f"rollout.output_format must be one of {sorted(FORMATS)}, got {self.output_format!r}")
        if self.history_window < 0:
            raise ValueError(f"rollout.history_window must be >= 0, got {self.history_window}")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return FORMATS[self.output_format][1]

    def user_message(
        self, task: str, history: Sequence[HistoryEntry], observation: str, admissible: Sequence[str] | None, skill: str = ""
    ) -> str:
        parts = [f"Task: {task}"]
        if skill:
            parts.append(f"Skills for this task:\n{skill}")
        if history:
            lines = []
            for entry in history:
                lines.append(f"Observation: {entry.observation}")
                lines.append(f"Action: {entry.action}")
            parts.append("Recent history:\n" + "\n".join(lines))
        parts.append(f"Current observation:\n{observation}")
        if self.show_admissible and admissible:
            shown = list(admissible)[: self.max_admissible]
            parts.append("Admissible actions: " + ", ".join(shown))
        parts.append(FORMATS[self.output_format][0])
        return "\n\n".join(parts)

    def encode(self, user: str) -> list[int]:
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _window(self, task: str, history: Sequence[HistoryEntry], observation: str, admissible: Sequence[str] | None) -> tuple[list[int], list]:
        """The student view's ids and history window: the oldest history is dropped first while over
        ``max_prompt_tokens``; the current observation is never cut (an over-long prompt is kept and counted)."""
        window = list(history)[-self.history_window :] if self.history_window else []
        while True:
            ids = self.encode(self.user_message(task, window, observation, admissible))
            if len(ids) <= self.max_prompt_tokens:
                return ids, window
            if not window:
                self.stats["prompt_overflow"] += 1
                n = self.stats["prompt_overflow"]
                if n & (n - 1) == 0:  # warn at 1, 2, 4, 8, ... occurrences: counted, not a flood
                    log.warning(
                        "prompt of %d tokens exceeds max_prompt_tokens=%d with no history left (%d times so far); "
                        "the current observation is never cut: raise env.max_prompt_tokens", len(ids), self.max_prompt_tokens, n
                    )
                return ids, window
            window = window[1:]
            self.stats["history_trimmed"] += 1

    def build_views(
        self, task: str, history: Sequence[HistoryEntry], observation: str, admissible: Sequence[str] | None, skill: str = ""
    ) -> PromptViews:
        """Both views of one turn, which differ by the skill block alone.

        The history window is the student's (trimmed by the student's own rule), so the policy sees
        the same prompt whether or not a teacher view is built. The teacher view is that very
        context with the skill block inserted; when it would exceed ``max_prompt_tokens`` the skill
        block is shortened (whole lines dropped from its end), never the history: otherwise the gap
        would measure "less history" as well as "the skill". A student prompt that already
        overflows leaves no room, and its teacher view gets no skill (counted in ``skill_trimmed``).
        """
        student, window = self._window(task, history, observation, admissible)
        if not skill:
            return PromptViews(student, student, "")
        lines = skill.splitlines()

        def teacher(n: int) -> list[int]:
            return self.encode(self.user_message(task, window, observation, admissible, "\n".join(lines[:n])))

        ids = teacher(len(lines))
        if len(ids) <= self.max_prompt_tokens:
            return PromptViews(student, ids, skill)
        self.stats["skill_trimmed"] += 1
        low, high = 0, len(lines) - 1  # the most lines that fit: the teacher's length grows with n
        while low < high:
            mid = (low + high + 1) // 2
            if len(teacher(mid)) <= self.max_prompt_tokens:
                low = mid
            else:
                high = mid - 1
        kept = "\n".join(lines[:low])
        return PromptViews(student, teacher(low) if kept else student, kept)

    def build(
        self, task: str, history: Sequence[HistoryEntry], observation: str, admissible: Sequence[str] | None, skill: str = ""
    ) -> list[int]:
        """Token ids of one view: the student's, or with ``skill`` the teacher's (see :meth:`build_views`)."""
        views = self.build_views(task, history, observation, admissible, skill)
        return views.teacher if skill else views.student


def assert_no_skills(prompt_text: str, skill_lines: Sequence[str]) -> None:
    """The evaluation guard: raise if any skill line appears in an evaluation prompt."""
    for line in skill_lines:
        if line and line in prompt_text:
            raise SkillLeakError(f"skill text reached an evaluation prompt: {line[:80]!r}")
