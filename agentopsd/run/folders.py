"""Run folders and composition checks: what a command line asks for is what a run does.

Every run writes into its own folder, ``runs/<name>/<YYYY-MM-DD_HH-MM-SS>/`` (Hydra's
convention), and ``runs/<name>/latest`` points at the newest one; ``ckpt_path=last`` resumes
that run, in that run's folder. A run that fails before it wrote anything leaves no folder.

An experiment picks an option of each config group and may set a few keys of those groups on
top. ``env=webshop`` on the command line swaps the option but would keep the experiment's keys
(a BabyAI ``env.id`` on a WebShop config): :func:`check_group_swaps` refuses that mix in one line.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from agentopsd.run.validation import ConfigError

STAMP = "%Y-%m-%d_%H-%M-%S"
LATEST = "latest"
SWAPPABLE = ("env", "model", "algorithm", "rollout", "trainer", "logger")
"""The config groups a command line may swap (``env=webshop``)."""


def _launch_id() -> str | None:
    """One folder name for every process of a distributed launch: each process composes its config
    itself, and timestamps taken a second apart would split one run over two folders."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("MASTER_PORT"):
        # torchrun without --rdzv-id: the rendezvous address is all the processes share
        return f"torchrun-{os.environ.get('MASTER_ADDR', 'localhost')}-{os.environ['MASTER_PORT']}"
    return None


def latest_run(runs_dir: str | Path) -> Path | None:
    """The folder ``runs_dir/latest`` points at, else the newest timestamped folder, else None.

    A ``runs_dir`` laid out before runs had folders of their own (``checkpoints/`` right in it)
    counts as its own latest run, so ``ckpt_path=last`` still resumes it.
    """
    root = Path(runs_dir)
    pointer = root / LATEST
    if pointer.is_symlink() or pointer.is_dir():
        target = pointer.resolve()
        if target.is_dir():
            return target
    elif pointer.is_file():  # where symlinks are not allowed the pointer is a file holding the folder's name
        target = root / pointer.read_text().strip()
        if target.is_dir():
            return target
    runs = sorted(p for p in root.glob("*") if p.is_dir() and not p.is_symlink() and (p / ".hydra").is_dir())
    if runs:
        return runs[-1]
    return root if (root / "checkpoints").is_dir() else None


def new_run(runs_dir: str | Path, now: float | None = None) -> Path:
    """``runs_dir/<timestamp>`` (not created): ``_1``, ``_2``... when a run of the same second exists."""
    root = Path(runs_dir)
    name = _launch_id() or time.strftime(STAMP, time.localtime(now))
    path, n = root / name, 0
    while path.exists() and not _launch_id():
        n += 1
        path = root / f"{name}_{n}"
    return path


def run_dir(runs_dir: str, ckpt_path: str | None = None) -> str:
    """The ``output_dir`` of a run: the latest run of this name when resuming it (``ckpt_path=last``),
    else a new timestamped folder. Registered as the ``run_dir`` resolver of the config."""
    if ckpt_path == "last":
        found = latest_run(runs_dir)
        if found is not None:
            return str(found)
    return str(new_run(runs_dir))


def register_resolvers() -> None:
    # cached: the config resolves output_dir several times, and every time must give the same folder
    OmegaConf.register_new_resolver("run_dir", run_dir, use_cache=True, replace=True)


def mark_latest(run: Path) -> None:
    """Point ``<run's parent>/latest`` at ``run``, atomically (a symlink renamed into place)."""
    pointer = run.parent / LATEST
    if pointer.exists() and not pointer.is_symlink() and pointer.is_dir():
        return  # a real folder of that name is the user's; leave it alone
    tmp = run.parent / f".{LATEST}.tmp{os.getpid()}"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(run.name, target_is_directory=True)
    except OSError:  # no symlinks on this file system
        tmp.write_text(run.name + "\n")
    os.replace(tmp, pointer)


def remove_if_unused(run: Path) -> bool:
    """Remove ``run`` when it holds nothing but what Hydra writes at start-up (``.hydra/``, the log).

    A run that failed before any work leaves no folder behind. Returns whether it was removed.
    """
    if not run.is_dir() or run.is_symlink():
        return False
    if any(p.name != ".hydra" and p.suffix != ".log" for p in run.iterdir()):
        return False
    shutil.rmtree(run, ignore_errors=True)
    for parent in (run.parent,):  # runs/<name>/ itself, when this was its only run
        pointer = parent / LATEST
        if pointer.is_symlink() and not pointer.exists():
            pointer.unlink()
        try:
            parent.rmdir()
        except OSError:
            pass  # not empty: other runs live there
    return True


class RunFolderCallback(Callback):
    """Hydra callback (``hydra.callbacks`` in the root config): a run that failed before it wrote
    anything (a bad value, a missing checkpoint) leaves no folder behind."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: object) -> None:
        if job_return.status != JobStatus.COMPLETED:
            remove_if_unused(Path(config.hydra.runtime.output_dir))


# ------------------------------------------------------------------ noise

# Printed by every run and none of it actionable here: Lightning's advertisement for its cloud logger;
# its note on every checkpoint save (ours hold plain types only and load with weights_only=True); its
# note that our module overrides on_after_batch_transfer (the rollout hook, on purpose) while data
# comes from a DataModule; its note that modules sit in eval mode (the frozen reference policy);
# torch's deprecation inside Lightning's own _pytree helper.
_NOISY_LOGS = ("💡 Tip:", "`weights_only` was not set")
_NOISY_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)",
    r"You have overridden `on_after_batch_transfer`",
    r"Found \d+ module\(s\) in eval mode",
)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NOISY_LOGS)


def silence_known_noise() -> None:
    """Drop the warnings and notes above (call after lightning is imported); bm25s's DEBUG lines too."""
    for pattern in _NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lightning"):
            logging.getLogger(name).addFilter(_DropNoise())
    # bm25s sets its own logger to DEBUG when it is imported (later, by the SearchQA env): a filter outlives that
    logging.getLogger("bm25s").addFilter(lambda record: record.levelno >= logging.WARNING)


