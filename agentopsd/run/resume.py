"""A resume never rewrites a run: it continues the run as it was made, and records its own config beside the first.

``ckpt_path=last`` (or a checkpoint inside a run folder) continues a run. Hydra would compose the command
line's config and write it over the run's ``.hydra/config.yaml``: a resume that swapped the algorithm
would train the checkpoint with another algorithm and erase the record of how the run was made. So,
before Hydra writes anything (:class:`ResumeCallback`, a Hydra callback of the root config):

- the composed config is compared with the run's recorded one (the latest record, see :func:`recorded_config`);
  a difference outside :data:`RESUMABLE_KEYS` is refused in one line naming the keys, exit 2, unless
  ``resume_force=true``;
- a resume in place records its config in ``.hydra/resume-<n>/`` (``config.yaml``, ``overrides.yaml``,
  ``hydra.yaml``): ``.hydra/config.yaml`` stays the first launch's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from agentopsd.run.validation import ConfigError

RESUMABLE_KEYS: tuple[str, ...] = (
    # how much to train: a finished run trains on to a larger total (runs.reopen_finished_epoch)
    "num_iterations",
    "trainer.max_steps",
    # where the run is and how it is resumed, not what it does
    "ckpt_path",
    "resume_force",
    "runs_dir",
    "output_dir",
    "memory_plan_only",
    # logging: what is written about the run, not what it trains
    "logger",
    "rollout_log",
    "report",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.log_every_n_steps",
    # evaluation and checkpoint cadence: when, not what (evaluation.num_tasks, the list measured, stays)
    "evaluation.every_n_iterations",
    "evaluation.before_training",
    "evaluation.at_end",
    "checkpoint.every_n_iterations",
    "checkpoint.keep_policies",
)
"""The keys a resume may change (and their sub-keys). Everything else (the algorithm, the environment, the
model, the data, the optimizer, the seed, ...) is what the checkpoint was trained with; changing it needs
``resume_force=true``."""

RECORD_PREFIX = "resume-"
SHOWN = 4
"""How many differing keys the refusal names with their values (the rest are counted)."""


def recorded_config(run_dir: str | Path) -> Path:
    """The run's latest config record: ``.hydra/resume-<n>/config.yaml`` of its last resume, else the first launch's
    ``.hydra/config.yaml``. What a resume compares with, and what evaluation and export read."""
    hydra_dir = Path(run_dir) / ".hydra"
    resumes = [(n, p) for p in hydra_dir.glob(f"{RECORD_PREFIX}*/config.yaml") if (n := _record_number(p.parent.name))]
    return max(resumes)[1] if resumes else hydra_dir / "config.yaml"


MOVED_MODULES = {
    "agentopsd.algorithms": "agentopsd.credit.algorithms",
    "agentopsd.models": "agentopsd.models.loading",
    "agentopsd.tiny": "agentopsd.models.tiny",
    "agentopsd.distributed": "agentopsd.training.distributed",
    "agentopsd.strategies": "agentopsd.training.strategies",
    "agentopsd.resume": "agentopsd.run.resume",
    "agentopsd.runs": "agentopsd.run.folders",
}
"""Modules that moved since a run's config could have been recorded, old -> new: a recorded ``_target_`` naming
the old one is read as the new one, so a run made before the move still resumes, evaluates and exports."""


def current_targets(node: Any) -> Any:
    """A recorded config (plain containers) with every ``_target_`` in a moved module (:data:`MOVED_MODULES`)
    renamed to where it lives now; everything else as recorded."""
    if isinstance(node, dict):
        out = {key: current_targets(value) for key, value in node.items()}
        target = out.get("_target_")
        if isinstance(target, str):
            module, _, name = target.rpartition(".")
            out["_target_"] = f"{MOVED_MODULES[module]}.{name}" if module in MOVED_MODULES else target
        return out
    if isinstance(node, list):
        return [current_targets(value) for value in node]
    return node


def load_recorded(run_dir: str | Path) -> Any:
    """The run's latest config record (:func:`recorded_config`) as a DictConfig, unresolved, its targets current."""
    from omegaconf import OmegaConf

    return OmegaConf.create(current_targets(OmegaConf.to_container(OmegaConf.load(recorded_config(run_dir)), resolve=False)))


def _record_number(name: str) -> int:
    suffix = name.removeprefix(RECORD_PREFIX)
    return int(suffix) if suffix.isdigit() else 0


def next_record(run_dir: str | Path) -> str:
    """The ``hydra.output_subdir`` of this resume's record, relative to the run: ``.hydra/resume-<n>``."""
    taken = [_record_number(p.name) for p in (Path(run_dir) / ".hydra").glob(f"{RECORD_PREFIX}*")]
    return f".hydra/{RECORD_PREFIX}{max(taken, default=0) + 1}"


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}``; a list is one leaf (the loggers: compared whole)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: node}
    return {prefix[:-1]: node}


def _resumable(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in RESUMABLE_KEYS)


