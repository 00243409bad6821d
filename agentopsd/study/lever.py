"""How far a multiplier method moved its turn advantages, read from a run's rollout shards.

    python -m agentopsd.study.lever results/ladder/runs/KeyDoorBoxS9-oracle-s* results/ladder/credit_data/KeyDoorBoxS9-*

For each run (a run folder with ``rollouts/*.tar``, or a ladder archive with ``rollouts/*.tar.xz``) over the
logged turns of trajectories with ``A_seq != 0`` (the others get 0 whatever the multiplier): the mean of
``|w_k - 1|``, the share of turns at the band's edge, and the mean relative move of the turn advantage,
``|At_k / A_seq - 1| = lam |w_k - 1|``; and the mean multiplier by outcome and by the sign of the turn's
evidence (for the oracle, the sign of the expert's gain: progress > 0, wasted 0, a step away or fatal < 0).
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import statistics
import tarfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import yaml


def records(run: Path) -> Iterator[dict]:
    """The trajectory records of a run's shards, plain or xz-compressed, in shard order."""
    for shard in sorted((run / "rollouts").glob("rollouts-*.tar*")):
        data = shard.read_bytes()
        if shard.suffix == ".xz":
            data = lzma.decompress(data)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    yield json.loads(tar.extractfile(member).read())


def lever(run: Path) -> dict:
    """The summary of one run (see the module docstring); empty when it logged no multipliers."""
    algo = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["algorithm"]
    lam, band = float(algo.get("mult_lambda", 0.0)), float(algo.get("mult_band", 0.0))
    dev: list[float] = []
    by_class: dict[str, list[float]] = defaultdict(list)
    for rec in records(run):
        if rec["seq_advantage"] == 0:
            continue
        outcome = "won" if rec["success"] else "lost"
        for turn in rec["turns"]:
            if "multiplier" not in turn:
                continue
            w = turn["multiplier"]
            dev.append(abs(w - 1))
            e = turn.get("evidence", 0.0)
            by_class[f"{outcome}, e{'>' if e > 1e-9 else '<' if e < -1e-9 else '='}0"].append(w)
    if not dev:
        return {}
    out = {"run": run.name, "algorithm": algo.get("name", ""), "lambda": lam, "band": band, "turns": len(dev),
           "mean |w-1|": statistics.fmean(dev), "at band edge": statistics.fmean(d >= band - 1e-6 for d in dev),
           "mean |At/A-1|": lam * statistics.fmean(dev)}
    for key in sorted(by_class):
        out[f"w ({key})"] = (statistics.fmean(by_class[key]), len(by_class[key]))
    return out


def table(rows: list[dict]) -> str:
    """A markdown table of :func:`lever` rows."""
    classes = sorted({k for r in rows for k in r if k.startswith("w (")})
    head = ["run", "lambda", "band", "turns", "mean |w-1|", "at band edge", "mean |At/A-1|", *classes]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [r["run"], f"{r['lambda']:g}", f"{r['band']:g}", str(r["turns"]), f"{r['mean |w-1|']:.3f}",
                 f"{r['at band edge']:.3f}", f"{r['mean |At/A-1|']:.3f}"]
        cells += [f"{r[c][0]:.3f} ({r[c][1]})" if c in r else "" for c in classes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    rows = [r for r in (lever(run) for run in args.runs) if r]
    text = table(rows)
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
