"""What the hint does: the expert action's log-prob with and without the skill block, on the expert's own states.

The teacher view is the student view plus a skill block (``PromptBuilder.build_views``). Whether that
block carries evidence a policy can read shows in one number per turn: log p(expert reply | teacher view)
- log p(expert reply | student view), the expert reply being ``<action>a</action>`` tokenized as the
generator emits it (its stop string ``</action>`` ends generation; no end-of-turn token follows). The
states are the ones the environment's expert visits on fixed training tasks, so the difference measures
the hint, not the policy's own mistakes. Every other action the env lists is scored too (the replies of one
view share its prompt's forward), which gives the expert's log-prob among the actions' replies only (a
block that makes every well-formed reply likelier, or any reply at all, cancels there) and whether the
expert's reply is the likeliest of them: the greedy choice among the actions.

Turns are split by whether a skill applies. A skill *applies* on a turn when the skill block the
teacher view holds there names the expert's action the way the skill files write an action: in single
quotes (``'pick up'``, ``'toggle'``). With the quickstart's episode-scoped bank (category skills only)
that is exactly the turns whose expert action is ``pick up``; with a turn-scoped bank (KeyDoor) a turn
with no situation in view holds no block and never applies (its two views are the same tokens, the
difference is 0 exactly). A turn is *decisive* when the expert's action on it wins the episode.

Everything here is pure given a model; ``studies/hint_table.py`` composes the run config and writes the table.
"""

from __future__ import annotations

import math
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
    """One expert turn's reply log-probs under each view."""

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
    rel_without: float = float("nan")
    """The expert reply's log-prob among the env's actions' replies only (log-softmax over them), student view:
    the policy restricted to well-formed replies, so a block that makes every reply likelier does not count."""
    rel_with: float = float("nan")
    top_without: bool = False
    """The expert's reply is strictly the likeliest of the env's actions' replies under the student view."""
    top_with: bool = False
    named_without: float = float("nan")
    """Log of the share the actions the skill block names (quoted) hold among the env's actions' replies, student
    view (nan where the block names none). On a turn where the expert does something else this is the control:
    a model that copies a quoted action raises it wherever the block is shown, one that reads the hint's
    condition does not."""
    named_with: float = float("nan")

    @property
    def diff(self) -> float:
        return self.lp_with - self.lp_without

    @property
    def rel_diff(self) -> float:
        return self.rel_with - self.rel_without

    @property
    def named_diff(self) -> float:
        return self.named_with - self.named_without


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


def candidates(turn: ExpertTurn) -> list[str]:
    """The replies a turn's expert action is compared with: the env's admissible actions (the expert's among
    them, first where the env lists none)."""
    listed = list(turn.admissible or ())
    return listed if turn.expert in listed else [turn.expert, *listed]


def _relative(scores: np.ndarray, k: int) -> tuple[float, bool]:
    """(log-softmax of ``scores`` at ``k``, whether ``k`` is strictly the largest)."""
    top = float(scores.max())
    rel = float(scores[k] - (top + np.log(np.exp(scores - top).sum())))
    others = np.delete(scores, k)
    return rel, bool(others.size == 0 or scores[k] > others.max())


def _share(scores: np.ndarray, chosen: list[int]) -> float:
    """log of the softmax mass of ``scores`` on ``chosen`` (nan when nothing is chosen)."""
    if not chosen:
        return float("nan")
    top = float(scores.max())
    return float(np.log(np.exp(scores[chosen] - top).sum()) - np.log(np.exp(scores - top).sum()))


