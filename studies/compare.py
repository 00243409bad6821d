"""Compare algorithms across a horizon ladder: GRPO, AgentOPSD, its ablations and RLSD.

    python studies/compare.py --jobs 2                         # the full grid
    python studies/compare.py --levels PickupObjS5 --seeds 0 --iterations 10   # a reduced grid

Every run is ``train.py experiment=quickstart`` with the level, algorithm and seed swapped; runs
of one (level, seed) share the same warm start (the cached supervised weights, made once before
the runs that use it) and see the same number of trajectories. The ladder is the quickstart's
task (find the one object in a room and pick it up) in rooms of growing size: longer paths
before the same decisive last turn. ``--jobs N`` runs N trainings at once, one thread each. Writes ``results/``: ``runs.csv`` (one row per run), ``table.md`` (mean and
spread of the evaluation success after RL per method and level) and ``horizon.png`` (success
against the expert's path length with a fitted slope per method: points lost per extra turn).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: studies/ is a package under the repository root
    sys.path.insert(0, str(ROOT))

from studies.common import log_rows, slope  # noqa: E402

METHODS = ["grpo", "agentopsd", "agentopsd_token", "agentopsd_raw_gap", "agentopsd_magnitude", "agentopsd_no_prior", "rlsd"]
# level -> turn limit: >= the expert's longest path on the eval list (6, 11 and 25 turns)
LEVELS = {"PickupObjS5": 8, "PickupObj": 12, "PickupObjS12": 26}



def last_eval(run_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """The first and last evaluation rows of a run's CSV log."""
    evals = [r for r in log_rows(run_dir) if "eval/success" in r]
    return evals[0], evals[-1]


CREDIT_STATS = ["credit/mean_abs_revision", "credit/frac_at_band_edge", "credit/evidence_mean", "credit/evidence_std",
                "credit/evidence_outcome_corr", "credit/multiplier_std"]


def training_stats(run_dir: Path) -> dict[str, float]:
    """Per-run means over the RL iterations: training success (temperature 1, the learning speed the
    final evaluation may hide once it saturates) and the credit statistics of methods that have them."""
    logged = log_rows(run_dir)
    out: dict[str, float] = {}
    for key, name in [("rollout/success", "train_success_mean"), *[(k, k.replace("credit/", "credit_")) for k in CREDIT_STATS]]:
        vals = [r[key] for r in logged if key in r and r[key] == r[key]]  # NaN: no group with mixed outcomes
        if vals:
            out[name] = statistics.mean(vals)
    return out


def expert_path_mean(level: str, num_tasks: int = 100) -> float:
    """The expert's mean path length on the level's fixed evaluation list (the horizon axis)."""
    sys.path.insert(0, str(ROOT))
    from agentopsd.envs.babyai.env import BabyAIEnv

    env = BabyAIEnv(level, split="eval")
    return statistics.mean(env.reset(options={"task_index": k})[1]["expert_steps"] for k in range(num_tasks))


def _train(level: str, method: str, seed: int, iterations: int, run_dir: Path, extra: list[str]) -> None:
    cmd = [sys.executable, "train.py", "experiment=quickstart", f"env.id=agentopsd/BabyAI-{level}-v0", f"env.max_turns={LEVELS[level]}",
           f"algorithm={method}", f"seed={seed}", f"num_iterations={iterations}", f"output_dir={run_dir}",
           "trainer.enable_progress_bar=false", "report=false", *extra]
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def warm_start_once(level: str, seed: int, out: Path) -> Path:
    """Make the (level, seed) warm start once: a minimal run whose cached weights the others copy."""
    warm = out / "warm" / f"{level}-s{seed}"
    if not any(warm.glob("policy-*.pt")) or not (warm / "before.json").exists():
        run_dir = out / "runs" / f"{level}-warm-s{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)
        (run_dir / "warm_start").mkdir(parents=True)
        for cached in warm.glob("*"):  # weights made earlier are reused, only the evaluation runs
            shutil.copy(cached, run_dir / "warm_start" / cached.name)
        # one tiny iteration; the evaluation before it is the warm start's success, shared by every method
        _train(level, "grpo", seed, 1, run_dir, ["data.tasks_per_batch=1", "data.group_size=2"])
        warm.mkdir(parents=True, exist_ok=True)
        for made in (run_dir / "warm_start").glob("*"):
            shutil.copy(made, warm / made.name)
        before, _ = last_eval(run_dir)
        (warm / "before.json").write_text(json.dumps(before))
    return warm


