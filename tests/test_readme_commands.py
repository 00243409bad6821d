"""Every command the README and the docs show says its time, and the CPU ones do what they say when run as written.

Each command line (`python train.py ...`, `agentopsd-train`, `agentopsd-eval`, `agentopsd-export`) carries a
comment with its time on a 2-core CPU, or says it needs GPUs. The pages are README.md, then docs/ in the site's
nav order (tests/test_docs.py: doc_pages); a command shown on several pages runs once, where it first appears.
The CPU ones run here in that order in one fresh folder, as a user would type them (the quickstart first: the export reads its run), those stated
at over a minute shortened the way the pages say. A command a page changes breaks this test, not a newcomer's
first hour.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_docs import code_blocks, doc_pages

ROOT = Path(__file__).resolve().parents[1]
PAGES = doc_pages()
BASH = [line.strip() for _, text in PAGES for lang, code in code_blocks(text) if lang == "bash"
        for line in code.splitlines() if line.strip()]
COMMAND_WORDS = ("train.py", "agentopsd-train", "agentopsd-eval", "agentopsd-export")
COMMANDS = list(dict.fromkeys(line for line in BASH if any(w in line.split("#", 1)[0] for w in COMMAND_WORDS)))
SHORTENED = re.search(r"shortened: `([^`]+)`", "\n".join(text for _, text in PAGES))


def stated_seconds(line: str) -> float | None:
    """The time a command's comment states (the largest figure, in seconds), or None when it states none."""
    comment = line.split("#", 1)[1] if "#" in line else ""
    figures = [float(n) * (60 if unit.startswith("min") else 1)
               for n, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(s|sec|seconds?|min|minutes?)\b", comment)]
    if figures:
        return max(figures)
    return 10.0 if re.search(r"\bseconds\b", comment) else None


def needs_gpu(line: str) -> bool:
    comment = line.split("#", 1)[1] if "#" in line else ""
    return bool(re.search(r"\bGPUs?\b", comment))


def test_every_command_states_its_time_or_that_it_needs_gpus():
    assert len(COMMANDS) >= 10 and SHORTENED
    unstated = [line for line in COMMANDS if stated_seconds(line) is None and not needs_gpu(line)]
    assert not unstated, f"README/docs commands without a time in their comment: {unstated}"


def _argv(command: str) -> list[str]:
    """A page's command as a process: `python train.py` from any folder, the console scripts of this install."""
    words = shlex.split(command)
    if words[:2] == ["python", "train.py"]:
        return [sys.executable, str(ROOT / "train.py"), *words[2:]]
    return [str(Path(sys.executable).parent / words[0]), *words[1:]]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


def _has_key(command: str, key: str) -> bool:
    """Does the config a train.py command composes have ``key`` (``warm_start.steps`` is absent when warm_start is null)?"""
    from hydra import compose, initialize_config_dir
    from omegaconf import DictConfig, OmegaConf

    from agentopsd.run.folders import register_resolvers

    register_resolvers()
    overrides = [w.replace("+experiment=", "experiment=", 1) for w in shlex.split(command)[1:] if "=" in w]
    overrides = [o for o in overrides if _key(o) not in ("ckpt_path", "model.path")]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(node, DictConfig) and leaf in node


def shorten(command: str) -> str:
    """The pages' shortening overrides in place of the command's own values of those keys, where the command's
    config has them (an environment without a warm start has no warm_start.steps)."""
    short = shlex.split(SHORTENED.group(1))
    tool = "python train.py" if command.startswith("python train.py") else command.split()[0]
    keep = [w for w in shlex.split(command)[len(tool.split()):] if _key(w) not in {_key(s) for s in short}]
    extra = [s for s in short if _has_key(f"{tool} {' '.join(keep)}", _key(s))]
    return " ".join([tool, *keep, *extra])


def _cpu_commands() -> list[str]:
    """The commands to run, in order: the quickstart (the install line's last step) first, then every other
    CPU command outside the install lines."""
    quickstart = next(line for line in COMMANDS if "pip install" in line and line.split("#", 1)[0].rstrip().endswith("python train.py"))
    rest = [line for line in COMMANDS if "pip install" not in line and not needs_gpu(line)]
    return [f"python train.py  #{quickstart.split('#', 1)[1]}", *rest]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_cpu_commands_run_in_order_as_written(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("AGENTOPSD_TEST_THREADS", "1"), "HYDRA_FULL_ERROR": "1"}
    outputs: dict[str, str] = {}
    for line in _cpu_commands():
        command = line.split("#", 1)[0].strip()
        if stated_seconds(line) > 60:
            command = shorten(command)
        start = time.monotonic()
        proc = subprocess.run(_argv(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
        print(f"{time.monotonic() - start:6.1f} s  {command}", flush=True)  # beside the pages' stated times (-s)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        outputs[command] = proc.stdout + proc.stderr
        if "train.py" in command:
            assert "outputs:" in outputs[command] and "eval success" in outputs[command], outputs[command][-2000:]
    assert len(outputs) >= 7
    # what the commands were meant to leave: the quickstart's run, the export it read, a finished run trained on
    assert (tmp_path / "runs" / "quickstart" / "latest" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "exported" / "config.json").is_file() and (tmp_path / "exported" / "tokenizer_config.json").is_file()
    extended = [out for command, out in outputs.items() if "ckpt_path=last" in command and "num_iterations=" in command]
    assert extended and all("resumed after" in out and "nothing trained" not in out for out in extended)
    evaluated = [out for command, out in outputs.items() if command.startswith("agentopsd-eval")]
    assert len(evaluated) >= 2 and all("success" in out for out in evaluated)


def test_shortening_replaces_the_commands_own_values_and_skips_absent_keys():
    assert SHORTENED, "a page says how to shorten a long command"
    short = shorten("python train.py env=webshop num_iterations=4")
    assert "num_iterations=4" not in short and "num_iterations=1" in short and "warm_start.steps=" in short
    bare = shorten("python train.py experiment=none env=searchqa algorithm=grpo")
    assert "warm_start" not in bare and "num_iterations=1" in bare  # no warm start in that config
    assert stated_seconds("x  # about 2 minutes, 1.9 GB") == 120 and stated_seconds("x  # 8 s") == 8
    assert stated_seconds("x  # seconds; also python -m y") == 10 and stated_seconds("x  # resume") is None
