"""agentopsd.training.distributed.exit_process: after a run that made a process group, the exit handlers run, the
streams are flushed, and interpreter shutdown (where gloo's worker threads can abort the process) is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentopsd.training.distributed import exit_code, exit_process

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent('''
    import atexit, sys
    from pathlib import Path
    import torch.distributed as dist
    from agentopsd.training.distributed import exit_process

    out, how = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=0, world_size=1)
    dist.barrier()
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    leftover = open(out / "unclosed", "w")  # flushed only by interpreter shutdown
    leftover.write("shutdown ran")
    print("printed, not flushed")
    if how == "exit_process":
        exit_process(3)
    sys.exit(3)
''')


def test_exit_code_reads_sys_exit_arguments(capsys) -> None:
    assert exit_code(None) == 0 and exit_code(0) == 0 and exit_code(3) == 3
    assert exit_code("error: bad input") == 1
    assert capsys.readouterr().err == "error: bad input\n"


def test_without_a_process_group_it_is_sys_exit() -> None:
    with pytest.raises(SystemExit) as stop:
        exit_process(4)
    assert stop.value.code == 4


@pytest.mark.parametrize("how", ["exit_process", "sys.exit"])
def test_after_a_process_group_the_handlers_run_and_shutdown_is_skipped(how: str, tmp_path: Path) -> None:
    """The control (sys.exit) shows what shutdown does: it flushes the unclosed file. exit_process skips it
    (the file stays empty), yet runs the atexit handlers, flushes stdout and keeps the exit status."""
    script = tmp_path / "leave.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), how], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "printed, not flushed\n"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "unclosed").read_text() == ("" if how == "exit_process" else "shutdown ran")
