"""The SmolLM2 recipe (``python train.py +experiment=smollm2``) run once and measured: where the time goes, peak RSS,
greedy success before and after.

    python benchmarks/smollm2_recipe.py [--out DIR] [--threads N] [--json PATH] [--report PATH]
                                        [-- train.py overrides ...]

One ``train.py`` subprocess (its own process group, so a stop kills nothing else). Measured:

- wall seconds and peak RSS of that process (``os.wait4``'s rusage of the child itself: ``ru_maxrss``);
- when each output line arrived (seconds since the start), kept in ``<out>/train.out`` as ``[   12.3] line``;
- the warm start: its steps and seconds from its own closing line (``warm start: N steps in Xs``), the
  demonstrations' seconds from theirs;
- per RL iteration, from the run's CSV: ``perf/rollout_seconds`` (generation and env steps), ``perf/teacher_seconds``
  (the no-grad scoring: the teacher view), ``perf/update_seconds`` (forward and backward of every row), the rows
  (turns) of the batch and the rollout's success;
- the evaluations' greedy success (``eval/success`` by completed iterations), and the seconds each took: from the
  line before it (the warm start's end, or the last iteration's rollout shard) to its own result line, so they
  include what ran between (the Trainer's setup before the first one, the final checkpoint before the last).

Threads: ``--threads`` sets ``OMP_NUM_THREADS`` for the run (default: as the caller's environment has it).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "teacher", "update")
WARM_DONE = re.compile(r"warm start: (\d+) steps in (\d+)s, final loss ([\d.naninf]+)")
WARM_CACHED = re.compile(r"warm start: loaded ")
DEMOS = re.compile(r"wrote (\d+) demonstration turns to .* in ([\d.]+)s")
EVAL = re.compile(r"eval \((before training|periodic|end), after (\d+) iterations?\): success ([\d.]+) on (\d+) episodes")
STAMP = re.compile(r"^\[\s*([\d.]+)\] (.*)$")


@dataclass
class Iteration:
    """One RL iteration's split, from the run's CSV."""

    iteration: int
    rollout: float
    teacher: float
    update: float
    rows: float
    """Turns in the batch: each is one row through generation, scoring and the update."""
    success: float
    """The training rollout's success (sampled at the rollout temperature)."""

    @property
    def total(self) -> float:
        return self.rollout + self.teacher + self.update


@dataclass
class Result:
    command: str
    commit: str
    threads: str
    returncode: int
    wall_seconds: float
    peak_rss_mib: float
    warm_start_steps: int | None = None
    warm_start_seconds: float | None = None
    demos_seconds: float | None = None
    evals: list[dict[str, float]] = field(default_factory=list)
    iterations: list[Iteration] = field(default_factory=list)


def parse_output(stamped: list[tuple[float, str]]) -> dict:
    """What the run's output lines say: the warm start's steps and seconds, the demonstrations' seconds, and each
    evaluation ``{when, iteration, success, episodes, at}`` (``at``: seconds since the start its line came)."""
    out: dict = {"evals": []}
    for at, line in stamped:
        if m := WARM_DONE.search(line):
            out["warm_start_steps"], out["warm_start_seconds"], out["warm_start_done_at"] = int(m.group(1)), float(m.group(2)), at
        elif WARM_CACHED.search(line):
            out["warm_start_done_at"] = at
        elif m := DEMOS.search(line):
            out["demos_seconds"] = float(m.group(2))
        elif m := EVAL.search(line):
            out["evals"].append({"when": m.group(1), "iteration": int(m.group(2)), "success": float(m.group(3)),
                                 "episodes": int(m.group(4)), "at": at})
    return out


def eval_seconds(evals: list[dict], warm_done_at: float | None, iteration_ends: dict[int, float]) -> list[dict]:
    """Each evaluation with ``seconds``: from the event before it (the warm start's end for the first, the end of
    the iteration it follows otherwise, both in seconds since the start) to its own line; None where unknown."""
    out = []
    for e in evals:
        before = warm_done_at if e["iteration"] == 0 else iteration_ends.get(e["iteration"])
        out.append({**e, "seconds": None if before is None else round(e["at"] - before, 1)})
    return out


def csv_iterations(rows: list[dict[str, str]]) -> list[Iteration]:
    """The update rows of a run's CSV (the ones with ``perf/update_seconds``), one :class:`Iteration` each."""
    found = []
    for row in rows:
        if not row.get("perf/update_seconds"):
            continue
        turns = float(row.get("rollout/turns") or "nan")
        episodes = float(row.get("rollout/trajectories") or "nan")
        found.append(Iteration(int(float(row["step"])), *(float(row[f"perf/{p}_seconds"]) for p in PHASES),
                               rows=turns * episodes, success=float(row.get("rollout/success") or "nan")))
    return sorted(found, key=lambda it: it.iteration)


