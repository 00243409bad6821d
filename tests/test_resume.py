"""A resume never rewrites a run: one that changes the run's config is refused in one line, and every resume records its
config beside the first launch's, never over it (issue 49, item 2; agentopsd/run/resume.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from agentopsd.run import resume
from agentopsd.run.validation import ConfigError
from tests.test_configs import cfg_for
from tests.test_train import ROOT


def test_only_keys_outside_the_resumable_ones_differ():
    recorded = {"num_iterations": 2, "seed": 0, "algorithm": {"name": "grpo"}, "logger": [{"a": 1}],
                "evaluation": {"num_tasks": 4, "every_n_iterations": 0}, "ckpt_path": None}
    composed = {"num_iterations": 3, "seed": 0, "algorithm": {"name": "agentopsd", "mode": "belief"}, "logger": [{"b": 2}],
                "evaluation": {"num_tasks": 4, "every_n_iterations": 1}, "ckpt_path": "last", "resume_force": False}
    differences = resume.config_differences(recorded, composed)
    assert list(differences) == ["algorithm.mode", "algorithm.name"]
    assert differences["algorithm.name"] == ("grpo", "agentopsd")
    composed["evaluation"]["num_tasks"] = 10  # the list measured is not a cadence
    assert "evaluation.num_tasks" in resume.config_differences(recorded, composed)


def test_the_latest_record_is_read_and_the_next_one_numbered(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("seed: 0\n")
    assert resume.recorded_config(tmp_path) == tmp_path / ".hydra" / "config.yaml"
    assert resume.next_record(tmp_path) == ".hydra/resume-1"
    for n in (1, 2, 10):
        (tmp_path / ".hydra" / f"resume-{n}").mkdir()
        (tmp_path / ".hydra" / f"resume-{n}" / "config.yaml").write_text(f"seed: {n}\n")
    assert resume.recorded_config(tmp_path) == tmp_path / ".hydra" / "resume-10" / "config.yaml"  # by number, not by name
    assert resume.next_record(tmp_path) == ".hydra/resume-11"


def fake_run(run: Path, *overrides: str) -> Path:
    """A run folder as train.py leaves it at start-up: Hydra's config.yaml and hydra.yaml (no training)."""
    cfg = cfg_for(*overrides, f"output_dir={run}")
    (run / ".hydra").mkdir(parents=True)
    hydra_node = cfg.hydra
    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    OmegaConf.save(task, run / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.to_container(hydra_node, resolve=False)}), run / ".hydra" / "hydra.yaml")
    return run


def test_a_resume_that_swaps_the_algorithm_is_refused_in_one_line(tmp_path):
    run = fake_run(tmp_path / "run", "experiment=babyai_tiny", "algorithm=grpo")
    before = (run / ".hydra" / "config.yaml").read_bytes()
    cfg = cfg_for("experiment=babyai_tiny", "ckpt_path=last", "num_iterations=3", f"output_dir={run}")
    with pytest.raises(ConfigError) as err:
        resume.check_resume(cfg)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"ckpt_path=last resumes {run}")
    assert "algorithm=grpo -> algorithm=agentopsd" in line and "resume_force=true" in line
    assert "num_iterations" not in line.split("which was made")[1].split(";")[0]  # num_iterations may change
    assert cfg.hydra.output_subdir == ".hydra"  # nothing redirected, nothing written
    assert (run / ".hydra" / "config.yaml").read_bytes() == before


def test_an_allowed_resume_records_beside_the_first(tmp_path):
    run = fake_run(tmp_path / "run", "experiment=babyai_tiny", "algorithm=grpo")
    cfg = cfg_for("experiment=babyai_tiny", "algorithm=grpo", "ckpt_path=last", "num_iterations=3", "evaluation.every_n_iterations=1",
                  "report=true", "trainer.enable_progress_bar=false", f"output_dir={run}")
    resume.check_resume(cfg)
    assert cfg.hydra.output_subdir == ".hydra/resume-1"  # Hydra writes there, not over .hydra/config.yaml


