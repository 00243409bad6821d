"""The rank invariant, checked in one process: two simulated ranks (threads) on deliberately unequal data
issue the same sequence of collectives (agreements, forwards, backwards) for every algorithm file.

A forward of the policy stands for FSDP's all-gathers, a backward for the gradient reduction; both are
recorded by hooks, the agreements by :mod:`agentopsd.training.distributed` itself. Each rank plays other tasks
(other prompt lengths and episode lengths), holds another number of rows, and one rank may have no
rows at all (every episode faulted); the entropy bonus and the KL penalty are on.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import traceback
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig
from agentopsd.training.data import TaskBatch
from agentopsd.training.distributed import SimulatedWorld, record
from agentopsd.training.module import AgentRLModule
from agentopsd.types import TaskSpec
from tests.conftest import TOY_ID, WALK_SKILLS

ALGORITHM_FILES = sorted(Path(__file__).parents[3].joinpath("conf", "algorithm").glob("*.yaml"))


def _algorithm(path: Path):
    cfg = OmegaConf.load(path)
    algo = instantiate(cfg)
    # every loss term on: the KL to a reference (a second model's forwards) and the entropy bonus
    return dataclasses.replace(algo, kl_coef=0.01, entropy_coef=0.001)


def _module(policy, algorithm, rank: int, fault_rate: float = 0.0, max_turns: int = 5, optim: dict | None = None,
            eval_tasks: int = 3, rollout: dict | None = None, num_threads: int = 0) -> AgentRLModule:
    model, tokenizer = policy
    module = AgentRLModule(
        copy.deepcopy(model), tokenizer, algorithm=algorithm,
        env=EnvConfig(id=TOY_ID, skills=WALK_SKILLS, max_turns=max_turns, output_format="action", fault_rate=fault_rate,
                      num_threads=num_threads),
        rollout=RolloutConfig(**{"max_new_tokens": 5, **(rollout or {})}),
        optim=OptimConfig(**{"lr": 1e-3, "ppo_epochs": 2, "num_mini_batches": 2, "micro_batch_size": 2, **(optim or {})}),
        evaluation=EvalConfig(num_tasks=eval_tasks, sampled_copies=1),
        num_iterations=2, seed=rank,
    )
    module._sharded = True  # take the sharded paths (whole-model forwards, padded scoring) as under FSDP
    opt = module.configure_optimizers()
    module.optimizers = lambda: opt["optimizer"]
    module.lr_schedulers = lambda: opt["lr_scheduler"]["scheduler"]
    module.manual_backward = lambda loss: loss.backward()
    for name, m in (("policy", module.model), ("reference", module.ref_model)):
        if m is not None:
            m.model.layers[0].register_forward_pre_hook(lambda *a, name=name: record(("forward", name)))
    first = module.model.model.layers[0].self_attn.q_proj.weight
    first.register_post_accumulate_grad_hook(lambda p: record(("backward",)))
    return module


def _tasks(rank: int) -> TaskBatch:
    # rank 0 plays groups 0 and 2 (goal 5 and 2), rank 1 group 1 (goal 3): other prompts, lengths, row counts
    goals = {0: 3, 1: 2, 2: 0}
    tasks = tuple(TaskSpec(TOY_ID, "train", seed=100 * g + c, task_index=goals[g], group_id=g) for g in range(3) for c in range(2 + g))
    return TaskBatch(0, tasks)


def run_ranks(policy, algorithm, *, fault_rank: int | None = None, max_turns=(5, 5), evaluate=True, optim: dict | None = None,
              eval_tasks: int = 3, rollout: dict | None = None, num_threads: int = 0) -> SimulatedWorld:
    world = SimulatedWorld(2, timeout=30)

    def rank(r: int) -> None:
        module = _module(policy, algorithm, r, fault_rate=1.0 if r == fault_rank else 0.0, max_turns=max_turns[r], optim=optim,
                         eval_tasks=eval_tasks, rollout=rollout, num_threads=num_threads)
        torch.manual_seed(r)
        batch = module.rollout(_tasks(r))
        module.algorithm.assign(batch, 0)
        module.update(batch, 0)
        if evaluate:
            module.evaluate()

    # a mismatch shows as one rank waiting for the other: surface both
    errors = {r: "".join(traceback.format_exception(e, limit=-4)) for r, e in world.run(rank).items() if isinstance(e, BaseException)}
    if errors:
        raise AssertionError(f"ranks failed: {errors}; last events: {[log[-3:] for log in world.logs]}")
    return world


def _same(world: SimulatedWorld) -> None:
    a, b = world.logs
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert a == b, f"ranks part at event {first}: rank 0 {a[first:first + 3]}, rank 1 {b[first:first + 3]}"
    assert ("backward",) in a and ("forward", "policy") in a


@pytest.mark.parametrize("path", ALGORITHM_FILES, ids=[p.stem for p in ALGORITHM_FILES])
def test_every_algorithm_issues_the_same_collectives_on_unequal_data(tiny_walk_policy, path):
    _same(run_ranks(tiny_walk_policy, _algorithm(path)))


def test_one_rank_done_first_and_one_rank_without_rows(tiny_walk_policy):
    """Rank 1's episodes end after one turn (all-done first) while rank 0 plays five; then every
    episode of rank 0 faults: it trains on nothing and still takes part in every pass."""
    algo = _algorithm(next(p for p in ALGORITHM_FILES if p.stem == "grpo_opsd"))
    _same(run_ranks(tiny_walk_policy, algo, max_turns=(5, 1), evaluate=False))
    _same(run_ranks(tiny_walk_policy, algo, fault_rank=0, evaluate=False))


def test_fewer_evaluation_tasks_than_ranks(tiny_walk_policy):
    """One evaluation task over two ranks: rank 1's shard is empty, and it still takes part in rank 0's
    turns (greedy and sampled) and in the gathering of outcomes; both ranks report the same metrics."""
    algo = _algorithm(next(p for p in ALGORITHM_FILES if p.stem == "grpo"))
    world = run_ranks(tiny_walk_policy, algo, eval_tasks=1)
    _same(world)
    assert ("gather", "evaluation/outcomes") in world.logs[1]


def test_overlapped_waves_keep_ranks_in_step(tiny_walk_policy, monkeypatch):
    """rollout.overlap_waves=4 with env steps in a thread pool: every rank makes 4 generate calls per turn
    whatever its episodes. Rank 0's 6 episodes make waves of 2, 2, 1, 1; rank 1's 3 make 1, 1, 1 and an empty
    one. Rank 1 is done after one turn while rank 0 plays five; in the evaluation rank 1 holds no task at all;
    then every episode of rank 0 faults at reset (all its waves empty from the start)."""
    from agentopsd.rollout.hf import HFGenerator

    real, inside = HFGenerator.generate, threading.local()

    def counted(self, prompts, sampling):
        if getattr(inside, "call", False):  # an empty call's placeholder generate: part of the same call
            return real(self, prompts, sampling)
        record(("generate", "empty" if not prompts else "rows"))  # the collector's call, not the collectives inside
        inside.call = True
        try:
            return real(self, prompts, sampling)
        finally:
            inside.call = False

    def same_calls(world: SimulatedWorld, collects: int) -> list[tuple]:
        calls = [[e for e in log if e[0] == "generate"] for log in world.logs]
        # an empty call forwards too (a placeholder row): the calls match in number, not in content
        assert len(calls[0]) == len(calls[1])
        world.logs = [[e for e in log if e[0] != "generate"] for log in world.logs]
        _same(world)
        turns = world.logs[0].count(("agree", "rollout/turn"))
        assert len(calls[0]) == 4 * (turns - collects)  # four per played turn; each collect's last agreement ends it
        return calls[1]

    monkeypatch.setattr(HFGenerator, "generate", counted)
    algo = _algorithm(next(p for p in ALGORITHM_FILES if p.stem == "grpo_opsd"))
    overlap = {"overlap_waves": 4}
    world = run_ranks(tiny_walk_policy, algo, max_turns=(5, 1), eval_tasks=1, rollout=overlap, num_threads=2)
    assert ("generate", "empty") in same_calls(world, collects=3)  # the rollout, the greedy and the sampled evaluation
    world = run_ranks(tiny_walk_policy, algo, fault_rank=0, evaluate=False, rollout=overlap, num_threads=2)
    same_calls(world, collects=1)


def test_token_budget_micro_batches_keep_ranks_in_step(tiny_walk_policy):
    """Micro-batches and sharded scoring passes cut by a token budget: their count depends on each rank's
    lengths, and is still agreed (dummy passes for the missing ones), also with one rank holding no rows.
    The public runs' numerics (dual-clip, clamped KL) are on."""
    algo = _algorithm(next(p for p in ALGORITHM_FILES if p.stem == "grpo_opsd"))
    optim = {"max_tokens_per_micro_batch": 500, "clip_ratio_c": 3.0, "kl_clamp": 10.0}
    world = run_ranks(tiny_walk_policy, algo, evaluate=False, optim=optim)
    _same(world)
    agreed = [e for e in world.logs[0] if e[0] == "agree"]
    assert any("update/micro-batches" in str(e) for e in agreed) and any("scoring/" in str(e) for e in agreed)
    _same(run_ranks(tiny_walk_policy, algo, fault_rank=0, evaluate=False, optim=optim))


def test_a_mismatch_is_caught(tiny_walk_policy, monkeypatch):
    """The check can fail: a rank that skips the agreement on its micro-batches parts from the other."""
    from agentopsd.training import distributed

    real = distributed.exchange

    def skewed(values, what):
        if what == "update/micro-batches" and distributed.rank_and_world()[0] == 1:
            distributed.record(("agree", what))
            return [[float(v) for v in values]] * 2  # answers alone: no exchange with rank 0
        return real(values, what)

    monkeypatch.setattr(distributed, "exchange", skewed)
    algo = _algorithm(next(p for p in ALGORITHM_FILES if p.stem == "grpo"))
    with pytest.raises(AssertionError):
        _same(run_ranks(tiny_walk_policy, algo, evaluate=False))
