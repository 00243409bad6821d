"""Run the quickstart (`python train.py`) over many seeds and write the per-seed table.

    python studies/quickstart_seeds.py --seeds 0-9 --algorithms agentopsd grpo     # the table in results/quickstart_seeds
    python studies/quickstart_seeds.py --seeds 0 --repeats 10                          # run-to-run spread of seed 0
    python studies/quickstart_seeds.py --seeds 0 1 --iterations 2                     # a quick look

Every run is the embedded default exactly as a user starts it, with only the seed and the algorithm
swapped: ``train.py seed=S algorithm=A output_dir=<out>/runs/<A>-s<S>``, its own warm start
included (a run of the same seed and repeat made earlier lends its cached demonstrations and weights,
so the algorithms of one repeat start from the same weights). Two runs at a time (``--jobs``), one
thread each, as on a 2-core CPU. ``--threads 0`` runs each as a user's ``python train.py`` does, with
train.py's own thread count (min(4, cores)) and OpenMP's default wait policy: with ``--jobs 1`` on an
otherwise idle machine, that is the newcomer's run and its wall time (runs named ``<A>-s<S>-t<N>``,
N the thread count, so they stand beside the one-thread runs).

``--repeats N`` runs each seed N times, each repeat in its own folder (``<A>-s<S>`` for the first,
``<A>-s<S>-r<K>`` for the others) with its own warm start trained anew, nothing lent from another
repeat: by default (``trainer.deterministic=false``) one seed on one machine does not give
bit-identical weights, and RL can amplify a warm start's difference in the sixth digit, so the
repeats measure what a newcomer who runs ``python train.py`` may see. (``train.py`` itself caches
the warm start under ``runs/<name>/warm_start/``, shared by every run of that name: a user's second
``python train.py`` loads the first one's warm start instead of training one.)

Resumable: a run whose log holds the final evaluation is read back, not trained again; a run cut
short goes on from its last checkpoint (``ckpt_path=last``). The code trained is the commit
checked out (exported once with ``git archive``, so edits made to the working tree while the grid
runs cannot leak into it). After every run, ``<out>/runs.csv`` (one row per run) and
``<out>/table.md`` are rewritten from every finished run under ``<out>/runs`` and every row already
in runs.csv whose folder is gone (run folders are not committed; a recorded run is not trained
again), so the tables of ``--seeds 0 --repeats 10`` and of ``--seeds 0-9`` written into one
folder, in one sitting or several, stand side by side. Per
run, the algorithms side by side; per algorithm, the run-to-run spread (the repeats of one seed) and
the seed-to-seed spread (the first run of each seed): how many runs reach the target, the mean with
a 95% bootstrap interval, the minimum, and how many are at the target two thirds of the way.
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentopsd.study.credit_quality import bootstrap

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: studies/ is a package under the repository root
    sys.path.insert(0, str(ROOT))

from studies.common import evaluations, export_code, head_commit, log_rows, parse_seeds, read_runs_csv  # noqa: E402,F401

TARGET = 0.8  # the success the issue asks of (nearly) every seed
ITERATIONS = 16  # the quickstart's num_iterations
# per-iteration means kept in runs.csv for telling stalled seeds from learning ones
DIAGNOSTICS = ["rollout/success", "loss/grad_norm", "loss/approx_kl", "loss/clip_frac", "credit/evidence_outcome_corr",
               "credit/mean_abs_revision", "credit/frac_at_band_edge", "credit/multiplier_std"]


# ------------------------------------------------------------------ reading a run back



def is_finished(run_dir: Path, iterations: int) -> bool:
    return iterations in evaluations(log_rows(run_dir))


def per_iteration(rows: list[dict[str, float]], key: str) -> list[float]:
    """The value of ``key`` at each logged iteration (NaN dropped: no group with mixed outcomes)."""
    return [r[key] for r in rows if key in r and r[key] == r[key]]


# ------------------------------------------------------------------ running



def command(algorithm: str, seed: int, run_dir: Path, iterations: int, resume: bool, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "train.py", f"seed={seed}", f"algorithm={algorithm}", f"output_dir={run_dir.resolve()}",
           "trainer.enable_progress_bar=false", "report=false"]
    if iterations != ITERATIONS:
        cmd.append(f"num_iterations={iterations}")
    return cmd + (["ckpt_path=last"] if resume else []) + extra


def run_name(algorithm: str, seed: int, repeat: int = 0, threads: int = 1) -> str:
    """``<A>-s<S>`` for a seed's first run, ``<A>-s<S>-r<K>`` for its repeat K (K >= 1), ``-t<N>`` after
    either for runs with N threads (N != 1): another thread count sums in another order, so it is another run."""
    return f"{algorithm}-s{seed}" + (f"-r{repeat}" if repeat else "") + (f"-t{threads}" if threads != 1 else "")


def effective_threads(threads: int) -> int:
    """``--threads 0`` is train.py's own default, min(4, cores)."""
    return threads or min(4, os.cpu_count() or 1)


