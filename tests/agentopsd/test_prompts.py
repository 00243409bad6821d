"""Prompt views, the action parser, history trimming and the evaluation skill guard."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentopsd.prompts import HistoryEntry, PromptBuilder, SkillLeakError, assert_no_skills, parse_action


@pytest.mark.parametrize(
    "text, fmt, want",
    [
        ("<action>go forward</action>", "action", "go forward"),
        ("<think>the key is left</think><action> turn   left </action>", "think_action", "turn left"),
        ("junk <action>pick up</action> <action>drop</action>", "action", "pick up"),
        ("no tags at all", "action", None),
        ("<action></action>", "action", None),
        ("<action>unterminated", "action", None),
        ("<think>x</think><search>capital of Lorn</search>", "search_r1", "<search>capital of Lorn</search>"),
        ("<answer>Vesk</answer><search>q</search>", "search_r1", "<answer>Vesk</answer>"),
        ("<search>open", "search_r1", None),
    ],
)
def test_parse_action(text, fmt, want):
    assert parse_action(text, fmt) == want


@given(st.text(max_size=300))
def test_parser_never_raises(text):
    for fmt in ("action", "think_action", "search_r1"):
        out = parse_action(text, fmt)
        assert out is None or isinstance(out, str)


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match="output_format"):
        PromptBuilder(tokenizer=None, output_format="xml")


def test_teacher_view_inserts_the_skill_and_nothing_else(tiny_walk_policy):
    _, tok = tiny_walk_policy
    b = PromptBuilder(tok)
    hist = [HistoryEntry("You are at position 0.", "right")]
    student = tok.decode(b.build("walk to 3", hist, "You are at position 1.", ["left", "right"]))
    teacher = tok.decode(b.build("walk to 3", hist, "You are at position 1.", ["left", "right"], skill="- go right"))
    assert "go right" in teacher and "go right" not in student
    assert teacher.replace("Skills for this task:\n- go right\n\n", "") == student


def test_history_window_and_trimming(tiny_walk_policy):
    _, tok = tiny_walk_policy
    hist = [HistoryEntry(f"observation number {i} " * 5, "right") for i in range(6)]
    b = PromptBuilder(tok, history_window=4)
    full = b.build("walk", hist, "now", None)
    assert "number 1 " not in tok.decode(full) and "number 2 " in tok.decode(full)  # window of 4
    tight = PromptBuilder(tok, history_window=4, max_prompt_tokens=len(full) - 5)
    ids = tight.build("walk", hist, "now", None)
    assert len(ids) <= tight.max_prompt_tokens and tight.stats["history_trimmed"] >= 1
    assert "now" in tok.decode(ids)  # the current observation is never cut
    none_fit = PromptBuilder(tok, max_prompt_tokens=5)
    ids = none_fit.build("walk", hist, "the current observation", None)
    assert "the current observation" in tok.decode(ids) and none_fit.stats["prompt_overflow"] == 1


def test_skill_guard():
    assert_no_skills("Task: go to the red ball", ["Keys open doors of their colour."])
    with pytest.raises(SkillLeakError):
        assert_no_skills("Task: x\nSkills: Keys open doors of their colour.", ["Keys open doors of their colour."])


def test_guard_fires_inside_evaluation(tiny_walk_policy):
    """A prompt builder that leaks the skill into the student view is caught at evaluation."""
    from tests.agentopsd.test_module import make_module

    module = make_module(tiny_walk_policy)
    module.trainer = None
    collector = module.collector
    leaky = collector.prompts.user_message

    def leaking_user_message(task, history, observation, admissible, skill=""):
        return leaky(task, history, observation, admissible, skill="- If the goal is ahead of you, go right.")

    collector.prompts.user_message = leaking_user_message
    with pytest.raises(SkillLeakError):
        module.evaluate()
