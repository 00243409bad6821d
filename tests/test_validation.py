"""Every check that can fail runs before any weights load or work starts, and says the fix in one line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import gymnasium as gym
import pytest

from agentopsd.run.validation import ConfigError, validate_config
from tests.test_configs import _resolve, cfg_for
from tests.test_train import ROOT

PAPER = ["alfworld_3b", "alfworld_7b", "webshop_3b", "webshop_7b", "searchqa_3b", "searchqa_7b"]


def test_vllm_missing_fails_before_the_model_loads(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    # the model path does not exist either: the vLLM check must come first (loading takes minutes)
    cfg = _resolve(cfg_for("experiment=webshop_3b", "model.path=/nonexistent/Qwen2.5-3B-Instruct"))
    with pytest.raises(ConfigError, match="rollout=vllm.*rollout=hf"):
        validate_config(cfg)


def test_vllm_needs_a_model_path(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(ConfigError, match="model.path"):
        validate_config(_resolve(cfg_for("experiment=babyai_tiny", "rollout=vllm")))


@pytest.mark.parametrize(("env", "size"), [("babyai", 100), ("webshop", 100), ("searchqa", 150)])
def test_evaluation_larger_than_its_list_is_an_error(env, size):
    with pytest.raises(ConfigError, match=rf"holds {size} tasks; set evaluation.num_tasks={size}"):
        validate_config(_resolve(cfg_for("experiment=babyai_tiny", f"env={env}", f"evaluation.num_tasks={size + 1}")))
    validate_config(_resolve(cfg_for("experiment=babyai_tiny", f"env={env}", f"evaluation.num_tasks={size}")))


@pytest.mark.parametrize("name", PAPER)
def test_paper_experiments_ask_for_no_more_than_their_list(name):
    cfg = _resolve(cfg_for(f"experiment={name}", "rollout=hf", "model.path=null"))
    assert cfg.evaluation.num_tasks is None  # the whole list
    if name.startswith("alfworld"):
        pytest.importorskip("alfworld")
    validate_config(cfg)


@pytest.mark.parametrize(("override", "field"), [
    ("env.max_turns=0", "env.max_turns"), ("optim.schedule=linear", "optim.schedule"),
    ("rollout.backend=tgi", "rollout.backend"), ("evaluation.num_tasks=0", "evaluation.num_tasks"),
])
def test_typed_settings_fail_before_any_work(override, field):
    with pytest.raises(ConfigError, match=field):
        validate_config(_resolve(cfg_for("experiment=babyai_tiny", override)))


def test_half_precision_weights_with_a_small_lr_warn(caplog):
    validate_config(_resolve(cfg_for("experiment=babyai_tiny", "trainer.precision=bf16-true", "optim.lr=1e-6")))
    assert "bf16-mixed" in caplog.text
    caplog.clear()
    validate_config(_resolve(cfg_for("experiment=babyai_tiny", "trainer.precision=bf16-mixed", "optim.lr=1e-6")))
    assert "bf16-mixed" not in caplog.text


@pytest.mark.parametrize("overrides", [
    ["model=qwen2.5-3b", "model.path=/nonexistent/Qwen2.5-3B-Instruct"],
    ["experiment=babyai_tiny", "ckpt_path=last"],
    ["experiment=babyai_tiny", "evaluation.num_tasks=1000"],
])
def test_train_py_fails_in_one_line(overrides, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "train.py", *overrides, f"output_dir={tmp_path}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoints").exists()  # nothing ran
    # without output_dir, the timestamped run folder Hydra made is removed again
    runs_dir = tmp_path / "named"
    proc = subprocess.run([sys.executable, "train.py", *overrides, f"runs_dir={runs_dir}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not runs_dir.exists()
    assert elapsed < 60  # imports and the checks: seconds, not a demonstration set and a warm start
    # the traceback stays one switch away
    env["HYDRA_FULL_ERROR"] = "1"
    full = subprocess.run([sys.executable, "train.py", *overrides, f"output_dir={tmp_path}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert full.returncode != 0 and "Traceback" in full.stderr


BLOCK_ALFWORLD = """
import sys


class _Missing:  # as if the alfworld extra were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("alfworld", "textworld"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Missing())
"""


def test_a_missing_environment_extra_fails_in_one_line_before_any_work(tmp_path):
    """`python train.py env=alfworld` without the extra: the install hint in one line, before the tokenizer is built."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK_ALFWORLD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path / "site")}
    env.pop("HYDRA_FULL_ERROR", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "train.py", "env=alfworld", "num_iterations=2", f"runs_dir={tmp_path / 'runs'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert errors == ["error: env.id=agentopsd/ALFWorld-v0: the ALFWorld environment needs the alfworld extra: "
                      "pip install 'agentopsd[alfworld]'"], proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists() and time.perf_counter() - t0 < 60  # no tokenizer, no demonstrations


def test_every_registered_environment_s_requirements_are_checked(monkeypatch):
    from agentopsd.envs import base

    ids = [i for i in gym.registry if i.startswith("agentopsd/")]
    assert all(base.missing_requirement(i) is None for i in ids)  # this install has every extra
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "textworld" else real(name, *a))
    assert "pip install 'agentopsd[alfworld]'" in base.missing_requirement("agentopsd/ALFWorld-v0")
    assert base.missing_requirement("agentopsd/BabyAI-PickupObj-v0") is None  # core install only
    with pytest.raises(ConfigError, match=r"^env.id=agentopsd/ALFWorld-v0: .*agentopsd\[alfworld\]"):
        validate_config(_resolve(cfg_for("experiment=none", "env=alfworld")))


def test_a_config_value_cannot_run_code(tmp_path):
    # no `eval`-like resolver is registered: an interpolation that would run Python is refused at once
    marker = tmp_path / "ran"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "train.py", "experiment=babyai_tiny", f"output_dir={tmp_path / 'out'}",
         f"+payload=${{eval:'open(\"{marker}\", \"w\")'}}", "num_iterations=1", "evaluation.num_tasks=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert not marker.exists()
    assert proc.returncode != 0 and "eval" in (proc.stderr + proc.stdout)


def test_meta_build_needs_fsdp_and_no_warm_start():
    """Only FSDP2's sharding fills a meta-built policy; a warm start needs the weights on every rank."""
    with pytest.raises(ConfigError, match="needs trainer=fsdp"):
        validate_config(_resolve(cfg_for("experiment=babyai_tiny", "trainer=ddp", "+model.meta_on_other_ranks=true")))
    with pytest.raises(ConfigError, match="cannot warm-start"):
        validate_config(_resolve(cfg_for("experiment=quickstart", "trainer=fsdp", "+model.meta_on_other_ranks=true")))
    validate_config(_resolve(cfg_for("experiment=babyai_tiny", "trainer=fsdp", "+model.meta_on_other_ranks=true")))
    validate_config(_resolve(cfg_for("experiment=webshop_3b", "rollout=hf", "model.path=null")))  # the paper setups: on, valid