def test_a_forced_resume_records_beside_the_first(tmp_path, capsys):
    run = fake_run(tmp_path / "run", "experiment=babyai_tiny", "algorithm=grpo")
    (run / ".hydra" / "resume-1").mkdir()
    cfg = cfg_for("experiment=babyai_tiny", "ckpt_path=last", "resume_force=true", f"output_dir={run}")
    resume.check_resume(cfg)
    assert cfg.hydra.output_subdir == ".hydra/resume-2"
    assert "resume_force=true" in capsys.readouterr().err


def test_a_run_recorded_before_the_modules_moved_still_resumes(tmp_path):
    """A config recorded when load_policy lived in agentopsd.models and the tiny model in agentopsd.tiny: its targets
    are read as where they live now, so the same command resumes (not refused for a _target_ it never chose)."""
    run = fake_run(tmp_path / "run", "experiment=babyai_tiny", "algorithm=grpo")
    record = run / ".hydra" / "config.yaml"
    text = record.read_text()
    assert "_target_: agentopsd.models.tiny.tiny_policy" in text
    record.write_text(text.replace("agentopsd.models.tiny.tiny_policy", "agentopsd.tiny.tiny_policy"))
    cfg = cfg_for("experiment=babyai_tiny", "algorithm=grpo", "ckpt_path=last", "num_iterations=3", f"output_dir={run}")
    resume.check_resume(cfg)
    assert cfg.hydra.output_subdir == ".hydra/resume-1"
    assert resume.load_recorded(run).model._target_ == "agentopsd.models.tiny.tiny_policy"  # what eval and export read
    assert resume.current_targets({"a": [{"_target_": "agentopsd.runs.RunFolderCallback"}]}) == {
        "a": [{"_target_": "agentopsd.run.folders.RunFolderCallback"}]}


def test_a_checkpoint_given_by_path_is_checked_against_its_run(tmp_path):
    run = fake_run(tmp_path / "run", "experiment=babyai_tiny", "algorithm=grpo")
    (run / "checkpoints").mkdir()
    ckpt = run / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match="algorithm=grpo -> algorithm=agentopsd"):
        resume.check_resume(cfg_for("experiment=babyai_tiny", f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'new'}"))
    cfg = cfg_for("experiment=babyai_tiny", "algorithm=grpo", f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'new'}")
    resume.check_resume(cfg)
    assert cfg.hydra.output_subdir == ".hydra"  # a new folder: its own record is its first


def test_a_fresh_run_is_not_a_resume(tmp_path):
    run = fake_run(tmp_path / "run", "experiment=babyai_tiny", "algorithm=grpo")
    cfg = cfg_for("experiment=babyai_tiny", f"output_dir={run}")
    resume.check_resume(cfg)
    assert cfg.hydra.output_subdir == ".hydra"


# ------------------------------------------------------------------ end to end: the two commands


def _train(*overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # the one line, as a user sees it
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_readme_resume_after_a_grpo_run_is_refused_and_the_run_unchanged(tmp_path):
    small = [f"runs_dir={tmp_path / 'runs'}", "evaluation.num_tasks=2", "trainer.enable_progress_bar=false", "rollout_log.max_samples=2"]
    first = _train("experiment=babyai_tiny", "algorithm=grpo", "num_iterations=1", *small)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = [p for p in (tmp_path / "runs").iterdir() if p.name != "latest"]
    record = run / ".hydra" / "config.yaml"
    before, files = record.read_bytes(), sorted(p.relative_to(run) for p in run.rglob("*"))

    refused = _train("experiment=babyai_tiny", "ckpt_path=last", "num_iterations=2", *small)
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: ckpt_path=last resumes") and refused.stderr.count("\n") == 1, refused.stderr
    assert "algorithm=grpo -> algorithm=agentopsd" in refused.stderr and "resume_force=true" in refused.stderr
    assert record.read_bytes() == before and sorted(p.relative_to(run) for p in run.rglob("*")) == files

    forced = _train("experiment=babyai_tiny", "ckpt_path=last", "num_iterations=2", "resume_force=true", *small)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "trained 1 iteration (2-2), resumed after 1" in forced.stdout
    assert record.read_bytes() == before  # the first launch's record, untouched
    second = OmegaConf.load(run / ".hydra" / "resume-1" / "config.yaml")
    assert second.algorithm.name == "agentopsd" and second.resume_force is True
    assert "resume_force=true" in (run / ".hydra" / "resume-1" / "overrides.yaml").read_text()
