"""Asynchronous rollouts on the vLLM backend (``rollout.backend=vllm rollout.max_staleness=k``): the rollout worker runs
its own engine on ``model.path`` and pushes every weight version it loads into it before generating with it.

Fast: the project's fake engine (:mod:`tests.fakes.fake_engine`, installed inside the spawned worker through
``WorkerSpec.worker_init``: it lives in ``sys.modules`` and does not cross the spawn by itself) generates with its own
copy of the weights, so each turn's behaviour log-probs say which weights the engine held: they must be those of the
version the turn is tagged with. Slow (marker ``vllm``): the same through the module and Lightning with the real vLLM
CPU engine, run under the vLLM venv's python (tests/agentopsd/rollout/async_vllm_probe.py).
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path

import pytest

from tests.agentopsd.rollout.async_vllm_probe import GAP_TOLERANCE, ITERATIONS, MOVED, moved, turn_gap

ROOT = Path(__file__).resolve().parents[3]
PROBE = ROOT / "tests" / "agentopsd" / "rollout" / "async_vllm_probe.py"


# ------------------------------------------------------------------ fast: the fake engine inside the worker


@pytest.fixture
def policy_folder(tiny_walk_policy, tmp_path):
    model, tokenizer = tiny_walk_policy
    folder = tmp_path / "policy"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return copy.deepcopy(model), tokenizer, str(folder)


def _fake_spec(tokenizer, folder: str, *, weights_as_loaded: bool, end: int):
    import gymnasium as gym

    from agentopsd.config import EnvConfig, RolloutConfig
    from agentopsd.rollout.async_rollout import WorkerSpec
    from agentopsd.training.data import sample_tasks
    from tests.conftest import TOY_ID, WALK_SKILLS
    from tests.fakes import fake_engine

    return WorkerSpec(
        tokenizer=tokenizer, env=EnvConfig(id=TOY_ID, skills=WALK_SKILLS, max_turns=3, output_format="action"),
        rollout=RolloutConfig(backend="vllm", max_new_tokens=6, max_staleness=1, recompute_old_logprobs=True,
                              vllm={"dtype": "float32"}),
        seed=0, rank=0, world=1, with_teacher=False, task_fn=functools.partial(sample_tasks, TOY_ID, 4, 2, 2, seed=0),
        start=0, end=end, max_staleness=1, threads=1, parent_pid=os.getpid(), env_spec=gym.spec(TOY_ID),
        model_path=folder, weights_as_loaded=weights_as_loaded,
        worker_init=functools.partial(fake_engine.install, sleep_available=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("warm_started", [False, True], ids=["fresh", "warm-started"])
def test_the_workers_engine_generates_with_the_version_each_turn_is_tagged_with(policy_folder, warm_started):
    """Version 0 is the folder's weights (fresh) or a warm start's (the engine must be synced before its first
    generate); version 1, published after iteration 0, reaches the engine before any turn tagged with it. Iteration 2
    waits for version 1 (k=1), so it has such turns whatever the timing."""
    from agentopsd.rollout.async_rollout import AsyncRollout

    folder_model, tokenizer, folder = policy_folder
    v0 = moved(folder_model, 0.05, seed=1) if warm_started else folder_model
    v1 = moved(v0, 0.05, seed=2)
    versions = {0: v0.eval(), 1: v1.eval()}
    producer = AsyncRollout(_fake_spec(tokenizer, folder, weights_as_loaded=not warm_started, end=3), v0)
    try:
        batches = {0: producer.next_batch(0, lambda: False)[0]}
        producer.publish(v1, 1)
        for it in (1, 2):
            batches[it] = producer.next_batch(it, lambda: False)[0]
    finally:
        producer.close()
    assert not producer.process.is_alive()
    tagged = {v: [turn for it in batches for t in batches[it] for turn in t.turns if turn.policy_version == v] for v in (0, 1)}
    assert tagged[0] and tagged[1], {it: [[x.policy_version for x in t.turns] for t in b] for it, b in batches.items()}
    assert {turn.policy_version for t in batches[2] for turn in t.turns} == {1}  # admission: iteration 2 waited for v1
    for v, turns in tagged.items():
        gaps = [turn_gap(versions[v], turn) for turn in turns]
        others = [turn_gap(versions[1 - v], turn) for turn in turns]
        assert max(gaps) < GAP_TOLERANCE, (v, gaps)  # the engine held the version the turn is tagged with
        assert min(others) > MOVED, (v, others)  # and not the other one


# ------------------------------------------------------------------ slow: the real vLLM CPU engine through the module



@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_worker_trains_three_iterations_with_bounded_staleness(tmp_path):
    """rollout.backend=vllm rollout.max_staleness=1, 3 iterations through the module and Lightning on the vLLM CPU
    build: the staleness bound per batch from the recorded versions, some staleness, the first ratio ~1 (against the
    proximal policy), every turn's engine log-probs those of the weights of the version it is tagged with (the engine
    was synced after each update), and no worker left after teardown."""
    from tests.agentopsd.rollout.test_vllm_backend import _run_in_own_group, _vllm_python

    python = _vllm_python()
    out = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["OMP_NUM_THREADS"] = "1"
    returncode, tail = _run_in_own_group([str(python), str(PROBE), str(tmp_path / "work"), str(out)], env, timeout=840)
    assert out.is_file(), f"rc={returncode}:\n{tail}"
    summary = json.loads(out.read_text())
    assert returncode == 0, tail
    assert sorted(summary["versions"]) == [str(i) for i in range(ITERATIONS)], summary
    worst = 0
    for it, versions in summary["versions"].items():
        staleness = [int(it) - v for v in versions]
        assert versions and 0 <= min(staleness) and max(staleness) <= 1, (it, versions)
        worst = max(worst, max(staleness))
    assert worst >= 1, summary["versions"]  # the worker played ahead of the update
    assert len(summary["first_ratio_dev"]) == ITERATIONS and max(summary["first_ratio_dev"]) < 1e-4, summary
    # the engine generated every turn with the weights of its version: versions after 0 only reach it by a sync
    assert summary["turns_after_v0"] > 0, summary
    assert summary["max_gap_own_version"] < GAP_TOLERANCE, summary
    assert summary["min_gap_version_0_after_v0"] > MOVED, summary
    assert summary["worker_alive_after_teardown"] is False and summary["producer_kept"] is False, summary




@pytest.mark.timeout(300)
def test_the_module_hands_the_worker_its_model_path_and_a_warm_start(policy_folder, monkeypatch):
    """Through the module (Lightning, 2 iterations, k=1) with a warm-started policy: the worker's engine loads
    ``model.path`` and is synced to the policy's own weights before its first generate (``weights_as_loaded``)."""
    import lightning as L

    from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig
    from agentopsd.credit.algorithms import Algorithm
    from agentopsd.rollout import source as source_lib
    from agentopsd.rollout.async_rollout import WorkerSpec
    from agentopsd.training.module import AgentRLModule
    from tests.agentopsd.rollout.test_async_rollout import fit
    from tests.conftest import TOY_ID, WALK_SKILLS
    from tests.fakes import fake_engine

    folder_model, tokenizer, folder = policy_folder
    warm = moved(folder_model, 0.05, seed=3)  # a warm start moved the policy away from the folder's weights
    snapshots, turns = {}, []

    class Recorder(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            snapshots[pl_module.iteration] = copy.deepcopy(pl_module.model).eval()
            turns.extend(turn for t in batch.trajectories for turn in t.turns)

    fake_engine.install(sleep_available=True)  # this process too: the module checks the backend it was given
    try:
        monkeypatch.setattr(source_lib, "WorkerSpec", functools.partial(
            WorkerSpec, worker_init=functools.partial(fake_engine.install, sleep_available=True)))
        module = AgentRLModule(
            warm, tokenizer, algorithm=Algorithm(),
            env=EnvConfig(id=TOY_ID, skills=WALK_SKILLS, max_turns=3, output_format="action"),
            rollout=RolloutConfig(backend="vllm", max_new_tokens=6, max_staleness=1, recompute_old_logprobs=True,
                                  vllm={"dtype": "float32"}),
            optim=OptimConfig(lr=1e-2, ppo_epochs=1, num_mini_batches=1, micro_batch_size=8),
            evaluation=EvalConfig(num_tasks=2), num_iterations=2, model_path=folder, weights_as_loaded=False)
        fit(module, 2, Recorder())
    finally:
        fake_engine.uninstall()
    assert module._rollouts is None
    assert turns and {turn.policy_version for turn in turns} <= {0, 1}
    gaps = [turn_gap(snapshots[turn.policy_version], turn) for turn in turns]
    folder_gaps = [turn_gap(folder_model.eval(), turn) for turn in turns if turn.policy_version == 0]
    assert max(gaps) < GAP_TOLERANCE, gaps  # the warm-started weights reached the engine before its first generate
    assert folder_gaps and min(folder_gaps) > MOVED, folder_gaps  # not the folder's, which it loaded
