"""``agentopsd-eval`` leaves through :func:`agentopsd.training.distributed.exit_process`, as ``agentopsd-train`` does: after
a process group was made (a multi-process evaluation), the exit handlers run, the streams are flushed, its exit
status is kept, and interpreter shutdown (where gloo's worker threads can abort the process) is skipped.

The console command's entry point (``[project.scripts]``) is called in a process that made a one-rank gloo group;
an unclosed file that only interpreter shutdown would flush tells whether shutdown ran (see
``tests/agentopsd/test_exit_process.py`` for the mechanism and its control)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent('''
    import atexit, importlib, sys
    from pathlib import Path
    import torch.distributed as dist

    out, entry = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=0, world_size=1)
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    leftover = open(out / "unclosed", "w")  # flushed only by interpreter shutdown
    leftover.write("shutdown ran")
    module, func = entry.split(":")
    sys.argv = ["agentopsd-eval", "ckpt_path=last", f"runs_dir={out / 'no-runs'}"]  # fails fast: exit status 2
    getattr(importlib.import_module(module), func)()
    (out / "returned").write_text("cli() returned instead of exiting")
''')


def console_entry(name: str) -> str:
    """The ``module:function`` of a console command, read from pyproject.toml's ``[project.scripts]``."""
    found = re.search(rf'^{re.escape(name)}\s*=\s*"([\w.]+:\w+)"', (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert found, f"{name} is not in pyproject.toml's [project.scripts]"
    return found.group(1)


def test_agentopsd_eval_after_a_process_group_exits_through_exit_process(tmp_path: Path) -> None:
    (tmp_path / "no-runs").mkdir()
    script = tmp_path / "eval_exit.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), console_entry("agentopsd-eval")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]  # main's status for a refused input, kept
    assert "error: ckpt_path=last: no run in" in proc.stderr
    assert not (tmp_path / "returned").exists()
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "unclosed").read_text() == "", (
        "agentopsd-eval ran interpreter shutdown after a process group (sys.exit, not agentopsd.training.distributed.exit_process)")