def lend_warm_start(run_dir: Path, seed: int, runs_root: Path, repeat: int = 0, threads: int = 1) -> None:
    """Copy the cached warm start of an earlier run of this seed and repeat (another algorithm's): the same
    demonstrations and weights for every algorithm of one repeat; never another repeat's, so repeats stay independent."""
    target = run_dir / "warm_start"
    if any(target.glob("policy-*.pt")):
        return
    suffix = run_name("", seed, repeat, threads)  # "-s<S>[-r<K>][-t<N>]": this seed, repeat and thread count only
    for other in sorted(runs_root.glob(f"*{suffix}/warm_start")):
        if other != target and any(other.glob("policy-*.pt")):
            target.mkdir(parents=True, exist_ok=True)
            for cached in other.iterdir():
                if cached.is_file():
                    _link_or_copy(cached, target / cached.name)
            return


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where the filesystem allows (a real model's warm start is hundreds of MB, and no run writes
    into a lent file: a run that trains its own writes a new one), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy(src, dst)


def run_one(algorithm: str, seed: int, out: Path, code: Path, commit: str, iterations: int, extra: list[str],
            repeat: int = 0, command_line: str = "", threads: int = 1, jobs: int = 2) -> dict:
    """Train (or resume, or read back) one run; ``threads`` 0 runs it with train.py's own thread count and
    OpenMP's default wait policy, as a user's ``python train.py`` does."""
    n_threads = effective_threads(threads)
    run_dir = out / "runs" / run_name(algorithm, seed, repeat, n_threads)
    meta_path = run_dir / "meta.json"
    if not run_dir.exists():  # made in an earlier sitting whose folder is gone: its row in runs.csv stands
        key = (algorithm, seed, repeat, n_threads)
        recorded = [r for r in recorded_rows(out) if run_key(r) == key and r.get("iterations") == iterations]
        if recorded:
            return recorded[0]
    if not is_finished(run_dir, iterations):
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        resume = (run_dir / "checkpoints" / "last.ckpt").exists() and meta.get("commit") == commit
        if not resume:  # start over, keeping only the warm start (the seed fixes it)
            if run_dir.exists():
                for child in run_dir.iterdir():
                    if child.name != "warm_start":
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
            meta = {}
            lend_warm_start(run_dir, seed, out / "runs", repeat, n_threads)
        run_dir.mkdir(parents=True, exist_ok=True)
        rss_file = run_dir / "peak_rss_kb"
        cmd = command(algorithm, seed, run_dir, iterations, resume, extra)
        timer = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file)] if Path("/usr/bin/time").exists() else []
        env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
        if threads:  # several runs side by side: pinned threads that sleep when idle, not spin
            env.update(OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
        else:  # exactly the user's environment: train.py picks the thread count
            env.pop("OMP_NUM_THREADS", None)
            env.pop("OMP_WAIT_POLICY", None)
        start = time.monotonic()
        with (run_dir / "stdout.log").open("a") as log:
            done = subprocess.run(timer + cmd, cwd=code, stdout=log, stderr=subprocess.STDOUT, env=env)
        wall = time.monotonic() - start
        # a run killed by a signal leaves time's "Command terminated by signal ..." line, not a number
        words = rss_file.read_text().split() if timer and rss_file.exists() else []
        rss_mb = int(words[-1]) / 1024 if words and words[-1].isdigit() else float("nan")
        meta = {"commit": commit, "wall_s": meta.get("wall_s", 0.0) + wall, "resumed": meta.get("resumed", 0) + resume,
                "peak_rss_mb": max(meta.get("peak_rss_mb", 0.0), rss_mb) if rss_mb == rss_mb else meta.get("peak_rss_mb"),
                "algorithm": algorithm, "seed": seed, "repeat": repeat, "iterations": iterations, "overrides": list(extra),
                "threads": n_threads, "jobs": jobs,
                "command": meta.get("command") or command_line}
        meta_path.write_text(json.dumps(meta))
        if done.returncode != 0 or not is_finished(run_dir, iterations):
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}); see {run_dir / 'stdout.log'}")
    return run_row(algorithm, seed, run_dir, iterations, repeat)


