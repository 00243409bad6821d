"""Shared by the study tests: the studies are scripts, not a package, so each test loads its script by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_study(stem: str) -> ModuleType:
    """``studies/<stem>.py`` as a module named ``study_<stem>``.

    The repository root goes on ``sys.path`` because the scripts import ``studies.common`` as they do when run from
    the root. The module is registered in ``sys.modules`` before it runs because dataclasses resolve their postponed
    annotations through it (a script defining one fails to load otherwise).
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    name = f"study_{stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / "studies" / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
