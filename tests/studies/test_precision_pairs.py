"""studies/precision_pairs.py: the per-seed pairs of float32 and auto runs on synthetic benchmark JSON (no training),
the paired statistics, and a sitting that keeps the seeds done before."""

from __future__ import annotations

import json

import pytest

from tests.studies.loader import load_study


@pytest.fixture(scope="module")
def pairs_study():
    return load_study("precision_pairs")


def _run(wall: float, curve: list[float], commit: str = "c0ffee1234567890", trained: float = 60) -> dict:
    return {"commit": commit, "threads": "1", "wall_seconds": wall,
            "iterations": [{"iteration": 1, "trained": trained / 2}, {"iteration": 2, "trained": trained / 2}],
            "evals": [{"when": "periodic", "iteration": 2 * k, "success": s, "episodes": 50} for k, s in enumerate(curve)]}


def test_the_area_is_the_mean_height_of_the_curve_over_the_iterations(pairs_study):
    assert pairs_study.area(_run(1, [0.0, 1.0, 1.0, 1.0])) == pytest.approx((0.5 + 1 + 1) / 3)
    assert pairs_study.area(_run(1, [0.0, 0.5])) == pytest.approx(0.25)
    assert pairs_study.final(_run(1, [0.0, 0.5, 0.25])) == 0.25


def test_the_table_pairs_each_seeds_runs_and_gives_the_difference_auto_minus_float32(pairs_study):
    """Auto loses 10 points at the end on seed 1 only: the mean difference is -5 with an interval around it; the wall
    ratio is float32 over auto. Planted defect: float32 - auto would print +5.0."""
    pairs = {0: {"float32": _run(1400, [0, 1, 1, 1]), "auto": _run(700, [0, 1, 1, 1])},
             1: {"float32": _run(1500, [0, 1, 1, 1]), "auto": _run(600, [0, 0.9, 0.9, 0.9])}}
    text = pairs_study.build_table(pairs, "python studies/precision_pairs.py --seeds 0-1")
    assert "| 0 | 0 / 100 / 100 / 100% | 0 / 100 / 100 / 100% | 1400 | 700 | 2.00x | 60 / 60 |" in text
    assert "| 1 | 0 / 100 / 100 / 100% | 0 / 90 / 90 / 90% | 1500 | 600 | 2.50x | 60 / 60 |" in text
    assert "mean 2.25x, worst seed 2.00x, best 2.50x" in text
    final_line = next(line for line in text.splitlines() if line.startswith("- final greedy success"))
    assert final_line.startswith("- final greedy success: -5.0 [")
    lo, hi = (float(x) for x in final_line.split("[")[1].rstrip("]").split(", "))
    assert lo < -5 < hi and lo >= -100 and hi > 0  # two seeds: a wide interval, cut to the possible range
    assert "Commits: c0ffee123456; OMP_NUM_THREADS: 1; seeds: 2" in text


def test_one_seed_says_it_has_no_interval(pairs_study):
    old = {**_run(1, [0, 1]), "iterations": [{"iteration": 1}]}  # a JSON from before the count: unknown, not 0
    text = pairs_study.build_table({3: {"float32": _run(2, [0, 1], trained=471), "auto": old}}, "cmd")
    assert "| 2.00x | 471 / ? |" in text
    assert "- final greedy success: +0.0 (one seed: no interval)" in text


def test_a_sitting_runs_only_the_seeds_without_json_and_keeps_a_failed_seed_out(pairs_study, tmp_path, monkeypatch):
    out = tmp_path / "seeds"
    out.mkdir()
    (out / "s0.json").write_text(json.dumps({"float32": _run(2, [0, 1]), "auto": _run(1, [0, 1])}))
    ran = []

    def fake(out_dir, seed, threads, runs_dir, overrides):
        ran.append((seed, threads, overrides))
        if seed == 1:
            (out_dir / f"s{seed}.json").write_text(json.dumps({"float32": _run(3, [0, 1]), "auto": _run(1, [0, 1])}))
            return 0
        return 1  # seed 2's run failed: no JSON, and the next sitting runs it again

    monkeypatch.setattr(pairs_study, "run_seed", fake)
    assert pairs_study.main(["--seeds", "0-2", "--out", str(out), "--runs", str(tmp_path / "runs"), "--", "num_iterations=2"]) == 1
    assert ran == [(1, "1", ["num_iterations=2"]), (2, "1", ["num_iterations=2"])]
    table = (out / "table.md").read_text()
    assert "seeds: 2" in table and "\n| 1 |" in table and "\n| 2 |" not in table
