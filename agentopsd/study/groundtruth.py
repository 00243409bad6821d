"""Ground truth for turn credit on environments that can be snapshot and restored (BabyAI, ALFWorld).

Two labels per turn k of a logged trajectory, both measured on copies of the environment state
before the turn (s_k) and after it (s_{k+1}):

- the expert label: the BabyAI bot's remaining path to success d(s) (-1: the bot cannot win from
  s). The turn is *progress* when the path shrinks, *wasted* when it does not, *fatal* when the
  task was winnable before it and is not after; ``expert_gain`` turns that into one number
  (d(s_k) - d(s_{k+1}), fatal = -``FATAL_GAIN``);
- the Monte Carlo turn advantage under a policy: V(s_{k+1}) - V(s_k), each V the success rate of
  M continuations of the policy from that state within the episode's remaining turn budget.

A BabyAI env (minigrid grid, bot memory, step counters, the TimeLimit wrapper) copies exactly
with ``copy.deepcopy``; an ALFWorld env's deepcopy replays the episode's commands on a fresh
engine (its planner cannot be copied). Either way a restored copy continued with the same actions
gives the same observations (tested). Logged trajectories are replayed from their task index, and every replayed
observation is checked against the logged one, so a state that does not match its log is an error,
never a silent label.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from agentopsd.rollout.base import Generator, SamplingConfig
from agentopsd.rollout.collector import FORMAT_ERROR_PREFIX, apply_step, format_error_note, history_entry
from agentopsd.rollout.prompts import HistoryEntry, PromptBuilder, parse_action

FATAL_GAIN = 100.0
"""expert_gain of a fatal turn: below any real path change (BabyAI levels are far shorter)."""
SIGNALS = ("advantage", "evidence", "revision", "multiplier", "belief")
"""Per-turn credit fields a rollout shard may hold (callbacks/rollout_logging.py)."""


@dataclass(frozen=True)
class LoggedTurn:
    k: int
    action: str
    """The parsed action, or the raw text of a format error."""
    observation: str
    """What the policy saw after the turn (the env's observation, or the format-error note)."""
    valid: bool
    signals: Mapping[str, float]
    """The credit fields logged for this turn (a subset of ``SIGNALS``: GRPO logs only the advantage)."""
    gaps: tuple[float, ...] | None = None
    """Each action token's gap delta_t, where the run logged them (algorithms with a teacher view)."""

    @property
    def stepped(self) -> bool:
        """Did the turn step the environment? (A format error does not; an invalid action does.)"""
        return not self.observation.startswith(FORMAT_ERROR_PREFIX)


@dataclass(frozen=True)
class LoggedTrajectory:
    run: str
    algorithm: str
    env_id: str
    iteration: int
    task_index: int
    success: bool
    seq_advantage: float
    turns: tuple[LoggedTurn, ...]
    group: int = -1
    """The task group's id within its iteration (-1 where the shard predates it)."""

    @classmethod
    def from_record(cls, record: Mapping[str, Any], *, run: str, algorithm: str) -> LoggedTrajectory:
        """One rollout-shard record (``trajectory_records``) as a typed trajectory."""
        turns = tuple(
            LoggedTurn(k=int(t["k"]), action=str(t["action"]), observation=str(t["observation"]), valid=bool(t["valid"]),
                       signals={name: float(t[name]) for name in SIGNALS if name in t},
                       gaps=tuple(float(d) for d in t["gaps"]) if t.get("gaps") is not None else None)
            for t in record["turns"]
        )
        return cls(run=run, algorithm=algorithm, env_id=str(record["env"]), iteration=int(record["iteration"]),
                   task_index=int(record["task_index"]), success=bool(record["success"]),
                   seq_advantage=float(record["seq_advantage"]), turns=turns, group=int(record.get("group", -1)))


@dataclass
class State:
    """A restorable point of an episode: the env copy plus what the policy's prompt needs."""

    env: gym.Env
    turn: int
    """Turns played so far (the next turn's index)."""
    task: str
    observation: str
    admissible: Sequence[str] | None
    """The env's admissible actions, as the collector passes them to the prompt."""
    history: list[HistoryEntry] = field(default_factory=list)
    done: bool = False
    won: bool = False
    terminated: bool = False
    """The env ended the episode itself (a win, or a failed strict instruction), not the turn budget."""

    def copy(self) -> State:
        """An independent copy (the env deep-copied): stepping it never touches this state."""
        return State(env=copy.deepcopy(self.env), turn=self.turn, task=self.task, observation=self.observation,
                     admissible=self.admissible, history=list(self.history), done=self.done, won=self.won,
                     terminated=self.terminated)


def make_env(env_id: str, max_turns: int, env_kwargs: Mapping[str, Any] | None = None) -> gym.Env:
    """A train-split env built as the collector builds it (TimeLimit at ``max_turns``)."""
    kwargs = dict(env_kwargs or {})
    return gym.make(env_id, split="train", max_episode_steps=max_turns, disable_env_checker=True, **kwargs)


def start(env: gym.Env, task_index: int) -> State:
    """Reset ``env`` to train task ``task_index`` and wrap it as the state before turn 0."""
    obs, info = env.reset(options={"task_index": task_index})
    admissible = info.get("admissible_actions")
    return State(env=env, turn=0, task=str(info.get("task", "")), observation=obs, admissible=admissible)


def advance(state: State, action: str | None, text: str = "", format_note: str = FORMAT_ERROR_PREFIX) -> State:
    """Play one turn on ``state`` in place, as the collector does (its ``apply_step`` and ``history_entry``), and
    return it.

    ``action`` None is a format error: a turn passes, the env does not step, the policy sees ``format_note``.
    """
    if state.done:
        raise ValueError("advance() on a finished episode: check State.done first")
    shown = state.observation
    if action is None:
        state.observation = format_note
    else:
        obs, _, terminated, truncated, info = state.env.step(action)
        state.observation = obs
        apply_step(state, info, terminated, truncated)
    state.history.append(history_entry(shown, action, text))
    state.turn += 1
    return state


def replay(env: gym.Env, traj: LoggedTrajectory, max_turns: int) -> list[State]:
    """The states s_0 .. s_K of a logged trajectory (copies), checked against its logged observations.

    Raises ValueError naming the turn where the replay and the log part (a different env, level
    or max_turns than the run used).
    """
    state = start(env, traj.task_index)
    states = [state.copy()]
    for turn in traj.turns:
        if state.done or state.turn >= max_turns:
            raise ValueError(f"{traj.run} task {traj.task_index}: the replay ended before logged turn {turn.k}; "
                             f"is max_turns={max_turns} the run's env.max_turns?")
        advance(state, turn.action if turn.stepped else None, turn.action, turn.observation)
        if state.observation != turn.observation:
            raise ValueError(f"{traj.run} task {traj.task_index} turn {turn.k}: replayed observation differs from the "
                             f"log ({state.observation[-80:]!r} vs {turn.observation[-80:]!r}); wrong env id or kwargs?")
        states.append(state.copy())
    if state.won != traj.success:
        raise ValueError(f"{traj.run} task {traj.task_index}: replay success {state.won} but logged {traj.success}")
    return states


# ---------------------------------------------------------------- expert label


def expert_remaining(state: State, cap: int = 256) -> int:
    """Steps the env's expert (the BabyAI bot, ALFWorld's handcoded expert) needs to win from ``state``
    (0 if already won), -1 if it cannot within ``cap``.

    Runs on a copy of the bare env with its step limits lifted: the label measures the task's
    distance, not the episode's remaining budget (an episode cut by the turn limit is not lost
    by its last turn).
    """
    if state.won:
        return 0
    if state.terminated:
        return -1
    env = copy.deepcopy(state.env.unwrapped)
    if not hasattr(env, "expert_action"):
        raise ValueError(f"{type(env).__name__} has no expert_action(): the expert label needs an env with an expert")
    lift = getattr(env, "lift_step_limit", None)  # an env that keeps its own step limit (BabyAI) reopens the copy
    if lift is not None:
        lift(cap + 1)
    for n in range(1, cap + 1):
        action = env.expert_action()
        if action == "done":  # the bot sees no way left (e.g. the target box was opened and vanished)
            return -1
        _, _, terminated, truncated, info = env.step(action)
        if info.get("won", False):
            return n
        if terminated or truncated:
            return -1
    return -1


def expert_gain(before: int, after: int) -> float:
    """One number per turn from the remaining paths: d(s_k) - d(s_{k+1}); fatal = -FATAL_GAIN; lost already = 0."""
    if before < 0:
        return 0.0  # nothing left to lose: the turn cannot matter
    if after < 0:
        return -FATAL_GAIN
    return float(before - after)


def expert_label(before: int, after: int) -> str:
    """progress (path shrank), wasted (it did not), fatal (winnable before, not after), lost (not winnable before)."""
    if before < 0:
        return "lost"
    if after < 0:
        return "fatal"
    return "progress" if after < before else "wasted"


def expert_path(states: Sequence[State], cap: int = 256) -> list[int]:
    """d(s_0) .. d(s_K): each state's remaining path (a turn's after-state is the next one's before-state)."""
    return [expert_remaining(s, cap) for s in states]


# ---------------------------------------------------------------- Monte Carlo advantage

Policy = Callable[[Sequence[State]], list[tuple[str | None, str]]]
"""Maps the states to act in to (parsed action or None for a format error, raw text) each."""


def generator_policy(generator: Generator, prompts: PromptBuilder, sampling: SamplingConfig) -> Policy:
    """The policy of a ``Generator`` behind the trainer's own student prompt (no skills: the student view)."""

    def act(states: Sequence[State]) -> list[tuple[str | None, str]]:
        ids = [prompts.build_views(s.task, s.history, s.observation, s.admissible).student for s in states]
        gens = generator.generate(ids, sampling)
        return [(parse_action(g.text, prompts.output_format), g.text) for g in gens]

    return act


def format_note(prompts: PromptBuilder) -> str:
    """The observation the collector shows after a format error (so continuations see training's prompts)."""
    return format_error_note(prompts)


def mc_values(states: Sequence[State], policy: Policy, samples: int, max_turns: int,
              note: str = FORMAT_ERROR_PREFIX) -> list[float]:
    """Success rate of ``samples`` continuations of ``policy`` from each state, up to turn ``max_turns``.

    Every continuation of every state runs in lockstep: one policy call per turn for all of them
    (a batched generate). A finished state's value is its outcome. ``note``: what a format error
    shows (``format_note(prompts)`` for the trainer's policy).
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    runs = [[s.copy() for _ in range(samples)] for s in states]
    while True:
        live = [r for group in runs for r in group if not r.done and r.turn < max_turns]
        if not live:
            break
        for run, (action, text) in zip(live, policy(live)):
            advance(run, action, text, note)
    return [float(np.mean([r.won for r in group])) for group in runs]


def mc_value(state: State, policy: Policy, samples: int, max_turns: int, note: str = FORMAT_ERROR_PREFIX) -> float:
    """``mc_values`` of one state."""
    return mc_values([state], policy, samples, max_turns, note)[0]


def mc_turn_advantages(
    states: Sequence[State], policy: Policy, samples: int, max_turns: int, note: str = FORMAT_ERROR_PREFIX
) -> list[float]:
    """V(s_{k+1}) - V(s_k) for every turn k of a replayed trajectory (``states`` = s_0 .. s_K).

    Each state's value is estimated once and shared by the two turns it borders; the budget is
    the episode's own (``max_turns`` minus the turns already played).
    """
    values = mc_values(states, policy, samples, max_turns, note)
    return [after - before for before, after in zip(values[:-1], values[1:])]
