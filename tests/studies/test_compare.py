"""studies/compare.py: rows read back from run logs, and the tables and plot written from them."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.studies.loader import load_study


@pytest.fixture(scope="module")
def compare():
    return load_study("compare")


def _fake_run(run_dir: Path, train_success: list[float], eval_success: float, corr: float | None) -> None:
    """A finished run's CSV log as Lightning's CSVLogger writes it: sparse rows, empty cells."""
    keys = ["step", "rollout/success", "credit/evidence_outcome_corr", "eval/success", "eval/success/horizon/1-5"]
    (run_dir / "csv" / "version_0").mkdir(parents=True)
    with (run_dir / "csv" / "version_0" / "metrics.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for i, s in enumerate(train_success):
            w.writerow({"step": i, "rollout/success": s, "credit/evidence_outcome_corr": "" if corr is None else corr})
        w.writerow({"step": len(train_success), "eval/success": eval_success, "eval/success/horizon/1-5": eval_success})
    (run_dir / "finished").write_text(f"{len(train_success)}\n")


def test_rows_tables_and_plot_come_from_the_run_logs(compare, tmp_path: Path, monkeypatch) -> None:
    warm = tmp_path / "warm" / "PickupObjS5-s0"
    warm.mkdir(parents=True)
    (warm / "before.json").write_text(json.dumps({"eval/success": 0.1}))
    compare.HORIZON.update({"PickupObjS5": 3.8, "PickupObj": 5.9})
    _fake_run(tmp_path / "runs" / "PickupObjS5-grpo-s0", [0.2, 0.4], 0.9, None)
    _fake_run(tmp_path / "runs" / "PickupObjS5-agentopsd-s0", [0.4, 0.8], 1.0, 0.3)
    _fake_run(tmp_path / "runs" / "PickupObj-agentopsd-s0", [0.0, 0.2], 0.5, float("nan"))
    trained: list[tuple] = []
    monkeypatch.setattr(compare, "_train", lambda *args: trained.append(args))
    # a finished run with the same budget is read back, never trained again
    rows = [compare.run_one(level, method, 0, 2, tmp_path, warm) for level, method in
            [("PickupObjS5", "grpo"), ("PickupObjS5", "agentopsd"), ("PickupObj", "agentopsd")]]
    assert trained == [] and [r["iterations"] for r in rows] == [2, 2, 2]
    assert rows[1]["success_before"] == pytest.approx(0.1) and rows[1]["success_after"] == pytest.approx(1.0)
    assert rows[1]["train_success_mean"] == pytest.approx(0.6)
    assert rows[1]["credit_evidence_outcome_corr"] == pytest.approx(0.3)
    assert "credit_evidence_outcome_corr" not in rows[0] and "credit_evidence_outcome_corr" not in rows[2]  # NaN is skipped

    compare.write_results(rows, tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "| grpo | 90.0 ± 0.0 (n=1) |  | n/a |" in table  # one level: no slope to fit
    # agentopsd: 100 at horizon 3.8, 50 at 5.9 -> -50 / 2.1 points per extra turn
    assert f"| agentopsd | 100.0 ± 0.0 (n=1) | 50.0 ± 0.0 (n=1) | {-50 / 2.1:+.2f} |" in table
    assert "| agentopsd | 60.0 ± 0.0 | 10.0 ± 0.0 |" in table
    assert "| agentopsd | PickupObjS5 |" in table and "0.300" in table
    assert (tmp_path / "horizon.png").stat().st_size > 1000
    with (tmp_path / "runs.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 3


def test_a_different_budget_trains_again(compare, tmp_path: Path, monkeypatch) -> None:
    warm = tmp_path / "warm" / "PickupObjS5-s0"
    warm.mkdir(parents=True)
    (warm / "before.json").write_text(json.dumps({"eval/success": 0.0}))
    compare.HORIZON["PickupObjS5"] = 3.8
    run_dir = tmp_path / "runs" / "PickupObjS5-grpo-s0"
    _fake_run(run_dir, [0.2, 0.4], 0.9, None)

    def train(level, method, seed, iterations, out_dir, extra):  # stands in for train.py: a fresh log
        trained.append(iterations)
        assert not (out_dir / "csv").exists()  # the old run's log was removed first
        _fake_run(out_dir, [0.5] * iterations, 0.7, None)
        (out_dir / "finished").unlink()  # run_one writes the marker itself

    trained: list[int] = []
    monkeypatch.setattr(compare, "_train", train)
    row = compare.run_one("PickupObjS5", "grpo", 0, 3, tmp_path, warm)
    assert trained == [3]
    assert row["iterations"] == 3 and row["success_after"] == pytest.approx(0.7)
    assert (run_dir / "finished").read_text() == "3\n"
