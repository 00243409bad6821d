"""One import path per module, every cited document in the repository, and the installed wheel.

The repository keeps envs/, callbacks/ and conf/ at the top; their only importable names are
``agentopsd.envs.*`` and ``agentopsd.callbacks.*`` (agentopsd/envs, agentopsd/callbacks and agentopsd/conf
are relative symlinks, see pyproject.toml). From a checkout's root ``import envs`` would still work (the
current folder is on sys.path) and load every module a second time under another name, with its own
registry and classes: these tests fail on any such import.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import gymnasium as gym
import pytest

ROOT = Path(__file__).resolve().parents[1]
OLD_NAMES = ("envs", "callbacks")
SKIP_DIRS = {".git", "runs", "build", "results", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "outputs"}


def _project_files(suffixes: tuple[str, ...]) -> list[Path]:
    """The project's own files (no virtualenvs, run folders or build output), each once (the symlinks under
    agentopsd/ are not followed: their targets are walked at the top)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv") and not d.endswith(".egg-info")]
        found += [Path(folder, f) for f in files if f.endswith(suffixes)]
    return sorted(found)


def _old_name_imports(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # gym entry points, LevelSpec entry points, `python -c "import envs..."`, logger names, docstrings
            names = re.findall(r"(?:^|[\s;,\"'`(])((?:envs|callbacks)(?:\.\w+)+)(?=[:\s;,\"'`)]|$)", node.value)
        else:
            continue
        bad += [f"{path.relative_to(root)}:{node.lineno}: {name}" for name in names if name.split(".")[0] in OLD_NAMES]
    return bad


def test_the_packages_are_symlinks_into_the_repository_layout():
    for name in ("envs", "callbacks", "conf"):
        link = ROOT / "agentopsd" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", f"agentopsd/{name} must be the relative link ../{name}"
        assert link.resolve() == (ROOT / name).resolve()


def test_nothing_imports_envs_or_callbacks_by_their_top_level_names():
    python_files = _project_files((".py",))
    assert any(p.relative_to(ROOT).parts[0] == "envs" for p in python_files)  # the walk sees the packages themselves
    # this file's own examples of the old spellings aside
    bad = [hit for path in python_files if path != Path(__file__).resolve() for hit in _old_name_imports(path)]
    assert not bad, "import these as agentopsd.envs... / agentopsd.callbacks...:\n" + "\n".join(bad)


def test_the_checker_catches_each_spelling(tmp_path):
    sample = tmp_path / "sample.py"
    for line in ("import envs", "import envs.base", "from envs.babyai.env import BabyAIEnv", "from callbacks import CreditCallback",
                 "gym.register(id='x', entry_point='envs.babyai.env:BabyAIEnv')", "code = 'import sys, envs.babyai'"):
        sample.write_text(line + "\n")
        assert _old_name_imports(sample, tmp_path), line
    sample.write_text("import agentopsd.envs\nfrom agentopsd.callbacks import CreditCallback\nx = args.envs.split(',')\n"
                      "y = 'agentopsd.envs.babyai.env:BabyAIEnv'\n")
    assert not _old_name_imports(sample, tmp_path)


def test_text_files_name_the_installed_modules():
    """Docs, configs and scripts: `python -m envs.x`, `_target_: callbacks.x` and code blocks importing them."""
    pattern = re.compile(r"(?:python -m |_target_:\s*|^\s*from |^\s*import )(envs|callbacks)\b", re.MULTILINE)
    bad = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}" for p in _project_files((".md", ".yaml", ".yml", ".sh", ".toml"))
           for m in pattern.finditer(p.read_text())]
    assert not bad, bad


def test_registered_entry_points_are_the_installed_names():
    import agentopsd.envs  # noqa: F401
    from agentopsd.envs.babyai.levels import LEVEL_SPECS

    ours = {env_id: spec.entry_point for env_id, spec in gym.registry.items() if env_id.startswith("agentopsd/")}
    assert len(ours) >= 4
    assert all(str(ep).startswith("agentopsd.envs.") for ep in ours.values()), ours
    own_levels = [spec.minigrid_id for spec in LEVEL_SPECS.values() if ":" in spec.minigrid_id]  # module:Class
    assert own_levels and all(ep.startswith("agentopsd.envs.") for ep in own_levels), own_levels
    assert not {"envs", "callbacks"} & set(sys.modules)  # nothing loaded them under the old names


