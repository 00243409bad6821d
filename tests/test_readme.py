"""The README's and the docs' code blocks do what they say: Python blocks run as written, every `train.py`
command composes (and passes the group-swap check), every install command names files and extras that
exist, every yaml block builds the class its page defines. The pages are README.md and docs/ in the site's
nav order (tests/test_docs.py: doc_pages)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.test_docs import code_blocks, doc_pages

ROOT = Path(__file__).resolve().parents[1]
PAGES = doc_pages()
README = PAGES[0][1]
BLOCKS = [(name, lang, code) for name, text in PAGES for lang, code in code_blocks(text)]
PYTHON = [(name, code) for name, lang, code in BLOCKS if lang == "python"]
BASH_LINES = [line.strip() for _, lang, code in BLOCKS if lang == "bash" for line in code.splitlines() if line.strip()]
TRAIN = list(dict.fromkeys(line for line in BASH_LINES if "train.py" in line or "agentopsd-train" in line))  # a checkout's or the wheel's
PIP = list(dict.fromkeys(line for line in BASH_LINES if "pip install" in line))


def test_the_pages_have_the_blocks_these_tests_check():
    readme_pip = [line for lang, code in code_blocks(README) if lang == "bash" for line in code.splitlines() if "pip install" in line]
    assert len(PYTHON) >= 5 and len(TRAIN) >= 6 and len(PIP) >= 3 and len(readme_pip) >= 2


def _run_block(name: str, code: str) -> dict:
    """Exec a page's block in a namespace of its own, leaving the algorithm and environment registries as they
    were (a page's example registers its own algorithm and environment ids)."""
    import gymnasium as gym

    from agentopsd.credit.algorithms import ALGORITHMS

    algorithms, envs = dict(ALGORITHMS), set(gym.registry)
    namespace: dict = {"__name__": "docs_example"}
    try:
        exec(compile(code, name, "exec", dont_inherit=True), namespace)  # as a user runs it: no __future__ of ours
    finally:
        ALGORITHMS.clear()
        ALGORITHMS.update(algorithms)
        for env_id in set(gym.registry) - envs:
            del gym.registry[env_id]
    return namespace


@pytest.mark.parametrize(("name", "code"), PYTHON, ids=[f"{name}:python{i}" for i, (name, _) in enumerate(PYTHON)])
def test_python_blocks_run_as_written(name, code):
    _run_block(name, code)


def test_running_a_block_leaves_the_registries_as_they_were():
    from agentopsd.credit.algorithms import ALGORITHMS

    before = dict(ALGORITHMS)
    example = next(code for name, code in PYTHON if "@register" in code)
    assert "grpo_sign" in _run_block("adding-an-algorithm.md", example)["SignGRPO"].name
    assert ALGORITHMS == before


def test_the_algorithm_example_writes_the_sign_and_its_yaml_builds_it(capsys):
    page = dict(PAGES)["docs/adding-an-algorithm.md"]
    python = next(code for lang, code in code_blocks(page) if lang == "python")
    namespace = _run_block("adding-an-algorithm.md", python)
    assert namespace["batch"]["advantages"].tolist() == [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]
    cls = namespace["SignGRPO"]
    for lang, code in code_blocks(page):
        if lang == "yaml":
            settings = yaml.safe_load(code)
            assert settings.pop("_target_").rsplit(".", 1)[1] == cls.__name__
            assert cls(**settings).name == "grpo_sign"  # every key is a field, with a valid value


CREDIT_EXAMPLE = next(code for _, code in PYTHON if "reshape_advantages(" in code)


def test_the_credit_example_prints_the_turn_advantages_worked_by_hand(capsys):
    """The example's numbers, worked by hand (gamma 0.95, lam 0.5, band 0.2: the defaults):
    A = +-0.5 / (sample std 0.707107 + 1e-6) = +-0.707106; prior 1/2, so l0 = 0.
    Evidence, teacher - student summed per turn: winner [0.4 + 0.3, 0.0, -0.1] = [0.7, 0, -0.1];
    loser [-0.3, -0.1 + 0.2] = [-0.3, 0.1] (its last token is off the turns).
    Winner: c = [0.7, 0.665, 0.53175], B = sigmoid(c) = [0.668188, 0.660383, 0.629891],
      dB = [0.168188, -0.007805, -0.030491], z = [1.40492, -0.57486, -0.83006] (population std + 1e-4),
      w = 1 + 0.2 z = [1.2 (clipped from 1.281), 0.885029, 0.833988], At = A (0.5 + 0.5 w) = [0.777816, 0.666457, 0.648412].
    Loser: c = [-0.3, -0.185], B = [0.425557, 0.453881], dB = [-0.074443, 0.028324], q = -dB, z = [0.99806, -0.99806],
      w = [1.199612, 0.800388], At = -A (0.5 + 0.5 w) = [-0.777679, -0.636533], and 0 on the padded turn."""
    namespace = _run_block("credit.md", CREDIT_EXAMPLE)
    got = namespace["turn_adv"]
    assert got.shape == (2, 3) and got[1, 2].item() == 0.0
    expected = [0.777816, 0.666457, 0.648412, -0.777679, -0.636533, 0.0]
    assert got.flatten().tolist() == pytest.approx(expected, abs=2e-6)
    printed = [float(x) for x in re.findall(r"-?\d+\.\d+", capsys.readouterr().out)]
    assert printed == pytest.approx(expected, abs=1e-4)  # what the reader sees


def _overrides(line: str) -> list[str]:
    words = shlex.split(line.split("#", 1)[0])
    start = next(i for i, w in enumerate(words) if w in ("train.py", "agentopsd-train"))
    return [w for w in words[start + 1 :] if "=" in w]


@pytest.mark.parametrize("line", TRAIN)
def test_train_commands_compose(line):
    from hydra import compose, initialize_config_dir

    from agentopsd.run.folders import check_group_swaps, register_resolvers

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
        assert 'agentopsd-train = "agentopsd.run.train:cli"' in (ROOT / "pyproject.toml").read_text()
    for path in re.findall(r"-c (\S+)", line) + re.findall(r"bash (\S+\.sh)", line):
        assert (ROOT / path).is_file(), path
    if "-c constraints-cpu.txt" in line:
        assert "torch==" in (ROOT / "constraints-cpu.txt").read_text()
    if "download.pytorch.org/whl/cpu" in line:  # the CPU index gives the version the constraints file pins
        pinned = re.search(r"^torch==([\d.]+)\+cpu$", (ROOT / "constraints-cpu.txt").read_text(), flags=re.MULTILINE)
        assert pinned and f"torch=={pinned.group(1)}" in line