def finished_rows(out: Path) -> list[dict]:
    """Every finished run under ``<out>/runs`` that this script made (its meta.json names it), whichever command made it."""
    rows = []
    for meta_path in sorted((out / "runs").glob("*/meta.json")):
        if meta_path.parent.is_symlink():  # train.py's `latest` link to the newest run folder
            continue
        meta = json.loads(meta_path.read_text())
        if "algorithm" in meta and is_finished(meta_path.parent, meta["iterations"]):
            rows.append(run_row(meta["algorithm"], meta["seed"], meta_path.parent, meta["iterations"], meta.get("repeat", 0)))
    return rows


INT_FIELDS = ("seed", "repeat", "threads", "jobs", "iterations", "resumed", "warm_start_trained")
TEXT_FIELDS = ("algorithm", "commit", "command", "overrides")


def run_key(row: dict) -> tuple:
    return row["algorithm"], int(row["seed"]), int(row.get("repeat", 0)), int(row.get("threads", 1))



def recorded_rows(out: Path) -> list[dict]:
    """The rows of ``<out>/runs.csv`` as written (run folders are not committed: a later sitting has the
    table's rows but not their folders), typed back; rows from before ``--threads`` ran one thread, two at a time."""
    rows = read_runs_csv(out / "runs.csv", text=lambda key: key in TEXT_FIELDS or key.endswith("_by_it"), ints=INT_FIELDS)
    return [{"threads": 1, "jobs": 2, **row} for row in rows]


def all_rows(out: Path) -> list[dict]:
    """Every finished run under ``<out>/runs``, and every row of ``<out>/runs.csv`` whose folder is gone."""
    rows = finished_rows(out)
    have = {run_key(r) for r in rows}
    return rows + [r for r in recorded_rows(out) if run_key(r) not in have]


def run_row(algorithm: str, seed: int, run_dir: Path, iterations: int, repeat: int = 0) -> dict:
    """One finished run as a row of runs.csv."""
    rows = log_rows(run_dir)
    evals = evaluations(rows)
    meta = json.loads((run_dir / "meta.json").read_text()) if (run_dir / "meta.json").exists() else {}
    row: dict = {"seed": seed, "repeat": repeat, "algorithm": algorithm, "commit": meta.get("commit", ""), "iterations": iterations,
                 # runs made before --threads existed ran one thread each, two at a time
                 "threads": meta.get("threads", 1), "jobs": meta.get("jobs", 2),
                 "success_warm_start": evals.get(0, float("nan")), "success_end": evals[iterations],
                 "command": meta.get("command", ""), "overrides": " ".join(meta.get("overrides", []))}
    row.update({f"eval_it{k}": v for k, v in sorted(evals.items())})
    log = run_dir / "train.log"
    row.update({"wall_s": meta.get("wall_s", float("nan")), "peak_rss_mb": meta.get("peak_rss_mb", float("nan")),
                "resumed": meta.get("resumed", 0),
                # a lent warm start is loaded, not trained: that run's time and memory leave out its ~150 s
                "warm_start_trained": int(log.exists() and "supervised steps on" in log.read_text())})
    for key in DIAGNOSTICS:
        vals = per_iteration(rows, key)
        if vals:
            name = key.replace("/", "_")
            row[f"{name}_mean"] = statistics.mean(vals)
            row[f"{name}_by_it"] = " ".join(f"{v:.3g}" for v in vals)
    return row


# ------------------------------------------------------------------ the table


