"""Iteration costs, measured side by side in one run on the same model and rollouts.

    python benchmarks/step.py [--env agentopsd/BabyAI-GoToLocal-v0] [--envs 64]

Prints three figures:
1. AgentOPSD iteration time / GRPO iteration time (target <= 1.3: one extra no-grad forward);
2. lockstep batched rollouts / a per-environment sequential loop, environment turns per second
   at 64 environments (target >= 10x);
3. the credit step's share of an AgentOPSD iteration (target < 1%).

``--figures 2`` runs only the rollout comparison. Figure [2] is printed twice: for the untrained tiny
policy's own turns (at most 12 tokens of ``<action>...</action>``, so prompt prefill dominates),
and for think-length turns of ``--response-tokens`` tokens (default 128; no stop string, only EOS
ends a turn early). The paper's setups write a think block before the action (``think_action``
format, up to 512 new tokens per turn), so the second line is the one that looks like them.

``--forward-ab`` measures the transformers generator's decode path against the one it replaced, side
by side on the same seeded rollouts (outputs are bit-identical, so the turn and token counts must
match): the decoder and LM head called apart with each decode step's 4-D mask handed over ready-made,
against the whole causal-LM call that builds its mask every step. With ``--quickstart`` the rollouts
are the quickstart's own (its composed config, its model after its warm start, which is cached under
``runs/quickstart/warm_start`` by any earlier ``python train.py``, else trained first: 1-2 minutes;
one training batch with both prompt views): lockstep only, no sequential side.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from dataclasses import replace
from pathlib import Path

import torch

import agentopsd.envs  # noqa: F401
from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig
from agentopsd.credit.algorithms import AgentOPSD, Algorithm
from agentopsd.models.tiny import tiny_policy
from agentopsd.rollout import hf
from agentopsd.rollout.base import SamplingConfig
from agentopsd.rollout.collector import Collector
from agentopsd.training.data import collate_trajectories, sample_tasks
from agentopsd.training.module import AgentRLModule
from agentopsd.types import TaskSpec


def build(env_id: str, skills: str, algorithm, model, tokenizer, max_turns: int, max_general: int | None) -> AgentRLModule:
    module = AgentRLModule(
        copy.deepcopy(model), tokenizer, algorithm=algorithm,
        env=EnvConfig(id=env_id, skills=skills, max_turns=max_turns, skill_max_general=max_general),
        rollout=RolloutConfig(max_new_tokens=12),
        optim=OptimConfig(lr=1e-4, ppo_epochs=1, num_mini_batches=2, micro_batch_size=64),
        evaluation=EvalConfig(num_tasks=1), num_iterations=10,
    )
    module.trainer = None
    return module


class _NoTrainer:
    """Just enough of a Trainer for ``update`` outside ``fit``: plain backward, plain optimizer."""

    def __init__(self, module: AgentRLModule) -> None:
        cfg = module.configure_optimizers()
        self.opt, self.sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
        module.optimizers = lambda: self.opt
        module.lr_schedulers = lambda: self.sched
        module.manual_backward = lambda loss: loss.backward()


def iteration_seconds(modules: list[AgentRLModule], trajectories, repeats: int = 3) -> list[tuple[float, float]]:
    """Per module: best seconds of everything after the rollout (collate, teacher forward, credit,
    update), and of credit alone. The modules take turns, so a slow spell of the machine hits all."""
    for module in modules:
        _NoTrainer(module)
    best = [(float("inf"), float("inf"))] * len(modules)
    for _ in range(repeats):
        for i, module in enumerate(modules):
            t0 = time.perf_counter()
            batch = collate_trajectories(trajectories, module.pad_id)
            with torch.no_grad():
                batch.student_logprobs = batch.old_logprobs
                if module.algorithm.needs_teacher:
                    batch.teacher_logprobs = module.action_logprobs(batch, "teacher")
            t1 = time.perf_counter()
            module.algorithm.assign(batch)
            credit = time.perf_counter() - t1
            module.update(batch, 0)
            best[i] = (min(best[i][0], time.perf_counter() - t0), min(best[i][1], credit))
    return best


@contextlib.contextmanager
def whole_model_forward():
    """The generator's decode path before the split: the whole causal LM, building its mask each step."""
    saved = hf.decoder_and_head, hf._takes_prepared_mask
    hf.decoder_and_head, hf._takes_prepared_mask = (lambda model: None), (lambda model: False)
    try:
        yield
    finally:
        hf.decoder_and_head, hf._takes_prepared_mask = saved


