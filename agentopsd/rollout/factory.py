"""The rollout a run's settings describe: its generator and collector, the colocated engine's weight
sync and sleep around each use, and the metrics of one rollout.

:class:`agentopsd.training.module.AgentRLModule` builds its collector here once (lazily, on first use) and calls
:func:`engine_sync` / :func:`engine_sleep` around every collection; nothing here reads Lightning state.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from agentopsd.config import EnvConfig, RolloutConfig
from agentopsd.rollout import base
from agentopsd.rollout.base import Generator, SamplingConfig
from agentopsd.rollout.collector import Collector
from agentopsd.rollout.prompts import PromptBuilder
from agentopsd.rollout.skills import SkillBank
from agentopsd.training.distributed import is_distributed
from agentopsd.types import Trajectory


def vllm_engine_kwargs(env: EnvConfig, rollout: RolloutConfig, *, seed: int, iterations_done: int,
                       weights_as_loaded: bool = True) -> dict:
    """rollout.vllm, plus what the run decides: the seed (the engine adds the rank), the longest
    sequence, and which weights the engine loads. ``loaded_step`` 0 (nothing to sync before the first
    update) only when the policy still holds the weights of the folder the engine loads: a fresh run
    (``iterations_done == 0``) whose weights nothing changed since loading (``weights_as_loaded``; a warm
    start changes them). Otherwise None: the engine is synced before its first generate."""
    kwargs = {"seed": seed, "max_model_len": env.max_prompt_tokens + rollout.max_new_tokens}
    kwargs.update({k: v for k, v in dict(rollout.vllm).items() if v is not None})
    kwargs.setdefault("loaded_step", 0 if iterations_done == 0 and weights_as_loaded else None)
    return kwargs


def make_generator(model: nn.Module, tokenizer: object, env: EnvConfig, rollout: RolloutConfig, *, seed: int,
                   model_path: str | None, iterations_done: int, weights_as_loaded: bool = True,
                   generation_dtype: torch.dtype | None = None) -> Generator:
    """vLLM (colocated, loading ``model_path``) or transformers on the policy itself (or, with ``generation_dtype``,
    on a copy of it in that dtype: :class:`agentopsd.training.precision.WeightPlan`), with the format-error chaos wrapper
    when ``rollout.malformed_rate`` asks for it (transformers only)."""
    if rollout.backend == "vllm":
        from agentopsd.rollout.vllm_backend import VLLMGenerator

        if model_path is None:
            raise ValueError("rollout.backend=vllm needs model.path (vLLM loads the weights itself)")
        return VLLMGenerator(model_path, tokenizer, **vllm_engine_kwargs(env, rollout, seed=seed, iterations_done=iterations_done,
                                                                                  weights_as_loaded=weights_as_loaded))
    from agentopsd.rollout.hf import HFGenerator

    # several ranks: every rank runs every forward (the rank invariant, agentopsd.training.distributed)
    generator = HFGenerator(model, tokenizer, synced_gpus=is_distributed(), weights_dtype=generation_dtype)
    if rollout.malformed_rate > 0:
        from agentopsd.rollout.chaos import MalformedGenerator

        generator = MalformedGenerator(generator, rollout.malformed_rate, seed=seed)
    return generator


def make_collector(env: EnvConfig, generator: Generator, prompts: PromptBuilder, sampling: SamplingConfig, *,
                   skill_bank: SkillBank | None, seed: int, stop_requested: Callable[[], bool],
                   overlap_waves: int, teacher_in_engine: bool = False) -> Collector:
    """The lockstep collector over ``env``'s environments, with fault injection when ``env.fault_rate`` is set;
    ``teacher_in_engine``: the generator also scores each turn's teacher view (``rollout.teacher_scoring=worker``)."""
    wrappers = []
    if env.fault_rate > 0:
        from agentopsd.envs.faults import FaultInjectionWrapper

        rate, seeds = env.fault_rate, itertools.count(seed * 10_000)
        # one seed per environment, in creation order: the same faults on every rerun
        wrappers.append(lambda e: FaultInjectionWrapper(e, p_reset=rate, p_step=rate, seed=next(seeds)))
    return Collector(
        env.id,
        generator,
        prompts,
        sampling,
        env_kwargs=env.kwargs,
        max_turns=env.max_turns,
        invalid_penalty=env.invalid_penalty,
        reward=env.reward,
        skill_bank=skill_bank,
        num_threads=env.num_threads,
        env_wrappers=wrappers,
        stop_requested=stop_requested,
        overlap_waves=overlap_waves,
        teacher_in_engine=teacher_in_engine,
    )


