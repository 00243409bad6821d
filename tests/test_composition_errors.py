"""Hydra's composition errors (a typo'd key or option, `model.path=` on the tiny model) are one line naming the key and
the fix, exit 2, like every other bad configuration (issue 49, item 4; agentopsd/run/composition.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentopsd.run.composition import check_composition
from agentopsd.run.validation import ConfigError
from tests.test_train import ROOT

CONF = ROOT / "conf"


def refusal(*argv: str) -> str:
    with pytest.raises(ConfigError) as err:
        check_composition(list(argv), CONF)
    line = str(err.value)
    assert "\n" not in line, line
    return line


def test_a_typo_in_an_option_names_the_closest_one_and_the_choices():
    line = refusal("env=babyia")
    assert line.startswith("env=babyia: no config env/babyia.yaml; did you mean env=babyai?")
    assert "babyai_pickupobj" in line and "--config-dir" in line
    assert "did you mean experiment=babyai_tiny?" in refusal("experiment=babyai_tny")


def test_a_typo_in_a_key_names_the_closest_key():
    line = refusal("optim.lrr=0.1")
    assert line.startswith("optim.lrr=0.1: optim has no key 'lrr'; did you mean optim.lr=0.1?") and "+optim.lrr=0.1" in line


def test_model_path_on_the_tiny_model_names_a_model_that_loads_one():
    line = refusal("model.path=/some/folder")
    assert line.startswith("model.path=/some/folder: model=tiny")
    assert "model=qwen2.5-3b model.path=/some/folder" in line


def test_other_composition_errors_are_one_line_too():
    assert refusal("+env=babyai").startswith("+env=babyai: env already has an option")
    assert refusal("x=[").startswith("x=[: ")
    assert refusal("--config-dir=/nonexistent/conf").startswith("--config-dir=/nonexistent/conf: no such folder")


def test_a_line_that_composes_and_hydras_own_commands_pass():
    check_composition(["experiment=babyai_tiny", "algorithm=grpo", "optim.lr=0.001"], CONF)
    check_composition(["--help"], CONF)  # Hydra's own: left to Hydra
    check_composition(["-m", "seed=0,1"], CONF)


def _train(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("argv", "start"), [
    (["model.path=/some/folder"], "error: model.path=/some/folder: model=tiny"),
    (["env=babyia"], "error: env=babyia: no config env/babyia.yaml; did you mean env=babyai?"),
    (["optim.lrr=0.1"], "error: optim.lrr=0.1: optim has no key 'lrr'"),
])
def test_train_py_prints_one_line_and_exits_2(argv, start, tmp_path):
    proc = _train(*argv, f"runs_dir={tmp_path / 'runs'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(start) and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing ran, no folder


def test_agentopsd_eval_prints_one_line_and_exits_2(capsys):
    from agentopsd.tools import eval_cli

    assert eval_cli.main(["env=babyia", "ckpt_path=last"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: env=babyia: no config env/babyia.yaml; did you mean env=babyai?") and err.count("\n") == 1
    assert eval_cli.main(["optim.lrr=0.1", "ckpt_path=last"]) == 2
    assert "did you mean optim.lr=0.1?" in capsys.readouterr().err
