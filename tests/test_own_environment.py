"""docs/own-environment.md as a user follows it: its files written exactly as shown into a folder outside the
repository, then its commands run there (issue 49, item 5). Also Gymnasium's `module:Id` on its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

from agentopsd.envs.base import env_class, registration_problem
from agentopsd.run.validation import ConfigError, validate_config
from tests.test_configs import _resolve, cfg_for
from tests.test_train import ROOT

GUIDE = ROOT / "docs" / "own-environment.md"
FILE_BLOCK = re.compile(r"^`([\w./-]+\.(?:py|yaml|json))`:\n\n```(\w+)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)


def guide_files() -> dict[str, str]:
    """``{path: text}`` of each block the guide introduces with a line naming its file (`countdown/...`:)."""
    return {path: code for path, _, code in FILE_BLOCK.findall(GUIDE.read_text())}


def guide_commands() -> str:
    (commands,) = BASH_BLOCK.findall(GUIDE.read_text())
    return commands


def test_the_guide_holds_a_whole_project():
    files = guide_files()
    assert set(files) == {"countdown/countdown_env/__init__.py", "countdown/countdown_skills.json",
                          "countdown/conf/env/countdown.yaml", "countdown/conf/experiment/countdown.yaml"}
    assert "countdown_env:Countdown-v0" in files["countdown/conf/env/countdown.yaml"]
    assert "--config-dir conf" in guide_commands()


def write_project(folder: Path) -> Path:
    for path, code in guide_files().items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(code)
    return folder


@pytest.fixture
def importable_project(tmp_path, monkeypatch):
    """The guide's project in a temporary folder, importable as it is when commands run inside it."""
    write_project(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "countdown"))
    monkeypatch.chdir(tmp_path / "countdown")
    yield tmp_path / "countdown"
    sys.modules.pop("countdown_env", None)
    gym.registry.pop("Countdown-v0", None)


def test_module_id_imports_the_package_that_registers_it(importable_project):
    assert "Countdown-v0" not in gym.registry
    assert registration_problem("countdown_env:Countdown-v0") is None  # imports countdown_env, which registers it
    assert env_class("countdown_env:Countdown-v0").__name__ == "Countdown"
    env = gym.make("countdown_env:Countdown-v0", split="eval", disable_env_checker=True)
    assert env.unwrapped.num_tasks == 5


def test_a_wrong_module_or_id_is_one_line(importable_project):
    missing = registration_problem("no_such_pkg.envs:Countdown-v0")
    assert missing.startswith("env.id=no_such_pkg.envs:Countdown-v0: importing no_such_pkg.envs failed") and "\n" not in missing
    assert "registered no 'Countdwn-v0'" in registration_problem("countdown_env:Countdwn-v0")
    assert "module>:<id>" in registration_problem("Countdown-v9")


def test_what_an_env_without_a_skill_bank_or_an_expert_can_run(importable_project, monkeypatch):
    base = ["experiment=none", "env.id=countdown_env:Countdown-v0", "env.max_turns=6", "evaluation.num_tasks=5"]
    validate_config(_resolve(cfg_for(*base, "env.skills=countdown_skills.json")))  # AgentOPSD with the guide's bank
    validate_config(_resolve(cfg_for(*base, "env.skills=null", "algorithm=grpo")))
    with pytest.raises(ConfigError, match=r"algorithm=agentopsd scores a teacher view, which needs a skill bank.*algorithm=grpo"):
        validate_config(_resolve(cfg_for(*base, "env.skills=null")))
    with pytest.raises(ConfigError, match=r"env.skills=missing.json: skill file missing.json not found"):
        validate_config(_resolve(cfg_for(*base, "env.skills=missing.json")))
    monkeypatch.delattr(env_class("countdown_env:Countdown-v0"), "expert_action")
    with pytest.raises(ConfigError, match=r"model=tiny trains its tokenizer on expert episodes.*model=smollm2-135m"):
        validate_config(_resolve(cfg_for(*base, "env.skills=countdown_skills.json")))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_guide_runs_as_written_outside_the_repository(tmp_path):
    assert not tmp_path.resolve().is_relative_to(ROOT)
    write_project(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", guide_commands()], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    runs = sorted(p for p in (tmp_path / "countdown" / "runs" / "countdown").iterdir() if p.name not in ("latest", "eval"))
    assert len(runs) == 2 and proc.stdout.count("eval success") == 2
    assert "countdown_env:Countdown-v0" in (runs[0] / ".hydra" / "config.yaml").read_text()
    assert "name: agentopsd" in (runs[1] / ".hydra" / "config.yaml").read_text()
    assert "eval: success" in proc.stdout and "on countdown_env:Countdown-v0" in proc.stdout