# ---- colocated vLLM (issue 28): sync before generating, sleep after --------------------------------------


def engine_sync(generator: Generator, model: nn.Module, step: int) -> None:
    """The generator's weights made the policy's (``step``: iterations done, so a vLLM engine skips a sync of
    the weights it already holds). Before a sleeping engine wakes, the gradients are dropped and PyTorch's
    cached blocks released (:func:`agentopsd.rollout.base.release_device_cache`), so the engine finds the memory the update held.
    An engine awake (a rollout worker's, which never sleeps, before each turn) handed nothing back: no cache to empty,
    and emptying it would be a device-wide synchronisation per call."""
    if hasattr(generator, "sleep"):  # the vLLM engine: gradients go before it wakes; weights named by step
        for p in model.parameters():
            p.grad = None
        if getattr(generator, "asleep", False):
            base.release_device_cache()
        generator.sync_weights(model, step=step)
    else:
        generator.sync_weights(model)


def generation_copy(collector: Collector | None) -> nn.Module | None:
    """The lockstep collector's transformers generator's own copy of the weights (``generation_dtype``), which then
    also scores the teacher view; None where the generator runs the policy itself (or is an engine), or where no
    collector was built (asynchronous rollouts before an evaluation)."""
    if collector is None:
        return None
    inner = getattr(collector.generator, "inner", collector.generator)  # the format-error chaos wrapper
    return inner.model if getattr(inner, "weights_dtype", None) is not None else None


def engine_sleep(generator: Generator) -> None:
    """A colocated engine frees its memory for the update (transformers has nothing to free)."""
    if hasattr(generator, "sleep"):
        generator.sleep()


def rollout_metrics(trajectories: Sequence[Trajectory], collector: Collector) -> dict[str, float]:
    """One rank's rollout: per-episode means, the collector's counters and throughput, prompt trimming."""
    n = max(len(trajectories), 1)
    s = collector.stats
    return {
        "rollout/success": sum(t.success for t in trajectories) / n,
        "rollout/score": sum(t.score for t in trajectories) / n,
        "rollout/reward": sum(t.reward for t in trajectories) / n,
        "rollout/penalty": sum(t.total_penalty for t in trajectories) / n,
        "rollout/turns": sum(len(t.turns) for t in trajectories) / n,
        "rollout/format_errors": float(s.format_errors),
        "rollout/invalid_actions": float(s.invalid_actions),
        "rollout/faults": float(s.faults),
        "rollout/trajectories": float(len(trajectories)),
        "perf/rollout_tokens_per_s": s.generated_tokens / max(s.generate_seconds, 1e-9),
        "perf/env_seconds": s.env_seconds,
        "perf/env_wait_seconds": s.env_wait_seconds,  # the env time no generation ran beside (all of it when serial)
        "perf/engine_teacher_seconds": s.teacher_seconds,  # teacher views scored by the generator (rollout.teacher_scoring=worker)
        "rollout/history_trimmed": float(collector.prompts.stats["history_trimmed"]),
        "rollout/skill_trimmed": float(collector.prompts.stats.get("skill_trimmed", 0)),
    }


def prompt_builder(tokenizer: object, env: EnvConfig) -> PromptBuilder:
    """The student/teacher prompt views the environment's settings describe."""
    return PromptBuilder(
        tokenizer,
        output_format=env.output_format,
        history_window=env.history_window,
        max_prompt_tokens=env.max_prompt_tokens,
        show_admissible=env.show_admissible,
        **({"system_prompt": env.system_prompt} if env.system_prompt is not None else {}),
    )


def skill_bank(env: EnvConfig) -> SkillBank | None:
    """The teacher view's skills (``env.skills``), or None for an environment run without them."""
    return SkillBank.for_env(env.skills, max_general=env.skill_max_general) if env.skills else None


def sampling_configs(rollout: RolloutConfig, stop_strings: tuple[str, ...]) -> tuple[SamplingConfig, SamplingConfig]:
    """The training rollout's sampling and the evaluation's: greedy at ``eval_temperature`` 0, else sampled at it."""
    train = SamplingConfig(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                           stop_strings=stop_strings)
    greedy = rollout.eval_temperature == 0
    evaluation = SamplingConfig(max_new_tokens=rollout.max_new_tokens, temperature=1.0 if greedy else rollout.eval_temperature,
                                greedy=greedy, stop_strings=stop_strings)
    return train, evaluation
