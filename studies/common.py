"""What the study drivers share: reading a run's logs back, seeds from the command line, the code a study trains
(the committed tree, unpacked once), its runs.csv typed back, and a least-squares slope.

The drivers (``studies/*.py``) make ``results/``: each runs ``train.py`` many times and writes tables. They are not
part of the installed package; ``python studies/<driver>.py --help`` says what each does.
"""

from __future__ import annotations

import csv
import shutil
import statistics
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def log_rows(run_dir: Path) -> list[dict[str, float]]:
    """Every row of the run's CSV logs, oldest version first (a resumed run adds a version)."""
    rows: list[dict[str, float]] = []
    paths = sorted((run_dir / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    for path in paths:
        with path.open() as f:
            rows += [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]
    return rows


def evaluations(rows: list[dict[str, float]]) -> dict[int, float]:
    """iteration -> greedy evaluation success; a later log's value wins (a resumed run re-evaluates)."""
    return {int(r["eval/iteration"]): r["eval/success"] for r in rows if "eval/success" in r and "eval/iteration" in r}


def parse_seeds(specs: list[str]) -> list[int]:
    """``0-9`` and ``3 5 7`` both work."""
    seeds: list[int] = []
    for spec in specs:
        lo, _, hi = spec.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SystemExit(f"--seeds: {spec!r} is neither a seed nor a range like 0-9")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return list(dict.fromkeys(seeds))


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def export_code(commit: str, dest_root: Path) -> Path:
    """The committed tree at ``commit``, unpacked once: the runs train that code, whatever the working tree does meanwhile."""
    dest = dest_root / commit[:12]
    if not (dest / "train.py").exists():
        tmp = dest.with_name(dest.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, capture_output=True, check=True).stdout
        tar_path = tmp / "src.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp, filter="data")
        tar_path.unlink()
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def read_runs_csv(path: Path, *, text: Callable[[str], bool], ints: tuple[str, ...], empty: float | None = None) -> list[dict]:
    """The rows of a runs.csv typed back (this script's and the ladder's): the columns ``text`` accepts as written,
    ``ints`` as ints, every other as a float; an empty cell is left out, or set to ``empty`` when given."""
    if not path.exists():
        return []
    rows = []
    with path.open() as f:
        for raw in csv.DictReader(f):
            row: dict = {}
            for key, value in raw.items():
                if text(key):
                    row[key] = value
                elif value in ("", None):
                    if empty is not None:
                        row[key] = empty
                else:
                    row[key] = int(float(value)) if key in ints else float(value)
            rows.append(row)
    return rows


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs (NaN with fewer than two distinct xs)."""
    if len(set(xs)) < 2:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
