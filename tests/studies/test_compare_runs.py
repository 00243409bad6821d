"""studies/compare_runs.py: two runs of one config and seed compared episode by episode, row by row."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.studies.loader import load_study


@pytest.fixture(scope="module")
def compare_runs():
    return load_study("compare_runs")


COLUMNS = ["step", "rollout/success", "perf/update_seconds", "eval/iteration", "eval/success"]


def _run(folder: Path, shards: dict[int, list[dict]], versions: list[list[dict]]) -> Path:
    """A run folder: rollout shards (iteration -> its episodes) and CSV versions (each a list of rows)."""
    (folder / "rollouts").mkdir(parents=True)
    for it, episodes in shards.items():
        with tarfile.open(folder / "rollouts" / f"rollouts-{it:06d}.tar", "w") as tar:
            for k, episode in enumerate(episodes):
                data = json.dumps(episode).encode()
                info = tarfile.TarInfo(f"{it:06d}_{k:04d}.json")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    for v, rows in enumerate(versions):
        path = folder / "csv" / f"version_{v}" / "metrics.csv"
        path.parent.mkdir(parents=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    return folder


def _train(it: int, success: str, seconds: str) -> dict:
    return {"step": str(it), "rollout/success": success, "perf/update_seconds": seconds}


def _eval(it: int, success: str) -> dict:
    return {"step": str(it), "eval/iteration": str(it), "eval/success": success}


def test_a_resumed_run_with_a_hole_against_an_uninterrupted_one(compare_runs, tmp_path):
    """The resumed run lost iteration 2's shard, row and evaluation, and logged iteration 1's evaluation again after
    its resume (the later version wins). Timings differ and do not count. Iteration 3's episodes differ."""
    episodes = {1: [{"a": 1}], 2: [{"a": 2}], 3: [{"a": 3}]}
    whole = _run(tmp_path / "whole", episodes,
                 [[_train(1, "0.5", "10"), _eval(1, "0.4"), _train(2, "0.6", "11"), _eval(2, "0.5"),
                   _train(3, "0.7", "12"), _eval(3, "0.9")]])
    holed = _run(tmp_path / "holed", {1: [{"a": 1}], 3: [{"a": 3, "b": 0}]},
                 [[_train(1, "0.5", "99"), _eval(1, "0.1")], [_eval(1, "0.4"), _train(3, "0.7", "13"), _eval(3, "0.9")]])
    text, agree = compare_runs.compare(whole, holed)
    assert not agree
    assert "| 1 | same | same | same | 40% / 40% |  |" in text  # perf/ differs (10 against 99): not counted
    assert "| 2 | – | – | – | 50% / – |  |" in text
    assert "| 3 | differs | same | same | 90% / 90% | episode: 000003_0000.json |" in text
    # without iteration 3's different episode the runs agree wherever both have an iteration
    (holed / "rollouts" / "rollouts-000003.tar").unlink()
    _, agree = compare_runs.compare(whole, holed)
    assert agree


def test_a_row_that_differs_names_its_columns_and_fails_the_command(compare_runs, tmp_path, capsys):
    a = _run(tmp_path / "a", {}, [[_train(1, "0.5", "10"), _eval(1, "0.4")]])
    b = _run(tmp_path / "b", {}, [[_train(1, "0.25", "10"), _eval(1, "0.5")]])
    assert compare_runs.main([str(a), str(b), "--out", str(tmp_path / "table")]) == 1
    assert "| 1 | – | differs | differs | 40% / 50% | train: rollout/success, eval: eval/success |" in capsys.readouterr().out
    assert compare_runs.main([str(a), str(a)]) == 0
    nan = _run(tmp_path / "nan", {}, [[_train(1, "nan", "10")]])  # nothing to average, in both runs
    assert compare_runs.main([str(nan), str(_run(tmp_path / "nan2", {}, [[_train(1, "nan", "12")]]))]) == 0


def test_a_folder_without_a_csv_is_refused_with_the_fix(compare_runs, tmp_path):
    with pytest.raises(SystemExit, match="give a run's output_dir"):
        compare_runs.main([str(tmp_path), str(tmp_path)])
