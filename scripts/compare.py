"""Compare algorithms across a horizon ladder: GRPO, AgentOPSD, its ablations and RLSD.

    python scripts/compare.py                                  # the full grid (hours on a 2-core CPU)
    python scripts/compare.py --levels GoToLocal PickupLoc --seeds 0 --iterations 10   # a reduced grid

Every run is ``train.py experiment=quickstart`` with the level, algorithm and seed swapped; runs
of one (level, seed) share the same warm start (the cached supervised weights) and see the same
number of trajectories. Writes ``results/``: ``runs.csv`` (one row per run), ``table.md`` (mean and
spread of the evaluation success after RL per method and level) and ``horizon.png`` (success
against the expert's path length with a fitted slope per method: points lost per extra turn).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["grpo", "agentopsd", "agentopsd_token", "agentopsd_raw_gap", "agentopsd_magnitude", "agentopsd_no_prior", "rlsd"]
LEVELS = {"GoToLocal": 12, "PickupLoc": 16, "PutNextLocal": 24, "UnlockPickup": 30}  # level -> turn limit (>= the expert's eval maximum)


def last_eval(run_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """The first and last evaluation rows of a run's CSV log."""
    rows = []
    for path in sorted((run_dir / "csv").glob("version_*/metrics.csv")):
        with path.open() as f:
            rows += [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]
    evals = [r for r in rows if "eval/success" in r]
    return evals[0], evals[-1]


def run_one(level: str, method: str, seed: int, iterations: int, out: Path, warm: Path) -> dict:
    run_dir = out / "runs" / f"{level}-{method}-s{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    (run_dir / "warm_start").mkdir(parents=True)
    for cached in warm.glob("*"):  # the shared warm start of this (level, seed)
        shutil.copy(cached, run_dir / "warm_start" / cached.name)
    cmd = [sys.executable, "train.py", "experiment=quickstart", f"env.id=agentopsd/BabyAI-{level}-v0", f"env.max_turns={LEVELS[level]}",
           f"algorithm={method}", f"seed={seed}", f"num_iterations={iterations}", f"output_dir={run_dir}",
           "trainer.enable_progress_bar=false", "report=false"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    for made in (run_dir / "warm_start").glob("*"):  # the first run of a (level, seed) made it
        if not (warm / made.name).exists():
            shutil.copy(made, warm / made.name)
    before, after = last_eval(run_dir)
    row = {"level": level, "method": method, "seed": seed, "iterations": iterations,
           "success_before": before["eval/success"], "success_after": after["eval/success"],
           "expert_steps_mean": None}
    row.update({k.replace("eval/success/horizon/", "horizon_"): v for k, v in after.items() if k.startswith("eval/success/horizon/")})
    return row


def write_results(rows: list[dict], out: Path) -> None:
    keys = sorted({k for r in rows for k in r}, key=lambda k: (not k.startswith(("level", "method", "seed")), k))
    with (out / "runs.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    levels = list(dict.fromkeys(r["level"] for r in rows))
    lines = ["| method | " + " | ".join(levels) + " | slope (points per extra turn) |", "|---" * (len(levels) + 2) + "|"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        cells, xs, ys = [], [], []
        for level in levels:
            vals = [r["success_after"] for r in rows if r["method"] == method and r["level"] == level]
            spread = statistics.pstdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{100 * statistics.mean(vals):.1f} ± {100 * spread:.1f} (n={len(vals)})" if vals else "")
            if vals:
                xs.append(LEVELS[level] / 2)  # about the expert's mean path length of the level's eval list
                ys.append(100 * statistics.mean(vals))
        slope = _slope(xs, ys)
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {slope:+.2f} |")
        ax.plot(xs, ys, "o-", label=f"{method} ({slope:+.2f}/turn)")
    ax.set(xlabel="horizon (about the expert's mean path length, turns)", ylabel="eval success after RL (%)", title="Success against horizon")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "horizon.png", dpi=110)
    (out / "table.md").write_text("\n".join(lines) + "\n")


def _slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", nargs="+", default=list(LEVELS), choices=list(LEVELS))
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for level in args.levels:
        for seed in args.seeds:
            warm = args.out / "warm" / f"{level}-s{seed}"
            warm.mkdir(parents=True, exist_ok=True)
            for method in args.methods:
                rows.append(run_one(level, method, seed, args.iterations, args.out, warm))
                print(rows[-1], flush=True)
                write_results(rows, args.out)


if __name__ == "__main__":
    main()
