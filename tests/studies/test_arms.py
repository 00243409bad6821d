"""studies/arms.py: the paired-arm statistics on synthetic summaries (no training), and one tiny study end to end
(slow): a shared warm start, summaries, the credit archive, and a second invocation that trains nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.studies.loader import load_study

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def arms():
    return load_study("arms")


def _summary(arm: str, seed: int, curve: list[float], lengths: dict[str, list[float]], warm: str = "w") -> dict:
    evals = {str(2 * k): {"success": v, "by_length": lengths} for k, v in enumerate(curve)}
    return {"arm": arm, "seed": seed, "iterations": 2 * (len(curve) - 1), "commit": "abc", "code": "c", "warm": warm,
            "wall_s": 1.0, "resumed": 0, "peak_rss_mb": 10.0, "evals": evals, "diagnostics": {}}


def test_the_first_sitting_pins_the_commit_and_later_sittings_train_it(arms, tmp_path: Path) -> None:
    # a study spans sittings while main moves on: every arm of every seed must train one code
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert arms.study_commit(tmp_path, None) == head
    assert (tmp_path / "commit.txt").read_text().strip() == head
    earlier = "0" * 40  # as if main had moved on since the first sitting (the pin is read, not resolved)
    (tmp_path / "commit.txt").write_text(earlier + "\n")
    assert arms.study_commit(tmp_path, None) == earlier
    assert arms.study_commit(tmp_path, "HEAD") == head  # --commit moves the pin
    assert arms.study_commit(tmp_path, None) == head
    with pytest.raises(SystemExit, match="not a commit"):
        arms.study_commit(tmp_path, "no-such-commit")


def test_runs_from_another_warm_start_are_named(arms, tmp_path: Path) -> None:
    # a fresh checkout retrains warm/; if its bytes differ, the runs already summarised silently drop out of the pairs
    (tmp_path / "summaries").mkdir()
    for arm, seed, warm in [("grpo", 0, "old"), ("agentopsd", 0, "new"), ("grpo", 1, "old"), ("grpo", 10, "old")]:
        (tmp_path / "summaries" / f"{arm}-s{seed}.json").write_text(json.dumps(_summary(arm, seed, [0.1, 0.5], {}, warm)))
    assert arms.unpaired(tmp_path, 0, "new") == ["grpo-s0"]
    assert arms.unpaired(tmp_path, 1, "old") == []
    assert arms.unpaired(tmp_path, 2, "new") == []


def test_area_under_the_curve_is_the_mean_success_over_the_run(arms) -> None:
    # 0 -> 0.5 -> 1.0 at iterations 0, 2, 4: trapezoids (0.5 + 1.5) / 2 / 4 * 2 = 0.5
    assert arms.auc({"0": {"success": 0.0}, "2": {"success": 0.5}, "4": {"success": 1.0}}) == pytest.approx(0.5)
    # a run that jumps early has the larger area at the same end
    assert arms.auc({"0": {"success": 0.0}, "2": {"success": 1.0}, "4": {"success": 1.0}}) == pytest.approx(0.75)
    assert arms.auc({"8": {"success": 1.0}}) != arms.auc({"8": {"success": 1.0}})  # one point: no area


def test_the_slope_weights_each_length_by_its_episodes(arms) -> None:
    # 9 turns: 3 of 4 won; 17 turns: 0 of 1 won. Per episode: (9,1)x3, (9,0), (17,0): slope = -0.75/8 per turn
    assert arms.length_slope({"9": [0.75, 4.0], "17": [0.0, 1.0]}) == pytest.approx(-0.75 / 8)
    # each length weighs by its episodes: the slope over the episodes, not over the three rates
    import numpy as np

    lengths = {"9": [0.9, 10.0], "13": [0.0, 1.0], "17": [0.5, 2.0]}
    xs = [9.0] * 10 + [13.0] + [17.0] * 2
    ys = [1.0] * 9 + [0.0] + [0.0] + [1.0, 0.0]
    assert arms.length_slope(lengths) == pytest.approx(np.polyfit(xs, ys, 1)[0])
    assert arms.length_slope(lengths) != pytest.approx(np.polyfit([9.0, 13.0, 17.0], [0.9, 0.0, 0.5], 1)[0])
    assert arms.length_slope({"9": [1.0, 3.0]}) != arms.length_slope({"9": [1.0, 3.0]})  # one length: NaN


def test_paired_differences_pair_only_runs_from_one_warm_start(arms) -> None:
    lengths = {"9": [1.0, 2.0], "15": [0.0, 2.0]}
    summaries = [_summary("grpo", 0, [0.0, 0.4, 0.5], lengths), _summary("agentopsd", 0, [0.0, 0.6, 0.7], lengths),
                 _summary("grpo", 1, [0.0, 0.2, 0.3], lengths), _summary("agentopsd", 1, [0.0, 0.3, 0.9], lengths, warm="other")]
    final = arms.paired_differences(summaries, "agentopsd", "final")
    assert final == {0: pytest.approx(0.2)}  # seed 1's runs started from different warm starts: no pair
    assert arms.paired_differences(summaries, "agentopsd", "auc") == {0: pytest.approx((0.3 + 0.65) / 2 - (0.2 + 0.45) / 2)}


def test_the_table_gives_each_arm_minus_grpo_with_its_bonferroni_interval(arms) -> None:
    summaries = []
    for seed in range(6):
        base = 0.3 + 0.1 * (seed % 3)  # rates in tenths: 10 episodes a length hold them exactly
        for arm, effect in (("grpo", 0.0), ("agentopsd", 0.1), ("agentopsd_wide", 0.0), ("stepopsd", -0.1)):
            lengths = {"9": [base + effect + 0.2, 10.0], "13": [base + effect, 10.0], "17": [base + effect - 0.2, 10.0]}
            summaries.append(_summary(arm, seed, [0.0, base, base + effect], lengths))
    text = arms.build_table(summaries, list(arms.ARMS), "python studies/arms.py")
    assert "Seeds with every arm (grpo, agentopsd, agentopsd_wide, stepopsd): 6" in text
    assert "Bonferroni over the 3 comparisons (98.33% each)" in text
    row = next(line for line in text.splitlines() if line.startswith("| agentopsd | 10.0"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # every pair differs by exactly +10 points: a zero-width interval at 10, Bonferroni or not
    assert cells[1].startswith("10.0 [10.0, 10.0] (6)") and cells[2] == "10.0 [10.0, 10.0]"
    assert any(line.startswith("| stepopsd | -10.0") for line in text.splitlines())
    # success by length, pooled over seeds, and the slope per extra turn (-5 points a turn in every arm)
    assert "| warm start |" in text and "| 9 | 13 | 17 |" in text
    per_arm = next(line for line in text.splitlines() if line.startswith("| grpo |"))
    assert per_arm.endswith("| -5.00 [-5.00, -5.00] (6) |")

def test_a_seed_counts_as_complete_only_with_every_arm_of_the_study(arms) -> None:
    """Two GRPO runs and nothing else: no pair stands, though every arm that has run so far is there."""
    lengths = {"9": [0.5, 10.0]}
    text = arms.build_table([_summary("grpo", 0, [0.0, 0.5], lengths), _summary("grpo", 1, [0.0, 0.6], lengths)],
                            list(arms.ARMS), "python studies/arms.py")
    assert "Seeds with every arm (grpo, agentopsd, agentopsd_wide, stepopsd): 0 (none); runs: 2." in text


def test_a_study_without_its_baseline_is_refused(arms, tmp_path) -> None:
    with pytest.raises(SystemExit, match="lacks grpo"):
        arms.main(["--arms", "agentopsd", "--out", str(tmp_path)])


def test_a_stretch_killed_with_its_sitting_still_counts_in_the_runs_wall_time(arms, tmp_path: Path, monkeypatch) -> None:
    """A sitting ends by killing the driver mid-run: that stretch never recorded its seconds. The next sitting reads
    them back from the stretch's start and the last write to the run's logs. Planted defect: without that, the
    resumed run's wall is 50 s (the recorded stretch) plus this one's."""
    run_dir = tmp_path / "runs" / "grpo-s0"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_text("checkpoint")
    weights = tmp_path / "policy.pt"
    weights.write_text("weights")
    started = time.time() - 1000
    (run_dir / "meta.json").write_text(json.dumps({"commit": "c", "code": "id", "warm": arms.file_digest(weights), "wall_s": 50.0,
                                                   "resumed": 0, "peak_rss_mb": 1.0, "started": started}))
    log = run_dir / "train.log"
    log.write_text("the killed stretch's last line\n")
    os.utime(log, (started + 600, started + 600))
    calls = []

    def fake_train(code, run_dir, overrides, arm, seed, iterations, extra) -> int:
        calls.append(extra)
        return 0

    monkeypatch.setattr(arms, "_train", fake_train)
    monkeypatch.setattr(arms, "log_rows", lambda run_dir: [])
    monkeypatch.setattr(arms, "eval_rows", lambda rows: {2: {}} if calls else {})
    monkeypatch.setattr(arms, "summarize", lambda run_dir, arm, seed, iterations, meta, before: meta)
    meta = arms.run_arm(tmp_path, tmp_path, "c", "id", "grpo", 0, 2, [], weights, {}, False)
    assert any(e.startswith("ckpt_path=") for e in calls[0])  # it resumed
    assert 650 <= meta["wall_s"] < 660 and meta["resumed"] == 1
    assert meta["started"] is None  # this stretch returned and recorded its own seconds
    assert arms.unrecorded_stretch(meta, run_dir) == 0.0


@pytest.mark.slow
def test_a_tiny_study_shares_one_warm_start_archives_the_evidence_and_resumes(tmp_path) -> None:
    tiny = ["experiment=keydoor", "warm_start.episodes=20", "warm_start.steps=2", "data.tasks_per_batch=2",
            "data.group_size=2", "evaluation.num_tasks=4", "evaluation.every_n_iterations=1", "model.hidden_size=32",
            "model.intermediate_size=64", "rollout.max_new_tokens=6", "checkpoint.every_n_iterations=1"]
    cmd = [sys.executable, "studies/arms.py", "--arms", "grpo", "agentopsd", "--seeds", "0", "--iterations", "1",
           "--jobs", "1", "--out", str(tmp_path), "--code", str(ROOT), "--mc-seeds", "0", "--mc-samples", "2", *tiny]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    weights = tmp_path / "warm" / "s0" / "policy.pt"
    before = json.loads((tmp_path / "warm" / "s0" / "before.json").read_text())
    assert before["by_length"] and 0.0 <= before["success"] <= 1.0  # the warm start's evaluation, by path length
    for arm in ("grpo", "agentopsd"):
        log = (tmp_path / "runs" / f"{arm}-s0" / "stdout.log").read_text()
        assert f"loaded {weights} (warm_start.weights)" in log  # one warm start, loaded by both arms
        summary = json.loads((tmp_path / "summaries" / f"{arm}-s0.json").read_text())
        assert summary["warm"] == before["warm"] and set(summary["evals"]) == {"0", "1"}
        assert summary["evals"]["1"]["by_length"]
        assert not list((tmp_path / "runs" / f"{arm}-s0" / "checkpoints").glob("*.ckpt"))  # weights pruned
    assert not (tmp_path / "runs" / "warm-s0").exists()
    archive = tmp_path / "credit_data" / "agentopsd-s0"
    assert [p.name for p in (tmp_path / "credit_data").iterdir()] == [archive.name]  # GRPO logs no evidence
    assert {p.name for p in (archive / "groundtruth").iterdir()} == {"expert-v2.json", "mc-iter0001-m2.json"}
    assert "| agentopsd |" in (tmp_path / "table.md").read_text()
    # a fresh checkout has the summaries, not the run folders or the warm start: nothing trains, no warm start is made
    for name in ("runs", "warm"):
        os.rename(tmp_path / name, tmp_path / f"{name}-kept")
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "warm").exists()
    assert len((tmp_path / "runs.csv").read_text().strip().splitlines()) == 3  # header and the two runs
    # a sitting that ended between an arm's summary and its archive: that arm trains again and is archived, GRPO not
    os.rename(archive, tmp_path / "archive-kept")
    third = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "agentopsd seed 0: summarised but not archived" in third.stderr
    assert (archive / "done.json").is_file() and (tmp_path / "runs" / "agentopsd-s0").is_dir()
    assert not (tmp_path / "runs" / "grpo-s0").exists()


def test_an_evaluation_a_run_lacks_shows_as_a_hole(arms) -> None:
    """A run that lost its evaluation after iteration 2 (a stop dropped it) keeps its place in the curve: the
    others' evaluations say which were due; a short train-success list says how many iterations were logged."""
    lengths = {"9": [0.5, 10.0]}
    whole, holed = _summary("grpo", 0, [0.0, 0.2, 0.5], lengths), _summary("grpo", 1, [0.0, 0.2, 0.6], lengths)
    del holed["evals"]["2"]
    holed["diagnostics"] = {"rollout/success": [0.25, 0.5, 0.75]}
    text = arms.build_table([whole, holed], list(arms.ARMS), "python studies/arms.py")
    rows = {line.split("|")[2].strip(): line for line in text.splitlines() if line.startswith("| grpo | ")}
    assert "| 0 → 20 → 50 |" in rows["0"] and "| 0 → – → 60 |" in rows["1"]
    assert "25 50 75 (3 of 4 logged)" in rows["1"]
    assert "–: an evaluation the run never made" in text
