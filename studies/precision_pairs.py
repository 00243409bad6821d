"""Does ``model.dtype=auto`` (a bf16 base where the CPU computes bf16 natively) learn as float32 does, and how much
faster is it? The SmolLM2 recipe at each seed both ways, paired by seed.

    OMP_WAIT_POLICY=PASSIVE python studies/precision_pairs.py --seeds 0-4 --threads 1

Each seed runs ``benchmarks/smollm2_recipe.py --compare -- seed=S``: ``model.dtype=float32``, then the default
``auto``, one after the other in one process tree, so both meet the same machine. Each precision trains its own
warm start (a bf16 warm start is not the float32 one's weights), from the same demonstrations and task stream. A seed
whose JSON is under ``--out`` is not run again, so a later sitting continues where one stopped (a seed cut short
starts over).

Writes ``--out``/``s<seed>.json`` and ``.md`` (the benchmark's figures), and ``table.md``: per seed the greedy success
at each evaluation both ways, the wall-clock ratio and the rows each run's updates trained on (a run that learns
sooner skips more rows whose advantage is 0, which shortens its update whatever the precision); over the seeds the paired difference auto - float32 of the
final greedy success and of the area under the success curve, each with a 95% t interval, and the wall ratio's mean
and worst seed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: studies/ is a package under the repository root
    sys.path.insert(0, str(ROOT))

from agentopsd.study.stats import t_interval  # noqa: E402
from studies.common import parse_seeds  # noqa: E402

PRECISIONS = ("float32", "auto")
"""The benchmark's two runs per seed, the baseline first."""


def curve(result: dict) -> list[tuple[int, float]]:
    """(iteration, greedy success) of each evaluation of one run, in order (a resumed run's later line wins)."""
    by_iteration = {int(e["iteration"]): float(e["success"]) for e in result["evals"]}
    return sorted(by_iteration.items())


def area(result: dict) -> float:
    """The area under the greedy success curve over the run, per iteration (trapezoids; 1 = perfect throughout)."""
    points = curve(result)
    if len(points) < 2:
        return points[0][1] if points else float("nan")
    total = sum((i1 - i0) * (s0 + s1) / 2 for (i0, s0), (i1, s1) in zip(points, points[1:]))
    return total / (points[-1][0] - points[0][0])


def final(result: dict) -> float:
    points = curve(result)
    return points[-1][1] if points else float("nan")


def trained(result: dict) -> str:
    """Rows the run's updates trained on (nonzero advantage): the work the update's time follows ("?" where the
    benchmark's JSON predates the count)."""
    counts = [it.get("trained") for it in result.get("iterations", [])]
    if not counts or any(c is None or c != c for c in counts):
        return "?"
    return f"{sum(counts):.0f}"


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:+.1f}"


def _interval(values: list[float]) -> str:
    mean, lo, hi = t_interval(values, bounds=(-1.0, 1.0))
    if lo != lo:
        return f"{_pct(mean)} (one seed: no interval)"
    return f"{_pct(mean)} [{_pct(lo)}, {_pct(hi)}]"


def build_table(pairs: dict[int, dict], command_line: str) -> str:
    """The markdown table of every seed's pair (``pairs``: seed -> the benchmark's ``--compare`` JSON)."""
    lines = [f"Command: `{command_line}`", ""]
    commits = sorted({r["commit"][:12] for pair in pairs.values() for r in pair.values()})
    threads = sorted({str(r["threads"]) for pair in pairs.values() for r in pair.values()})
    lines += [f"Commits: {', '.join(commits) or 'none'}; OMP_NUM_THREADS: {', '.join(threads) or 'none'}; "
              f"seeds: {len(pairs)}", ""]
    lines += ["| seed | float32: greedy success at each evaluation | auto | float32 s | auto s | float32 s / auto s | "
              "rows the update trained: float32 / auto |", "|---|---|---|---|---|---|---|"]
    ratios, finals, areas = [], [], []
    for seed in sorted(pairs):
        f32, auto = pairs[seed]["float32"], pairs[seed]["auto"]
        ratio = f32["wall_seconds"] / auto["wall_seconds"]
        ratios.append(ratio)
        finals.append(final(auto) - final(f32))
        areas.append(area(auto) - area(f32))
        shown = [" / ".join(f"{100 * s:.0f}" for _, s in curve(r)) + "%" for r in (f32, auto)]
        lines.append(f"| {seed} | {shown[0]} | {shown[1]} | {f32['wall_seconds']:.0f} | {auto['wall_seconds']:.0f} | "
                     f"{ratio:.2f}x | {trained(f32)} / {trained(auto)} |")
    lines.append("")
    if ratios:
        lines += [f"Wall-clock ratio (float32 s / auto s): mean {sum(ratios) / len(ratios):.2f}x, worst seed "
                  f"{min(ratios):.2f}x, best {max(ratios):.2f}x.", ""]
        lines += ["Paired difference auto - float32 (points, mean and 95% t interval over the seeds):", "",
                  f"- final greedy success: {_interval(finals)}",
                  f"- area under the greedy success curve: {_interval(areas)}"]
    return "\n".join(lines) + "\n"


def read_pairs(out: Path) -> dict[int, dict]:
    pairs = {}
    for path in sorted(out.glob("s*.json")):
        if path.stem[1:].isdigit():
            pairs[int(path.stem[1:])] = json.loads(path.read_text())
    return pairs


def run_seed(out: Path, seed: int, threads: str, runs_dir: Path, overrides: list[str]) -> int:
    """The benchmark's ``--compare`` at ``seed``; its JSON lands under ``out`` only once both runs ended."""
    partial = out / f".s{seed}.json.partial"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "smollm2_recipe.py"), "--compare", "--threads", threads,
           "--out", str(runs_dir / f"s{seed}"), "--json", str(partial), "--report", str(out / f"s{seed}.md"),
           "--", f"seed={seed}", *overrides]
    code = subprocess.run(cmd, cwd=ROOT, env=os.environ.copy(), check=False).returncode
    if code == 0 and partial.exists():
        partial.rename(out / f"s{seed}.json")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", nargs="+", default=["0-4"])
    parser.add_argument("--threads", default="1", help="OMP_NUM_THREADS of every run")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "smollm2_speed" / "seeds")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "precision_pairs", help="the runs' folders")
    parser.add_argument("--table-only", action="store_true", help="rewrite table.md from the JSON under --out")
    parser.add_argument("overrides", nargs="*", help="train.py overrides after --, for both runs of every seed")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command_line = "python studies/precision_pairs.py " + " ".join(sys.argv[1:] if argv is None else argv)
    failed = []
    if not args.table_only:
        for seed in parse_seeds(args.seeds):
            if (args.out / f"s{seed}.json").exists():
                print(f"seed {seed}: done before, kept", flush=True)
                continue
            if run_seed(args.out, seed, args.threads, args.runs, args.overrides) != 0:
                failed.append(seed)
            (args.out / "table.md").write_text(build_table(read_pairs(args.out), command_line))
    (args.out / "table.md").write_text(build_table(read_pairs(args.out), command_line))
    if failed:
        print(f"seeds {failed}: a run failed; their logs are under {args.runs}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
