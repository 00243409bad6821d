"""scripts/gpu_check.sh: fails fast without CUDA; on CPU, everything but the GPU run itself.

The builder, the train.py command lines (composed here with Hydra: the paper experiment on FSDP2 and
vLLM), the table from a CSV log, and the whole pipeline through the real train.py on CPU.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentopsd.memory import QWEN25, compose_config

ROOT = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")


@no_cuda
@pytest.mark.parametrize("entry", [["bash", "scripts/gpu_check.sh"], [sys.executable, "scripts/gpu_check.py"]])
def test_without_cuda_it_fails_in_seconds_saying_so(entry: list[str]) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run(entry, cwd=ROOT, capture_output=True, text=True, timeout=60, env=_env())
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2 and elapsed < 20, (proc.returncode, elapsed, proc.stderr)
    assert "gpu_check: no CUDA device visible" in proc.stderr and "nothing was run" in proc.stderr
    assert proc.stdout == ""


def test_preflight_names_a_missing_vllm(gpu_check, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    problems = gpu_check.preflight(["webshop"])
    assert len(problems) == 1 and "vllm is not installed" in problems[0]


def test_the_shape_is_qwen25_05b(gpu_check) -> None:
    arch = QWEN25["qwen/qwen2.5-0.5b"]
    shape = gpu_check.QWEN25_05B
    assert (shape["hidden_size"], shape["num_layers"], shape["num_heads"], shape["num_key_value_heads"],
            shape["intermediate_size"]) == (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads,
                                            arch.intermediate_size)


def test_dry_run_builds_the_folders_and_the_paper_commands(tmp_path: Path) -> None:
    # ALFWorld's tokenizer text comes from its engine (the [alfworld] extra)
    names = ["alfworld", "webshop"] if importlib.util.find_spec("alfworld") else ["webshop"]
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--shape", "tiny", "--workdir", str(tmp_path), "--no-qwen-tokenizer",
         "--envs", ",".join(names)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env() | {"GPU_CHECK_DRY": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    commands = [line.split() for line in proc.stdout.splitlines() if "train.py" in line]
    assert [c[2] for c in commands] == [f"+experiment={n}_3b" for n in names]
    for name, command in zip(names, commands):
        folder = tmp_path / name / "policy"
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == "qwen2" and config["hidden_size"] == 128 and config["dtype"] == "bfloat16"
        assert config["max_position_embeddings"] >= 2048 + 512
        from transformers import AutoTokenizer

        assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(folder))
        overrides = command[2:]
        assert f"model.path={folder}" in overrides
        cfg = compose_config(overrides)
        experiment = compose_config([overrides[0]])
        assert cfg.trainer.strategy._target_ == "agentopsd.strategies.FSDP2Strategy"
        assert cfg.trainer.devices == 1 and cfg.trainer.accelerator == "gpu"
        assert cfg.trainer.precision == experiment.trainer.precision  # the experiment's own
        assert cfg.rollout.backend == "vllm" and cfg.rollout.max_new_tokens == 512
        assert cfg.env.history_window == experiment.env.history_window and cfg.num_iterations == 2
        assert cfg.model._target_ == experiment.model._target_  # loaded like the real 3B, from model.path


def test_table_reads_the_csv_log(gpu_check, tmp_path: Path) -> None:
    keys = ["step", "perf/rollout_tokens_per_s", "perf/update_tokens_per_s", "perf/rollout_seconds", "perf/teacher_seconds",
            "perf/update_seconds", "loss/first_ratio_dev", "rollout/logprob_diff_max", "eval/success"]
    (tmp_path / "csv" / "version_0").mkdir(parents=True)
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerow({"step": 1, "perf/rollout_tokens_per_s": 1000, "perf/update_tokens_per_s": 5, "perf/rollout_seconds": 30,
                    "perf/teacher_seconds": 2, "perf/update_seconds": 9, "loss/first_ratio_dev": 0, "rollout/logprob_diff_max": 0.5})
        w.writerow({"step": 2, "perf/rollout_tokens_per_s": 2500, "perf/update_tokens_per_s": 40000, "perf/rollout_seconds": 12.25,
                    "perf/teacher_seconds": 1.5, "perf/update_seconds": 6, "loss/first_ratio_dev": 0, "rollout/logprob_diff_max": 0.03125})
        w.writerow({"step": 2, "eval/success": 0.0})  # evaluation rows are not iterations
    rows = gpu_check.read_iterations(tmp_path)
    assert len(rows) == 2
    result = gpu_check.RunResult("webshop", 0, 100.0, rows, 30720.0, tmp_path / "webshop.log")
    failed = gpu_check.RunResult("alfworld", 124, 210.0, [], None, tmp_path / "alfworld.log")
    text = gpu_check.table([result, failed], "header")
    lines = {line[:42].strip(): line[42:].split() for line in text.splitlines()[2:]}
    assert lines["rollout tokens/s (vLLM)"] == ["2500", "-"]  # the last (warm) iteration
    assert lines["update tokens/s"] == ["40000", "-"]
    assert lines["iteration s: rollout / teacher / update"][:5] == ["12.2", "/", "1.5", "/", "6.0"]
    assert lines["first iteration s (warm-up)"][:5] == ["30.0", "/", "2.0", "/", "9.0"]
    assert lines["teacher-scoring tokens/s"][0] == "n/a"  # not logged
    assert lines["peak GPU memory, device (GiB)"] == ["30.00", "n/a"]
    assert lines["vLLM vs training log-prob |diff| max"][0] == "0.0312"
    assert "FAILED (exit 124" in text


@pytest.mark.slow
def test_the_pipeline_through_train_py_on_cpu(tmp_path: Path) -> None:
    """The real train.py with the check's command line, on CPU: rollout=hf instead of vLLM, float32,
    16-token turns; the table must come out of the run's own CSV log."""
    args = ["--skip-preflight", "--shape", "tiny", "--envs", "webshop", "--tasks", "2", "--group", "2", "--turns", "1",
            "--eval-tasks", "1", "--workdir", str(tmp_path), "--no-qwen-tokenizer"]
    for override in ("trainer.accelerator=cpu", "rollout=hf", "rollout.max_new_tokens=16", "trainer.precision=32-true"):
        args += ["--override", override]
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=_env())
    log = (tmp_path / "webshop" / "webshop.log")
    assert proc.returncode == 0, proc.stdout + (log.read_text()[-3000:] if log.exists() else proc.stderr)
    lines = {line[:42].strip(): line[42:].split() for line in proc.stdout.splitlines() if not line.startswith("gpu_check")}
    assert lines["run"] == ["ok"] and lines["iterations logged"] == ["2"]
    assert float(lines["rollout tokens/s (vLLM)"][0]) > 0 and float(lines["update tokens/s"][0]) > 0
    assert float(lines["first mini-batch |ratio - 1| max"][0]) < 1e-2
    assert not (tmp_path / "webshop" / "policy").exists()  # weights removed, logs kept