def timed_rollout(collector: Collector, tasks, sampling: SamplingConfig, *, one_at_a_time: bool = False,
                  with_teacher: bool = False, seed: int = 0) -> tuple[float, int, int]:
    """(seconds, environment turns, generated tokens) of one seeded rollout of ``tasks``."""
    torch.manual_seed(seed)
    groups = [[t] for t in tasks] if one_at_a_time else [list(tasks)]
    turns = tokens = 0
    t0 = time.perf_counter()
    for group in groups:
        turns += sum(len(t.turns) for t in collector.collect(group, with_teacher=with_teacher, sampling=sampling))
        tokens += collector.stats.generated_tokens
    return time.perf_counter() - t0, turns, tokens


def forward_ab(collector: Collector, tasks, sampling: SamplingConfig, repeats: int, *, sequential: bool = True,
               with_teacher: bool = False) -> str:
    """Lockstep (and sequential) rollouts with the whole-model decode path and the split one, alternating,
    best of ``repeats`` each; both must generate the same turns and tokens."""
    collector._envs(tasks[0].split, len(tasks))  # the env pool, built untimed
    sides = {"whole model": whole_model_forward, "decoder + head": contextlib.nullcontext}
    best: dict[str, dict[str, tuple[float, int, int]]] = {name: {} for name in sides}
    for r in range(repeats):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            with sides[name]():
                runs = {"lockstep": timed_rollout(collector, tasks, sampling, with_teacher=with_teacher)}
                if sequential:
                    runs["sequential"] = timed_rollout(collector, tasks[:16], sampling, one_at_a_time=True, seed=1)
            for kind, run in runs.items():
                best[name][kind] = min(best[name].get(kind, run), run)
    old, new = best["whole model"], best["decoder + head"]
    if any(old[k][1:] != new[k][1:] for k in old):
        raise RuntimeError(f"the two decode paths generated different rollouts: {old} vs {new}")
    parts = [f"{k} {old[k][0]:.2f} s -> {new[k][0]:.2f} s ({old[k][0] / new[k][0]:.3f}x; "
             f"{new[k][1]} turns, {new[k][2] / new[k][1]:.1f} tokens/turn)" for k in old]
    if sequential:
        fig = {name: (b["lockstep"][1] / b["lockstep"][0]) / (b["sequential"][1] / b["sequential"][0]) for name, b in best.items()}
        parts.append(f"[2] {fig['whole model']:.2f}x -> {fig['decoder + head']:.2f}x")
    return f"whole model -> decoder + head, best of {repeats}: " + " | ".join(parts)


