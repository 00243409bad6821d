"""benchmarks/smollm2_recipe.py --micro: every phase timed in float32 and in bf16 in one process, printed side by side
with their ratio. CI runs it on the tiny Qwen2 (``--model tiny``, seconds); the SmolLM2 figures are in
results/smollm2_speed."""

from __future__ import annotations

import json
import os
import time


def test_the_table_puts_both_precisions_side_by_side_with_bf16s_speed_up(smollm2_recipe_bench):
    seconds = {phase: {"float32": 1.2, "bfloat16": 0.4} for phase in smollm2_recipe_bench.MICRO_PHASES}
    seconds["update micro-batch"] = {"float32": 0.5, "bfloat16": 1.0}
    text = smollm2_recipe_bench.micro_table({"model": "smollm2", "threads": 1, "repeats": 3, "native_bf16_flags": ["avx512_bf16"],
                              "seconds": seconds})
    assert "native bf16 flags: avx512_bf16" in text
    assert "| rollout turn | 16 prompts, 8 new tokens, KV cache | 1.200 | 0.400 | 3.00x |" in text
    assert "| update micro-batch | 8 rows, forward + backward, LoRA | 0.500 | 1.000 | 0.50x |" in text  # slower: below 1
    assert len([line for line in text.splitlines() if line.startswith("| ") and "x |" in line]) == 4
    shared = smollm2_recipe_bench.micro_table({"model": "smollm2", "threads": 2, "repeats": 3, "native_bf16_flags": [],
                                               "busy": 1, "wait_policy": "unset", "spin_count": "3000", "seconds": seconds})
    assert shared.startswith("model smollm2, 2 thread(s), OMP_WAIT_POLICY unset, GOMP_SPINCOUNT 3000, 1 busy neighbour(s)")


def test_busy_neighbours_spin_for_the_block_only(smollm2_recipe_bench):
    """``--micro --busy N``: N processes spin while the phases are timed and are gone after (planted defect: left
    running, they would load every later test)."""
    with smollm2_recipe_bench.busy_neighbours(2) as procs:
        time.sleep(0.2)
        assert len(procs) == 2 and all(p.poll() is None for p in procs)  # still spinning
    assert all(p.returncode is not None for p in procs)


def test_micro_runs_every_phase_both_ways_on_the_tiny_model(smollm2_recipe_bench, tmp_path, capsys):
    out = tmp_path / "micro.json"
    assert smollm2_recipe_bench.main(["--micro", "--model", "tiny", "--repeats", "1", "--busy", "1", "--json", str(out),
                                      "--report", str(tmp_path / "micro-table.txt")]) == 0
    figures = json.loads(out.read_text())
    assert figures["model"] == "tiny" and set(figures["seconds"]) == set(smollm2_recipe_bench.MICRO_PHASES)
    assert figures["busy"] == 1 and figures["wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "unset")
    for phase, s in figures["seconds"].items():
        assert set(s) == {"float32", "bfloat16"} and min(s.values()) > 0, (phase, s)
    printed = capsys.readouterr().out
    assert "| phase | work | float32 s | bf16 s | bf16 speed-up (float32 s / bf16 s) |" in printed
    assert (tmp_path / "micro-table.txt").read_text().strip() in printed


def _result(bench, command: str, warm: float, phases: tuple[float, float, float], evals: list[tuple[float, float]],
            wall: float, trained: float = 100):
    its = [bench.Iteration(i + 1, *(p / 2 for p in phases), rows=100, success=0.5, trained=trained / 2) for i in range(2)]
    return bench.Result(command=command, commit="abc1234", threads="2", returncode=0, wall_seconds=wall, peak_rss_mib=4000,
                        warm_start_steps=96, warm_start_seconds=warm, iterations=its,
                        evals=[{"when": "periodic", "iteration": 2 * k, "success": s, "episodes": 50, "at": 0, "seconds": t}
                               for k, (s, t) in enumerate(evals)])


def test_compare_puts_float32_and_auto_side_by_side_with_float32_over_auto(smollm2_recipe_bench):
    """Planted defect: the time per row over every row (not the trained ones) prints 2.000 and 2.000."""
    bench = smollm2_recipe_bench
    f32 = _result(bench, "f", 600, (200, 300, 400), [(0.0, 100), (1.0, 80)], wall=2000)
    auto = _result(bench, "a", 500, (100, 150, 400), [(0.0, 50), (0.9, None)], wall=1000, trained=50)
    text = bench.compare_table(f32, auto)
    # the same update time over half the rows: twice the time per row trained
    assert "| update per row trained (nonzero advantage) | 4.000 | 8.000 | 0.50x |" in text
    assert "Rows the update trained on: 100 (float32) and 50 (auto)." in text
    assert "| wall (whole recipe) | 2000 | 1000 | **2.00x** |" in text
    assert "| warm start | 600 | 500 | 1.20x |" in text
    assert "| RL rollout | 200 | 100 | 2.00x |" in text  # summed over both iterations
    assert "| teacher scoring (with any recompute) | 300 | 150 | 2.00x |" in text
    assert "| update | 400 | 400 | 1.00x |" in text
    assert "| evaluations | 180 | 50 | 3.60x |" in text  # an evaluation without a time is left out of the sum
    assert "| greedy success at each evaluation | 0% / 100% | 0% / 90% | |" in text


def test_compare_runs_float32_then_auto_each_in_its_own_folder(smollm2_recipe_bench, tmp_path, monkeypatch):
    bench = smollm2_recipe_bench
    calls = []

    def fake(overrides, out, threads, shown):
        calls.append((overrides, out.name, threads))
        return _result(bench, " ".join(overrides), 1, (1, 1, 1), [(1.0, 1)], wall=10 if "model.dtype=float32" in overrides else 5)

    monkeypatch.setattr(bench, "measure", fake)
    report = tmp_path / "side-by-side.txt"
    assert bench.main(["--compare", "--threads", "2", "--out", str(tmp_path), "--report", str(report), "--", "seed=3"]) == 0
    assert calls == [(["seed=3", "model.dtype=float32"], "float32", "2"), (["seed=3"], "auto", "2")]
    assert "| wall (whole recipe) | 10 | 5 | **2.00x** |" in report.read_text()


def test_the_rows_trained_come_from_the_csvs_zero_advantage_share(smollm2_recipe_bench):
    rows = [{"step": "1", "perf/rollout_seconds": "10", "perf/teacher_seconds": "5", "perf/update_seconds": "8",
             "rollout/turns": "4", "rollout/trajectories": "24", "rollout/success": "0.5", "update/zero_advantage_share": "0.75"},
            {"step": "1", "eval/success": "0.2"},  # an evaluation row: no phases
            {"step": "2", "perf/rollout_seconds": "10", "perf/teacher_seconds": "5", "perf/update_seconds": "8",
             "rollout/turns": "3", "rollout/trajectories": "24", "rollout/success": "0.9"}]  # no share logged: all trained
    its = smollm2_recipe_bench.csv_iterations(rows)
    assert [(it.iteration, it.rows, it.trained) for it in its] == [(1, 96, 24), (2, 72, 72)]
