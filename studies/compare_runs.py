"""Do two runs of one config and seed agree: the same episodes, the same logged metrics, the same evaluations?

    python studies/compare_runs.py RUN_A RUN_B [--out PATH]

Per iteration that either run has, it compares:
- the rollout shard (``rollouts/rollouts-<iteration>.tar``): every episode's JSON, byte for byte;
- the iteration's train row in the CSV: every column except ``perf/*`` (timings);
- the evaluation after the iteration: every ``eval/`` column.

A resumed run logs under several ``csv/version_*``; for each iteration the row of the later version wins.
Prints a markdown table with one line per iteration. Each cell reads "same", "differs", or "–" where one run lacks it.
It names the columns that differ.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: studies/ is a package under the repository root
    sys.path.insert(0, str(ROOT))

from studies.common import log_rows  # noqa: E402

MISSING = "–"


def shard_digests(run: Path) -> dict[int, dict[str, str]]:
    """Iteration -> {member name: sha256 of its bytes} of each rollout shard the run wrote."""
    out: dict[int, dict[str, str]] = {}
    for path in sorted((run / "rollouts").glob("rollouts-*.tar")):
        with tarfile.open(path) as tar:
            out[int(path.stem.split("-")[1])] = {m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest()
                                                 for m in tar.getmembers() if m.isfile()}
    return out


def csv_rows(run: Path) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """(iteration -> train row, iteration -> evaluation row), each row its non-empty cells; later versions win."""
    train: dict[int, dict[str, float]] = {}
    evals: dict[int, dict[str, float]] = {}
    for row in log_rows(run):
        if "eval/iteration" in row:
            evals[int(row["eval/iteration"])] = {k: v for k, v in row.items() if k.startswith("eval/")}
        elif "perf/update_seconds" in row:
            train[int(row["step"])] = {k: v for k, v in row.items() if not k.startswith("perf/")}
    return train, evals


def differing(a: dict, b: dict) -> list[str]:
    """The keys whose values differ, or that only one side has (NaN on both sides is the same value: a metric with
    nothing to average logs NaN in either run)."""
    def same(x, y) -> bool:
        return x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)

    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not same(a[k], b[k]))


def _cell(a: dict | None, b: dict | None, what: str) -> tuple[str, list[str]]:
    if a is None or b is None:
        return MISSING, []
    keys = differing(a, b)
    return ("same", []) if not keys else ("differs", [f"{what}: {k}" for k in keys])


def compare(run_a: Path, run_b: Path) -> tuple[str, bool]:
    """The markdown table, and whether every iteration both runs have agrees in every part."""
    shards = shard_digests(run_a), shard_digests(run_b)
    (train_a, eval_a), (train_b, eval_b) = csv_rows(run_a), csv_rows(run_b)
    iterations = sorted(set(shards[0]) | set(shards[1]) | set(train_a) | set(train_b) | set(eval_a) | set(eval_b))
    lines = [f"A: `{run_a}`; B: `{run_b}`", "",
             "| iteration | episodes (shard) | train row | evaluation | greedy success A / B | what differs |",
             "|---|---|---|---|---|---|"]
    agree = True
    for it in iterations:
        parts = [_cell(shards[0].get(it), shards[1].get(it), "episode"), _cell(train_a.get(it), train_b.get(it), "train"),
                 _cell(eval_a.get(it), eval_b.get(it), "eval")]
        agree &= all(cell != "differs" for cell, _ in parts)
        success = " / ".join(f"{100 * e[it]['eval/success']:.0f}%" if it in e and "eval/success" in e[it]
                             else MISSING for e in (eval_a, eval_b))
        what = [k for _, keys in parts for k in keys]
        shown = ", ".join(what[:4]) + (f" and {len(what) - 4} more" if len(what) > 4 else "")
        lines.append(f"| {it} | {' | '.join(cell for cell, _ in parts)} | {success} | {shown} |")
    return "\n".join(lines), agree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    for run in (args.run_a, args.run_b):
        if not (run / "csv").is_dir():
            raise SystemExit(f"{run}: no csv/ folder; give a run's output_dir (it holds csv/ and rollouts/)")
    text, agree = compare(args.run_a, args.run_b)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