def test_a_failed_run_shows_its_log_tail(tmp_path: Path) -> None:
    """2 trajectories cannot feed the experiment's 4 mini-batches: train.py stops in its config check."""
    args = ["--skip-preflight", "--shape", "tiny", "--envs", "webshop", "--tasks", "1", "--group", "2",
            "--workdir", str(tmp_path), "--no-qwen-tokenizer", "--override", "trainer.accelerator=cpu"]
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=_env())
    assert proc.returncode == 1
    assert "FAILED (exit 2" in proc.stdout and "iterations logged" in proc.stdout  # train.py: a config error exits 2
    assert "--- webshop: last" in proc.stderr and "optim.num_mini_batches=4 exceeds" in proc.stderr


def test_two_gpu_mode_commands_and_lines(gpu_check, tmp_path: Path) -> None:
    """--gpus 2: train.py on 2 devices, and the colocated probe under torchrun with sleep on and off."""
    setup = gpu_check.SETUPS["webshop"]
    command = gpu_check.train_command(setup, tmp_path / "p", tmp_path / "r", tasks=8, group=8, turns=3, eval_tasks=8, devices=2)
    assert "trainer.devices=2" in command and "trainer.devices=1" not in command
    on = gpu_check.sync_probe_command(tmp_path / "w", tmp_path / "o", sleep=True)
    off = gpu_check.sync_probe_command(tmp_path / "w", tmp_path / "o", sleep=False)
    assert on[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"] and on[5].endswith("vllm_colocate_check.py")
    assert "--sleep" in on and "--no-sleep" in off and on[on.index("--device") + 1] == "cuda"
    probe = {"ok": True, "failures": [], "sync_s": 0.412, "max_abs_logprob_diff_after_sync": 3e-4,
             "memory_gib": {"engine_awake": 42.5, "update": 1.9, "after_sync": 42.6}}
    text = gpu_check.probe_lines({"sleep": probe, "no_sleep": {"failures": ["crashed: X"]}})
    assert "sleep     ok; sync 0.412 s" in text and "during the update 1.90" in text and "3.00e-04" in text
    assert "no_sleep  FAILED: crashed: X" in text and "n/a" in text
    args = gpu_check.parse_args(["--gpus", "2"])
    assert args.gpus == 2
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--gpus", "3"])


@no_cuda
def test_two_gpu_mode_preflight_needs_two_devices(gpu_check) -> None:
    assert any("no CUDA device" in p for p in gpu_check.preflight(["webshop"], gpus=2))