def run_one(level: str, method: str, seed: int, iterations: int, out: Path, warm: Path) -> dict:
    run_dir = out / "runs" / f"{level}-{method}-s{seed}"
    done = run_dir / "finished"
    # a run finished in an earlier invocation with the same budget is read back: a grid cut short
    # resumes where it stopped; a different --iterations trains again rather than mixing budgets
    if not done.exists() or int(done.read_text()) != iterations:
        shutil.rmtree(run_dir, ignore_errors=True)
        (run_dir / "warm_start").mkdir(parents=True)
        for cached in warm.glob("*"):  # the shared warm start of this (level, seed)
            shutil.copy(cached, run_dir / "warm_start" / cached.name)
        # evaluated once after RL only: the warm start's evaluation is shared (warm/before.json)
        _train(level, method, seed, iterations, run_dir, ["evaluation.before_training=false", "evaluation.every_n_iterations=0"])
        done.write_text(f"{iterations}\n")
    _, after = last_eval(run_dir)
    before = json.loads((warm / "before.json").read_text())
    row = {"level": level, "method": method, "seed": seed, "iterations": iterations,
           "success_before": before["eval/success"], "success_after": after["eval/success"],
           "expert_steps_mean": HORIZON[level]}
    row.update({k.replace("eval/success/horizon/", "horizon_"): v for k, v in after.items() if k.startswith("eval/success/horizon/")})
    row.update(training_stats(run_dir))
    return row


HORIZON: dict[str, float] = {}
"""level -> the expert's mean path length on its eval list (filled in by main)."""


def write_results(rows: list[dict], out: Path) -> None:
    keys = sorted({k for r in rows for k in r}, key=lambda k: (not k.startswith(("level", "method", "seed")), k))
    with (out / "runs.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    levels = sorted(dict.fromkeys(r["level"] for r in rows), key=lambda lv: HORIZON.get(lv, 0.0))
    lines = ["| method | " + " | ".join(levels) + " | slope (points per extra turn) |", "|---" * (len(levels) + 2) + "|"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for m_index, method in enumerate(methods):
        cells, xs, ys, errs = [], [], [], []
        for level in levels:
            vals = [r["success_after"] for r in rows if r["method"] == method and r["level"] == level]
            spread = statistics.pstdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{100 * statistics.mean(vals):.1f} ± {100 * spread:.1f} (n={len(vals)})" if vals else "")
            if vals:
                xs.append(HORIZON[level])
                ys.append(100 * statistics.mean(vals))
                errs.append(100 * spread)
        fitted = slope(xs, ys)
        slope_text = f"{fitted:+.2f}" if fitted == fitted else "n/a"  # NaN: fewer than two levels
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {slope_text} |")
        # spread over seeds as error bars; methods nudged apart on x so their bars stay readable
        nudge = 0.06 * (m_index - (len(methods) - 1) / 2)
        ax.errorbar([x + nudge for x in xs], ys, yerr=errs, fmt="o-", capsize=3, label=f"{method} ({slope_text}/turn)")
    ax.set(xlabel="horizon (the expert's mean path length on the eval list, turns)", ylabel="eval success after RL (%)", title="Success against horizon (mean and spread over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "horizon.png", dpi=110)
    lines += ["", "Training success (temperature 1), mean over the RL iterations: how fast each method learns.", "",
              "| method | " + " | ".join(levels) + " |", "|---" * (len(levels) + 1) + "|"]
    for method in dict.fromkeys(r["method"] for r in rows):
        cells = []
        for level in levels:
            vals = [r["train_success_mean"] for r in rows if r["method"] == method and r["level"] == level and "train_success_mean" in r]
            cells.append(f"{100 * statistics.mean(vals):.1f} ± {100 * (statistics.pstdev(vals) if len(vals) > 1 else 0.0):.1f}" if vals else "")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    credit_rows = [r for r in rows if any(k.startswith("credit_") for k in r)]
    if credit_rows:
        names = [k.replace("credit/", "credit_") for k in CREDIT_STATS]
        lines += ["", "Credit statistics, mean over every run and iteration of a method (the `credit/` metrics).", "",
                  "| method | level | " + " | ".join(n.removeprefix("credit_") for n in names) + " |", "|---" * (len(names) + 2) + "|"]
        for method in dict.fromkeys(r["method"] for r in credit_rows):
            for level in levels:
                group = [r for r in credit_rows if r["method"] == method and r["level"] == level]
                if group:
                    cells = [f"{statistics.mean(r[n] for r in group if n in r):.3f}" if any(n in r for r in group) else "" for n in names]
                    lines.append(f"| {method} | {level} | " + " | ".join(cells) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", nargs="+", default=list(LEVELS), choices=list(LEVELS))
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--jobs", type=int, default=1, help="trainings at once (each on one thread)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for level in args.levels:
        HORIZON[level] = expert_path_mean(level)
    rows: list[dict] = []
    # seed-major: a grid cut short still has every method and level of its first seeds
    cells = [(level, seed) for seed in args.seeds for level in args.levels]
    with ThreadPoolExecutor(args.jobs) as pool:
        warms = dict(zip(cells, pool.map(lambda c: warm_start_once(*c, args.out), cells)))
        jobs = [(level, method, seed) for (level, seed) in cells for method in args.methods]
        for row in pool.map(lambda j: run_one(j[0], j[1], j[2], args.iterations, args.out, warms[(j[0], j[2])]), jobs):
            rows.append(row)
            print(row, flush=True)
            write_results(rows, args.out)


if __name__ == "__main__":
    main()