def quickstart_collector():
    """The quickstart's module (composed config, its model after its warm start) and one training batch."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from agentopsd.models.warmstart import warm_start
    from agentopsd.run import folders as runs

    runs.register_resolvers()
    root = Path(__file__).resolve().parents[1]
    with initialize_config_dir(config_dir=str(root / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=["output_dir=/tmp/agentopsd-step"])
    model, tokenizer = instantiate(cfg.model)
    warm_start(model, tokenizer, cfg.env, cfg.warm_start, root / "runs" / "quickstart" / "warm_start")
    module = AgentRLModule(model, tokenizer, algorithm=instantiate(cfg.algorithm), env=instantiate(cfg.env),
                           rollout=instantiate(cfg.rollout), optim=instantiate(cfg.optim),
                           evaluation=instantiate(cfg.evaluation), num_iterations=cfg.num_iterations, seed=cfg.seed)
    module.model.eval()
    tasks = sample_tasks(cfg.env.id, 50, cfg.data.tasks_per_batch, cfg.data.group_size, 0, seed=cfg.seed)
    return module.collector, tasks


def lockstep_vs_sequential(collector: Collector, tasks: list[TaskSpec], sampling: SamplingConfig, repeats: int) -> str:
    """Environment turns per second: all tasks in lockstep, then 16 of them one at a time.

    Each side repeats the same seeded rollout ``repeats`` times, taking turns with the other, and
    keeps its fastest: this machine's speed drifts by +-15% from minute to minute, and a slow
    spell during one side's only run would set the ratio.
    """
    collector._envs(tasks[0].split, len(tasks))  # build the env pool untimed: both loops then reuse it
    subset = tasks[:16]  # the sequential loop is slow: time 16 episodes (two tasks' groups) and compare rates
    t_batched = t_seq = float("inf")
    for _ in range(repeats):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        batched = collector.collect(tasks, with_teacher=False, sampling=sampling)
        t_batched = min(t_batched, time.perf_counter() - t0)
        tokens_batched = collector.stats.generated_tokens
        torch.manual_seed(1)
        t0 = time.perf_counter()
        sequential, tokens_seq = [], 0
        for task in subset:
            sequential += collector.collect([task], with_teacher=False, sampling=sampling)
            tokens_seq += collector.stats.generated_tokens
        t_seq = min(t_seq, time.perf_counter() - t0)
    turns_batched = sum(len(t.turns) for t in batched)
    turns_seq = sum(len(t.turns) for t in sequential)
    rate_b, rate_s = turns_batched / t_batched, turns_seq / t_seq
    return (f"lockstep {rate_b:.1f} env turns/s ({len(tasks)} envs, {tokens_batched / turns_batched:.1f} tokens/turn) "
            f"vs sequential {rate_s:.1f} turns/s ({tokens_seq / turns_seq:.1f} tokens/turn), best of {repeats}: "
            f"{rate_b / rate_s:.2f}x (target >= 10x)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--env", default="agentopsd/BabyAI-GoToLocal-v0")
    parser.add_argument("--skills", default="babyai")
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--skill-max-general", type=int, default=None, help="general skills kept in the teacher view (default: all)")
    parser.add_argument("--figures", default="1,2,3", help="which figures to measure, e.g. 2 (1 and 3 come together)")
    parser.add_argument("--response-tokens", type=int, default=128,
                        help="also measure [2] with N generated tokens per turn (think-then-act length); 0 = off")
    parser.add_argument("--repeats", type=int, default=3, help="[2]: runs per side, fastest kept")
    parser.add_argument("--forward-ab", action="store_true",
                        help="[2]: the generator's split decode path against the whole-model call, side by side")
    parser.add_argument("--quickstart", action="store_true", help="--forward-ab on the quickstart's own rollouts (and nothing else)")
    args = parser.parse_args()
    figures = {int(f) for f in args.figures.split(",")}
    if args.quickstart:
        collector, tasks = quickstart_collector()
        print(f"quickstart rollout: {forward_ab(collector, tasks, collector.sampling, args.repeats, sequential=False, with_teacher=True)}")
        return
    model, tokenizer = tiny_policy(args.env, skills=args.skills)
    tasks = sample_tasks(args.env, 50, args.envs // 8, 8, 0, seed=0)
    grpo = build(args.env, args.skills, Algorithm(), model, tokenizer, args.max_turns, args.skill_max_general)

    if figures & {1, 3}:
        # 1 + 3: the same rollouts, scored and updated by each algorithm from the same weights
        opsd = build(args.env, args.skills, AgentOPSD(), model, tokenizer, args.max_turns, args.skill_max_general)
        torch.manual_seed(0)  # the same rollouts run to run: their prompt lengths set the costs
        t0 = time.perf_counter()
        opsd.model.eval()
        trajectories = opsd.collector.collect(tasks, with_teacher=True)
        rollout_s = time.perf_counter() - t0
        opsd.model.train()
        (t_grpo, _), (t_opsd, t_credit) = iteration_seconds([grpo, opsd], trajectories)
        total_grpo, total_opsd = rollout_s + t_grpo, rollout_s + t_opsd
        print(f"iteration: rollout {rollout_s:.2f}s | GRPO update {t_grpo:.2f}s | AgentOPSD teacher+credit+update {t_opsd:.2f}s")
        print(f"[1] AgentOPSD / GRPO iteration time: {total_opsd / total_grpo:.3f} (target <= 1.3)")
        print(f"[3] credit share of an AgentOPSD iteration: {100 * t_credit / total_opsd:.3f}% ({t_credit * 1e3:.2f} ms; target < 1%)")

    if 2 in figures:
        # 2: lockstep against one environment at a time, same model, turn limit and code path
        collector = grpo.collector
        grpo.model.eval()
        own = collector.sampling.max_new_tokens
        measure = forward_ab if args.forward_ab else lockstep_vs_sequential
        print(f"[2] the policy's own turns (<= {own} tokens): {measure(collector, tasks, collector.sampling, args.repeats)}")
        if args.response_tokens > 0:
            long = replace(collector.sampling, max_new_tokens=args.response_tokens, stop_strings=())
            print(f"[2] {args.response_tokens}-token turns: {measure(collector, tasks, long, args.repeats)}")


if __name__ == "__main__":
    main()
