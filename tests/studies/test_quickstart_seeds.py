"""studies/quickstart_seeds.py: resume logic, rows read back from run logs, and the per-seed table (no training)."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from tests.studies.loader import load_study


@pytest.fixture(scope="module")
def qs():
    return load_study("quickstart_seeds")


def _write_log(run_dir: Path, version: int, evals: dict[int, float], train: list[float]) -> None:
    """A CSV log as Lightning's CSVLogger writes it: sparse rows, empty cells."""
    keys = ["step", "rollout/success", "loss/grad_norm", "eval/iteration", "eval/success"]
    path = run_dir / "csv" / f"version_{version}" / "metrics.csv"
    path.parent.mkdir(parents=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for i, s in enumerate(train):
            w.writerow({"step": i, "rollout/success": s, "loss/grad_norm": 0.5})
        for it, s in evals.items():
            w.writerow({"step": it, "eval/iteration": it, "eval/success": s})


def test_a_resumed_runs_later_log_wins_and_finished_needs_the_final_evaluation(qs, tmp_path: Path) -> None:
    _write_log(tmp_path, 0, {0: 0.0, 4: 0.2}, [0.1, 0.2])
    assert not qs.is_finished(tmp_path, 16)
    # version_10 sorts after version_2 by number, not by text
    _write_log(tmp_path, 2, {4: 0.3}, [])
    _write_log(tmp_path, 10, {4: 0.5, 16: 0.9}, [0.6])
    assert qs.evaluations(qs.log_rows(tmp_path)) == {0: 0.0, 4: 0.5, 16: 0.9}
    assert qs.is_finished(tmp_path, 16)


def test_parse_seeds_ranges_and_lists(qs) -> None:
    assert qs.parse_seeds(["0-3", "7", "2"]) == [0, 1, 2, 3, 7]
    with pytest.raises(SystemExit, match="neither a seed nor a range"):
        qs.parse_seeds(["a-b"])


def test_bootstrap_interval_stays_inside_the_values(qs) -> None:
    values = [0.0, 0.96, 0.97, 0.99, 1.0, 0.98, 0.95, 0.97, 0.96, 1.0]
    lo, hi = qs.bootstrap_interval(values)
    assert 0.0 <= lo < sum(values) / len(values) < hi <= 1.0
    assert qs.bootstrap_interval([1.0] * 5) == (1.0, 1.0)


def _fake_train(qs, monkeypatch, calls: list[list[str]], finish: bool, envs: list[dict] | None = None) -> None:
    """Stand in for train.py: record the command and write the log a finished (or cut short) run leaves."""
    def run(cmd, cwd, stdout, stderr, env):
        calls.append(cmd)
        if envs is None:
            assert env["OMP_NUM_THREADS"] == "1"
        else:
            envs.append(env)
        run_dir = Path(next(a for a in cmd if a.startswith("output_dir=")).split("=", 1)[1])
        version = len(list((run_dir / "csv").glob("version_*")))
        _write_log(run_dir, version, {0: 0.0, 16: 0.9} if finish else {0: 0.0}, [0.25, 0.5])
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / "last.ckpt").write_text("x")
        if "/usr/bin/time" in cmd:
            Path(cmd[cmd.index("-o") + 1]).write_text("2048000\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(qs.subprocess, "run", run)


def test_run_one_skips_finished_resumes_cut_short_and_restarts_other_commits(qs, tmp_path: Path, monkeypatch) -> None:
    calls: list[list[str]] = []
    # cut short: the run fails without its final evaluation, its checkpoint stays
    _fake_train(qs, monkeypatch, calls, finish=False)
    with pytest.raises(RuntimeError, match="failed"):
        qs.run_one("agentopsd", 3, tmp_path, tmp_path, "abc", 16, [])
    assert "ckpt_path=last" not in calls[-1] and "seed=3" in calls[-1] and "algorithm=agentopsd" in calls[-1]
    # the same command again goes on from the checkpoint
    _fake_train(qs, monkeypatch, calls, finish=True)
    row = qs.run_one("agentopsd", 3, tmp_path, tmp_path, "abc", 16, [])
    assert "ckpt_path=last" in calls[-1] and len(calls) == 2
    assert row["success_end"] == 0.9 and row["resumed"] == 1 and row["commit"] == "abc"
    assert row["rollout_success_by_it"] == "0.25 0.5 0.25 0.5"  # both versions' iterations
    # finished: read back, not trained again
    assert qs.run_one("agentopsd", 3, tmp_path, tmp_path, "abc", 16, [])["success_end"] == 0.9 and len(calls) == 2
    # a cut-short run of another commit starts over (keeping the warm start), with the warm start lent by seed
    other = tmp_path / "runs" / "grpo-s3"
    _write_log(other, 0, {0: 0.0}, [0.1])
    (other / "checkpoints").mkdir()
    (other / "checkpoints" / "last.ckpt").write_text("x")
    (other / "meta.json").write_text(json.dumps({"commit": "old", "wall_s": 5.0}))
    (tmp_path / "runs" / "agentopsd-s3" / "warm_start").mkdir(exist_ok=True)
    (tmp_path / "runs" / "agentopsd-s3" / "warm_start" / "policy-1.pt").write_text("w")
    row = qs.run_one("grpo", 3, tmp_path, tmp_path, "abc", 16, [])
    assert "ckpt_path=last" not in calls[-1] and row["resumed"] == 0
    assert (other / "warm_start" / "policy-1.pt").exists()
    assert not (other / "csv" / "version_1").exists()  # the old commit's log went with the restart


def _row(algorithm: str, seed: int, end: float, repeat: int = 0, mid: float | None = None) -> dict:
    return {"seed": seed, "repeat": repeat, "algorithm": algorithm, "commit": "0123456789abcdef", "iterations": 16,
            "success_warm_start": 0.0, "success_end": end, "eval_it0": 0.0, "eval_it8": end / 2 if mid is None else mid,
            "eval_it16": end, "wall_s": 400.0 + seed, "peak_rss_mb": 1900.0, "resumed": 0,
            "rollout_success_by_it": "0 0 0.5 0.5 1 1", "loss_approx_kl_mean": 0.0125}


def test_table_shows_algorithms_side_by_side_and_the_target_count(qs, tmp_path: Path) -> None:
    rows = [_row("grpo", 1, 0.5), _row("agentopsd", 0, 0.96), _row("agentopsd", 1, 0.04), _row("grpo", 0, 0.81)]
    rows[0].update(warm_start_trained=0, wall_s=50.0, peak_rss_mb=800.0)  # grpo seed 1 loaded seed 1's warm start
    qs.write_results(rows, tmp_path, ["agentopsd", "grpo"], 16, "python studies/quickstart_seeds.py --seeds 0-1")
    table = (tmp_path / "table.md").read_text()
    assert "| 0 | 0 | 1 | 0 → 48 → 96 | 0 → 40 → 81 | 400 / 1900 | 400 / 1900 |" in table
    assert "| 1 | 0 | 1 | 0 → 2 → 4 | 0 → 25 → 50 | 401 / 1900 | 50* / 800* |" in table and "\\* loaded its warm start" in table
    # seed to seed only (no seed repeated); iteration 8 is the last evaluation within two thirds of 16
    assert "≥ 80% at iteration 8" in table
    # the run that loaded its warm start is left out of time and memory
    assert "| grpo | seed to seed: seeds 0, 1; 1 thread, 2 at a time | 1 / 2 | 0 / 2 | 66 [50, 81] | 50 | 0 | 400 (400) | 1900 |" in table
    assert "| agentopsd | seed to seed: seeds 0, 1; 1 thread, 2 at a time | 1 / 2 | 0 / 2 | 50 [4, 96] | 4 |" in table
    assert "| agentopsd | 0 | 0 | 1 | 50 | 25 | 75 |  | 0.0125 |  |  |" in table  # first and last 4 of 6 iterations
    assert "Commit: 0123456789ab" in table and "--seeds 0-1" in table
    with (tmp_path / "runs.csv").open() as f:
        read = list(csv.DictReader(f))
    assert [(r["seed"], r["algorithm"]) for r in read] == [("0", "agentopsd"), ("0", "grpo"), ("1", "agentopsd"), ("1", "grpo")]
    assert list(read[0])[:11] == ["seed", "repeat", "threads", "algorithm", "commit", "iterations", "success_warm_start", "success_end",
                                  "eval_it0", "eval_it8", "eval_it16"]


def test_table_puts_run_to_run_beside_seed_to_seed(qs, tmp_path: Path) -> None:
    """Repeats of seed 0 and the first runs of seeds 0-2, written by two commands into one folder."""
    repeats = [_row("agentopsd", 0, end, repeat=k, mid=0.9) for k, end in enumerate([0.96, 0.5, 0.9, 0.85])]
    seeds = [_row("agentopsd", s, end, mid=0.3) for s, end in [(1, 0.95), (2, 0.97)]]
    for r in repeats:
        r["command"] = "python studies/quickstart_seeds.py --seeds 0 --repeats 4"
    for r in seeds:
        r["command"] = "python studies/quickstart_seeds.py --seeds 0-2"
    qs.write_results(repeats + seeds, tmp_path, ["agentopsd"], 16, "unused")
    table = (tmp_path / "table.md").read_text()
    assert "`python studies/quickstart_seeds.py --seeds 0 --repeats 4`; `python studies/quickstart_seeds.py --seeds 0-2`" in table
    assert "| 0 | 3 | 1 | 0 → 90 → 85 | 403 / 1900 |" not in table  # wall: 400 + seed, not + repeat
    assert "| 0 | 3 | 1 | 0 → 90 → 85 | 400 / 1900 |" in table
    run_to_run = next(line for line in table.splitlines() if "run to run: seed 0, 4 runs" in line)
    assert run_to_run.startswith("| agentopsd | run to run: seed 0, 4 runs; 1 thread, 2 at a time | 3 / 4 | 4 / 4 | 80 [") and "| 50 |" in run_to_run
    seed_to_seed = next(line for line in table.splitlines() if "seed to seed: seeds 0-2, first run of each" in line)
    assert seed_to_seed.startswith("| agentopsd | seed to seed: seeds 0-2, first run of each; 1 thread, 2 at a time | 3 / 3 | 1 / 3 | 96 [")
    assert "| 95 |" in seed_to_seed


def test_repeats_train_their_own_warm_start_and_lend_only_within_a_repeat(qs, tmp_path: Path, monkeypatch) -> None:
    calls: list[list[str]] = []
    _fake_train(qs, monkeypatch, calls, finish=True)
    runs = tmp_path / "runs"
    (runs / "agentopsd-s0" / "warm_start").mkdir(parents=True)
    (runs / "agentopsd-s0" / "warm_start" / "policy-first.pt").write_text("w")
    qs.run_one("agentopsd", 0, tmp_path, tmp_path, "abc", 16, [], repeat=1, command_line="cmd")
    assert "output_dir=" + str((runs / "agentopsd-s0-r1").resolve()) in calls[-1]
    assert not (runs / "agentopsd-s0-r1" / "warm_start").exists()  # trained anew, not the first run's
    # the other algorithm of repeat 1 starts from repeat 1's warm start, not the first run's
    (runs / "agentopsd-s0-r1" / "warm_start").mkdir()
    (runs / "agentopsd-s0-r1" / "warm_start" / "policy-r1.pt").write_text("w")
    qs.run_one("grpo", 0, tmp_path, tmp_path, "abc", 16, [], repeat=1, command_line="cmd")
    assert [p.name for p in (runs / "grpo-s0-r1" / "warm_start").iterdir()] == ["policy-r1.pt"]
    # lent as a hard link, not a copy (a real model's warm start is hundreds of MB)
    assert (runs / "grpo-s0-r1" / "warm_start" / "policy-r1.pt").samefile(runs / "agentopsd-s0-r1" / "warm_start" / "policy-r1.pt")
    # a repeat of seed 1 never borrows from seed 10's
    (runs / "agentopsd-s10-r1" / "warm_start").mkdir(parents=True)
    (runs / "agentopsd-s10-r1" / "warm_start" / "policy-s10.pt").write_text("w")
    qs.run_one("agentopsd", 1, tmp_path, tmp_path, "abc", 16, [], repeat=1, command_line="cmd")
    assert not (runs / "agentopsd-s1-r1" / "warm_start").exists()
    # the folder's finished runs are read back with their seed, repeat and command, once each
    (runs / "latest").symlink_to(runs / "agentopsd-s0-r1")  # train.py links its newest run
    rows = qs.finished_rows(tmp_path)
    assert sorted((r["algorithm"], r["seed"], r["repeat"]) for r in rows) == [("agentopsd", 0, 1), ("agentopsd", 1, 1), ("grpo", 0, 1)]
    assert {r["command"] for r in rows} == {"cmd"}


def test_threads_zero_runs_as_a_user_does_and_stands_beside_one_thread_runs(qs, tmp_path: Path, monkeypatch) -> None:
    """--threads 0: train.py's own thread count and OpenMP's default policy, in its own folder and summary rows."""
    calls: list[list[str]] = []
    envs: list[dict] = []
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(qs.os, "cpu_count", lambda: 2)
    _fake_train(qs, monkeypatch, calls, finish=True, envs=envs)
    runs = tmp_path / "runs"
    (runs / "agentopsd-s0" / "warm_start").mkdir(parents=True)
    (runs / "agentopsd-s0" / "warm_start" / "policy-one-thread.pt").write_text("w")
    for k in range(2):
        qs.run_one("agentopsd", 0, tmp_path, tmp_path, "abc", 16, [], repeat=k, command_line="cmd", threads=0, jobs=1)
    assert "OMP_NUM_THREADS" not in envs[-1] and "OMP_WAIT_POLICY" not in envs[-1]
    assert "output_dir=" + str((runs / "agentopsd-s0-r1-t2").resolve()) in calls[-1]
    assert not (runs / "agentopsd-s0-t2" / "warm_start").exists()  # never the one-thread run's warm start
    qs.run_one("agentopsd", 0, tmp_path, tmp_path, "abc", 16, [], command_line="cmd", threads=1)
    assert envs[-1]["OMP_NUM_THREADS"] == "1" and envs[-1]["OMP_WAIT_POLICY"] == "PASSIVE"
    rows = qs.finished_rows(tmp_path)
    assert sorted((r["seed"], r["repeat"], r["threads"], r["jobs"]) for r in rows) == [(0, 0, 1, 2), (0, 0, 2, 1), (0, 1, 2, 1)]
    qs.write_results(rows, tmp_path, ["agentopsd"], 16, "cmd")
    table = (tmp_path / "table.md").read_text()
    assert "| agentopsd | run to run: seed 0, 2 runs; 2 threads, one at a time | 2 / 2 |" in table
    assert "| agentopsd | seed to seed: seed 0; 1 thread, 2 at a time | 1 / 1 |" in table
    assert "| 0 | 1 | 2 | 0 → 90 |" in table
    with pytest.raises(SystemExit, match="--threads"):
        qs.main(["--threads", "-1", "--out", str(tmp_path)])


def test_rows_recorded_in_runs_csv_stand_when_their_folders_are_gone(qs, tmp_path: Path, monkeypatch) -> None:
    """Run folders are not committed: a later sitting keeps the recorded rows beside its new runs and does not
    train a recorded run again."""
    old = [_row("agentopsd", s, 0.9 + s / 100) for s in (0, 1)]  # written before --threads: no threads column
    qs.write_results(old, tmp_path, ["agentopsd"], 16, "first sitting")
    with (tmp_path / "runs.csv").open() as f:
        written = list(csv.DictReader(f))
    with (tmp_path / "runs.csv").open("w", newline="") as f:  # the older layout: no threads or jobs columns
        w = csv.DictWriter(f, fieldnames=[k for k in written[0] if k not in ("threads", "jobs")], extrasaction="ignore")
        w.writeheader()
        w.writerows(written)
    calls: list[list[str]] = []
    _fake_train(qs, monkeypatch, calls, finish=True)
    row = qs.run_one("agentopsd", 1, tmp_path, tmp_path, "abc", 16, [], command_line="cmd")
    assert calls == [] and row["success_end"] == 0.91 and row["threads"] == 1 and row["jobs"] == 2
    qs.run_one("agentopsd", 2, tmp_path, tmp_path, "abc", 16, [], command_line="cmd")
    assert len(calls) == 1
    rows = qs.all_rows(tmp_path)
    assert sorted((r["seed"], r["threads"], r["success_end"]) for r in rows) == [(0, 1, 0.9), (1, 1, 0.91), (2, 1, 0.9)]
    assert isinstance(rows[-1]["seed"], int) and isinstance(rows[-1]["wall_s"], float)
    qs.write_results(rows, tmp_path, ["agentopsd"], 16, "cmd")
    table = (tmp_path / "table.md").read_text()
    assert "| 0 | 0 | 1 | 0 → 45 → 90 |" in table and "| 2 | 0 | 1 | 0 →  → 90 |" in table
    assert "seed to seed: seeds 0-2; 1 thread, 2 at a time | 3 / 3 |" in table


def test_fall_after_passing_counts_only_falls_after_the_run_reached_90(qs) -> None:
    assert qs.fall_after_passing([0.0, 0.96, 0.94, 0.26, 0.57]) == pytest.approx(0.70)  # the run
    assert qs.fall_after_passing([0.0, 0.5, 0.2, 0.85, 0.89]) == 0.0  # never reached 90%: its dips are not a fall
    assert qs.fall_after_passing([0.0, 0.91, 0.97, 0.88, 0.96]) == pytest.approx(0.09)  # below the best so far, not the first pass
    assert qs.fall_after_passing([0.0, 0.96, 0.96]) == 0.0
    row = _row("agentopsd", 0, 0.86, mid=0.96)
    assert qs.keeps_what_it_learns(row)  # 96 -> 86 is a fall of exactly 10 points: allowed
    row["success_end"] = row["eval_it16"] = 0.85
    assert not qs.keeps_what_it_learns(row)
    row = _row("agentopsd", 0, 0.79, mid=0.5)
    assert not qs.keeps_what_it_learns(row)  # never fell, but ended below 80%


def _variants(algorithm: str, seed: int, curves: dict[int, tuple[float, float, float]]) -> list[dict]:
    """One row per thread count: evaluations after 0 / 4 / 8 / 16 iterations."""
    rows = []
    for threads, (e4, e8, e16) in curves.items():
        row = _row(algorithm, seed, e16, mid=e8)
        row.update(threads=threads, eval_it4=e4)
        rows.append(row)
    return rows


def test_rounding_summary_takes_the_worst_variant_of_each_seed(qs, tmp_path: Path) -> None:
    rows = _variants("agentopsd", 0, {1: (0.96, 0.94, 0.94), 2: (0.96, 0.94, 0.57), 3: (0.96, 0.96, 0.96)}) + \
        _variants("agentopsd", 1, {1: (0.84, 0.96, 0.96), 2: (0.9, 0.96, 0.95), 3: (0.5, 0.9, 0.92)}) + \
        _variants("grpo", 0, {1: (0.9, 0.9, 0.8), 2: (0.9, 0.9, 0.9), 3: (0.9, 0.9, 0.9)}) + \
        _variants("grpo", 1, {1: (0.9, 0.9, 0.8), 2: (0.9, 0.9, 0.8), 3: (0.9, 0.9, 0.8)})
    summary = {(s["algorithm"], s["seed"]): s for s in qs.rounding_summary(rows)}
    s0 = summary[("agentopsd", 0)]
    assert (s0["variants"], s0["threads"], s0["min_end"], s0["kept"]) == (3, [1, 2, 3], 0.57, 2)
    assert s0["max_fall"] == pytest.approx(0.39)
    assert summary[("agentopsd", 1)]["min_end"] == 0.92 and summary[("agentopsd", 1)]["kept"] == 3
    # paired per seed over the variants both ran: seed 0 (0.14 - 0.33 + 0.06) / 3, seed 1 (0.16 + 0.15 + 0.12) / 3
    mean, low, high, n = qs.paired_difference(rows, "agentopsd", "grpo")
    assert n == 2 and mean == pytest.approx(((0.14 - 0.33 + 0.06) / 3 + 0.43 / 3) / 2)
    assert -1.0 <= low < mean < high <= 1.0
    qs.write_results(rows, tmp_path, ["agentopsd", "grpo"], 16, "cmd")
    table = (tmp_path / "table.md").read_text()
    assert "| agentopsd | 0 | 3 (1, 2, 3) | 57 | 82 | 39 | 2 / 3 |" in table
    assert "- agentopsd: 5 of 6 runs over 2 seeds keep what they learn; lowest end 57% (seed 0), largest fall 39 points." in table
    assert "- agentopsd minus grpo at the end: " in table
    # one thread count only: no rounding section
    qs.write_results([r for r in rows if r["threads"] == 1], tmp_path, ["agentopsd", "grpo"], 16, "cmd")
    assert "Across rounding variants" not in (tmp_path / "table.md").read_text()


def test_several_thread_counts_run_each_seed_once_per_count(qs, tmp_path: Path, monkeypatch) -> None:
    """--threads 1 2 3: every seed and algorithm once per thread count, each in its own folder and environment."""
    calls: list[list[str]] = []
    envs: list[dict] = []
    _fake_train(qs, monkeypatch, calls, finish=True, envs=envs)
    monkeypatch.setattr(qs, "head_commit", lambda: "abc")
    qs.main(["--seeds", "0-1", "--algorithms", "agentopsd", "--threads", "1", "2", "3", "--jobs", "1",
             "--out", str(tmp_path), "--code", str(tmp_path)])
    names = sorted(Path(next(a for a in c if a.startswith("output_dir=")).split("=", 1)[1]).name for c in calls)
    assert names == ["agentopsd-s0", "agentopsd-s0-t2", "agentopsd-s0-t3", "agentopsd-s1", "agentopsd-s1-t2", "agentopsd-s1-t3"]
    assert sorted(e["OMP_NUM_THREADS"] for e in envs) == ["1", "1", "2", "2", "3", "3"]
    table = (tmp_path / "table.md").read_text()
    assert "| agentopsd | 0 | 3 (1, 2, 3) | 90 | 90 | 0 | 3 / 3 |" in table
    assert "Commit: abc+worktree" in table  # --code: the checkout's files were trained, not the commit
