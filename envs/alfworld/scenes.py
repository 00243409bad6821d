"""Generated ALFWorld scenes, written in the official game-directory format.

Each task is a directory holding ``traj_data.json`` (``task_type``, ``pddl_params``) and
``game.tw-pddl`` (``pddl_domain``, ``grammar``, ``pddl_problem``, ``solvable``), the layout of
ALFWorld's ``json_2.1.1`` release, so the loader that plays official games plays these too.
The PDDL problem is written against the domain and grammar shipped in the ``alfworld``
package; goals and task sentences come from its ``goal_library``.

A task is a pure function of ``(split, index)``: the index picks the task type
(``index % 6``), a seeded ``random.Random`` picks the room, the receptacles, the objects and
where they start. Generation keeps a scene only when ALFWorld's handcoded expert wins it
within ``EXPERT_STEP_LIMIT`` steps (``verify``), and stores the expert's plan in
``traj_data.json["agentopsd"]``; otherwise it draws again with the next ``attempt``.
Tasks are generated lazily, on first use, into a versioned cache directory.
"""

from __future__ import annotations

import functools
import json
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from agentopsd.envs.alfworld.rooms import (
    LAMP,
    LAMP_HOLDERS,
    LOOK_OBJECTS,
    OPENABLE,
    ROOMS,
    TASK_EXCLUDED_PARENT,
    TASK_PROPERTY,
    TASK_ROOMS,
    TASK_TYPES,
    Room,
)

GENERATOR_VERSION = "gen1"
SIZES = {"train": 600 * len(TASK_TYPES), "eval": 12 * len(TASK_TYPES)}
"""Tasks per split: 600 (train) and 12 (eval) per task type; eval is a fixed list of 72."""
EXPERT_STEP_LIMIT = 50
"""A generated scene is kept only if the expert wins within this many steps (the default horizon)."""
MAX_ATTEMPTS = 25
GAME_FILE = "game.tw-pddl"
TRAJ_FILE = "traj_data.json"
CACHE_ENV = "AGENTOPSD_ALFWORLD_CACHE"

Verifier = Callable[[Path], "list[str] | None"]
"""Plays a game file with the expert; returns the winning plan, or None when it does not win."""


@dataclass(frozen=True)
class Scene:
    """One generated task: the room's receptacles and objects and the goal's parameters."""

    task_id: str
    task_type: str
    room: str
    object_target: str
    parent_target: str
    """Destination class; "" for look_at_obj_in_light."""
    toggle_target: str
    """The lamp class for look_at_obj_in_light, else ""."""
    receptacles: tuple[tuple[str, str], ...]
    """(PDDL id, ALFRED class), sorted by id."""
    objects: tuple[tuple[str, str, str], ...]
    """(PDDL id, ALFRED class, id of the receptacle it starts in), sorted by id."""
    task_desc: str


@functools.lru_cache(maxsize=1)
def _alfred_tables() -> tuple[dict[str, frozenset[str]], dict[str, frozenset[str]]]:
    """(receptacle class -> object classes it may hold, property -> object classes), from ALFRED."""
    import alfworld.gen.constants as constants

    holds = {r: frozenset(objs) for r, objs in constants.VAL_RECEPTACLE_OBJECTS.items()}
    props = {p: frozenset(objs) for p, objs in constants.VAL_ACTION_OBJECTS.items()}
    return holds, props


@functools.lru_cache(maxsize=1)
def _alfred_types() -> tuple[list[str], list[str]]:
    """All object classes (otype) and fixed receptacle classes (rtype), as ALFRED declares them."""
    import alfworld.gen.constants as constants

    rtypes = sorted(set(constants.RECEPTACLES) - set(constants.MOVABLE_RECEPTACLES))
    otypes = sorted(set(constants.OBJECTS) - set(rtypes))
    return otypes, rtypes


def receptacle_id(cls: str, number: int) -> str:
    """PDDL id the AlfredDemangler turns into "<class> <n>" (basins keep ALFRED's Sink|..|SinkBasin form)."""
    if cls == "SinkBasin":
        return f"Sink_bar_{number:02d}_bar_SinkBasin"
    if cls == "BathtubBasin":
        return f"Bathtub_bar_{number:02d}_bar_BathtubBasin"
    return f"{cls}_bar_{number:02d}"


def _sample_receptacles(room: Room, rng: random.Random) -> list[tuple[str, str]]:
    out = []
    for cls, low, high in room.receptacles:
        out += [(receptacle_id(cls, k + 1), cls) for k in range(rng.randint(low, high))]
    return out


