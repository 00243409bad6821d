"""The README's code blocks do what they say: Python blocks run as written, every `train.py`
command composes (and passes the group-swap check), every install command names files and
extras that exist."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.DOTALL)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH_LINES = [line.strip() for lang, code in BLOCKS if lang == "bash" for line in code.splitlines() if line.strip()]
TRAIN = [line for line in BASH_LINES if "train.py" in line or "agentopsd-train" in line]  # a checkout's or the wheel's
PIP = [line for line in BASH_LINES if "pip install" in line]


def test_the_readme_has_the_blocks_these_tests_check():
    assert len(PYTHON) >= 2 and len(TRAIN) >= 6 and len(PIP) >= 2


@pytest.mark.parametrize("code", PYTHON, ids=[f"python{i}" for i in range(len(PYTHON))])
def test_python_blocks_run_as_written(code):
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


def _overrides(line: str) -> list[str]:
    words = shlex.split(line.split("#", 1)[0])
    start = next(i for i, w in enumerate(words) if w in ("train.py", "agentopsd-train"))
    return [w for w in words[start + 1 :] if "=" in w]


@pytest.mark.parametrize("line", TRAIN)
def test_train_commands_compose(line):
    from hydra import compose, initialize_config_dir

    from agentopsd.runs import check_group_swaps, register_resolvers

    register_resolvers()
    # train.py reads `+experiment=X` as `experiment=X`
    overrides = [o.replace("+experiment=", "experiment=", 1) for o in _overrides(line)]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    check_group_swaps(cfg.hydra.runtime.choices.get("experiment"), overrides, ROOT / "conf")
    assert cfg.env.id and cfg.model._target_


@pytest.mark.parametrize("line", PIP)
def test_install_commands_name_what_exists(line):
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+)\s*=", section, flags=re.MULTILINE))  # (tomllib needs Python 3.11)
    for named in re.findall(r'-e "?\.\[([\w,]+)\]', line):
        assert set(named.split(",")) <= extras, named
    if "agentopsd-train" in line:
        assert 'agentopsd-train = "agentopsd.train:cli"' in (ROOT / "pyproject.toml").read_text()
    for path in re.findall(r"-c (\S+)", line) + re.findall(r"bash (\S+\.sh)", line):
        assert (ROOT / path).is_file(), path
    if "-c constraints-cpu.txt" in line:
        assert "torch==" in (ROOT / "constraints-cpu.txt").read_text()
    if "download.pytorch.org/whl/cpu" in line:  # the CPU index gives the version the constraints file pins
        pinned = re.search(r"^torch==([\d.]+)\+cpu$", (ROOT / "constraints-cpu.txt").read_text(), flags=re.MULTILINE)
        assert pinned and f"torch=={pinned.group(1)}" in line
