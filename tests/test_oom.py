"""An out-of-memory error on one rank ends a 2-process job promptly, with one line naming the rank and the
phase (not the other ranks' 30-minute wait in their next collective)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentopsd.training.oom import (
    EXIT_CODE,
    DeviceOutOfMemory,
    is_out_of_memory,
    oom_line,
    out_of_memory_ends_the_job,
)

ROOT = Path(__file__).resolve().parents[1]


def test_one_line_names_rank_phase_and_what_to_lower():
    import torch

    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details")
    line = oom_line(err, "update", 1, 2)
    assert line.startswith("rank 1 of 2 ran out of device memory during update: CUDA out of memory. Tried to allocate 2.00 GiB;")
    assert "max_tokens_per_micro_batch" in line and "\n" not in line
    assert is_out_of_memory(RuntimeError("NCCL error: out of memory")) and not is_out_of_memory(ValueError("x"))


def test_alone_it_raises_the_line(capsys):
    import torch

    with pytest.raises(DeviceOutOfMemory, match="rank 0 of 1 ran out of device memory during scoring"):
        with out_of_memory_ends_the_job("scoring"):
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert "error: rank 0 of 1" in capsys.readouterr().err
    with pytest.raises(KeyError):  # other errors pass through untouched
        with out_of_memory_ends_the_job("scoring"):
            raise KeyError("x")


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "rank", "phase"), [("ddp", 1, "update"), ("ddp", 0, "evaluation"), ("fsdp", 1, "evaluation")])
def test_an_out_of_memory_rank_ends_the_two_process_job_promptly(strategy, rank, phase, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "OOM_RANK": str(rank), "OOM_PHASE": phase}
    overrides = ["experiment=babyai_tiny", f"trainer={strategy}", "trainer.accelerator=cpu", "trainer.devices=2",
                 "trainer.precision=32-true", "trainer.enable_progress_bar=false", "num_iterations=2",
                 "evaluation.num_tasks=2", f"output_dir={tmp_path / 'run'}",
                 # a rank left waiting would fail at this timeout: the test asserts the job ended well before it
                 "trainer.strategy.timeout.seconds=300"]
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "tests/oom_probe.py", *overrides], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the job still ran 240 s after the planted out-of-memory error; stacks:\n{err[-6000:]}")
    elapsed = time.monotonic() - t0
    line = f"error: rank {rank} of 2 ran out of device memory during {phase}: CUDA out of memory."
    assert proc.returncode != 0 and line in err, f"exit {proc.returncode}\n{out[-1500:]}\n{err[-4000:]}"
    assert elapsed < 200, elapsed
    # no rank is left behind: the process group is gone
    time.sleep(1)
    left = subprocess.run(["ps", "-o", "pid,stat,args", "--no-headers", "-s", str(proc.pid)], capture_output=True, text=True).stdout
    alive = [row for row in left.splitlines() if row.split()[1][0] != "Z"]  # an exited, unreaped rank is gone
    assert not alive, left
    assert EXIT_CODE == 3
