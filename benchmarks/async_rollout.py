"""Iterations per hour of the quickstart in lockstep against ``rollout.max_staleness`` 1 and 2 on 2 cores,
the bound the cores allow, and a stand-in cost model of the ratio to expect on GPUs.

    python benchmarks/async_rollout.py [--iterations 8] [--rounds 1] [--out /tmp/agentopsd-async-bench]
                                       [--weights policy-*.pt] [--json PATH] [--report PATH]
    python benchmarks/async_rollout.py --quick          # tiny settings: proves the script runs (seconds a run)
    python benchmarks/async_rollout.py --model-only     # the GPU cost model alone, no training

Runs (``python train.py``, the quickstart, in subprocesses, one at a time so that no two share the cores,
each in its own folder under ``--out``), alternated in rounds so that drift hits every variant alike:

- ``lockstep-2t``: ``OMP_NUM_THREADS=2``, what ``python train.py`` does on 2 cores;
- ``lockstep-1t``: ``OMP_NUM_THREADS=1`` (each phase on one core: the scaling of each phase 1 -> 2 threads);
- ``async-k1``: ``OMP_NUM_THREADS=1 rollout.max_staleness=1 rollout.worker_threads=1`` (trainer one thread,
  the rollout worker one thread);
- ``async-k2``: the same with ``rollout.max_staleness=2``;
- ``async-k1-ws`` and ``async-k2-ws``: the same with ``rollout.teacher_scoring=worker`` (the worker scores each
  turn's teacher view right after generating it; the trainer then runs only the proximal recompute and the update).

The first run trains the warm start; the others load its ``policy-*.pt`` (``warm_start.weights``), so every run
starts its RL from the same weights and only RL iterations are timed. Evaluation runs once, before training,
on a few tasks (its log line marks when training starts); no evaluation after, no report, no checkpoint but the
final one.

What is timed: the end of each iteration is the modification time of its rollout shard
(``rollouts/rollouts-<i>.tar``, written at every iteration's end, ``rollout_log.every_n_iterations=1``).
The steady seconds per iteration are ``(end[N-2] - end[1]) / (N-3)``: iterations 2 .. N-2. Left out, alike for
every variant: the first iteration (asynchronous runs spawn their worker and fill the queue there) and the last
two (with ``max_staleness=k`` the worker has nothing left to play during the last k updates, so the trainer
runs alone: faster than in a long run). The whole loop (the evaluation line before training to the last
shard, fill and tail included) is shown beside it. Iterations per hour = 3600 / steady seconds.

The bound: each phase's mean seconds over the same iterations from the run's CSV (``perf/rollout_seconds``,
``perf/teacher_seconds`` (scoring), ``perf/update_seconds``) at 1 and 2 threads (lockstep runs). Lockstep on 2
threads takes R2 + S2 + U2 an iteration; asynchronous with one core each takes, in steady state,
max(R1, S1 + U1) (the worker generates while the trainer scores and updates), so the ratio is at most
(R2 + S2 + U2) / max(R1, S1 + U1). The same with each run's measured wall time per iteration (its other work
included: credit, logging, the shard) is ``W2 / max(R1, W1 - R1)``. Both are upper bounds: the two processes
still share memory bandwidth and caches, and this machine may be shared.

The stand-in cost model (:func:`simulate`): per-iteration generation time G and train time T (scoring +
update); lockstep takes G + T; with ``max_staleness=k`` and generation on devices of its own, a worker that may
start iteration i's generation once the update of iteration i-k-1 is done. A discrete-event simulation over
``--model-iterations`` iterations with G drawn from a spread (``--spread``: the slowest episode decides a
batch's generation time; uniform, seeded), so that k=2 can absorb variance k=1 cannot. Inputs, peers' GPU
figures (per training step):

- verl one-step-off (DAPO, Qwen2.5-Math-7B, 2 x 16 H20; https://verl.readthedocs.io/en/latest/advance/one_step_off.html,
  the same table in the verl repository's own docs): colocated sync, FSDP2: gen 321 s,
  old_log_prob 88 s, update_actor 286 s (step 749 s); Megatron: gen 207 s, old_log_prob 119 s, update_actor 344 s
  (step 699 s). Its asynchronous rows (4 GPUs generate, 12 train): FSDP2 generate_sequences 458 s, old_log_prob
  108 s, update_actor 337 s, step 520 s (total time +23%); Megatron 501 s, 120 s, 347 s, step 566 s (+40%).
  The same page: in DAPO 32B training the rollout takes about 70% of the time.
- NeMo RL v0.4 (GRPO, Llama 3.1 8B, 16 H100; the performance summary of NeMo RL's docs,
  https://docs.nvidia.com/nemo/rl/latest/about/performance-summary.html): on-policy 97.7 s a step, 1-step off
  74.6 s (1.31x); no split of generation and training given.
- verl fully async (Qwen2.5-7B, 128 GPUs; https://verl.readthedocs.io/en/latest/advance/fully_async.html):
  2.35x-2.67x; no split given here.

Where no split is published the generation share is an assumption, shown as such (50%, 85%). The model
assumes each phase keeps its colocated speed on its own devices (twice the devices, or a split that costs
nothing); peers split a fixed set of GPUs instead, which slows each phase: the verl rows are also run with
their asynchronous phase times, beside what verl measured.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VARIANTS: dict[str, tuple[int, int, int, str]] = {
    "lockstep-2t": (2, 0, 1, "trainer"),
    "lockstep-1t": (1, 0, 1, "trainer"),
    "async-k1": (1, 1, 1, "trainer"),
    "async-k2": (1, 2, 1, "trainer"),
    "async-k1-ws": (1, 1, 1, "worker"),
    "async-k2-ws": (1, 2, 1, "worker"),
}
"""name -> (OMP_NUM_THREADS of the trainer, rollout.max_staleness, rollout.worker_threads, rollout.teacher_scoring)."""
BASELINE = "lockstep-2t"
COMMON = ["evaluation.before_training=true", "evaluation.every_n_iterations=0", "evaluation.at_end=false",
          "evaluation.num_tasks=8", "report=false", "trainer.enable_progress_bar=false",
          "checkpoint.every_n_iterations=100000", "rollout_log.every_n_iterations=1"]
"""Every run: one small evaluation before training (its log line marks the start), a shard every iteration (its
modification time marks the iteration's end), nothing else between iterations that the quickstart would not do."""
QUICK = ["data.tasks_per_batch=2", "data.group_size=2", "warm_start.steps=2", "warm_start.episodes=20",
         "evaluation.num_tasks=4"]
PHASES = ("rollout", "teacher", "update")
EVAL_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[[^]]*evaluation\]\[INFO\] - eval \(before training")

# ---------------------------------------------------------------- pure parts


def steady_window(iterations: int) -> tuple[int, int]:
    """The first and last iteration (1-based, inclusive) whose times are counted: 2 .. N-2 (see the docstring)."""
    if iterations < 4:
        raise ValueError(f"--iterations must be at least 4 (iterations 2..N-2 are timed), got {iterations}")
    return 2, iterations - 2


def steady_seconds(ends: dict[int, float], iterations: int) -> float:
    """Seconds per iteration over the steady window, from each iteration's end time (``ends[i]``, 1-based)."""
    first, last = steady_window(iterations)
    return (ends[last] - ends[first - 1]) / (last - first + 1)


def phase_means(rows: dict[int, dict[str, float]], iterations: int) -> dict[str, float]:
    """Each phase's mean seconds over the steady window's iterations (``rows[i]["rollout"]`` ...)."""
    first, last = steady_window(iterations)
    return {p: statistics.fmean(rows[i][p] for i in range(first, last + 1)) for p in PHASES}


def async_bound(two: dict[str, float], one: dict[str, float]) -> float:
    """Lockstep on 2 threads over asynchronous with one core each, in steady state:
    (R2 + S2 + U2) / max(R1, S1 + U1)."""
    lockstep = two["rollout"] + two["teacher"] + two["update"]
    return lockstep / max(one["rollout"], one["teacher"] + one["update"])


def wall_bound(wall_two: float, wall_one: float, rollout_one: float) -> float:
    """The bound with each lockstep run's wall seconds per iteration (its other work included): the trainer's
    share on one core is the 1-thread iteration less its rollout, ``W2 / max(R1, W1 - R1)``."""
    return wall_two / max(rollout_one, wall_one - rollout_one)


def simulate(gen: Sequence[float], train: Sequence[float], k: int) -> float:
    """Seconds for len(gen) iterations: iteration i generates for ``gen[i]`` and trains for ``train[i]``.

    The generator (on devices of its own) starts iteration i once it has finished i-1 and the weights of version
    i-k are out (the update of iteration i-k-1 is done; version 0 is there from the start); the update of i
    starts once i is generated and the update of i-1 is done. ``k=0`` is lockstep: the sum of all times.
    """
    if len(gen) != len(train):
        raise ValueError("gen and train need one time per iteration each")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    gen_end, update_end = 0.0, [0.0] * len(gen)
    for i, (g, t) in enumerate(zip(gen, train)):
        admitted = update_end[i - k - 1] if i - k - 1 >= 0 else 0.0
        gen_end = max(gen_end, admitted) + g
        update_end[i] = max(gen_end, update_end[i - 1] if i else 0.0) + t
    return update_end[-1] if gen else 0.0


def draw(mean: float, n: int, spread: float, seed: int) -> list[float]:
    """n times uniform in mean * [1 - spread, 1 + spread] (seeded)."""
    rng = random.Random(seed)
    return [mean * (1 + spread * rng.uniform(-1, 1)) for _ in range(n)]


@dataclass
class ModelRow:
    source: str
    gen: float
    train: float
    lockstep_gen: float = 0.0
    lockstep_train: float = 0.0
    measured: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    """'lockstep' and 'k=1', 'k=2' at spread 0 and at the spread: seconds per iteration."""


def cost_model(rows: list[ModelRow], n: int, spread: float, seed: int) -> list[ModelRow]:
    """Seconds per iteration for each row: lockstep (``lockstep_gen + lockstep_train``, or gen + train when
    those are 0) and k = 1, 2 with constant times and with G drawn from the spread (the same draws for every k)."""
    for row in rows:
        lg, lt = (row.lockstep_gen, row.lockstep_train) if row.lockstep_gen else (row.gen, row.train)
        row.seconds["lockstep"] = lg + lt
        for label, s in (("", 0.0), (" spread", spread)):
            gen = draw(row.gen, n, s, seed)
            for k in (1, 2):
                row.seconds[f"k={k}{label}"] = simulate(gen, [row.train] * n, k) / n
    return rows


def peer_rows() -> list[ModelRow]:
    """The cost model's inputs (seconds per step; sources in the module docstring)."""
    return [
        ModelRow("verl 7B FSDP2, colocated phase times (gen 46%)", 321, 88 + 286),
        ModelRow("verl 7B Megatron, colocated phase times (gen 31%)", 207, 119 + 344),
        ModelRow("verl 7B FSDP2, its async phase times (4 gen + 12 train GPUs)", 458, 108 + 337, 321, 88 + 286,
                 "749 -> 520 s/step: 1.44x"),
        ModelRow("verl 7B Megatron, its async phase times (4 gen + 12 train GPUs)", 501, 120 + 347, 207, 119 + 344,
                 "699 -> 566 s/step: 1.23x"),
        ModelRow("verl DAPO 32B: rollout ~70% of the time", 70, 30),
        ModelRow("assumed: generation 50%", 50, 50),
        ModelRow("assumed: generation 85%", 85, 15),
    ]


# ---------------------------------------------------------------- runs


@dataclass
class Run:
    variant: str
    round: int
    folder: str
    steady_seconds: float
    loop_seconds: float | None
    """Whole loop per iteration: the evaluation line before training to the last shard (fill and tail included)."""
    phases: dict[str, float]
    staleness_mean: float | None
    tis_weight_mean: float | None


def overrides(variant: str, iterations: int, quick: bool, weights: Path | None) -> tuple[dict[str, str], list[str]]:
    """The environment and the ``train.py`` overrides of one variant."""
    threads, k, worker_threads, teacher_scoring = VARIANTS[variant]
    env = {k_: v for k_, v in os.environ.items() if k_ not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["OMP_NUM_THREADS"] = str(threads)
    args = [f"num_iterations={iterations}", *COMMON, *(QUICK if quick else [])]
    if k:
        args += [f"rollout.max_staleness={k}", f"rollout.worker_threads={worker_threads}",
                 f"rollout.teacher_scoring={teacher_scoring}"]
    if weights is not None:
        args.append(f"warm_start.weights={weights}")
    return env, args


def shard_ends(folder: Path) -> dict[int, float]:
    """Iteration (1-based) -> when its rollout shard was written."""
    return {int(p.stem.split("-")[1]): p.stat().st_mtime for p in (folder / "rollouts").glob("rollouts-*.tar")}


def training_start(log: Path) -> float | None:
    """When the evaluation before training logged its result (local time, as the run's log writes it)."""
    for line in log.read_text().splitlines():
        m = EVAL_LINE.match(line)
        if m:
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def csv_rows(folder: Path) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """Iteration -> its phase seconds; iteration -> its staleness and TIS metrics (where logged)."""
    paths = sorted((folder / "csv").glob("version_*/metrics.csv"))
    if not paths:
        raise SystemExit(f"{folder}: no csv/version_*/metrics.csv (did the run log?)")
    phases, extra = {}, {}
    with paths[-1].open() as f:
        for row in csv.DictReader(f):
            if row.get("perf/update_seconds"):
                step = int(float(row["step"]))
                phases[step] = {p: float(row[f"perf/{p}_seconds"]) for p in PHASES}
                extra[step] = {k: float(row[k]) for k in ("rollout/staleness_mean", "rollout/tis_weight_mean") if row.get(k)}
    return phases, extra


def run_variant(variant: str, round_: int, out: Path, iterations: int, quick: bool, weights: Path | None) -> Run:
    folder = out / f"round{round_}-{variant}"
    if folder.exists():
        shutil.rmtree(folder)  # this script's own folder from an earlier invocation: a fresh run
    folder.mkdir(parents=True)
    env, args = overrides(variant, iterations, quick, weights)
    with (folder.parent / f"round{round_}-{variant}.out").open("w") as log:
        done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"output_dir={folder}"], cwd=ROOT, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{variant} (round {round_}) failed with exit code {done.returncode}: see {log.name}")
    ends = shard_ends(folder)
    if sorted(ends) != list(range(1, iterations + 1)):
        raise SystemExit(f"{variant}: expected rollout shards 1..{iterations} in {folder}/rollouts, found {sorted(ends)}")
    phases, extra = csv_rows(folder)
    start = training_start(folder / "train.log")
    first, last = steady_window(iterations)
    window = range(first, last + 1)
    stale = [extra[i]["rollout/staleness_mean"] for i in window if "rollout/staleness_mean" in extra.get(i, {})]
    tis = [extra[i]["rollout/tis_weight_mean"] for i in window if "rollout/tis_weight_mean" in extra.get(i, {})]
    return Run(variant, round_, str(folder), steady_seconds(ends, iterations),
               (ends[iterations] - start) / iterations if start else None, phase_means(phases, iterations),
               statistics.fmean(stale) if stale else None, statistics.fmean(tis) if tis else None)


def warm_weights(folder: Path) -> Path:
    found = sorted((folder / "warm_start").glob("policy-*.pt"))
    if not found:
        raise SystemExit(f"{folder}/warm_start holds no policy-*.pt: did the quickstart's warm start run?")
    return found[0]


# ---------------------------------------------------------------- report


def summarise(runs: list[Run]) -> dict[str, dict]:
    """Per variant, the median over rounds of its steady seconds, loop seconds and phases."""
    out: dict[str, dict] = {}
    for v in VARIANTS:
        mine = [r for r in runs if r.variant == v]
        if not mine:
            continue
        loops = [r.loop_seconds for r in mine if r.loop_seconds]
        out[v] = {"steady_seconds": statistics.median(r.steady_seconds for r in mine),
                  "loop_seconds": statistics.median(loops) if loops else None,
                  "phases": {p: statistics.median(r.phases[p] for r in mine) for p in PHASES},
                  "staleness_mean": mine[0].staleness_mean, "tis_weight_mean": mine[0].tis_weight_mean, "runs": len(mine)}
    return out


def measured_tables(summary: dict[str, dict]) -> list[str]:
    base = summary[BASELINE]["steady_seconds"]
    lines = ["| variant | s/iteration (steady) | iterations/hour | vs lockstep-2t | whole loop s/iteration | rollout s "
             "| scoring s | update s | staleness mean | TIS weight mean |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v, s in summary.items():
        ph = s["phases"]
        loop = f"{s['loop_seconds']:.2f}" if s["loop_seconds"] else "-"
        stale = f"{s['staleness_mean']:.2f}" if s["staleness_mean"] is not None else "-"
        tis = f"{s['tis_weight_mean']:.3f}" if s["tis_weight_mean"] is not None else "-"
        lines.append(f"| {v} | {s['steady_seconds']:.2f} | {3600 / s['steady_seconds']:.0f} | {base / s['steady_seconds']:.2f}x "
                     f"| {loop} | {ph['rollout']:.2f} | {ph['teacher']:.2f} | {ph['update']:.2f} | {stale} | {tis} |")
    lines += ["", "For the asynchronous runs the rollout column is the time the trainer waited for the worker."]
    if "lockstep-1t" in summary:
        one, two = summary["lockstep-1t"], summary[BASELINE]
        lines += ["", "| phase (lockstep) | 1 thread s | 2 threads s | speed-up 1 -> 2 threads |", "|---|---:|---:|---:|"]
        for p, name in zip(PHASES, ("rollout (generation + env)", "scoring", "update")):
            lines.append(f"| {name} | {one['phases'][p]:.2f} | {two['phases'][p]:.2f} | {one['phases'][p] / two['phases'][p]:.2f}x |")
        lines.append(f"| whole iteration (wall) | {one['steady_seconds']:.2f} | {two['steady_seconds']:.2f} "
                     f"| {one['steady_seconds'] / two['steady_seconds']:.2f}x |")
        b = async_bound(two["phases"], one["phases"])
        w = wall_bound(two["steady_seconds"], one["steady_seconds"], one["phases"]["rollout"])
        got = {v: base / s["steady_seconds"] for v, s in summary.items() if VARIANTS[v][1] > 0}
        lines += ["", "| async on 2 cores | ratio vs lockstep-2t |", "|---|---:|",
                  f"| bound from the phases: (R2+S2+U2) / max(R1, S1+U1) | {b:.2f}x |",
                  f"| bound from the wall times: W2 / max(R1, W1-R1) | {w:.2f}x |",
                  *(f"| measured, {v} | {r:.2f}x |" for v, r in got.items())]
    return lines


def model_tables(rows: list[ModelRow], n: int, spread: float) -> list[str]:
    lines = [f"Seconds per step over {n} steps (fill included); G spread: uniform +-{spread:.0%}.", "",
             "| input (s/step) | G | T | lockstep | k=1 | k=2 | k=1 spread | k=2 spread | lockstep / k=1 spread "
             "| lockstep / k=2 spread | peer measured |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        s = r.seconds
        lines.append(f"| {r.source} | {r.gen:g} | {r.train:g} | {s['lockstep']:.1f} | {s['k=1']:.1f} | {s['k=2']:.1f} "
                     f"| {s['k=1 spread']:.1f} | {s['k=2 spread']:.1f} | {s['lockstep'] / s['k=1 spread']:.2f}x "
                     f"| {s['lockstep'] / s['k=2 spread']:.2f}x | {r.measured or '-'} |")
    lines += ["", "G: generation, T: scoring + update, per step. Rows with the peers' asynchronous phase times take "
              "lockstep from their colocated rows (the same GPUs, each phase on all of them). NeMo RL's Llama 3.1 8B "
              "(97.7 -> 74.6 s/step, 1.31x) and verl's fully async (2.35-2.67x) publish no split, so no row."]
    return lines


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
    return f"{head or 'unknown'}{' plus uncommitted changes' if dirty.strip() else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8, help="num_iterations of each run (>= 4; 2..N-2 are timed)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of all variants (medians over rounds)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("/tmp/agentopsd-async-bench"), help="the runs' folders")
    parser.add_argument("--weights", type=Path, default=None,
                        help="a warm start's policy-*.pt to start every run from (default: the first run trains it)")
    parser.add_argument("--quick", action="store_true", help="tiny settings (2 tasks x 2 copies, 2 warm-start steps)")
    parser.add_argument("--model-only", action="store_true", help="only the GPU cost model: no training runs")
    parser.add_argument("--model-iterations", type=int, default=200)
    parser.add_argument("--spread", type=float, default=0.2, help="generation time spread of the cost model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    parser.add_argument("--report", type=Path, default=None, help="write the markdown here")
    args = parser.parse_args(argv)
    command = "python benchmarks/async_rollout.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    steady_window(args.iterations)  # refuse a too short run before any work
    if BASELINE not in args.variants and not args.model_only:
        raise SystemExit(f"--variants must include {BASELINE}: every ratio is against it")

    runs: list[Run] = []
    load_before = os.getloadavg()[0]
    if not args.model_only:
        weights: Path | None = args.weights
        if weights is not None and not weights.is_file():
            raise SystemExit(f"--weights {weights}: no such file (a policy-*.pt from a run's warm_start/ folder)")
        for round_ in range(1, args.rounds + 1):
            for variant in args.variants:
                t0 = time.perf_counter()
                run = run_variant(variant, round_, args.out, args.iterations, args.quick, weights)
                weights = weights or warm_weights(Path(run.folder))
                runs.append(run)
                print(f"round {round_} {variant:>12s}: {run.steady_seconds:6.2f} s/iteration steady "
                      f"({time.perf_counter() - t0:.0f} s the run)", flush=True)
    rows = cost_model(peer_rows(), args.model_iterations, args.spread, args.seed)

    lines = ["# Asynchronous rollouts against lockstep (benchmarks/async_rollout.py)", "",
             f"`{command}` at commit `{commit()}`; {platform.python_version()}, {os.cpu_count()} CPUs, load average "
             f"{load_before:.1f} before the runs, {os.getloadavg()[0]:.1f} at the end (other processes share the cores "
             "when it is above what these runs add: about 1 for lockstep, 2 for asynchronous).", ""]
    summary = summarise(runs) if runs else {}
    if summary:
        first, last = steady_window(args.iterations)
        lines += [f"## Measured: the quickstart{' (--quick settings)' if args.quick else ''}, {args.iterations} iterations "
                  f"a run, iterations {first}..{last} timed, {args.rounds} round(s) (medians)", "",
                  *measured_tables(summary), ""]
    lines += ["## Stand-in cost model: generation and training on devices of their own", "",
              *model_tables(rows, args.model_iterations, args.spread), ""]
    text = "\n".join(lines)
    print("\n" + text)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "commit": commit(), "cpus": os.cpu_count(),
                                         "iterations": args.iterations, "quick": args.quick, "runs": [asdict(r) for r in runs],
                                         "summary": summary, "cost_model": [asdict(r) for r in rows],
                                         "model_iterations": args.model_iterations, "spread": args.spread}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