# ------------------------------------------------------------------ composition


def override_groups(overrides: list[str]) -> dict[str, str]:
    """``{group: option}`` for each swappable group the command line chose (``env=webshop``, ``+env=x``)."""
    chosen = {}
    for item in overrides:
        key, sep, value = item.lstrip("+~").partition("=")
        if sep and key in SWAPPABLE:
            chosen[key] = value
    return chosen


def pinned_keys(experiment_yaml: Path) -> dict[str, list[str]]:
    """The keys an experiment file sets inside each swappable group, ``{"env": ["max_turns"], ...}``."""
    body = OmegaConf.to_container(OmegaConf.load(experiment_yaml), resolve=False)
    if not isinstance(body, dict):
        return {}
    return {g: sorted(body[g]) if isinstance(body[g], dict) else [] for g in SWAPPABLE if g in body}


def experiments_choosing(group: str, option: str, conf_dir: Path) -> list[str]:
    """The experiments whose defaults pick ``group=option`` (``- override /env: webshop``)."""
    found = []
    for path in sorted((conf_dir / "experiment").glob("*.yaml")):
        defaults = OmegaConf.load(path).get("defaults") or []
        if any(isinstance(d, DictConfig) and d.get(f"override /{group}") == option for d in defaults):
            found.append(path.stem)
    return found


def check_group_swaps(experiment: str | None, overrides: list[str], conf_dir: Path) -> None:
    """Fail in one line when a swapped group would be mixed with values the experiment sets for it."""
    if not experiment:
        return
    path = conf_dir / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        return
    pinned = pinned_keys(path)
    for group, option in override_groups(overrides).items():
        if group in pinned:
            keys = ", ".join(f"{group}.{k}" for k in pinned[group]) or group
            others = [e for e in experiments_choosing(group, option, conf_dir) if e != experiment]
            instead = f", or an experiment made for it ({', '.join(f'experiment={e}' for e in others)})" if others else ""
            raise ConfigError(
                f"{group}={option}: experiment={experiment} pins {group} ({keys}), which would be mixed into {group}={option}; "
                f"add experiment=none to get {group}={option} as it is{instead}, or set those keys (e.g. {group}.<key>=...) instead of swapping"
            )


def warm_start_dir(output_dir: Path, runs_dir: Path) -> Path:
    """Where the warm start caches its demonstrations and weights: shared by the runs of one name
    (``runs/<name>/warm_start``), or inside an ``output_dir`` given outside ``runs_dir``."""
    return runs_dir / "warm_start" if output_dir.parent.resolve() == runs_dir.resolve() else output_dir / "warm_start"


def reopen_finished_epoch(checkpoint: dict, done: int, planned: int) -> bool:
    """Let a finished run train on to a larger ``num_iterations`` when resumed (``ckpt_path=last``).

    A run is one Lightning epoch of ``num_iterations`` batches. Its last checkpoint is written at the
    last batch's end, after the task stream ran out, so Lightning's loop state says "last batch"
    and a resume would close the epoch and stop at ``max_epochs=1``, training nothing. When the
    checkpoint holds fewer iterations than now planned, clearing that flag makes the checkpoint read
    like one cut short at that iteration: the stream (restored at its position, len now ``planned``)
    yields the same tasks a run planned that long from the start would have. The learning-rate
    schedule is rebuilt for the new total at the restored step (as Hugging Face's and torchtune's
    resumes do): a cosine decay that had reached its end resumes from where the longer plan puts that step.
    Returns whether the checkpoint was changed (in place, before Lightning restores its loops).
    """
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not progress or not progress.get("is_last_batch") or done >= planned:
        return False
    progress["is_last_batch"] = False
    logging.getLogger(__name__).info(
        "resuming a finished run of %d iterations to num_iterations=%d: same task stream, learning-rate schedule "
        "rebuilt for %d iterations", done, planned, planned)
    return True


# ------------------------------------------------------------------ the closing summary


def _plural(n: int) -> str:
    return f"{n} iteration" + ("" if n == 1 else "s")


def summary(history: list[dict[str, float]], trained: int, done: int, planned: int) -> str:
    """The run's last lines, numbered by completed iterations like every log, CSV row and figure.

    ``history``: the evaluations (``eval/success``, ``eval/iteration`` = iterations completed, 0
    before RL); ``trained``: iterations this process trained; ``done``: iterations completed in all
    (a resumed run counts the checkpoint's); ``planned``: ``num_iterations``.
    """
    lines = []
    if trained == 0:
        lines.append(f"nothing trained: the run had already completed {_plural(done)} of {planned} (num_iterations)")
    elif trained < done:
        lines.append(f"trained {_plural(trained)} ({done - trained + 1}-{done}), resumed after {done - trained}")
    if done < planned and trained:
        lines.append(f"stopped after {_plural(done)} of {planned} (trainer.max_steps or a limit)")
    if history:
        before = next((h for h in history if h.get("eval/iteration", -1) == 0), None)
        last = history[-1]
        after = f"{last['eval/success']:.1%} after {_plural(int(last.get('eval/iteration', done)))}"
        if before is not None and last is not before:
            lines.append(f"eval success: {before['eval/success']:.1%} before RL -> {after}")
        elif before is not None:
            lines.append(f"eval success: {before['eval/success']:.1%} before RL (no evaluation after it)")
        else:
            lines.append(f"eval success: {after} (no evaluation before RL: evaluation.before_training=false)")
    return "\n".join(lines)
