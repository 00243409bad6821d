"""A folder per run: timestamped folders, a `latest` pointer, resume of the latest, no empty folders;
and the closing summary, numbered by completed iterations."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from agentopsd.run import folders as runs

# ------------------------------------------------------------------ folders


def _run(root: Path, name: str, files: tuple[str, ...] = ("checkpoints/last.ckpt",)) -> Path:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    for f in files:
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_text("x")
    return run


def test_new_runs_get_new_folders_even_within_one_second(tmp_path, monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    first = runs.new_run(tmp_path, now=0.0)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", first.name) and not first.exists()
    first.mkdir()
    second = runs.new_run(tmp_path, now=0.0)
    assert second.name == first.name + "_1"


def test_processes_of_one_launch_share_a_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert runs.new_run(tmp_path, now=0.0) == runs.new_run(tmp_path, now=5.0) == tmp_path / "torchrun-job7"


def test_latest_follows_the_pointer_then_the_newest_folder(tmp_path):
    assert runs.latest_run(tmp_path) is None
    old, new = _run(tmp_path, "2026-01-01_00-00-00"), _run(tmp_path, "2026-01-02_00-00-00")
    assert runs.latest_run(tmp_path) == new  # no pointer yet: the newest timestamp
    runs.mark_latest(old)
    assert (tmp_path / "latest").is_symlink() and runs.latest_run(tmp_path) == old.resolve()
    runs.mark_latest(new)
    assert runs.latest_run(tmp_path) == new.resolve()
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").write_text(old.name + "\n")  # a file system without symlinks
    assert runs.latest_run(tmp_path) == old


def test_a_folder_from_before_per_run_folders_is_its_own_latest(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert runs.latest_run(tmp_path) == tmp_path


def test_output_dir_resumes_the_latest_run_only_with_ckpt_path_last(tmp_path):
    run = _run(tmp_path, "2026-01-01_00-00-00")
    runs.mark_latest(run)
    assert Path(runs.run_dir(str(tmp_path), "last")) == run.resolve()
    fresh = Path(runs.run_dir(str(tmp_path), None))
    assert fresh.parent == tmp_path and fresh != run
    assert Path(runs.run_dir(str(tmp_path / "none_yet"), "last")).parent == tmp_path / "none_yet"


def test_a_run_that_wrote_nothing_leaves_no_folder(tmp_path):
    root = tmp_path / "quickstart"
    failed = _run(root, "2026-01-01_00-00-00", files=("train.log",))
    assert runs.remove_if_unused(failed)
    assert not root.exists()  # nor its parent, when that was its only run
    kept = _run(root, "2026-01-02_00-00-00")
    failed = _run(root, "2026-01-03_00-00-00", files=("train.log",))
    assert runs.remove_if_unused(failed) and not failed.exists()
    assert not runs.remove_if_unused(kept) and kept.exists()


def test_warm_start_cache_is_shared_by_the_runs_of_a_name(tmp_path):
    assert runs.warm_start_dir(tmp_path / "qs" / "2026-01-01_00-00-00", tmp_path / "qs") == tmp_path / "qs" / "warm_start"
    assert runs.warm_start_dir(tmp_path / "mine", tmp_path / "qs") == tmp_path / "mine" / "warm_start"


# ------------------------------------------------------------------ the summary


def _evals(*points: tuple[int, float]) -> list[dict[str, float]]:
    return [{"eval/iteration": float(i), "eval/success": s} for i, s in points]


def test_summary_counts_the_iterations_actually_trained():
    # +trainer.max_steps=1 on a 16-iteration config: one iteration, and it says so
    text = runs.summary(_evals((0, 0.0), (1, 0.25)), trained=1, done=1, planned=16)
    assert "0.0% before RL -> 25.0% after 1 iteration" in text and "stopped after 1 iteration of 16" in text
    assert "16 iterations" not in text


def test_summary_without_an_evaluation_before_training():
    text = runs.summary(_evals((3, 0.5)), trained=3, done=3, planned=3)
    assert "before RL ->" not in text and "50.0% after 3 iterations" in text and "before_training=false" in text


def test_summary_of_a_finished_run_resumed():
    text = runs.summary(_evals((0, 0.0), (3, 0.9)), trained=0, done=3, planned=3)
    assert text.startswith("nothing trained") and "completed 3 iterations of 3" in text


def test_a_finished_runs_epoch_reopens_only_for_a_larger_num_iterations():
    def checkpoint(last: bool) -> dict:
        return {"loops": {"fit_loop": {"epoch_loop.batch_progress": {"is_last_batch": last, "current": {"ready": 2}}}}}

    finished = checkpoint(last=True)
    assert runs.reopen_finished_epoch(finished, done=2, planned=12)
    assert finished["loops"]["fit_loop"]["epoch_loop.batch_progress"] == {"is_last_batch": False, "current": {"ready": 2}}
    for ckpt, done, planned in [(checkpoint(True), 2, 2), (checkpoint(True), 4, 2), (checkpoint(False), 1, 12), ({}, 2, 12)]:
        before = repr(ckpt)
        assert not runs.reopen_finished_epoch(ckpt, done=done, planned=planned) and repr(ckpt) == before


def test_summary_of_a_run_resumed_midway():
    text = runs.summary(_evals((0, 0.0), (2, 0.5), (4, 0.75)), trained=2, done=4, planned=4)
    assert "trained 2 iterations (3-4), resumed after 2" in text and "after 4 iterations" in text


# ------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_two_runs_in_a_row_keep_both_reports(tmp_path):
    from tests.test_train import run_train

    root = tmp_path / "quickstart"
    tiny = ["num_iterations=1", "data.tasks_per_batch=2", "data.group_size=2", "optim.num_mini_batches=1", "evaluation.num_tasks=2",
            "warm_start=null", "rollout_log.max_samples=4", "trainer.enable_progress_bar=false", f"runs_dir={root}"]
    run_train(*tiny)
    first = runs.latest_run(root)
    page = (first / "report" / "index.html").read_bytes()
    shards = sorted(p.name for p in (first / "rollouts").iterdir())
    run_train(*tiny, "seed=1")
    second = runs.latest_run(root)
    assert second != first and (root / "latest").is_symlink()
    assert (first / "report" / "index.html").read_bytes() == page  # untouched by the second run
    assert sorted(p.name for p in (first / "rollouts").iterdir()) == shards
    for run, seed in ((first, 0), (second, 1)):
        assert [p.name for p in (run / "csv").iterdir()] == ["version_0"]
        assert f"seed {seed}" in (run / "report" / "index.html").read_text()
    # resuming takes the latest run (seed 1: its own settings; tests/test_resume.py), in its own folder; a run that
    # fails leaves no folder
    proc = run_train(*tiny, "seed=1", "ckpt_path=last")
    assert str(second) in proc.stdout and "nothing trained" in proc.stdout
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    import subprocess
    import sys

    from tests.test_train import ROOT

    bad = subprocess.run([sys.executable, "train.py", *tiny, "data.group_size=1"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode != 0
    assert sorted(p.name for p in root.iterdir() if p.name != "latest") == sorted([first.name, second.name])