def config_differences(recorded: dict[str, Any], composed: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (recorded value, composed value)}`` for every key outside :data:`RESUMABLE_KEYS` that differs.
    Both are compared unresolved (``${seed}`` stays ``${seed}``), so each difference is named where it is set."""
    missing = object()
    old, new = _flatten(recorded), _flatten(composed)
    return {
        key: (old.get(key, missing), new.get(key, missing))
        for key in sorted(old.keys() | new.keys())
        if not _resumable(key) and old.get(key, missing) != new.get(key, missing)
    }


def _show(value: Any) -> str:
    if type(value) is object:  # the sentinel of a key one side lacks
        return "(absent)"
    return value or "''" if isinstance(value, str) else str(value)


def group_changes(recorded_choices: dict[str, Any], composed_choices: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{group: (recorded option, composed option)}`` for the config groups (``algorithm``, ``env``, ...) whose
    option differs: one entry says more than the dozen keys a swapped group changes."""
    return {g: (recorded_choices[g], composed_choices[g]) for g in sorted(recorded_choices.keys() & composed_choices.keys())
            if not g.startswith("hydra/") and recorded_choices[g] != composed_choices[g]}


def refusal(run_dir: Path, ckpt_path: str, differences: dict[str, tuple[Any, Any]],
            groups: dict[str, tuple[Any, Any]] | None = None) -> str:
    """The one line a refused resume prints: the swapped groups, then the other keys that differ."""
    groups = groups or {}
    named = [f"{g}={_show(a)} -> {g}={_show(b)}" for g, (a, b) in groups.items()]
    named += [f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in differences.items() if k.split(".")[0] not in groups]
    shown = "; ".join(named[:SHOWN]) + (f" (and {len(named) - SHOWN} more)" if len(named) > SHOWN else "")
    return (f"ckpt_path={ckpt_path} resumes {run_dir}, which was made with another config ({shown}); a resume may change "
            "only num_iterations, logging and the evaluation and checkpoint cadence: resume with the run's settings, drop "
            "ckpt_path to start a new run, or add resume_force=true to resume anyway (its config is recorded beside the run's)")


def checkpoint_run(cfg: DictConfig, output_dir: Path) -> Path | None:
    """The run folder ``ckpt_path`` continues: ``output_dir`` itself for ``last`` (or a path inside it), the run
    holding a checkpoint given by path, or None (no resume, or a checkpoint outside any run folder)."""
    ckpt = cfg.get("ckpt_path")
    if not ckpt:
        return None
    if ckpt == "last":
        return output_dir if (output_dir / ".hydra" / "config.yaml").is_file() else None
    for candidate in (Path(ckpt).resolve(), *Path(ckpt).resolve().parents):
        if (candidate / ".hydra" / "config.yaml").is_file():
            return candidate
    return None


def recorded_choices(record: Path) -> dict[str, Any]:
    """The group options of a record (its ``hydra.yaml``: ``hydra.runtime.choices``), empty when it has none."""
    hydra_yaml = record.with_name("hydra.yaml")
    if not hydra_yaml.is_file():
        return {}
    choices = OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.runtime.choices", default=None)
    return dict(OmegaConf.to_container(choices, resolve=False)) if choices is not None else {}


def _global_rank() -> int:
    """This process's rank before any process group exists (torchrun and SLURM set it in the environment)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)


def check_resume(config: DictConfig) -> None:
    """Refuse a resume that changes the run (:class:`ConfigError`), and point a resume in place at a record of its
    own (``hydra.output_subdir``). ``config`` is Hydra's full config (``hydra`` node included), not yet written."""
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(config)  # the run's name (${hydra:runtime.choices.experiment}) resolves
    output_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).resolve()
    run = checkpoint_run(config, output_dir)
    if run is None:
        return
    composed = OmegaConf.to_container(config, resolve=False)
    composed.pop("hydra", None)
    recorded = current_targets(OmegaConf.to_container(OmegaConf.load(recorded_config(run)), resolve=False))
    differences = config_differences(recorded, composed)
    if differences and not config.get("resume_force", False):
        groups = group_changes(recorded_choices(recorded_config(run)), dict(config.hydra.runtime.choices))
        raise ConfigError(refusal(run, str(config.ckpt_path), differences, groups))
    if run != output_dir or config.hydra.output_subdir is None:
        return  # a new folder for this run (a checkpoint given by path), or a process that records nothing
    with read_write(config.hydra), open_dict(config.hydra):
        # rank 0 records; the other processes of a launch would race it for the next number
        config.hydra.output_subdir = next_record(run) if _global_rank() == 0 else None
    if differences and _global_rank() == 0:
        print(f"warning: resume_force=true: resuming {run} with another config ({', '.join(differences)}); "
              f"recorded in {run / str(config.hydra.output_subdir)}", file=sys.stderr)


class ResumeCallback(Callback):
    """Hydra callback (``hydra.callbacks`` in the root config): :func:`check_resume` before Hydra writes the config."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_resume(config)
        except ConfigError as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {err}", file=sys.stderr)  # one line, as every bad configuration
            sys.exit(2)