def bootstrap_interval(values: list[float], level: float = 0.95, draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap of the mean: the interval stays inside the values' own range (never past 0 or 100%)."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    _, low, high = bootstrap(statistics.fmean, values, draws=draws, seed=seed, level=level)
    return low, high


def _pct(x: float) -> str:
    return "" if x != x else f"{100 * x:.0f}"


def _seeds_text(seeds: list[int]) -> str:
    """``0-9`` for a range, else the seeds listed."""
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(str(s) for s in seeds)


def _setup_text(rows: list[dict]) -> str:
    """How the runs of a group shared the machine: threads per run and runs at a time."""
    threads = rows[0].get("threads", 1)
    jobs = sorted({r.get("jobs", 2) for r in rows})
    at_once = "one at a time" if jobs == [1] else f"{'/'.join(map(str, jobs))} at a time"
    return f"{threads} thread{'s' if threads != 1 else ''}, {at_once}"


def spread_groups(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """The groups the summary compares, for each thread count: run to run (every repeat of a seed run
    more than once) and seed to seed (the first run of each seed), or the one run of one seed."""
    groups = []
    for threads in sorted({r.get("threads", 1) for r in rows}):
        these = [r for r in rows if r.get("threads", 1) == threads]
        seeds = sorted({r["seed"] for r in these})
        own = []
        for seed in seeds:
            repeats = [r for r in these if r["seed"] == seed]
            if len({r.get("repeat", 0) for r in repeats}) > 1:
                own.append((f"run to run: seed {seed}, {len(repeats)} runs; {_setup_text(repeats)}", repeats))
        first = [r for r in these if not r.get("repeat", 0)]
        if first and (len(seeds) > 1 or not own):
            own.append((f"seed to seed: seed{'s' if len(seeds) > 1 else ''} {_seeds_text(seeds)}"
                        + (", first run of each" if own else "") + f"; {_setup_text(first)}", first))
        groups += own
    return groups


def checkpoint_iteration(eval_its: list[int], iterations: int) -> int | None:
    """The last evaluated iteration at or before two thirds of the run: where the jump should be done."""
    early = [i for i in eval_its if 0 < i <= 2 * iterations / 3]
    return max(early) if early else None


PASSED = 0.9  # once a run has reached this greedy success ...
MAX_FALL = 0.1  # ... it should never fall more than this below its best at a later evaluation


def eval_curve(row: dict) -> list[float]:
    """A run's greedy evaluations in iteration order (the warm start's first)."""
    its = sorted(int(k[len("eval_it"):]) for k in row if k.startswith("eval_it") and row[k] == row[k])
    return [row[f"eval_it{i}"] for i in its]


def fall_after_passing(curve: list[float], passed: float = PASSED) -> float:
    """How far the run fell below its best so far at an evaluation after it first reached ``passed``
    (the largest such fall; 0 when it never fell or never got there): the unlearning a newcomer sees."""
    best: float | None = None
    fall = 0.0
    for value in curve:
        if best is not None:
            fall = max(fall, best - value)
            best = max(best, value)
        elif value >= passed:
            best = value
    return fall


def keeps_what_it_learns(row: dict) -> bool:
    """The quickstart's goal for one run: at least the target after the last iteration, and no fall of more than
    MAX_FALL below its best once past PASSED (a float margin: 96% to 86% is a fall of 10 points, not more)."""
    return row["success_end"] >= TARGET and fall_after_passing(eval_curve(row)) <= MAX_FALL + 1e-9


def rounding_summary(rows: list[dict]) -> list[dict]:
    """Per algorithm and seed, over its variants (thread counts and repeats: other roundings of the same run):
    how many, the lowest and mean end, the largest fall after passing PASSED, and how many keep what they learn."""
    out = []
    for algorithm, seed in sorted({(r["algorithm"], r["seed"]) for r in rows}):
        runs = [r for r in rows if r["algorithm"] == algorithm and r["seed"] == seed]
        ends = [r["success_end"] for r in runs]
        out.append({"algorithm": algorithm, "seed": seed, "variants": len(runs),
                    "threads": sorted({int(r.get("threads", 1)) for r in runs}),
                    "min_end": min(ends), "mean_end": statistics.fmean(ends),
                    "max_fall": max(fall_after_passing(eval_curve(r)) for r in runs),
                    "kept": sum(keeps_what_it_learns(r) for r in runs)})
    return out


def paired_difference(rows: list[dict], a: str, b: str) -> tuple[float, float, float, int]:
    """``a`` minus ``b``'s end success, per seed the mean over the variants both ran (same seed, repeat and thread
    count), then the mean over seeds with its 95% Student t interval: ``(mean, low, high, seeds)``."""
    by = {run_key(r): r for r in rows}
    per_seed: dict[int, list[float]] = {}
    for key, row in by.items():
        other = by.get((b, *key[1:]))
        if key[0] == a and other is not None:
            per_seed.setdefault(key[1], []).append(row["success_end"] - other["success_end"])
    diffs = [statistics.fmean(v) for _, v in sorted(per_seed.items())]
    if not diffs:
        return float("nan"), float("nan"), float("nan"), 0
    from agentopsd.study.stats import t_interval  # exact t quantiles

    mean, low, high = t_interval(diffs, bounds=(-1.0, 1.0))
    return mean, low, high, len(diffs)


def rounding_table(rows: list[dict], algorithms: list[str]) -> list[str]:
    """Markdown lines: per seed, the variants' worst end and worst fall; per algorithm, how many runs keep what they
    learn; the paired difference of the first two algorithms. Empty when no seed ran more than one thread count."""
    summary = [s for s in rounding_summary(rows) if len(s["threads"]) > 1]
    if not summary:
        return []
    lines = ["", f"Across rounding variants (thread counts; a seed's repeats count as variants too): per seed, the lowest "
                 f"success after the last iteration and the largest fall below the run's best once it had reached "
                 f"{100 * PASSED:.0f}%; a run keeps what it learns when it ends at ≥ {100 * TARGET:.0f}% and never falls "
                 f"more than {100 * MAX_FALL:.0f} points below its best after passing {100 * PASSED:.0f}%.", "",
             "| algorithm | seed | variants (threads) | min at the end | mean at the end | largest fall | runs that keep it |",
             "|---|---|---|---|---|---|---|"]
    order = {a: i for i, a in enumerate(algorithms)}
    summary.sort(key=lambda s: (order.get(s["algorithm"], 99), s["algorithm"], s["seed"]))
    for s in summary:
        lines.append(f"| {s['algorithm']} | {s['seed']} | {s['variants']} ({', '.join(map(str, s['threads']))}) | "
                     f"{_pct(s['min_end'])} | {_pct(s['mean_end'])} | {_pct(s['max_fall'])} | {s['kept']} / {s['variants']} |")
    lines.append("")
    for a in dict.fromkeys(s["algorithm"] for s in summary):
        these = [s for s in summary if s["algorithm"] == a]
        worst = min(these, key=lambda s: s["min_end"])
        lines.append(f"- {a}: {sum(s['kept'] for s in these)} of {sum(s['variants'] for s in these)} runs over "
                     f"{len(these)} seeds keep what they learn; lowest end {_pct(worst['min_end'])}% (seed {worst['seed']}), "
                     f"largest fall {_pct(max(s['max_fall'] for s in these))} points.")
    present = [a for a in algorithms if any(s["algorithm"] == a for s in summary)]
    if len(present) >= 2:
        mean, low, high, n = paired_difference(rows, present[0], present[1])
        if n:
            lines.append(f"- {present[0]} minus {present[1]} at the end: {100 * mean:+.1f} points [{100 * low:+.1f}, "
                         f"{100 * high:+.1f}] (95% t over {n} seeds, each the mean over the variants both ran).")
    return lines


def _commit_text(commit: str) -> str:
    """The short hash, keeping ``+worktree`` (``--code``: a checkout's files, not the commit, were trained)."""
    head, plus, rest = commit.partition("+")
    return head[:12] + plus + rest


def build_table(rows: list[dict], algorithms: list[str], iterations: int, command_line: str) -> str:
    """Markdown: per run, each algorithm's evaluations by iteration; per algorithm, the run-to-run and
    seed-to-seed spreads (runs at the target, at the end and two thirds of the way; mean; minimum)."""
    algorithms = [a for a in algorithms if any(r["algorithm"] == a for r in rows)] + \
        sorted({r["algorithm"] for r in rows} - set(algorithms))
    by = {(r["algorithm"], r["seed"], r.get("repeat", 0), r.get("threads", 1)): r for r in rows}
    runs = sorted({(r.get("threads", 1), r["seed"], r.get("repeat", 0)) for r in rows})
    commits = sorted({r["commit"] for r in rows if r.get("commit")})
    commands = list(dict.fromkeys(r.get("command") or command_line for r in sorted(rows, key=lambda r: (r.get("repeat", 0) == 0, r["seed"]))))
    overrides = sorted({r.get("overrides", "") for r in rows} - {""})
    eval_its = sorted({int(k[len("eval_it"):]) for r in rows for k in r if k.startswith("eval_it")})
    early = checkpoint_iteration(eval_its, iterations)
    lines = [f"Quickstart (`python train.py`) over seeds and repeated runs: greedy evaluation success (%) on the fixed "
             f"evaluation list after 0 (the warm start) / {' / '.join(str(i) for i in eval_its if i)} RL iterations; "
             f"wall time and peak memory (RSS) per run on a 2-core CPU (threads per run and runs at a time in the "
             f"summary). A repeat is the same seed run again from scratch, its warm start trained anew.", ""]
    lines += [f"Command{'s' if len(commands) > 1 else ''}: " + "; ".join(f"`{c}`" for c in commands) + "  ",
              f"Commit: {', '.join(_commit_text(c) for c in commits) or 'unknown'}" + ("  " if overrides else "")]
    if overrides:
        lines.append(f"Overrides: {'; '.join(f'`{o}`' for o in overrides)}")
    lines.append("")
    head = ["seed", "repeat", "threads"] + [f"{a}: {' → '.join(str(i) for i in eval_its)}" for a in algorithms] + \
        [f"{a} s / MB" for a in algorithms]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for threads, seed, repeat in runs:
        cells = [str(seed), str(repeat), str(threads)]
        for a in algorithms:
            r = by.get((a, seed, repeat, threads))
            cells.append(" → ".join(_pct(r.get(f"eval_it{i}", float("nan"))) for i in eval_its) if r else "")
        for a in algorithms:
            r = by.get((a, seed, repeat, threads))
            lent = "" if not r or r.get("warm_start_trained", 1) else "*"
            cells.append(f"{r['wall_s']:.0f}{lent} / {r['peak_rss_mb']:.0f}{lent}" if r else "")
        lines.append("| " + " | ".join(cells) + " |")
    if any(not r.get("warm_start_trained", 1) for r in rows):
        lines += ["", "\\* loaded its warm start from the cache of another algorithm's run of that seed and repeat, so "
                      "this time and memory leave out the demonstrations and supervised steps."]
    at_early = f"≥ {100 * TARGET:.0f}% at iteration {early}" if early else ""
    lines += ["", f"Per algorithm: runs at ≥ {100 * TARGET:.0f}% after the last iteration"
                  + (f" and already at iteration {early} (two thirds of the way)" if early else "")
                  + ", mean after RL with a 95% bootstrap interval (percentile, 10,000 draws), the lowest run.", "",
              f"| algorithm | spread | ≥ {100 * TARGET:.0f}% at the end | {at_early or 'early'} | mean after RL (95% interval) "
              "| min | mean warm start | mean wall s (max) | max peak RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    for a in algorithms:
        for name, group in spread_groups([r for r in rows if r["algorithm"] == a]):
            ends = [r["success_end"] for r in group]
            lo, hi = bootstrap_interval(ends)
            early_vals = [r.get(f"eval_it{early}") for r in group] if early else []
            early_cell = f"{sum(v >= TARGET for v in early_vals if v is not None)} / {len(group)}" if early else ""
            # time and memory over the runs that made their own warm start, as a user's run does (else all, starred)
            own = [r for r in group if r.get("warm_start_trained", 1)] or group
            star = "" if own[0].get("warm_start_trained", 1) else "*"
            walls = [r["wall_s"] for r in own if r["wall_s"] == r["wall_s"]]
            rss = [r["peak_rss_mb"] for r in own if r["peak_rss_mb"] == r["peak_rss_mb"]]
            warm = [r["success_warm_start"] for r in group if r["success_warm_start"] == r["success_warm_start"]]
            cost = f"{statistics.fmean(walls):.0f} ({max(walls):.0f}){star} | {max(rss):.0f}{star}" if walls and rss else " | "
            lines.append(f"| {a} | {name} | {sum(e >= TARGET for e in ends)} / {len(ends)} | {early_cell} | "
                         f"{_pct(statistics.fmean(ends))} [{_pct(lo)}, {_pct(hi)}] | {_pct(min(ends))} | "
                         f"{_pct(statistics.fmean(warm)) if warm else ''} | {cost} |")
    lines += rounding_table(rows, algorithms)
    # what tells a stalled run from a learning one: how fast training success (temperature 1) rises,
    # how large the updates are, and whether the credit's evidence tracks the outcome
    lines += ["", "Per run, means over the RL iterations: training success (%; first and last 4 iterations), gradient "
                  "norm, approximate KL of the update, clip fraction, correlation of the credit's evidence with the outcome.", "",
              "| algorithm | seed | repeat | threads | train success | first 4 | last 4 | grad norm | approx KL | clip frac "
              "| evidence-outcome corr |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (algorithms.index(r["algorithm"]), r.get("threads", 1), r["seed"], r.get("repeat", 0))):
        train = [float(v) for v in str(r.get("rollout_success_by_it", "")).split()]
        cells = [_pct(statistics.fmean(train)), _pct(statistics.fmean(train[:4])), _pct(statistics.fmean(train[-4:]))] \
            if train else ["", "", ""]
        cells += [f"{r[k]:.3g}" if k in r else "" for k in
                  ("loss_grad_norm_mean", "loss_approx_kl_mean", "loss_clip_frac_mean", "credit_evidence_outcome_corr_mean")]
        lines.append(f"| {r['algorithm']} | {r['seed']} | {r.get('repeat', 0)} | {r.get('threads', 1)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(rows: list[dict], out: Path, algorithms: list[str], iterations: int, command_line: str) -> None:
    order = {a: i for i, a in enumerate(algorithms)}
    rows = sorted(rows, key=lambda r: (r.get("threads", 1), r["seed"], r.get("repeat", 0), order.get(r["algorithm"], 99),
                                       r["algorithm"]))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fixed = ["seed", "repeat", "threads", "algorithm", "commit", "iterations", "success_warm_start", "success_end"]
    keys = fixed + sorted((k for k in keys if k.startswith("eval_it")), key=lambda k: int(k[7:])) + \
        [k for k in keys if k not in fixed and not k.startswith("eval_it")]
    with (out / "runs.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    (out / "table.md").write_text(build_table(rows, algorithms, iterations, command_line))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", default=["0-9"], help="seeds or ranges: 0-9, or 0 3 7")
    parser.add_argument("--algorithms", nargs="+", default=["agentopsd", "grpo"])
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each seed, each from scratch (its own warm start): the run-to-run spread")
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--threads", type=int, nargs="+", default=[1],
                        help="threads per run; several (e.g. 1 2 3) run every seed once per count, rounding variants: another "
                             "thread count sums in another order. 0: train.py's own default (min(4, cores)) and OpenMP's "
                             "default wait policy, as a user's `python train.py` runs (use with --jobs 1 on an idle machine)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "quickstart_seeds")
    parser.add_argument("--code", type=Path, default=None,
                        help="train from this checkout instead of an export of HEAD (e.g. . for uncommitted edits)")
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides, e.g. data.group_size=4")
    args = parser.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    if args.repeats < 1:
        raise SystemExit(f"--repeats: {args.repeats}; give 1 or more")
    if any(t < 0 for t in args.threads):
        raise SystemExit(f"--threads: {args.threads}; give counts of 1 or more, or 0 for train.py's own default")
    threads = list(dict.fromkeys(args.threads))
    args.out = args.out.resolve()  # the runs' working directory is the exported code, not here
    args.out.mkdir(parents=True, exist_ok=True)
    commit = head_commit()
    code = args.code.resolve() if args.code else export_code(commit, Path(os.environ.get("TMPDIR", "/tmp")) / "quickstart_seeds_src")
    if args.code:
        commit += "+worktree"
    command_line = "python studies/quickstart_seeds.py " + " ".join(sys.argv[1:] if argv is None else argv)
    # algorithm-major (the first algorithm's grid lands first), then repeat-major (every seed's first run first),
    # then a seed's rounding variants side by side
    jobs = [(a, s, k, t) for a in args.algorithms for k in range(args.repeats) for s in seeds for t in threads]
    failures: list[str] = []
    lock = threading.Lock()  # two runs may finish at once: one writer of the tables at a time

    def one(job: tuple[str, int, int, int]) -> None:
        try:
            row = run_one(job[0], job[1], args.out, code, commit, args.iterations, args.overrides, job[2], command_line,
                          threads=job[3], jobs=args.jobs)
        except RuntimeError as error:
            failures.append(str(error))
            print(error, file=sys.stderr, flush=True)
            return
        with lock:  # every finished run in the folder, this command's and earlier ones'
            write_results(all_rows(args.out), args.out, args.algorithms, args.iterations, command_line)
        print(f"{job[0]} seed {job[1]} repeat {job[2]} threads {effective_threads(job[3])}: "
              f"{_pct(row['success_warm_start'])}% -> {_pct(row['success_end'])}% "
              f"in {row['wall_s']:.0f} s", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, jobs))
    if failures:
        raise SystemExit(f"{len(failures)} run(s) failed; rerun the same command to retry them")


if __name__ == "__main__":
    main()
