"""benchmarks/async_rollout.py: the bound and the cost model it prints beside the measured ratio must be right, it
must time the same iterations of every run, and a tiny end-to-end invocation must run every variant."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("async_rollout", ROOT / "benchmarks" / "async_rollout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["async_rollout"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_lockstep_is_the_sum_of_every_time(bench):
    gen, train = [3.0, 1.0, 4.0, 1.5], [2.0, 0.5, 1.0, 2.5]
    assert bench.simulate(gen, train, 0) == pytest.approx(sum(gen) + sum(train))


@pytest.mark.parametrize("g, t", [(3.0, 2.0), (2.0, 3.0), (2.0, 2.0)])
@pytest.mark.parametrize("k", [1, 2])
def test_constant_times_cost_the_longer_phase_per_iteration_after_the_fill(bench, g, t, k):
    n = 10
    assert bench.simulate([g] * n, [t] * n, k) == pytest.approx(min(g, t) + n * max(g, t))


def test_one_step_ahead_waits_for_the_update_before_last(bench):
    """Iteration 2 may start only once iteration 0's update is done (weights of version 1): a slow first update
    holds the generator back under k=1, not under k=2."""
    gen, train = [1.0, 1.0, 1.0], [5.0, 0.1, 0.1]
    # k=1: gen 0 [0,1], gen 1 [1,2], update 0 [1,6]; gen 2 waits for it: [6,7]; update 1 [6,6.1]; update 2 [7,7.1]
    assert bench.simulate(gen, train, 1) == pytest.approx(7.1)
    # k=2: gen 2 [2,3] at once; updates 0 [1,6], 1 [6,6.1], 2 [6.1,6.2]
    assert bench.simulate(gen, train, 2) == pytest.approx(6.2)


def test_two_steps_ahead_absorb_variance_one_step_cannot(bench):
    n = 400
    gen = bench.draw(1.0, n, 0.3, seed=1)
    train = [1.0] * n
    k1, k2 = bench.simulate(gen, train, 1), bench.simulate(gen, train, 2)
    assert k2 < k1 < bench.simulate(gen, train, 0)
    assert k2 / n == pytest.approx(1.0, abs=0.05)  # nearly the mean of the longer phase
    assert k1 / n > 1.05  # a slow generation after a fast one still stalls the update


def test_draw_is_seeded_and_within_the_spread(bench):
    a = bench.draw(10.0, 50, 0.2, seed=3)
    assert a == bench.draw(10.0, 50, 0.2, seed=3) and a != bench.draw(10.0, 50, 0.2, seed=4)
    assert all(8.0 <= x <= 12.0 for x in a) and bench.draw(10.0, 3, 0.0, seed=0) == [10.0] * 3


def test_the_bound_is_lockstep_on_two_threads_over_the_longer_side_on_one_core(bench):
    two = {"rollout": 6.0, "teacher": 1.0, "update": 3.0}
    one = {"rollout": 8.0, "teacher": 2.0, "update": 4.0}
    assert bench.async_bound(two, one) == pytest.approx(10.0 / 8.0)  # generation is the longer side
    one_slow_trainer = {"rollout": 5.0, "teacher": 2.0, "update": 4.0}
    assert bench.async_bound(two, one_slow_trainer) == pytest.approx(10.0 / 6.0)  # scoring + update are
    assert bench.wall_bound(11.0, 15.0, 8.0) == pytest.approx(11.0 / 8.0)
    assert bench.wall_bound(11.0, 15.0, 6.0) == pytest.approx(11.0 / 9.0)


def test_every_variant_is_timed_over_iterations_two_to_n_minus_two(bench):
    ends = {i: 10.0 * i + (100.0 if i == 1 else 0.0) + (50.0 if i >= 7 else 0.0) for i in range(1, 9)}
    ends = {i: v + 100.0 for i, v in ends.items()}  # the first iteration's fill shifts every later end alike
    # 8 iterations: 2..6 timed, from the end of 1 to the end of 6; iterations 7 and 8 (a slow tail here) left out
    assert bench.steady_seconds(ends, 8) == pytest.approx((ends[6] - ends[1]) / 5)
    rows = {i: {"rollout": float(i), "teacher": 1.0, "update": 2.0} for i in range(1, 9)}
    assert bench.phase_means(rows, 8) == {"rollout": 4.0, "teacher": 1.0, "update": 2.0}
    with pytest.raises(ValueError, match="at least 4"):
        bench.steady_window(3)


def test_the_variants_settings(bench):
    env, args = bench.overrides("async-k2", 6, quick=True, weights=Path("/w/policy-x.pt"))
    assert env["OMP_NUM_THREADS"] == "1"
    assert {"rollout.max_staleness=2", "rollout.worker_threads=1", "num_iterations=6", "warm_start.weights=/w/policy-x.pt",
            "data.tasks_per_batch=2", "rollout.teacher_scoring=trainer"} <= set(args)
    assert "rollout.teacher_scoring=worker" in bench.overrides("async-k1-ws", 6, quick=True, weights=None)[1]
    env, args = bench.overrides("lockstep-2t", 6, quick=False, weights=None)
    assert env["OMP_NUM_THREADS"] == "2" and not any(a.startswith(("rollout.max_staleness", "warm_start.weights", "data.")) for a in args)


def test_the_cost_model_report_runs_without_training(bench, capsys, tmp_path):
    assert bench.main(["--model-only", "--json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "## Stand-in cost model" in out and "## Measured" not in out and "749 -> 520 s/step" in out
    rows = {r["source"]: r for r in json.loads((tmp_path / "m.json").read_text())["cost_model"]}
    half = rows["assumed: generation 50%"]["seconds"]
    assert half["lockstep"] == 100.0 and half["k=1"] == pytest.approx(50.0, abs=0.5)


@pytest.mark.slow
def test_a_quick_run_times_every_variant(tmp_path):
    """Four tiny quickstart runs, one after another (about a minute on a busy 2-core machine): the two lockstep ones
    the bound needs, and k=1 with each teacher scoring (k=2 differs from k=1 by one override, checked above)."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "async_rollout.py"), "--quick", "--iterations", "4",
                          "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "r.json"),
                           "--variants", "lockstep-2t", "lockstep-1t", "async-k1", "async-k1-ws"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for variant in ("lockstep-2t", "lockstep-1t", "async-k1", "async-k1-ws"):
        assert f"| {variant} | " in out.stdout
    assert "bound from the phases" in out.stdout and "measured, async-k1-ws" in out.stdout
    numbers = json.loads((tmp_path / "r.json").read_text())
    assert [r["variant"] for r in numbers["runs"]] == ["lockstep-2t", "lockstep-1t", "async-k1", "async-k1-ws"]
    summary = numbers["summary"]
    assert summary["async-k1"]["staleness_mean"] > 0 and summary["lockstep-2t"]["staleness_mean"] is None
    # every run after the first loaded the first run's warm start
    assert all("warm_start.weights=" in (tmp_path / "runs" / f"round1-{v}" / ".hydra" / "overrides.yaml").read_text()
               for v in ("lockstep-1t", "async-k1", "async-k1-ws"))


def test_a_missing_warm_start_is_refused_before_any_run(bench, tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        bench.main(["--quick", "--iterations", "4", "--weights", str(tmp_path / "policy-none.pt"), "--out", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists()