def read_csv(folder: Path) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for path in sorted((folder / "csv").glob("version_*/metrics.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    return rows


def shard_ends(folder: Path, started: float) -> dict[int, float]:
    """Iteration (1-based) -> seconds since the start when its rollout shard was written (the iteration's end)."""
    return {int(p.stem.split("-")[1]): p.stat().st_mtime - started for p in (folder / "rollouts").glob("rollouts-*.tar")}


def run(overrides: list[str], out: Path, threads: str | None) -> tuple[int, float, float, list[tuple[float, str]], float]:
    """``train.py +experiment=smollm2 overrides output_dir=out``: (exit code, wall s, peak RSS MiB, stamped lines,
    start time as a Unix time). Output goes on to this terminal and into ``out/train.out``."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = threads
    cmd = [sys.executable, str(ROOT / "train.py"), "+experiment=smollm2", *overrides, f"output_dir={out}",
           "trainer.enable_progress_bar=false"]
    out.mkdir(parents=True, exist_ok=True)
    stamped: list[tuple[float, str]] = []
    started_unix, started = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        with (out / "train.out").open("w") as log:
            for line in proc.stdout:
                at = time.perf_counter() - started
                stamped.append((at, line.rstrip("\n")))
                log.write(f"[{at:8.1f}] {line}")
                log.flush()
                print(f"[{at:8.1f}] {line}", end="", flush=True)
        _, status, usage = os.wait4(proc.pid, 0)
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGINT)  # train.py's own handler checkpoints and stops between turns
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    scale = 1024 if sys.platform != "darwin" else 1024 * 1024  # ru_maxrss: KiB on Linux, bytes on macOS
    return proc.returncode, time.perf_counter() - started, usage.ru_maxrss / scale, stamped, started_unix


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout
    return f"{head or 'unknown'}{' plus uncommitted changes' if dirty.strip() else ''}"


def markdown(result: Result) -> str:
    """The run's figures as markdown: the split per iteration, the evaluations, wall time and peak RSS."""
    lines = [f"`{result.command}` at {result.commit}, OMP_NUM_THREADS={result.threads}, exit code {result.returncode}",
             "", f"wall {result.wall_seconds:.0f} s ({result.wall_seconds / 60:.1f} min), peak RSS {result.peak_rss_mib:.0f} MiB", ""]
    if result.warm_start_seconds is not None and result.warm_start_steps:
        lines.append(f"warm start: {result.warm_start_steps} steps in {result.warm_start_seconds:.0f} s "
                     f"({result.warm_start_seconds / result.warm_start_steps:.1f} s a step)"
                     + (f"; demonstrations {result.demos_seconds:.1f} s" if result.demos_seconds is not None else ""))
        lines.append("")
    if result.iterations:
        lines += ["| iteration | rows | rollout s | teacher scoring s | update s | total s | s per row | training success |",
                  "|---|---|---|---|---|---|---|---|"]
        for it in result.iterations:
            lines.append(f"| {it.iteration} | {it.rows:.0f} | {it.rollout:.1f} | {it.teacher:.1f} | {it.update:.1f} | "
                         f"{it.total:.1f} | {it.total / max(it.rows, 1):.2f} | {it.success:.2f} |")
        n = len(result.iterations)
        sums = {p: sum(getattr(it, p) for it in result.iterations) for p in PHASES}
        total = sum(sums.values())
        lines.append(f"| all {n} | {sum(it.rows for it in result.iterations):.0f} | "
                     + " | ".join(f"{sums[p]:.0f} ({100 * sums[p] / max(total, 1e-9):.0f}%)" for p in PHASES)
                     + f" | {total:.0f} | | |")
        lines.append("")
    if result.evals:
        lines += ["| evaluation | after iterations | greedy success | episodes | seconds |", "|---|---|---|---|---|"]
        for e in result.evals:
            lines.append(f"| {e['when']} | {e['iteration']} | {e['success']:.2f} | {e['episodes']} | {e['seconds']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # under runs/smollm2/: the warm start is cached in runs/smollm2/warm_start, shared with `train.py +experiment=smollm2`
    parser.add_argument("--out", type=Path, default=None, help="the run's folder (default runs/smollm2/bench-<UTC time>)")
    parser.add_argument("--threads", default=None, help="OMP_NUM_THREADS for the run (default: as set here)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--report", type=Path, default=None, help="write the markdown here")
    parser.add_argument("overrides", nargs="*", help="train.py overrides after --, e.g. num_iterations=2")
    args = parser.parse_args(argv)
    threads = args.threads or os.environ.get("OMP_NUM_THREADS") or "unset"
    if args.out is None:
        args.out = ROOT / "runs" / "smollm2" / time.strftime("bench-%Y-%m-%d_%H-%M-%S", time.gmtime())
    code, wall, rss, stamped, started_unix = run(args.overrides, args.out, args.threads)
    parsed = parse_output(stamped)
    ends = shard_ends(args.out, started_unix)
    result = Result(command="python train.py +experiment=smollm2 " + shlex.join(args.overrides), commit=commit(),
                    threads=threads, returncode=code, wall_seconds=wall, peak_rss_mib=rss,
                    warm_start_steps=parsed.get("warm_start_steps"), warm_start_seconds=parsed.get("warm_start_seconds"),
                    demos_seconds=parsed.get("demos_seconds"),
                    evals=eval_seconds(parsed["evals"], parsed.get("warm_start_done_at"), ends),
                    iterations=csv_iterations(read_csv(args.out)))
    text = markdown(result)
    print("\n" + text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(result)
        data["iteration_ends_s"] = ends
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