def score_turns(model, tokenizer, builder: PromptBuilder, turns: Sequence[ExpertTurn], *, pad_id: int,
                temperature: float = 1.0) -> list[ScoredTurn]:
    """Both views of every turn (``build_views``, as the collector calls it) and every candidate reply's log-prob
    under each (:func:`candidates`: the expert's and the env's other actions), from the scorer's no-grad forward
    (the replies of one view share its prompt's forward). A turn whose two views are the same tokens is scored
    once (its difference is 0 exactly)."""
    from agentopsd.rollout.scoring import continuation_logprobs

    if not turns:
        return []
    views = [builder.build_views(t.task, list(t.history), t.observation, t.admissible, skill=t.block) for t in turns]
    acts = [candidates(t) for t in turns]
    replies = {a: reply_ids(tokenizer, a, builder.output_format) for names in acts for a in names}
    prompts: list[list[int]] = []
    conts: list[list[int]] = []
    row: dict[tuple[int, str, str], int] = {}  # (turn, view, action) -> its row
    for i, v in enumerate(views):
        for name, prompt in [("student", v.student)] + ([("teacher", v.teacher)] if v.teacher != v.student else []):
            for a in acts[i]:
                row[(i, name, a)] = len(prompts)
                prompts.append(prompt)
                conts.append(replies[a])
    lps = [sum(x) for x in continuation_logprobs(model, prompts, conts, pad_id=pad_id, temperature=temperature)]

    def scores(i: int, view: str) -> np.ndarray:
        view = view if (i, view, acts[i][0]) in row else "student"  # the same tokens: the student's rows
        return np.asarray([lps[row[(i, view, a)]] for a in acts[i]], dtype=float)

    out = []
    for i, (t, v) in enumerate(zip(turns, views)):
        k = acts[i].index(t.expert)
        without, with_skill = scores(i, "student"), scores(i, "teacher")
        rel_without, top_without = _relative(without, k)
        rel_with, top_with = _relative(with_skill, k)
        named = [j for j, a in enumerate(acts[i]) if skill_applies(v.skill, a)]
        out.append(ScoredTurn(task_index=t.task_index, turn=t.turn, expert=t.expert, skill=v.skill,
                              applies=skill_applies(v.skill, t.expert), decisive=t.decisive, lp_without=float(without[k]),
                              lp_with=float(with_skill[k]), reply_tokens=len(replies[t.expert]), rel_without=rel_without,
                              rel_with=rel_with, top_without=top_without, top_with=top_with,
                              named_without=_share(without, named), named_with=_share(with_skill, named)))
    return out


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
    rel_diff: Estimate
    """Mean of rel_with - rel_without (the expert's log-prob among the env's actions' replies), same interval."""
    top_without: float
    """Share of the split's turns where the expert's reply is the likeliest of the actions' replies, student view."""
    top_with: float
    named_diff: Estimate
    """Mean shift of the named actions' log share (``ScoredTurn.named_without``) over the split's turns whose block
    names an action, same interval: on the ``none`` turns, how much the block pulls toward what it names."""


def summarize(turns: Sequence[ScoredTurn], split: str, *, resamples: int = 2000, seed: int = 0) -> SplitSummary:
    """The split's means; an empty split gives nan means and ``diff.n == 0``."""
    chosen = [t for t in turns if in_split(t, split)]
    if not chosen:
        nan = float("nan")
        none = Estimate(nan, nan, nan, 0)
        return SplitSummary(split, 0, 0, nan, nan, none, nan, none, nan, nan, none)
    diffs = [t.diff for t in chosen]
    tasks = [t.task_index for t in chosen]
    named = [t for t in chosen if not math.isnan(t.named_diff)]
    return SplitSummary(
        split=split, turns=len(chosen), tasks=len({t.task_index for t in chosen}),
        lp_without=float(np.mean([t.lp_without for t in chosen])), lp_with=float(np.mean([t.lp_with for t in chosen])),
        diff=cluster_bootstrap_mean(diffs, tasks, resamples=resamples, seed=seed),
        share_raised=float(np.mean([d > 0 for d in diffs])),
        rel_diff=cluster_bootstrap_mean([t.rel_diff for t in chosen], tasks, resamples=resamples, seed=seed),
        top_without=float(np.mean([t.top_without for t in chosen])), top_with=float(np.mean([t.top_with for t in chosen])),
        named_diff=cluster_bootstrap_mean([t.named_diff for t in named], [t.task_index for t in named], resamples=resamples,
                                          seed=seed))
