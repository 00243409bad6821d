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
    incremental: bool = True
    """Build each prompt from token pieces cached across turns (the chat template's frame and each
    history entry tokenized once), not by re-templating the whole prompt every turn. Used only when
    a probe finds it gives the full template's tokens exactly for this tokenizer (see :meth:`pieces_ok`)."""
    _pieces: dict = field(default_factory=dict, repr=False)
    _piece_mode: bool | None = field(default=None, repr=False)

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

    # ------------------------------------------------------------------ pieces
    #
    # The user message is "\n\n".join(parts); each part (and each history line pair) is tokenized on
    # its own and cached, and the prompt is the concatenation of the frame's head, the pieces and the
    # frame's tail. Pieces are cut right after a newline and before a letter ("Task:", "Observation:",
    # ...), where byte-level BPE pre-tokenizers (Qwen2.5's among them) never join two characters into
    # one pre-token, so the pieces' tokens are the whole text's. A probe checks this per tokenizer.

    def _frame(self) -> tuple[list[int], list[int]]:
        """Token ids of the chat template around the user message: (head, tail), templated once."""
        frame = self._pieces.get("__frame__")
        if frame is None:
            marker = "\x00AGENTOPSD\x00"
            messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": marker}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            head, _, tail = text.partition(marker)
            frame = self._pieces["__frame__"] = (self._tokens(head), self._tokens(tail))
        return frame

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _piece(self, text: str) -> list[int]:
        ids = self._pieces.get(text)
        if ids is None:
            if len(self._pieces) > 50_000:  # a long run's pieces of finished episodes: start over
                frame = self._pieces.get("__frame__")
                self._pieces.clear()
                if frame is not None:
                    self._pieces["__frame__"] = frame
            ids = self._pieces[text] = self._tokens(text)
        return ids

    def _parts(self, task: str, observation: str, admissible: Sequence[str] | None, skill: str = "") -> tuple[list[str], list[str]]:
        """The user message's texts before the history and after it (each ends with the separator that follows it)."""
        before = [f"Task: {task}\n\n"]
        if skill:
            before.append(f"Skills for this task:\n{skill}\n\n")
        after = [f"Current observation:\n{observation}\n\n"]
        if self.show_admissible and admissible:
            after.append("Admissible actions: " + ", ".join(list(admissible)[: self.max_admissible]) + "\n\n")
        after.append(FORMATS[self.output_format][0])
        return before, after

    def _entry(self, entry: HistoryEntry, last: bool) -> list[int]:
        return self._piece(f"Observation: {entry.observation}\nAction: {entry.action}" + ("\n\n" if last else "\n"))

    def _assemble(self, before: list[str], window: Sequence[HistoryEntry], after: list[str]) -> list[int]:
        head, tail = self._frame()
        ids = list(head)
        for text in before:
            ids += self._piece(text)
        if window:
            ids += self._piece("Recent history:\n")
            for i, entry in enumerate(window):
                ids += self._entry(entry, i == len(window) - 1)
        for text in after:
            ids += self._piece(text)
        return ids + tail

    def pieces_ok(self) -> bool:
        """Whether piecewise tokens equal the full template's for this tokenizer, probed once on texts with
        the joins that could go wrong (punctuation, digits, spaces and newlines at the ends of pieces)."""
        if self._piece_mode is None:
            ok = self.incremental
            if ok:
                try:
                    hist = [HistoryEntry("You arrive at loc 3.  ", "go to desk 1"), HistoryEntry("Nothing happens.\n", "look 2,"),
                            HistoryEntry("On the desk 1, you see a pen 2, and a mug 1!", "take mug 1 from desk 1")]
                    for window, skill, adm in ((hist, "- Look first.\n- Then act: 1, 2.", ["go to x 1", "look"]), ([], "", None), (hist[:1], "", ["a"])):
                        for obs in ("You see a cabinet 4, a drawer 12.", "12", "  spaced out  \n"):
                            full = self.encode(self.user_message("put a clean mug in desk.", window, obs, adm, skill))
                            before, after = self._parts("put a clean mug in desk.", obs, adm, skill)
                            ok = ok and full == self._assemble(before, window, after)
                except Exception as err:  # a tokenizer without a text template: the full path only
                    log.debug("piecewise prompts unavailable: %s", err)
                    ok = False
                if not ok:
                    log.info("prompts: this tokenizer's pieces do not join to the full template's tokens; every prompt is templated whole")
            self._piece_mode = ok
        return self._piece_mode

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
        if self.pieces_ok():
            return self._window_from_pieces(task, window, observation, admissible)
        while True:
            ids = self.encode(self.user_message(task, window, observation, admissible))
            if len(ids) <= self.max_prompt_tokens:
                return ids, window
            if not window:
                self._overflow(len(ids))
                return ids, window
            window = window[1:]
            self.stats["history_trimmed"] += 1

    def _window_from_pieces(self, task: str, window: list, observation: str, admissible: Sequence[str] | None) -> tuple[list[int], list]:
        """:meth:`_window` from cached pieces: the length of each choice of window is a sum, no re-templating."""
        before, after = self._parts(task, observation, admissible)
        fixed = sum(map(len, self._frame())) + sum(len(self._piece(t)) for t in before + after)
        entries = [len(self._entry(e, i == len(window) - 1)) for i, e in enumerate(window)]
        header = len(self._piece("Recent history:\n"))
        drop = 0
        while window[drop:] and fixed + header + sum(entries[drop:]) > self.max_prompt_tokens:
            drop += 1
        if drop:
            self.stats["history_trimmed"] += drop
            window = window[drop:]
        ids = self._assemble(before, window, after)
        if len(ids) > self.max_prompt_tokens:
            self._overflow(len(ids))
        return ids, window

    def _overflow(self, n_tokens: int) -> None:
        self.stats["prompt_overflow"] += 1
        n = self.stats["prompt_overflow"]
        if n & (n - 1) == 0:  # warn at 1, 2, 4, 8, ... occurrences: counted, not a flood
            log.warning(
                "prompt of %d tokens exceeds max_prompt_tokens=%d with no history left (%d times so far); "
                "the current observation is never cut: raise env.max_prompt_tokens", n_tokens, self.max_prompt_tokens, n
            )

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
            if self.pieces_ok():  # only the skill piece is new: the rest are the student's cached pieces
                before, after = self._parts(task, observation, admissible, "\n".join(lines[:n]))
                return self._assemble(before, window, after)
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
