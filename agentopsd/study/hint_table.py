"""What the hint does: the expert action's log-prob with and without the skill block, on the expert's own states.

The teacher view is the student view plus a skill block (``PromptBuilder.build_views``). Whether that
block carries evidence a policy can read shows in one number per turn: log p(expert reply | teacher view)
- log p(expert reply | student view), the expert reply being ``<action>a</action>`` tokenized as the
generator emits it (its stop string ``</action>`` ends generation; no end-of-turn token follows). The
states are the ones the environment's expert visits on fixed training tasks, so the difference measures
the hint, not the policy's own mistakes.

Turns are split by whether a skill applies. A skill *applies* on a turn when the skill block the
teacher view holds there names the expert's action the way the skill files write an action: in single
quotes (``'pick up'``, ``'toggle'``). With the quickstart's episode-scoped bank (category skills only)
that is exactly the turns whose expert action is ``pick up``; with a turn-scoped bank (KeyDoor) a turn
with no situation in view holds no block and never applies (its two views are the same tokens, the
difference is 0 exactly). A turn is *decisive* when the expert's action on it wins the episode.

Everything here is pure given a model; ``scripts/hint_table.py`` composes the run config and writes the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from agentopsd.rollout.prompts import HistoryEntry, PromptBuilder
from agentopsd.rollout.skills import SkillBank
from agentopsd.study.credit_quality import Estimate, cluster_bootstrap_mean
from agentopsd.study.groundtruth import State, advance

SPLITS = ("all", "applies", "none", "decisive", "other")
"""``applies``/``none``: a skill names the expert's action on the turn, or not (:func:`skill_applies`);
``decisive``/``other``: the expert's action wins the episode, or not."""


@dataclass(frozen=True)
class ExpertTurn:
    """One state the expert visits, with what both prompt views need."""

    task_index: int
    turn: int
    task: str
    history: tuple[HistoryEntry, ...]
    observation: str
    admissible: tuple[str, ...] | None
    block: str
    """The skill block the trainer's teacher view would hold on this turn ("" where the bank gives none)."""
    expert: str
    """The expert's action in this state."""
    decisive: bool
    """The expert's action won the episode."""


@dataclass(frozen=True)
class ScoredTurn:
    """One expert turn's reply log-prob under each view."""

    task_index: int
    turn: int
    expert: str
    skill: str
    """The skill block the teacher view held (the retrieved one, shortened if it did not fit)."""
    applies: bool
    decisive: bool
    lp_without: float
    """log p(expert reply | student view): the sum over the reply's tokens."""
    lp_with: float
    """log p(expert reply | teacher view)."""
    reply_tokens: int

    @property
    def diff(self) -> float:
        return self.lp_with - self.lp_without


def skill_applies(block: str, action: str) -> bool:
    """Whether the skill block names ``action`` as an action: quoted, as the skill files write actions.

    Why quotes: the episode-scoped BabyAI block is on every turn of a PickupObj episode, but it tells what to
    do only when it names the move ('pick up'); 'go forward' and the turns are never named, so the block says
    nothing about those turns' expert action. An empty block (a turn-scoped bank with no situation) never applies.
    """
    return bool(block) and bool(action) and f"'{action}'" in block


def turn_block(bank: SkillBank | None, skill_key: str, task: str, first_observation: str, observation: str) -> str:
    """The skill block of a turn as the collector builds it: an episode-scoped bank's block once from the
    reset observation, a turn-scoped bank's from this turn's observation ("" without a bank)."""
    if bank is None:
        return ""
    if bank.scope == "turn":
        return bank.block(skill_key, task, observation)
    return bank.block(skill_key, task, first_observation)


def expert_turns(env: gym.Env, task_index: int, max_turns: int, bank: SkillBank | None) -> list[ExpertTurn]:
    """The expert plays training task ``task_index`` to its end (or ``max_turns``); one record per state it acts in.

    The episode is played with the study's ``advance`` (the collector's own step and history rules), so each
    record's history and observation are what the trainer's prompt would show on that turn.
    """
    obs, info = env.reset(options={"task_index": task_index})
    task = str(info.get("task", ""))
    skill_key = str(info.get("skill_key", ""))
    admissible = info.get("admissible_actions")
    state = State(env=env, turn=0, task=task, observation=obs, admissible=admissible)
    out: list[ExpertTurn] = []
    while not state.done and state.turn < max_turns:
        expert = env.unwrapped.expert_action()
        if expert == "done":  # the bot sees no way left: not a state with an expert action to score
            break
        record = dict(task_index=task_index, turn=state.turn, task=task, history=tuple(state.history),
                      observation=state.observation,
                      admissible=tuple(state.admissible) if state.admissible is not None else None,
                      block=turn_block(bank, skill_key, task, obs, state.observation), expert=expert)
        advance(state, expert, expert)
        out.append(ExpertTurn(**record, decisive=state.won))
    return out


