"""The lockstep collector: N tasks x G copies advance together, one batched generate per turn."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import gymnasium as gym

from agentopsd.config import check_overlap_waves
from agentopsd.envs.base import env_class, steps_thread_safe
from agentopsd.envs.runner import BatchedRunner, PendingStep
from agentopsd.rollout.base import Generation, Generator, SamplingConfig
from agentopsd.rollout.prompts import HistoryEntry, PromptBuilder, PromptViews, assert_no_skills, parse_action
from agentopsd.rollout.skills import SkillBank
from agentopsd.training.distributed import all_max, any_rank, is_distributed
from agentopsd.training.preemption import RolloutStopped
from agentopsd.types import TaskSpec, Trajectory, Turn

log = logging.getLogger(__name__)

REWARDS = ("success", "score")
"""The outcome reward R behind A_seq: the success bit (the paper's) or the environment's graded score."""
FORMAT_ERROR_PREFIX = "Your output did not follow the format."
"""How the observation after a format-error turn begins: such a turn does not step the env."""
WAVE_SEED_STRIDE = 1_000_003
"""Seeded sampling, wave ``w``: seed + w * this. Copies of a task in two waves show the same first prompt; one
seed for every call would hand them the same random draws (vLLM seeds prompt i with seed + i, transformers
seeds the call)."""


def format_error_note(prompts: PromptBuilder) -> str:
    """The observation the policy sees after a format error: the prefix and the prompt's format reminder."""
    return f"{FORMAT_ERROR_PREFIX} {prompts.user_message('', [], '', None).splitlines()[-1]}"


def history_entry(shown: str, action: str | None, text: str) -> HistoryEntry:
    """What the prompt's history keeps of a turn: the observation it acted on, and its action (the raw text, cut at
    200 characters, when it had none)."""
    return HistoryEntry(observation=shown, action=action or text.strip()[:200])


def apply_step(episode, info: Mapping, terminated: bool, truncated: bool) -> None:
    """What an env step changes in an episode's record (the collector's ``_Episode``, the study's replay ``State``):
    the admissible actions (when the env sends them), ``won``, ``terminated`` and ``done``."""
    if info.get("admissible_actions") is not None:
        episode.admissible = info["admissible_actions"]
    episode.won = bool(info.get("won", False))
    episode.terminated = bool(terminated)
    episode.done = bool(terminated or truncated)


@dataclass
class _Episode:
    """Mutable per-environment state while a batch of episodes runs."""

    spec: TaskSpec
    task: str = ""
    observation: str = ""
    env_state: str = ""
    """The environment's last observation: what ``observation`` shows unless a format error replaced it."""
    admissible: list[str] | None = None
    skill: str = ""
    """The skill block of the teacher view (scope ``turn``: the current turn's)."""
    skill_key: str = ""
    task_type: str = ""
    expert_steps: int = -1
    history: list[HistoryEntry] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    terminated: bool = False
    won: bool = False
    score: float = 0.0
    fault: str | None = None
    truncated: bool = False


@dataclass
class CollectorStats:
    """Counters of one ``collect`` call (logged under ``rollout/``)."""

    turns: int = 0
    generated_tokens: int = 0
    format_errors: int = 0
    invalid_actions: int = 0
    faults: int = 0
    generate_seconds: float = 0.0
    """Wall time inside the generator's calls."""
    env_seconds: float = 0.0
    """The environments' own wall time: resets, and each turn's (or wave's) steps from submission to the last
    env's return, summed. Under ``overlap_waves`` part of it runs beside generation."""
    env_wait_seconds: float = 0.0
    """Wall time the collector spent waiting on environments, generating nothing: all of ``env_seconds`` when
    serial; what the overlap did not hide when ``overlap_waves`` > 1 (``env_seconds - env_wait_seconds``
    ran beside generation)."""
    teacher_seconds: float = 0.0
    """Wall time the generator spent scoring teacher views (``teacher_in_engine``; 0 when the trainer scores them)."""


@dataclass
class _Wave:
    """One wave's turn from its generate call until its env steps are recorded."""

    active: list[int]
    student: list
    teacher: list
    gens: list[Generation]
    parsed: dict[int, str | None]
    pending: PendingStep | None = None
    """Its env steps, once submitted (an empty submission when every output was a format error)."""
    version: int = 0
    """The policy version that generated it (:attr:`Collector.policy_version` at its generate call)."""
    teacher_logprobs: list | None = None
    """Per row, the teacher view's log-probs of its action scored by the generating weights (``teacher_in_engine``)."""


def split_waves(n: int, waves: int) -> list[list[int]]:
    """Episode indices of each wave, fixed for a whole collect: a wave's next prompts need its own steps'
    results, so an episode cannot change wave while its step runs. Interleaved (i, i + waves, ...) because
    the G copies of a task sit side by side: each wave gets copies of every task, and the waves' episode
    lengths stay alike (a wave whose episodes all ended leaves nothing to overlap with)."""
    return [list(range(w, n, waves)) for w in range(waves)]


def wave_sampling(sampling: SamplingConfig, wave: int) -> SamplingConfig:
    """Wave ``wave``'s sampling: a seeded one moved by WAVE_SEED_STRIDE per wave, anything else unchanged."""
    if sampling.seed is None or wave == 0:
        return sampling
    return replace(sampling, seed=sampling.seed + wave * WAVE_SEED_STRIDE)


def effective_waves(requested: int, env_id: str, num_threads: int) -> tuple[int, str]:
    """How many generate calls a turn makes, and why it is 1 when more were asked for ('' when not).

    A function of settings alone, never of this rank's tasks: every rank must make the same calls (the rank
    invariant, agentopsd.training.distributed), also a rank with one env (no pool) or none (an empty shard).
    """
    if requested == 1:
        return 1, ""
    if num_threads < 2:
        return 1, (f"rollout.overlap_waves={requested} needs env.num_threads >= 2 (a wave's env steps run in that "
                   f"thread pool while the next wave generates), got {num_threads}: turns run serially")
    if not steps_thread_safe(env_class(env_id)):
        return 1, (f"rollout.overlap_waves={requested}: {env_id} sets thread_safe_step = False (its steps must not run "
                   "beside other threads): turns run serially")
    return requested, ""


class Collector:
    """Runs episodes for a list of task copies with one generator call per turn (or per wave)."""

    def __init__(
        self,
        env_id: str,
        generator: Generator,
        prompts: PromptBuilder,
        sampling: SamplingConfig,
        *,
        env_kwargs: dict | None = None,
        max_turns: int = 50,
        invalid_penalty: float = 0.1,
        reward: str = "success",
        skill_bank: SkillBank | None = None,
        num_threads: int = 0,
        env_wrappers: Sequence = (),
        stop_requested: Callable[[], bool] | None = None,
        overlap_waves: int = 1,
        before_turn: Callable[[], int] | None = None,
        teacher_in_engine: bool = False,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {max_turns}")
        check_overlap_waves(overlap_waves)
        if reward not in REWARDS:
            raise ValueError(f"env.reward must be one of {REWARDS}, got {reward!r}")
        self.env_id = env_id
        self.generator = generator
        self.prompts = prompts
        self.sampling = sampling
        self.env_kwargs = dict(env_kwargs or {})
        self.max_turns = max_turns
        self.invalid_penalty = invalid_penalty
        self.reward = reward
        self.skill_bank = skill_bank
        self.num_threads = num_threads
        self.env_wrappers = tuple(env_wrappers)
        self.stop_requested = stop_requested
        """Checked before every turn: when it holds on any rank, ``collect`` raises RolloutStopped."""
        self.before_turn = before_turn
        """Called before every turn's generate calls; returns the policy version from then on (an asynchronous
        rollout worker loads weights published since the last turn here: episodes in flight carry on with them)."""
        self.policy_version = 0
        """The weight version each turn records (:attr:`agentopsd.types.Turn.policy_version`)."""
        if teacher_in_engine and not callable(getattr(generator, "score", None)):
            raise ValueError(f"rollout.teacher_scoring=worker needs a generator that scores prompts ({type(generator).__name__} "
                             "has no score method): use rollout.backend=hf, or rollout.teacher_scoring=trainer")
        self.teacher_in_engine = teacher_in_engine
        """With the teacher view: the generator scores each turn's teacher prompt + action right after generating it,
        with the same weights (:attr:`agentopsd.types.Turn.teacher_logprobs`)."""
        self.waves, why_serial = effective_waves(overlap_waves, env_id, num_threads)
        """Generate calls per turn (``rollout.overlap_waves`` when the env and env.num_threads allow it, else 1)."""
        if why_serial:
            log.warning(why_serial)
        self._pools: dict[str, list[gym.Env]] = {}
        self.stats = CollectorStats()
        self._skill_lines = self._all_skill_lines(skill_bank)

    @staticmethod
    def _all_skill_lines(bank: SkillBank | None) -> tuple[str, ...]:
        return () if bank is None else bank.all_lines()

    def _envs(self, split: str, n: int) -> list[gym.Env]:
        pool = self._pools.setdefault(split, [])
        while len(pool) < n:
            # TimeLimit at max_turns: format errors do not step the env, so the collector's own
            # turn loop is the binding limit and the env's can never end an episode earlier
            env = gym.make(self.env_id, split=split, max_episode_steps=self.max_turns, disable_env_checker=True, **self.env_kwargs)
            for wrap in self.env_wrappers:
                env = wrap(env)
            pool.append(env)
        return pool[:n]

    def close(self) -> None:
        """Close the environments and the generator (a vLLM engine holds processes and memory)."""
        for pool in self._pools.values():
            for env in pool:
                env.close()
        self._pools.clear()
        close = getattr(self.generator, "close", None)
        if close is not None:
            close()

    def collect(self, tasks: Sequence[TaskSpec], *, with_teacher: bool, sampling: SamplingConfig | None = None) -> list[Trajectory]:
        """Play every task copy to the end; ``with_teacher`` also builds the skill-augmented view."""
        sampling = sampling or self.sampling
        self.stats = CollectorStats()
        split = tasks[0].split if tasks else "train"
        if any(t.split != split for t in tasks):
            raise ValueError("one collect call takes tasks of one split")
        evaluating = split == "eval"
        if evaluating and with_teacher:
            raise ValueError("the teacher view is training-only: skills must never reach evaluation")
        # a rank can hold no tasks (a shard of a list shorter than the world): it builds no environments
        # and still runs the turn loop below, taking part in the other ranks' forwards
        runner = BatchedRunner(self._envs(split, len(tasks)), num_threads=self.num_threads) if tasks else None
        episodes = [_Episode(spec=t) for t in tasks]
        t0 = time.perf_counter()
        results = runner.reset([t.seed for t in tasks], [{"task_index": t.task_index} for t in tasks]) if runner else []
        self.stats.env_seconds += time.perf_counter() - t0
        self.stats.env_wait_seconds = self.stats.env_seconds  # resets come before any generation: nothing hides them
        for ep, res in zip(episodes, results):
            self._start(ep, res, with_teacher)
        waves = split_waves(len(episodes), self.waves)
        in_flight: list[_Wave | None] = [None] * len(waves)
        try:
            self._turns(episodes, waves, in_flight, runner, with_teacher, evaluating, sampling)
        except BaseException:
            # the next collect resets these envs: none may still be stepping in the pool when this one leaves
            for wave in in_flight:
                if wave is not None and wave.pending is not None:
                    wave.pending.abandon()
            raise
        finally:
            if runner is not None:  # its threads end with the collect; the envs stay pooled for the next one
                runner.release()
        for ep in episodes:
            if not ep.done:
                ep.truncated = True
        self.stats.faults = sum(ep.fault is not None for ep in episodes)
        return [self._finish(ep) for ep in episodes]

    def _turns(self, episodes: list[_Episode], waves: list[list[int]], in_flight: list[_Wave | None],
               runner: BatchedRunner | None, with_teacher: bool, evaluating: bool, sampling: SamplingConfig) -> None:
        """The turn loop: per turn one agreement (where generating is a collective; else one at the end), then one
        generate call per wave, each wave's env steps
        submitted to the runner. Serial (one wave) they are recorded at once; overlapped, a wave's steps run
        while the next wave generates and are recorded just before that wave's next prompts need them, so at
        the top of a turn the last wave(s) of the turn before may still be stepping."""
        distributed = is_distributed()
        # per turn, ranks agree only when the generator's calls are collectives (transformers on a sharded or
        # synced policy, a tensor-parallel engine); engines of their own (vLLM, one per rank) let each rank play
        # on alone and agree once, at the end, whether a stop was requested anywhere
        lockstep = distributed and getattr(self.generator, "collective", True)
        stopped = False
        # the loop ends when every rank agrees it is over (not after a local count): a rank whose episodes
        # all ended keeps taking part in the others' forwards until they end too (the rank invariant)
        for turn in itertools.count():
            playing = turn < self.max_turns
            if playing:
                here = self._plays_on(episodes, waves, in_flight)
            else:
                self._settle_all(in_flight, episodes)
                here = False
            stop = bool(self.stop_requested is not None and self.stop_requested())
            # one collective per turn answers both questions: max(2 * stop + active) over ranks
            code = all_max(2 * stop + here, "rollout/turn") if lockstep else 2 * stop + here
            if code >= 2:
                if not distributed or lockstep:
                    raise RolloutStopped("a stop was requested (a signal): rollout abandoned between turns")
                self._settle_all(in_flight, episodes)  # alone: stop playing, and say so at the agreement below
                stopped = True
                break
            if not code:
                break  # nothing is in flight: this rank had nothing to play, which it learnt by settling every wave
            if self.before_turn is not None:
                self.policy_version = int(self.before_turn())
            for w, members in enumerate(waves):
                if in_flight[w] is not None:  # this wave's last steps: its prompts need them now
                    self._settle(in_flight[w], episodes)
                    in_flight[w] = None
                active = [i for i in members if not episodes[i].done] if playing else []
                wave = self._generate_wave(active, episodes, with_teacher, evaluating, wave_sampling(sampling, w))
                if wave is None:
                    continue
                assert runner is not None  # active episodes exist only with tasks
                self._submit(wave, runner)
                if self.waves == 1:
                    self._settle(wave, episodes)  # serial: nothing to overlap with
                else:
                    in_flight[w] = wave
        if distributed and not lockstep and any_rank(stopped, "rollout/end"):
            raise RolloutStopped("a stop was requested (a signal) on some rank: rollout abandoned between turns")

    def _generate_wave(self, active: list[int], episodes: list[_Episode], with_teacher: bool, evaluating: bool,
                       sampling: SamplingConfig) -> _Wave | None:
        """One generate call for the ``active`` episodes' prompts (None when there are none)."""
        if not active:
            # other ranks may be generating this wave: an empty call takes part in their forwards (the rank invariant)
            self.generator.generate([], sampling)
            return None
        # both views of a turn from one call: same history window, same trimming, the skill block alone differs
        views = [self._views(episodes[i], with_teacher) for i in active]
        student = [v.student for v in views]
        if evaluating and self._skill_lines:
            for ids in student:
                assert_no_skills(self.prompts.tokenizer.decode(ids), self._skill_lines)
        teacher = [v.teacher for v in views]
        t0 = time.perf_counter()
        gens = self.generator.generate(student, sampling)
        self.stats.generate_seconds += time.perf_counter() - t0
        teacher_lp = None
        if with_teacher and self.teacher_in_engine:
            # before before_turn can load newer weights: the teacher view is scored by the version that generated
            t0 = time.perf_counter()
            teacher_lp = self.generator.score(teacher, [g.token_ids for g in gens], sampling)
            self.stats.teacher_seconds += time.perf_counter() - t0
        parsed: dict[int, str | None] = {}
        for i, gen in zip(active, gens):
            parsed[i] = parse_action(gen.text, self.prompts.output_format)
            self.stats.generated_tokens += len(gen.token_ids)
        return _Wave(active, student, teacher, gens, parsed, version=self.policy_version, teacher_logprobs=teacher_lp)

    def _submit(self, wave: _Wave, runner: BatchedRunner) -> None:
        """Hand the wave's parsed actions to the runner (format errors do not step the env)."""
        actions = {i: a for i, a in wave.parsed.items() if a is not None}
        t0 = time.perf_counter()
        wave.pending = runner.submit(actions)
        self.stats.env_wait_seconds += time.perf_counter() - t0  # an inline runner steps right here

    def _settle(self, wave: _Wave, episodes: list[_Episode]) -> None:
        """Wait for the wave's env steps and record its turns."""
        stepped = {}
        if wave.pending is not None:
            t0 = time.perf_counter()
            wave.pending.wait()  # the wait alone: recording the results below is the collector's own work
            self.stats.env_wait_seconds += time.perf_counter() - t0
            stepped = wave.pending.result()
            self.stats.env_seconds += wave.pending.seconds
        teacher_lp = wave.teacher_logprobs or [()] * len(wave.active)
        for i, s_ids, t_ids, gen, t_lp in zip(wave.active, wave.student, wave.teacher, wave.gens, teacher_lp):
            self._record(episodes[i], s_ids, t_ids, gen, wave.parsed[i], stepped.get(i), wave.version, t_lp)

    def _plays_on(self, episodes: list[_Episode], waves: list[list[int]], in_flight: list[_Wave | None]) -> bool:
        """Does an episode of this rank play another turn? Settled waves answer at once when one of theirs is
        still running; otherwise the waves still stepping are settled, oldest first (the likeliest to be done),
        until one shows such an episode. Never a guess: an episode those steps end must not cost every rank
        one more, empty, turn (an empty call still runs a placeholder generation under lockstep)."""

        def known() -> bool:
            return any(not episodes[i].done for w, members in enumerate(waves) if in_flight[w] is None for i in members)

        for w, wave in enumerate(in_flight):
            if known():
                return True
            if wave is not None:
                self._settle(wave, episodes)
                in_flight[w] = None
        return known()

    def _settle_all(self, in_flight: list[_Wave | None], episodes: list[_Episode]) -> None:
        for w, wave in enumerate(in_flight):
            if wave is not None:
                self._settle(wave, episodes)
                in_flight[w] = None

    def _start(self, ep: _Episode, res, with_teacher: bool) -> None:
        if res.error is not None:
            ep.done, ep.fault = True, f"reset: {res.error}"
            return
        info = res.info
        ep.task = str(info.get("task", ""))
        ep.observation = ep.env_state = res.observation
        ep.admissible = info.get("admissible_actions")
        ep.task_type = str(info.get("task_type", ""))
        ep.expert_steps = int(info.get("expert_steps", -1))
        ep.skill_key = str(info.get("skill_key", ""))
        if with_teacher and self.skill_bank is not None and self.skill_bank.scope == "episode":
            ep.skill = self.skill_bank.block(ep.skill_key, ep.task, ep.observation)

    def _views(self, ep: _Episode, with_teacher: bool) -> PromptViews:
        if with_teacher and self.skill_bank is not None and self.skill_bank.scope == "turn":
            ep.skill = self.skill_bank.block(ep.skill_key, ep.task, ep.env_state)  # this turn's situations only
        return self.prompts.build_views(ep.task, ep.history, ep.observation, ep.admissible, skill=ep.skill if with_teacher else "")

    def _record(self, ep: _Episode, s_ids, t_ids, gen, action: str | None, res, version: int,
                teacher_logprobs: tuple[float, ...] = ()) -> None:
        self.stats.turns += 1
        # the penalty belongs to this turn alone; the outcome reward is set once, at the end (_finish)
        reward, penalty, valid = 0.0, 0.0, False
        if action is None:
            self.stats.format_errors += 1
            observation = format_error_note(self.prompts)
            penalty = self.invalid_penalty
        elif res.error is not None:
            ep.done, ep.fault = True, f"step: {res.error}"
            observation = ""
        else:
            valid = bool(res.info.get("action_valid", True))
            if not valid:
                self.stats.invalid_actions += 1
                penalty = self.invalid_penalty
            reward = float(res.reward)
            observation = res.observation
            apply_step(ep, res.info, res.terminated, res.truncated)
            ep.score = float(res.info.get("score", float(ep.won)))
        ep.turns.append(
            Turn(
                index=len(ep.turns),
                prompt_ids=tuple(s_ids),
                teacher_prompt_ids=tuple(t_ids),
                action_ids=tuple(gen.token_ids),
                behaviour_logprobs=tuple(gen.logprobs),
                action_text=gen.text,
                parsed_action=action or "",
                observation=observation,
                reward=reward,
                valid=valid,
                penalty=penalty,
                state=ep.env_state,  # a format error does not change the environment's state
                policy_version=version,
                teacher_logprobs=tuple(teacher_logprobs),
            )
        )
        ep.history.append(history_entry(ep.observation, action, gen.text))
        if observation:
            ep.observation = observation
        if action is not None and res.error is None:
            ep.env_state = observation  # the environment stepped (an invalid action steps it too)

    def _finish(self, ep: _Episode) -> Trajectory:
        success = ep.won and ep.fault is None
        return Trajectory(
            task=ep.spec,
            turns=tuple(ep.turns),
            success=success,
            score=ep.score,
            task_type=ep.task_type,
            expert_steps=ep.expert_steps,
            skill_text=ep.skill if self.skill_bank is None or self.skill_bank.scope == "episode" else "",
            fault=ep.fault,
            truncated=ep.truncated,
            reward=float(success) if self.reward == "success" else ep.score,
        )
