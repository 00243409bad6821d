"""studies/hint_table.py: rows replace a policy's earlier rows, the pending row stays until it is measured, and a run end to end."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.studies.loader import load_study

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ht():
    return load_study("hint_table")


def _row(label: str, split: str, diff: str = "0.1", *, model: str = "tiny", stage: str = "before warm start",
         temperature: str = "1", tasks: str = "50") -> dict:
    return {"label": label, "model": model, "stage": stage, "weights": "initial", "env": "BabyAI-PickupObj-v0", "tasks": tasks,
            "temperature": temperature, "split": split, "turns": "10", "tasks_with_turns": "5", "lp_without": "-1.0",
            "lp_with": "-0.9", "diff": diff, "diff_low": "0.0", "diff_high": "0.2", "share_raised": "0.6", "rel_diff": "0.05",
            "rel_low": "0.0", "rel_high": "0.1", "top_without": "0.2", "top_with": "0.4",
            "named_diff": "0.3", "named_low": "0.2", "named_high": "0.4", "named_turns": "4", "commit": "abc"}


def test_a_rerun_replaces_its_policys_rows_and_keeps_the_others(ht) -> None:
    old = [_row("a", "all"), _row("a", "applies"), _row("b", "all"), _row("a", "all", temperature="0.7")]
    new = [_row("a", "all", diff="0.5"), _row("a", "applies", diff="0.6")]
    merged = ht.merge_rows(old, new)
    assert [(r["label"], r["split"], r["temperature"], r["diff"]) for r in merged] == [
        ("b", "all", "1", "0.1"), ("a", "all", "0.7", "0.1"), ("a", "all", "1", "0.5"), ("a", "applies", "1", "0.6")]


def test_the_pending_smollm2_row_shows_until_it_is_measured(ht) -> None:
    before = ht.markdown([_row("tiny", "all"), _row("smol", "all", model="smollm2-135m")])
    assert "| smollm2-135m | after warm start | - | all | not yet run (needs the smollm2 recipe's warm start) |" in before
    after = ht.markdown([_row("smol", "all", model="smollm2-135m", stage="after warm start")])
    assert "not yet run" not in after


def test_the_script_end_to_end_on_two_tasks(tmp_path) -> None:
    """The quickstart's config and tiny model, two tasks, twice: the second run replaces the first's rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "studies" / "hint_table.py"), "--tasks", "2", "--resamples", "50", "--out", str(tmp_path)]
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    with open(tmp_path / "table.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["split"] for r in rows] == ["all", "applies", "none", "decisive", "other"]
    assert {r["label"] for r in rows} == {"tiny before warm start seed 0"}
    by = {r["split"]: r for r in rows}
    assert int(by["applies"]["turns"]) + int(by["none"]["turns"]) == int(by["all"]["turns"])
    assert by["applies"]["turns"] == by["decisive"]["turns"] == "2"  # one pick-up per PickupObj task, and it wins
    assert "not yet run" in (tmp_path / "table.md").read_text()
    turns = (tmp_path / "turns" / "tiny_before_warm_start_seed_0.csv").read_text().splitlines()
    assert len(turns) == 1 + int(by["all"]["turns"])
    missing = subprocess.run(cmd + ["--weights", str(tmp_path / "nope.pt")], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode != 0 and "no such file" in missing.stderr


def test_decisive_turns_that_are_the_applies_turns_share_one_line(ht) -> None:
    same = ht.markdown([_row("a", "applies"), _row("a", "decisive"), _row("a", "none", diff="0.2"), _row("a", "other", diff="0.3")])
    assert "| applies = decisive |" in same and "| decisive |" not in same
    assert "| none |" in same and "| other |" in same  # different turns: a line each