def test_every_cited_document_is_in_the_repository():
    """A docstring, comment or doc that names a ``*.md`` file names one the repository has."""
    results_docs = sorted((ROOT / "results").rglob("*.md"))
    documents = [p.relative_to(ROOT).as_posix() for p in _project_files((".md",)) + results_docs]
    cited = re.compile(r"[\w./-]*\w\.md\b")
    bad = []
    for path in _project_files((".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt")) + results_docs:
        text = re.sub(r"https?://\S+", "", path.read_text(errors="replace"))  # a public address is a fine citation
        for name in set(cited.findall(text)):
            name = name.lstrip("./")
            if not any(doc == name or doc.endswith("/" + name) for doc in documents):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, "these cite documents the repository does not have; say it in the text itself:\n" + "\n".join(bad)


def _copy_source(dest: Path) -> None:
    """The project as a fresh checkout has it: no build/ left over (setuptools would pack its stale files)."""
    ignore = shutil.ignore_patterns(".git", ".venv*", "runs", "build", "results", "*.egg-info", "__pycache__", ".*cache", ".hypothesis")
    shutil.copytree(ROOT, dest, symlinks=True, ignore=ignore)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_installs_and_trains_from_any_folder(tmp_path):
    """Build the wheel, install it into a fresh virtualenv and run a one-iteration experiment in an empty folder.

    Offline and quick: the wheel is built with this environment's setuptools (--no-build-isolation) and
    installed with --no-deps into a virtualenv whose .pth file puts this environment's site-packages
    after its own (the dependencies come from there; the wheel's agentopsd comes first)."""
    src, wheels, venv, work = tmp_path / "src", tmp_path / "wheels", tmp_path / "venv", tmp_path / "work"
    _copy_source(src)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)], check=True, timeout=300)
    (wheel,) = wheels.glob("agentopsd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"agentopsd"}, top  # no top-level envs/ or callbacks/
    for shipped in ("agentopsd/envs/babyai/env.py", "agentopsd/callbacks/credit.py", "agentopsd/conf/config.yaml",
                    "agentopsd/conf/experiment/babyai_tiny.yaml", "agentopsd/rollout/skills/babyai.json", "agentopsd/run/train.py"):
        assert shipped in names, shipped
    # the workshop stays out of the product: no test doubles (the fake vLLM engine lives in tests/fakes/)
    doubles = [n for n in names if "fake" in n.rsplit("/", 1)[-1] or "/testing/" in n]
    assert not doubles, doubles
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "agentopsd-train = agentopsd.run.train:cli" in entry_points

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    Path(own_site, "parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)

    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    env |= {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    probe = ("import importlib.util, agentopsd, agentopsd.envs, agentopsd.callbacks; print(agentopsd.__file__); "
             "print(importlib.util.find_spec('envs'), importlib.util.find_spec('callbacks'))")
    out = subprocess.run([str(python), "-c", probe], cwd=work, env=env, capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0].startswith(own_site), out  # the wheel's copy, not the checkout
    assert out[1] == "None None", out  # no top-level envs or callbacks installed

    run = subprocess.run([str(venv / "bin" / "agentopsd-train"), "experiment=babyai_tiny", "num_iterations=1",
                          "evaluation.num_tasks=2", "trainer.enable_progress_bar=false"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "after 1 iteration" in run.stdout, run.stdout[-2000:]
    latest = work / "runs" / "babyai_tiny" / "latest"
    assert (latest / "checkpoints" / "last.ckpt").is_file() and (latest / ".hydra" / "config.yaml").is_file()
    assert sorted(p.name for p in work.iterdir()) == ["runs"]  # everything under the current folder's runs/