def _task_pairs(task_type: str, room: Room, classes: set[str]) -> list[tuple[str, str]]:
    """(object class, destination class) pairs the room supports for a task type."""
    holds, props = _alfred_tables()
    needed = props[TASK_PROPERTY[task_type]] if task_type in TASK_PROPERTY else None
    excluded = TASK_EXCLUDED_PARENT.get(task_type)
    pairs = []
    for obj in room.objects:
        if needed is not None and obj not in needed:
            continue
        starts = {c for c in classes if obj in holds.get(c, ())}
        for parent in sorted(starts):
            # The object must be able to start somewhere other than its destination class.
            if parent != excluded and starts - {parent}:
                pairs.append((obj, parent))
    return pairs


def _place(cls: str, receptacles: list[tuple[str, str]], avoid: str, rng: random.Random) -> str | None:
    holds, _ = _alfred_tables()
    spots = [rid for rid, rcls in receptacles if cls in holds.get(rcls, ()) and rcls != avoid]
    return rng.choice(spots) if spots else None


def _task_desc(task_type: str, obj: str, parent: str, toggle: str, rng: random.Random) -> str:
    """One of goal_library's templates, filled as alfworld's ``get_templated_task_desc`` does."""
    import alfworld.gen.goal_library as glib

    template = rng.choice(glib.gdict[task_type]["templates"])
    return template.format(obj=obj.lower(), recep=parent.lower(), toggle=toggle.lower(), mrecep="")


def sample_scene(split: str, index: int, attempt: int = 0, seed: int = 0) -> Scene:
    """Draw task ``index`` of ``split`` (a pure function of its arguments; ``seed`` picks another set)."""
    suffix = f"/seed{seed}" if seed else ""
    rng = random.Random(f"agentopsd-alfworld/{GENERATOR_VERSION}/{split}/{index}/{attempt}{suffix}")
    task_type = TASK_TYPES[index % len(TASK_TYPES)]
    room = ROOMS[rng.choice(TASK_ROOMS[task_type])]
    receptacles = _sample_receptacles(room, rng)
    classes = {cls for _, cls in receptacles}
    objects: list[tuple[str, str]] = []  # (class, receptacle id)
    toggle, parent = "", ""
    if task_type == "look_at_obj_in_light":
        toggle = LAMP
        holders = [rid for rid, cls in receptacles if cls in LAMP_HOLDERS]
        objects.append((LAMP, rng.choice(holders)))
        obj = rng.choice(sorted(LOOK_OBJECTS & set(room.objects)))
    else:
        obj, parent = rng.choice(_task_pairs(task_type, room, classes))
    n_targets = rng.randint(2, 3) if task_type == "pick_two_obj_and_place" else rng.randint(1, 2)
    for _ in range(n_targets):
        spot = _place(obj, receptacles, avoid=parent, rng=rng)
        if spot is not None:
            objects.append((obj, spot))
    distractors = [c for c in room.objects if c != obj]
    for _ in range(rng.randint(6, 12)):
        cls = rng.choice(distractors)
        spot = _place(cls, receptacles, avoid="", rng=rng)
        if spot is not None:
            objects.append((cls, spot))
    counts: dict[str, int] = {}
    numbered = []
    for cls, spot in objects:
        counts[cls] = counts.get(cls, 0) + 1
        numbered.append((f"{cls}_bar_{counts[cls]:02d}", cls, spot))
    return Scene(
        task_id=f"agentopsd_{split}_{index:05d}" + (f"_seed{seed}" if seed else ""),
        task_type=task_type,
        room=room.name,
        object_target=obj,
        parent_target=parent,
        toggle_target=toggle,
        receptacles=tuple(sorted(receptacles)),
        objects=tuple(sorted(numbered)),
        task_desc=_task_desc(task_type, obj, parent, toggle, rng),
    )


