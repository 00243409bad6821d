"""The hint table: the expert's states, both prompt views, the split, and the reply log-probs against a hand computation."""

from __future__ import annotations

import math

import gymnasium as gym
import pytest
import torch

import agentopsd.envs  # noqa: F401  (registers the ids)
from agentopsd.rollout.prompts import PromptBuilder
from agentopsd.rollout.skills import SkillBank
from agentopsd.study.hint_table import (
    ScoredTurn,
    expert_turns,
    reply_ids,
    score_turns,
    skill_applies,
    summarize,
)

PICKUP = "agentopsd/BabyAI-PickupObj-v0"
KEYDOOR = "agentopsd/BabyAI-KeyDoorBoxS5-v0"
PICKUP_BANK = ("babyai", 0)  # the quickstart's: category skills and mistakes only (env.skill_max_general=0)


def _env(env_id: str, max_turns: int) -> gym.Env:
    return gym.make(env_id, split="train", max_episode_steps=max_turns, disable_env_checker=True, compute_expert_steps=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small tiny policy whose tokenizer knows both BabyAI skill files (random weights: the numbers only need to differ)."""
    from agentopsd.models.tiny import tiny_policy

    torch.manual_seed(0)
    model, tok = tiny_policy(KEYDOOR, skills="babyai_keydoor", vocab_size=400, hidden_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, intermediate_size=64, text_episodes=3,
                             cache_dir=str(tmp_path_factory.mktemp("tok")))
    model.eval()
    return model, tok


def _builder(tok) -> PromptBuilder:
    return PromptBuilder(tok, output_format="action", history_window=2, max_prompt_tokens=4096, system_prompt="Act in the grid world.")


def test_a_skill_applies_where_the_block_names_the_experts_action() -> None:
    block = SkillBank.for_env(*PICKUP_BANK[:1], max_general=PICKUP_BANK[1]).retrieve("pickup", "pick up the red box").render()
    assert skill_applies(block, "pick up")
    # the block is there on a move, but says nothing about it; "Toggling a box ..." names no action 'toggle'
    assert not skill_applies(block, "go forward") and not skill_applies(block, "turn left")
    assert not skill_applies(block, "toggle")
    assert not skill_applies("", "pick up")  # a turn-scoped bank's turn without a situation


def test_pickup_expert_turns_split_on_the_pick_up() -> None:
    """Hand-checked case: on PickupObj with the quickstart's bank, the one turn a skill applies to is the expert's
    pick-up, which is also the decisive (winning) last turn; every turn holds the same episode block."""
    bank = SkillBank.for_env("babyai", max_general=0)
    turns = expert_turns(_env(PICKUP, 12), 3, 12, bank)
    assert [t.expert for t in turns] == ["go forward", "go forward", "turn right", "go forward", "go forward", "pick up"]
    assert [skill_applies(t.block, t.expert) for t in turns] == [False] * 5 + [True]
    assert [t.decisive for t in turns] == [False] * 5 + [True]
    assert len({t.block for t in turns}) == 1 and "'pick up'" in turns[0].block
    # each turn's history is the turns before it, as the collector keeps it
    assert [h.action for h in turns[-1].history] == [t.expert for t in turns[:-1]]
    assert [h.observation for h in turns[-1].history] == [t.observation for t in turns[:-1]]


def test_turn_scoped_bank_gives_a_block_only_where_a_situation_shows() -> None:
    bank = SkillBank.for_env("babyai_keydoor")
    turns = expert_turns(_env(KEYDOOR, 32), 0, 32, bank)
    assert turns[-1].decisive and not any(t.decisive for t in turns[:-1])
    for t in turns:
        assert t.block == bank.situational(t.observation).render()
    assert any(t.block for t in turns) and any(not t.block for t in turns)


def test_views_differ_by_the_skill_block_alone(tiny) -> None:
    model, tok = tiny
    builder = _builder(tok)
    turns = expert_turns(_env(PICKUP, 12), 3, 12, SkillBank.for_env("babyai", max_general=0))
    for t in turns:
        views = builder.build_views(t.task, list(t.history), t.observation, t.admissible, skill=t.block)
        student, teacher = tok.decode(views.student), tok.decode(views.teacher)
        head = f"Task: {t.task}\n\n"
        assert head in student
        assert teacher == student.replace(head, head + f"Skills for this task:\n{t.block}\n\n", 1)


def _hand_logprob(model, prompt: list[int], reply: list[int]) -> float:
    """log p(reply | prompt) from one full forward of the model: log_softmax of the logits at each reply position."""
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return float(sum(logp[len(prompt) + j - 1, tok_id] for j, tok_id in enumerate(reply)))


def test_reply_logprobs_equal_a_hand_computation_from_the_logits(tiny) -> None:
    """KeyDoor mixes turns with and without a block, so each turn's teacher score must be its own row's."""
    model, tok = tiny
    builder = _builder(tok)
    turns = expert_turns(_env(KEYDOOR, 32), 0, 32, SkillBank.for_env("babyai_keydoor"))
    scored = score_turns(model, tok, builder, turns, pad_id=tok.pad_token_id)
    assert len(scored) == len(turns)
    for t, s in zip(turns, scored):
        views = builder.build_views(t.task, list(t.history), t.observation, t.admissible, skill=t.block)
        reply = tok.encode(f"<action>{t.expert}</action>", add_special_tokens=False)
        assert s.reply_tokens == len(reply) and s.skill == t.block
        assert s.lp_without == pytest.approx(_hand_logprob(model, views.student, reply), abs=1e-4)
        assert s.lp_with == pytest.approx(_hand_logprob(model, views.teacher, reply), abs=1e-4)
        if not t.block:  # the same tokens: scored once, the difference is 0 exactly
            assert s.lp_with == s.lp_without
        else:
            assert s.lp_with != s.lp_without
        assert s.applies == skill_applies(t.block, t.expert)
        # among the env's actions' replies: a log-softmax over the seven replies' hand log-probs
        assert t.expert in t.admissible
        named = [a for a in t.admissible if skill_applies(t.block, a)]  # what the block quotes (the key: 'pick up')
        assert bool(named) == bool(t.block)
        for prompt, rel, top, share in ((views.student, s.rel_without, s.top_without, s.named_without),
                                        (views.teacher, s.rel_with, s.top_with, s.named_with)):
            hand = {a: _hand_logprob(model, prompt, tok.encode(f"<action>{a}</action>", add_special_tokens=False))
                    for a in t.admissible}
            norm = math.log(sum(math.exp(v) for v in hand.values()))
            assert rel == pytest.approx(hand[t.expert] - norm, abs=1e-4)
            assert top == all(hand[t.expert] > v for a, v in hand.items() if a != t.expert)
            if named:
                assert share == pytest.approx(math.log(sum(math.exp(hand[a]) for a in named)) - norm, abs=1e-4)
            else:
                assert math.isnan(share)


def test_scores_at_a_temperature_divide_the_logits(tiny) -> None:
    model, tok = tiny
    builder = _builder(tok)
    turn = expert_turns(_env(PICKUP, 12), 3, 12, SkillBank.for_env("babyai", max_general=0))[-1]
    hot = score_turns(model, tok, builder, [turn], pad_id=tok.pad_token_id, temperature=0.5)[0]
    views = builder.build_views(turn.task, list(turn.history), turn.observation, turn.admissible, skill=turn.block)
    reply = reply_ids(tok, turn.expert, "action")
    ids = torch.tensor([views.teacher + reply])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double() / 0.5, dim=-1)
    hand = float(sum(logp[len(views.teacher) + j - 1, i] for j, i in enumerate(reply)))
    assert hot.lp_with == pytest.approx(hand, abs=1e-4)


def test_reply_format_other_than_action_is_refused(tiny) -> None:
    with pytest.raises(ValueError, match="output_format=action"):
        reply_ids(tiny[1], "pick up", "think_action")


def _turn(task: int, k: int, lp_without: float, lp_with: float, applies: bool = False, decisive: bool = False) -> ScoredTurn:
    # the relative log-probs move half as much as the raw ones; the expert is on top with the block where it rose
    return ScoredTurn(task_index=task, turn=k, expert="x", skill="s" if applies else "", applies=applies, decisive=decisive,
                      lp_without=lp_without, lp_with=lp_with, reply_tokens=3, rel_without=-1.0,
                      rel_with=-1.0 + (lp_with - lp_without) / 2, top_without=False, top_with=lp_with > lp_without,
                      named_without=-2.0 if applies or decisive else math.nan, named_with=-1.5 if applies else -2.25)


def test_summary_by_hand() -> None:
    turns = [_turn(0, 0, -2.0, -1.0, applies=True, decisive=True), _turn(0, 1, -1.0, -1.0),
             _turn(1, 0, -3.0, -4.0), _turn(1, 1, -1.0, -0.5, applies=True), _turn(2, 0, -1.0, -1.0)]
    every = summarize(turns, "all", resamples=200)
    assert every.turns == 5 and every.tasks == 3 and every.diff.n == 3  # the interval resamples tasks, not turns
    assert every.diff.mean == pytest.approx((1.0 + 0.0 - 1.0 + 0.5 + 0.0) / 5)
    assert every.lp_without == pytest.approx(-8.0 / 5) and every.lp_with == pytest.approx(-7.5 / 5)
    assert every.share_raised == pytest.approx(2 / 5)  # strictly raised: the equal turns do not count
    assert every.rel_diff.mean == pytest.approx(every.diff.mean / 2) and every.rel_diff.n == 3
    assert (every.top_without, every.top_with) == (0.0, pytest.approx(2 / 5))
    # the named actions' shift: only the turns whose block names one (applies: +0.5 twice; the decisive one: +0.5)
    assert every.named_diff.n == 2 and every.named_diff.mean == pytest.approx(0.5)
    applies = summarize(turns, "applies", resamples=200)
    assert (applies.turns, applies.tasks, applies.diff.mean, applies.share_raised) == (2, 2, 0.75, 1.0)
    none = summarize(turns, "none", resamples=200)
    assert (none.turns, none.diff.mean) == (3, pytest.approx(-1 / 3))
    decisive = summarize(turns, "decisive", resamples=200)
    assert (decisive.turns, decisive.diff.mean) == (1, 1.0)
    other = summarize(turns, "other", resamples=200)
    assert other.turns == 4
    empty = summarize([t for t in turns if not t.decisive], "decisive")
    assert empty.turns == 0 and empty.diff.n == 0 and math.isnan(empty.lp_with)
    with pytest.raises(ValueError, match="unknown split"):
        summarize(turns, "informed")