def reply_ids(tokenizer, action: str, output_format: str) -> list[int]:
    """The generator's reply for ``action``: ``<action>a</action>`` tokenized alone (the prompt ends with the
    chat template's assistant header, so the reply's tokens do not join with it)."""
    if output_format != "action":
        raise ValueError(f"the hint table scores the expert's reply in env.output_format=action, got {output_format!r} "
                         "(a think_action reply has reasoning the expert does not write)")
    return list(tokenizer.encode(f"<action>{action}</action>", add_special_tokens=False))


def score_turns(model, tokenizer, builder: PromptBuilder, turns: Sequence[ExpertTurn], *, pad_id: int,
                temperature: float = 1.0) -> list[ScoredTurn]:
    """Both views of every turn (``build_views``, as the collector calls it) and the expert reply's log-prob
    under each, from the scorer's no-grad forward. A turn whose two views are the same tokens is scored once
    (its difference is 0 exactly)."""
    from agentopsd.rollout.scoring import continuation_logprobs

    if not turns:
        return []
    views = [builder.build_views(t.task, list(t.history), t.observation, t.admissible, skill=t.block) for t in turns]
    replies = [reply_ids(tokenizer, t.expert, builder.output_format) for t in turns]
    informed = [i for i, v in enumerate(views) if v.teacher != v.student]
    prompts = [v.student for v in views] + [views[i].teacher for i in informed]
    conts = replies + [replies[i] for i in informed]
    lps = [sum(x) for x in continuation_logprobs(model, prompts, conts, pad_id=pad_id, temperature=temperature)]
    with_skill = list(lps[: len(turns)])
    for j, i in enumerate(informed):
        with_skill[i] = lps[len(turns) + j]
    return [ScoredTurn(task_index=t.task_index, turn=t.turn, expert=t.expert, skill=v.skill,
                       applies=skill_applies(v.skill, t.expert), decisive=t.decisive, lp_without=float(lps[i]),
                       lp_with=float(with_skill[i]), reply_tokens=len(replies[i]))
            for i, (t, v) in enumerate(zip(turns, views))]


def in_split(turn: ScoredTurn, split: str) -> bool:
    if split == "all":
        return True
    if split == "applies":
        return turn.applies
    if split == "none":
        return not turn.applies
    if split == "decisive":
        return turn.decisive
    if split == "other":
        return not turn.decisive
    raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")


@dataclass(frozen=True)
class SplitSummary:
    """One split of one policy's turns."""

    split: str
    turns: int
    tasks: int
    lp_without: float
    lp_with: float
    diff: Estimate
    """Mean of lp_with - lp_without over the split's turns, 95% bootstrap interval resampling whole tasks."""
    share_raised: float
    """Share of the split's turns where the skill block raised the expert reply's log-prob (strictly)."""


def summarize(turns: Sequence[ScoredTurn], split: str, *, resamples: int = 2000, seed: int = 0) -> SplitSummary:
    """The split's means; an empty split gives nan means and ``diff.n == 0``."""
    chosen = [t for t in turns if in_split(t, split)]
    if not chosen:
        nan = float("nan")
        return SplitSummary(split, 0, 0, nan, nan, Estimate(nan, nan, nan, 0), nan)
    diffs = [t.diff for t in chosen]
    return SplitSummary(
        split=split, turns=len(chosen), tasks=len({t.task_index for t in chosen}),
        lp_without=float(np.mean([t.lp_without for t in chosen])), lp_with=float(np.mean([t.lp_with for t in chosen])),
        diff=cluster_bootstrap_mean(diffs, [t.task_index for t in chosen], resamples=resamples, seed=seed),
        share_raised=float(np.mean([d > 0 for d in diffs])))
