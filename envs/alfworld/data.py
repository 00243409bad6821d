"""Where ALFWorld games come from: the official release (``ALFWORLD_DATA``) or generated scenes.

Both sources give game directories in the same format (``traj_data.json`` + ``game.tw-pddl``),
and one loader plays them. This module only finds them; it imports neither engine.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from agentopsd.envs.alfworld.rooms import TASK_TYPES

DATA_ENV = "ALFWORLD_DATA"
RELEASE_DIR = "json_2.1.1"
OFFICIAL_SPLITS = {"train": "train", "valid_seen": "valid_seen", "valid_unseen": "valid_unseen"}
EVAL_SPLITS = ("valid_seen", "valid_unseen")
SOURCES = ("auto", "official", "generated")
# `import alfworld` sets ALFWORLD_DATA to this folder itself when it is unset, so the value
# alone does not mean the user pointed us at data.
ALFWORLD_DEFAULT_DATA = Path("~/.cache/alfworld").expanduser()

LAYOUT_HELP = (
    f"it must contain {RELEASE_DIR}/{{train,valid_seen,valid_unseen}}/<task>/<trial>/ folders, each with "
    "traj_data.json and game.tw-pddl (fetch them with `alfworld-download`)"
)


def resolve_data_dir(data_dir: str | Path | None, source: str) -> Path | None:
    """The official data folder to use, or None for generated scenes.

    ``data_dir`` wins; else ``$ALFWORLD_DATA`` unless it is alfworld's own default (which
    ``import alfworld`` sets by itself); ``source="official"`` falls back to that default;
    ``source="generated"`` always means generated scenes.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}: choose one of {list(SOURCES)}")
    if source == "generated":
        return None
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env_value = os.environ.get(DATA_ENV)
    if env_value and Path(env_value).expanduser() != ALFWORLD_DEFAULT_DATA:
        return Path(env_value).expanduser()
    return ALFWORLD_DEFAULT_DATA if source == "official" else None


def _playable(root: str, files: list[str]) -> str | None:
    """The task type of a game folder ALFWorld's TextWorld env would play, else None.

    The same filter as alfworld's ``AlfredTWEnv.collect_game_files``: no movable-receptacle or
    sliced tasks, one of the six task types, a game file marked solvable.
    """
    if "traj_data.json" not in files or "game.tw-pddl" not in files:
        return None
    if "movable" in root or "Sliced" in root:
        return None
    task_type = json.loads(Path(root, "traj_data.json").read_text()).get("task_type")
    if task_type not in TASK_TYPES:
        return None
    if not json.loads(Path(root, "game.tw-pddl").read_text()).get("solvable", False):
        return None
    return task_type


@functools.lru_cache(maxsize=8)
def official_games(data_dir: Path, split: str) -> tuple[tuple[Path, str], ...]:
    """(game file, task type) of every playable game of an official split, sorted by path.

    Sorted so that task i is the same game on every machine (``os.walk`` order is not).
    Cached per process: the train split has ~3,500 games to open.
    """
    if not data_dir.is_dir():
        raise FileNotFoundError(
            f"ALFWorld data folder {data_dir} does not exist (from data_dir= or ${DATA_ENV}): {LAYOUT_HELP}; "
            f"or unset {DATA_ENV} to play the generated scenes"
        )
    root = data_dir / RELEASE_DIR / OFFICIAL_SPLITS[split]
    games = []
    if root.is_dir():
        for folder, _, files in os.walk(root):
            task_type = _playable(folder, files)
            if task_type is not None:
                games.append((Path(folder) / "game.tw-pddl", task_type))
    if not games:
        raise FileNotFoundError(
            f"no playable ALFWorld games under {root} (${DATA_ENV}={data_dir}): {LAYOUT_HELP}; "
            f"or unset {DATA_ENV} to play the generated scenes"
        )
    return tuple(sorted(games))
