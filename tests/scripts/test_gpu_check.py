"""scripts/gpu_check.sh: every assertion fails on a bad input; the commands are the paper experiment's; the
probe's pieces; and, slow, the whole CPU rehearsal with its controls (``--rehearse-on-cpu``)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentopsd.tools.architecture import QWEN25
from agentopsd.tools.memory import compose_config

ROOT = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    yield _load("gpu_check")
    sys.modules.pop("gpu_check", None)


@pytest.fixture(scope="module")
def probe():
    yield _load("vllm_colocate_check")
    sys.modules.pop("vllm_colocate_check", None)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")


def _row(iteration: int, **values: float) -> dict[str, float]:
    return {"rollout/iteration": float(iteration), **values}


# ---------------------------------------------------------------------------------------- fails fast


@no_cuda
@pytest.mark.parametrize("entry", [["bash", "scripts/gpu_check.sh"], [sys.executable, "scripts/gpu_check.py"]])
def test_without_cuda_it_fails_in_seconds_saying_so(entry: list[str]) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run(entry, cwd=ROOT, capture_output=True, text=True, timeout=60, env=_env())
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2 and elapsed < 20, (proc.returncode, elapsed, proc.stderr)
    assert "gpu_check: no CUDA device visible" in proc.stderr and "nothing was run" in proc.stderr
    assert "--rehearse-on-cpu" in proc.stderr
    assert proc.stdout == ""


def test_an_empty_wheels_folder_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--wheels", str(tmp_path), "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 2 and "no wheels in" in proc.stderr and "gpu_prepare.sh" in proc.stderr


def test_preflight_names_missing_packages_and_the_prepare_step(gpu_check, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("hydra", "webdataset") else real(name, *a))
    (line,) = gpu_check.preflight(gpu=False)
    assert "hydra, webdataset" in line and "gpu_prepare.sh" in line and "--wheels .gpu_wheels" in line


def test_the_shape_is_qwen25_05b(gpu_check) -> None:
    arch = QWEN25["qwen/qwen2.5-0.5b"]
    shape = gpu_check.QWEN25_05B
    assert (shape["hidden_size"], shape["num_layers"], shape["num_heads"], shape["num_key_value_heads"],
            shape["intermediate_size"]) == (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads,
                                            arch.intermediate_size)


# ---------------------------------------------------------------------------------------- the assertions


def test_check_below_fails_on_a_value_over_the_limit_a_nan_and_a_missing_value(gpu_check) -> None:
    key = "rollout/logprob_diff_mean"
    good = [_row(1, **{key: 0.01}), _row(2, **{key: 0.049})]
    assert gpu_check.check_below("x", key, good, 0.05).ok
    assert not gpu_check.check_below("x", key, [*good, _row(3, **{key: 0.051})], 0.05).ok
    assert not gpu_check.check_below("x", key, [*good, _row(3, **{key: math.nan})], 0.05).ok
    missing = gpu_check.check_below("x", key, [*good, _row(3)], 0.05)
    assert not missing.ok and "missing from 1 of 3" in missing.detail
    assert not gpu_check.check_below("x", key, [], 0.05).ok  # nothing logged is no pass
    assert not gpu_check.check_below("x", key, [{"eval/success": 0.0}], 0.05).ok  # evaluation rows are not iterations


def _ratio(iteration: int, abs_sum: float, tokens: int, max_dev: float) -> dict:
    return {"event": "first_ratio", "iteration": iteration, "abs_log_ratio_sum": abs_sum, "tokens": tokens,
            "max_dev": max_dev}


def test_the_first_ratio_is_judged_by_its_token_mean_in_bf16_and_its_max_in_float32(gpu_check) -> None:
    # a healthy bf16 run: 1,000 tokens a rank, |log ratio| 2e-3 on average, one token off by 0.3 (batch variance)
    healthy = [_ratio(1, 2.0, 1000, 0.3), _ratio(1, 1.5, 1000, 0.02), _ratio(2, 2.5, 1000, 0.05), _ratio(2, 0.0, 0, 0.0)]
    check = gpu_check.check_first_ratio("r", healthy, exact=False)
    assert check.ok and "0.0025 at iteration 2" in check.detail and "max |ratio - 1| 0.3" in check.detail
    assert not gpu_check.check_first_ratio("r", healthy, exact=True).ok  # float32 on both sides: the max is exact
    assert gpu_check.check_first_ratio("r", [_ratio(1, 0.0, 900, 2e-5)], exact=True).ok
    # old log-probs not recomputed (a stale generator's): every token off by about 0.06
    stale = [*healthy, _ratio(3, 64.5, 1000, 0.18), _ratio(3, 0.0, 0, 0.0)]
    failed = gpu_check.check_first_ratio("r", stale, exact=False)
    assert not failed.ok and "0.0645 at iteration 3" in failed.detail
    assert not gpu_check.check_first_ratio("r", [_ratio(1, math.nan, 10, 0.0)], exact=False).ok
    nothing = gpu_check.check_first_ratio("r", [_ratio(1, 0.0, 0, 0.0), {"event": "update"}], exact=False)
    assert not nothing.ok and "no first mini-batch" in nothing.detail  # nothing measured is no pass


def test_exact_ratio_only_with_float32_weights_trained_in_float32(gpu_check) -> None:
    assert gpu_check.exact_ratio("32-true", "float32")
    assert not gpu_check.exact_ratio("bf16-mixed", "float32") and not gpu_check.exact_ratio("32-true", "bfloat16")


def test_check_iterations_wants_exactly_the_expected_ones(gpu_check) -> None:
    rows = [_row(1), {"eval/success": 0.0}, _row(2), _row(3)]
    assert gpu_check.check_iterations("x", rows, [1, 2, 3]).ok
    assert not gpu_check.check_iterations("x", rows[:3], [1, 2, 3]).ok
    assert not gpu_check.check_iterations("x", rows, [1, 2, 3, 4]).ok


def test_check_exit(gpu_check) -> None:
    assert gpu_check.check_exit("x", 0).ok
    assert not gpu_check.check_exit("x", 3).ok and not gpu_check.check_exit("x", None).ok


def test_peak_vs_plan_fails_on_a_plan_off_by_2x_either_way(gpu_check) -> None:
    mib = 2**20
    assert gpu_check.check_peak_vs_plan("m", 100 * mib, 95 * mib).ok
    assert gpu_check.check_peak_vs_plan("m", 100 * mib, 109 * mib).ok
    assert not gpu_check.check_peak_vs_plan("m", 100 * mib, 200 * mib).ok  # plan-2x: twice too much
    assert not gpu_check.check_peak_vs_plan("m", 100 * mib, 50 * mib).ok  # half: the measurement overruns
    assert not gpu_check.check_peak_vs_plan("m", 100 * mib, 88 * mib).ok
    assert not gpu_check.check_peak_vs_plan("m", None, 100 * mib).ok
    assert not gpu_check.check_peak_vs_plan("m", 100 * mib, 0).ok


def test_an_out_of_memory_rank_must_end_the_job_promptly_naming_itself(gpu_check) -> None:
    line = "error: rank 1 of 2 ran out of device memory during rollout: simulated: waking ...; lower ..."
    assert gpu_check.check_oom_reported("o", 3, f"...\n{line}\n", 20.0).ok
    assert not gpu_check.check_oom_reported("o", 3, f"{line}", 1800.0).ok  # the others waited for the timeout
    assert not gpu_check.check_oom_reported("o", 1, f"{line}", 20.0).ok  # a traceback's exit, not the job ending
    assert not gpu_check.check_oom_reported("o", 3, "torch.OutOfMemoryError: simulated", 20.0).ok  # no rank, no phase
    assert not gpu_check.check_oom_reported("o", 0, "", 20.0).ok


def test_control_check_wants_exactly_the_planted_failure(gpu_check) -> None:
    C = gpu_check.Check
    assert gpu_check.control_check("p", "a", [C("a", False, ""), C("b", True, "")]).ok
    assert not gpu_check.control_check("p", "a", [C("a", True, ""), C("b", True, "")]).ok  # the defect went unseen
    assert not gpu_check.control_check("p", "a", [C("a", False, ""), C("b", False, "")]).ok  # it broke something else too
    assert not gpu_check.control_check("p", "a", [C("a", True, ""), C("b", False, "")]).ok


def _summary(leg: str = "none", **failed: str) -> dict:
    checks = {n: {"ok": n not in failed, "detail": failed.get(n, "fine")}
              for n in ("own_device", "sleep_frees", "cache_filled_sync", "logprobs_match", "stale_control", "cycles")}
    return {"legs": {leg: {"checks": checks}}}


def test_probe_checks_fail_when_any_rank_failed_or_none_reported(gpu_check) -> None:
    ok = gpu_check.probe_checks([_summary(), _summary()])
    assert [c.name for c in ok][:2] == ["probe.own_device", "probe.sleep_frees"] and all(c.ok for c in ok)
    bad = {c.name: c for c in gpu_check.probe_checks([_summary(), _summary(logprobs_match="mean 0.3")])}
    assert not bad["probe.logprobs_match"].ok and bad["probe.logprobs_match"].detail == "rank 1: mean 0.3"
    assert sum(not c.ok for c in bad.values()) == 1
    assert not any(c.ok for c in gpu_check.probe_checks([]))
    assert not any(c.ok for c in gpu_check.probe_checks([_summary("stale-engine")], "none"))  # the leg did not run


def test_probe_gap_sleep_share_and_legs(probe) -> None:
    mean, worst = probe.logprob_gap([[-1.0, -2.0], [-0.5]], [[-1.01, -2.0], [-0.2]])
    assert mean == pytest.approx(0.31 / 3) and worst == pytest.approx(0.3)
    assert probe.logprob_gap([[]], [[]]) == (math.inf, math.inf)  # nothing compared is no agreement
    assert probe.gap_ok(0.019, 0.49, 0.02, 0.5)
    assert not probe.gap_ok(0.021, 0.1, 0.02, 0.5) and not probe.gap_ok(0.001, 0.5, 0.02, 0.5)
    assert not probe.gap_ok(math.nan, 0.0, 0.02, 0.5)
    assert probe.sleep_share(95, 100) >= probe.SLEEP_FREED_MIN > probe.sleep_share(80, 100)
    assert probe.sleep_share(5, 0) == 0.0
    checks = {n: {"ok": True} for n in probe.CHECKS}
    assert probe.leg_behaved("none", checks) and not probe.leg_behaved("stale-engine", checks)
    checks["logprobs_match"] = {"ok": False}
    assert probe.leg_behaved("stale-engine", checks) and not probe.leg_behaved("none", checks)
    assert not probe.leg_behaved("skip-cache-release", checks)


def test_the_engine_device_is_found_through_a_wrapper(probe) -> None:
    import types

    model = torch.nn.Linear(2, 2)
    assert probe.engine_weights_device(model) == "cpu"
    assert probe.engine_weights_device(types.SimpleNamespace(runnable=model)) == "cpu"
    assert probe.engine_weights_device(types.SimpleNamespace()) == "unknown"


def test_probe_defaults_are_production_settings_on_cuda(probe) -> None:
    cuda = probe.parse_args(["--device", "cuda", "--workdir", "w", "--json-out", "o"])
    assert (cuda.dtype, cuda.enforce_eager, cuda.sleep, cuda.cycles, cuda.train_steps, cuda.lr) == ("bfloat16", False, True, 2, 5, 1e-3)
    assert (cuda.mean_tol, cuda.max_tol) == (0.02, 0.5)
    cpu = probe.parse_args(["--workdir", "w", "--json-out", "o"])
    assert (cpu.dtype, cpu.enforce_eager, cpu.sleep) == ("float32", True, False)  # the vLLM CPU build has no sleep
    assert probe.parse_args(["--engine", "fake", "--workdir", "w", "--json-out", "o"]).sleep
    with pytest.raises(SystemExit):
        probe.parse_args(["--legs", "none,bogus", "--workdir", "w", "--json-out", "o"])


# ---------------------------------------------------------------------------------------- the commands


def test_the_train_runs_are_the_paper_experiment_at_lr_1e4_evaluated_first_then_resumed(gpu_check, tmp_path: Path) -> None:
    setup, sizes = gpu_check.SETUPS["webshop"], gpu_check.Sizes(4, 4, 2, 4)
    first = gpu_check.train_overrides(setup, tmp_path / "p", tmp_path / "r", sizes, accelerator="gpu", devices=1, rollout="hf")
    resumed = gpu_check.train_overrides(setup, tmp_path / "p", tmp_path / "r", sizes, accelerator="gpu", devices=1,
                                        rollout="vllm", iterations=4, resume=True)
    cfg = compose_config([o for o in first if not o.startswith("model.path")])
    experiment = compose_config([first[0]])
    assert cfg.trainer.strategy._target_ == "agentopsd.training.strategies.FSDP2Strategy" and cfg.trainer.devices == 1
    assert cfg.trainer.precision == experiment.trainer.precision == "bf16-mixed"
    assert cfg.optim.lr == 1e-4 and cfg.num_iterations == 3 and cfg.evaluation.before_training is True
    assert cfg.rollout.backend == "hf" and cfg.rollout.max_new_tokens == 512
    cfg = compose_config([o for o in resumed if not o.startswith(("model.path", "ckpt_path"))])
    assert cfg.rollout.backend == "vllm" and cfg.num_iterations == 4 and "ckpt_path=last" in resumed
    assert cfg.optim.tis_cap > 0  # tis_capped_frac is measured where vLLM generates
    command = gpu_check.train_command(first)
    assert command[1].endswith("scripts/gpu_check.py")  # the instrumented train.py (GPU_CHECK_TRAIN)


@pytest.mark.parametrize("accelerator", ["gpu", "cpu"])
def test_the_asynchronous_legs_are_the_experiment_with_a_worker_one_update_ahead(gpu_check, tmp_path: Path,
                                                                                  accelerator: str) -> None:
    setup, sizes = gpu_check.SETUPS["webshop"], gpu_check.Sizes(2, 2, 1, 2, 64)
    one, collective = (gpu_check.async_overrides(setup, tmp_path / "p", tmp_path / "r", sizes, accelerator=accelerator,
                                                 collective=c) for c in (False, True))
    for overrides in (one, collective):
        cfg = compose_config([o for o in overrides if not o.startswith("model.path")])
        assert cfg.rollout.max_staleness == gpu_check.ASYNC_K == 1 and cfg.rollout.backend == "hf"
        assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.devices == 1 and cfg.num_iterations == 2
        assert not gpu_check.exact_ratio(cfg.trainer.precision, cfg.model.dtype)  # judged by the token mean
    assert compose_config([o for o in one if not o.startswith("model.path")]).rollout.devices is None
    cfg = compose_config([o for o in collective if not o.startswith("model.path")])
    if accelerator == "gpu":  # the worker on the second GPU: the collective push over NCCL
        assert list(cfg.rollout.devices) == [1] and cfg.rollout.weight_transport == "auto"
    else:  # beside the trainer: the same push over gloo
        assert cfg.rollout.devices is None and cfg.rollout.weight_transport == "collective"


def test_the_collective_leg_is_skipped_saying_so_on_one_gpu(gpu_check) -> None:
    (_, _, one), (_, collective, why) = gpu_check.async_legs(1, cpu=False)
    assert one is None and collective and why.startswith("skipped: it needs 2 GPUs") and "has 1" in why
    assert all(why is None for _, _, why in gpu_check.async_legs(2, cpu=False))
    assert all(why is None for _, _, why in gpu_check.async_legs(0, cpu=True))  # rehearsed on CPU with gloo


def test_the_async_checks_fail_on_a_batch_staler_than_k(gpu_check, tmp_path: Path) -> None:
    result = gpu_check.RunResult("a", 0, 1.0, tmp_path / "log")
    rows = [_row(1, **{"rollout/staleness_max": 0.0}), _row(2, **{"rollout/staleness_max": 1.0})]
    events = [_ratio(1, 0.0, 10, 0.0), _ratio(2, 0.01, 10, 0.002)]
    assert all(c.ok for c in gpu_check.async_checks("a", result, rows, events, exact=False))
    stale = [*rows[:1], _row(2, **{"rollout/staleness_max": 2.0})]
    failed = [c.name for c in gpu_check.async_checks("a", result, stale, events, exact=False) if not c.ok]
    assert failed == ["a.staleness"]


def test_the_planned_peak_doubles_under_the_plant(gpu_check, tmp_path: Path) -> None:
    config = {"model_type": "qwen2", "vocab_size": 768, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "intermediate_size": 256, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps(config))
    overrides = gpu_check.train_overrides(gpu_check.SETUPS["webshop"], tmp_path / "p", tmp_path / "r",
                                          gpu_check.Sizes(2, 2, 1, 2, 16), accelerator="cpu", devices=2, rollout="vllm")
    planned, label = gpu_check.planned_update_peak(overrides, 1, 220, 16)
    doubled, _ = gpu_check.planned_update_peak(overrides, 1, 220, 16, double=True)
    longer, _ = gpu_check.planned_update_peak(overrides, 2, 440, 16)
    assert planned > 0 and doubled == 2 * planned and longer > planned and "1 rows x 220 tokens" in label
    shape = {"micro_rows": 1, "micro_length": 220, "micro_action": 16}
    events = [{"event": "update", "iteration": 1, "start_bytes": 1000, "peak_bytes": 10 * planned, **shape},
              {"event": "update", "iteration": 2, "start_bytes": 1000, "peak_bytes": planned - 1000, **shape}]
    check, numbers = gpu_check.peak_memory_check(overrides, events)  # the first update makes AdamW's states: left out
    assert check.ok and numbers == {"measured": planned, "planned": planned}
    assert not gpu_check.peak_memory_check(overrides, events, double=True)[0].ok
    assert not gpu_check.peak_memory_check(overrides, [])[0].ok


def test_dry_run_builds_the_folder_and_prints_the_commands(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--rehearse-on-cpu", "--workdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    train = [line for line in lines if "gpu_check.py +experiment=webshop_3b" in line and "max_staleness" not in line]
    assert len(train) == 2 and "ckpt_path=last" in train[1] and "num_iterations=4" in train[1]
    assert any("vllm_colocate_check.py" in line and "--engine fake" in line and "stale-engine,skip-cache-release" in line
               for line in lines)
    asynchronous = [line for line in lines if "rollout.max_staleness=1" in line]
    assert len(asynchronous) == 2 and "rollout.weight_transport=collective" in asynchronous[1]
    config = json.loads((tmp_path / "policy" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["hidden_size"] == 128 and config["dtype"] == "bfloat16"


# ---------------------------------------------------------------------------------------- the rehearsal


@pytest.mark.slow
def test_the_cpu_rehearsal_passes_and_its_controls_fail_as_planted(tmp_path: Path) -> None:
    """``bash scripts/gpu_check.sh --rehearse-on-cpu`` end to end (about 5 minutes on 2 cores): every assertion
    passes, and each planted defect fails exactly its assertion."""
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--rehearse-on-cpu", "--workdir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=_env())
    out = proc.stdout
    for control in ("control.stale-engine.probe.fake", "control.skip-cache-release.probe.fake", "control.plan-2x",
                    "control.stale-engine.train", "control.skip-cache-release.train",
                    "control.async.one-device.skip-recompute", "control.async.collective.skip-recompute"):
        assert f"PASS  {control}:" in out, out[-6000:]
    assert proc.returncode == 0 and "gpu_check: PASSED" in out, out[-6000:] + proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------- the carried wheels


@pytest.fixture(scope="module")
def carried():
    yield _load("carried_wheels")
    sys.modules.pop("carried_wheels", None)


def test_only_the_wheels_the_machine_lacks_are_installed(carried) -> None:
    wheels = ["d/protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl", "d/tensorboardX-2.6.5-py3-none-any.whl",
              "d/hydra_core-1.3.8-py3-none-any.whl", "d/antlr4_python3_runtime-4.9.3-py3-none-any.whl"]
    assert [carried.distribution_name(w) for w in wheels] == ["protobuf", "tensorboardx", "hydra-core",
                                                              "antlr4-python3-runtime"]
    machine = {"protobuf", "tensorboardx"}
    assert carried.wheels_to_install(wheels, machine.__contains__) == wheels[2:]
    assert carried.wheels_to_install(wheels, lambda name: False) == wheels
    assert carried.is_installed("pytest") and not carried.is_installed("no-such-distribution-here")


def _wheel(folder: Path, distribution: str, module: str, text: str) -> Path:
    """A minimal pure-Python wheel of ``distribution`` 99.0 holding ``module`` (a dotted name: a package)."""
    import zipfile

    info = f"{distribution.replace('-', '_')}-99.0.dist-info"
    files = {f"{module.replace('.', '/')}/__init__.py": text,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 99.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    path = folder / f"{distribution.replace('-', '_')}-99.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
    return path


def test_the_machines_own_protobuf_wins_over_the_carried_one(tmp_path: Path) -> None:
    """gpu_check.sh --wheels on a machine that has protobuf (this Python) and lacks a carried package: the run sees
    the machine's protobuf and the carried package."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "protobuf", "google.protobuf", "CARRIED = True\n")
    _wheel(wheels, "gpu-check-carried-probe", "gpu_check_carried_probe", "CARRIED = True\n")
    # stands in for the machine's python: the check itself prints where both imports come from
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [[ "$1" == scripts/gpu_check.py ]]; then
  exec {sys.executable} -c 'import google.protobuf as p, gpu_check_carried_probe as c; print(getattr(p, "CARRIED", False), c.CARRIED)'
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    for _ in range(2):  # the second run finds the folder installed
        proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--wheels", str(wheels), "--dry-run"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env=dict(_env(), PYTHON=str(fake)))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["False", "True"], proc.stdout  # the machine's protobuf, the carried probe
    assert not (wheels / "site" / "google").exists()