def render_problem(scene: Scene) -> str:
    """The PDDL problem, in the layout of ALFWorld's generated problems."""
    import alfworld.gen.goal_library as glib

    holds, props = _alfred_tables()
    otypes, rtypes = _alfred_types()
    loc = {rid: f"loc_bar_{k + 1:02d}" for k, (rid, _) in enumerate(scene.receptacles)}
    present = sorted({cls for _, cls, _ in scene.objects})
    objects = ["agent1 - agent"] + [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in rtypes]
    objects += [f"{oid} - object" for oid, _, _ in scene.objects]
    objects += [f"{rid} - receptacle" for rid, _ in scene.receptacles]
    objects += ["loc_bar_00 - location"] + [f"{loc[rid]} - location" for rid, _ in scene.receptacles]
    init = [f"(receptacleType {rid} {cls}Type)" for rid, cls in scene.receptacles]
    init += [f"(objectType {oid} {cls}Type)" for oid, cls, _ in scene.objects]
    init += [
        f"(canContain {r}Type {o}Type)" for r in sorted({c for _, c in scene.receptacles}) for o in present
        if o in holds.get(r, ())
    ]
    init += [f"(pickupable {oid})" for oid, cls, _ in scene.objects if cls != LAMP]
    init += [f"(openable {rid})" for rid, cls in scene.receptacles if cls in OPENABLE]
    init.append("(atLocation agent1 loc_bar_00)")
    for prop, pred in (("Cleanable", "cleanable"), ("Heatable", "heatable"), ("Coolable", "coolable")):
        init += [f"({pred} {oid})" for oid, cls, _ in scene.objects if cls in props[prop]]
    init += [f"(toggleable {oid})" for oid, cls, _ in scene.objects if cls == LAMP]
    init += [f"(inReceptacle {oid} {rid})" for oid, _, rid in scene.objects]
    init += [f"(objectAtLocation {oid} {loc[rid]})" for oid, _, rid in scene.objects]
    init += [f"(receptacleAtLocation {rid} {loc[rid]})" for rid, _ in scene.receptacles]
    goal = glib.gdict[scene.task_type]["pddl"].format(
        obj=scene.object_target, recep=scene.parent_target, toggle=scene.toggle_target, mrecep=""
    )
    lines = [f"(define (problem plan_{scene.task_id})", "(:domain alfred)", "(:objects"]
    lines += [f"    {o}" for o in objects] + ["    )", "(:init"] + [f"    {f}" for f in init] + ["    )"]
    # goal_library writes '#' for PDDL's '-' and closes the (define ...) itself.
    return "\n".join(lines) + "\n" + goal.replace("#", "-").strip() + "\n"


def traj_data(scene: Scene, split: str, index: int, attempt: int, seed: int, expert_plan: list[str]) -> dict:
    return {
        "task_id": scene.task_id,
        "task_type": scene.task_type,
        "pddl_params": {
            "object_target": scene.object_target,
            "parent_target": scene.parent_target,
            "toggle_target": scene.toggle_target,
            "mrecep_target": "",
            "object_sliced": False,
        },
        "scene": {"room": scene.room},
        "turk_annotations": {"anns": [{"task_desc": scene.task_desc}]},
        "agentopsd": {
            "generator": GENERATOR_VERSION,
            "split": split,
            "index": index,
            "scene_seed": seed,
            "attempt": attempt,
            "expert_plan": expert_plan,
            "expert_steps": len(expert_plan),
        },
    }


def game_data(scene: Scene) -> dict:
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    domain = Path(ALFRED_PDDL_PATH).read_text()
    # What alfworld's add_task_to_grammar does, with the sentence already drawn by our rng.
    grammar = Path(ALFRED_TWL2_PATH).read_text().replace("UNKNOWN GOAL", scene.task_desc)
    return {"pddl_domain": domain, "grammar": grammar, "pddl_problem": render_problem(scene), "solvable": True}


def _dump(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Versioned cache folder: ``cache_dir`` or $AGENTOPSD_ALFWORLD_CACHE or ~/.cache/agentopsd/alfworld."""
    base = cache_dir or os.environ.get(CACHE_ENV) or "~/.cache/agentopsd/alfworld"
    return Path(base).expanduser() / f"{GENERATOR_VERSION}-alfworld{metadata.version('alfworld')}"


def task_dir(root: Path, split: str, index: int, seed: int = 0) -> Path:
    folder = split if seed == 0 else f"{split}-seed{seed}"
    return root / folder / f"{index:05d}-{TASK_TYPES[index % len(TASK_TYPES)]}"


def ensure_task(root: Path, split: str, index: int, verify: Verifier, seed: int = 0) -> Path:
    """The game directory of task ``index``, generated (and expert-verified) on first use."""
    if split not in SIZES:
        raise ValueError(f"unknown split {split!r}: choose one of {sorted(SIZES)}")
    final = task_dir(root, split, index, seed)
    if (final / GAME_FILE).is_file() and (final / TRAJ_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(MAX_ATTEMPTS):
        scene = sample_scene(split, index, attempt, seed)
        # Written aside and renamed into place, so concurrent workers never see half a game.
        with tempfile.TemporaryDirectory(dir=final.parent, prefix=".tmp-") as tmp:
            work = Path(tmp) / "game"
            work.mkdir()
            _dump(work / GAME_FILE, game_data(scene))
            _dump(work / TRAJ_FILE, traj_data(scene, split, index, attempt, seed, []))
            plan = verify(work / GAME_FILE)
            if plan is None:
                continue
            _dump(work / TRAJ_FILE, traj_data(scene, split, index, attempt, seed, plan))
            try:
                os.rename(work, final)
            except OSError:
                if not (final / GAME_FILE).is_file():  # not another worker's finished copy
                    raise
            return final
    raise RuntimeError(f"no expert-solvable scene for {split} task {index} in {MAX_ATTEMPTS} attempts")

