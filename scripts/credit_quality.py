"""Credit quality of finished runs: each logged turn signal against the BabyAI expert's ground truth.

    python scripts/credit_quality.py results/quickstart_seeds/runs/agentopsd-s* results/quickstart_seeds/runs/grpo-s* \\
        --out results/credit_quality

Every trajectory in a run's rollout shards is replayed from its task index (each observation
checked against the log), the bot's remaining path is measured before and after every turn, and
each turn's ground truth is the path it saved (fatal turns far below). For every logged signal
(the turn advantage; the evidence e_k and revision dB_k where the algorithm logs them) the table
gives the within-trajectory rank correlation and pairwise accuracy with 95% bootstrap intervals,
by algorithm x env x training stage (thirds of the run's logged iterations). ``uniform`` (A_seq on
every turn) is the chance line; the logged GRPO advantage is not uniform, because invalid-action and
format penalties belong to the turn that earned them.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tarfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import envs  # noqa: E402,F401  (registers the agentopsd/* env ids)
from agentopsd.credit_quality import credit_quality  # noqa: E402
from agentopsd.groundtruth import (  # noqa: E402
    LoggedTrajectory,
    expert_gain,
    expert_label,
    expert_path,
    make_env,
    replay,
)

STAGES = ("early", "mid", "late")
SIGNAL_ORDER = ("uniform", "advantage", "evidence", "revision")
"""``uniform``: A_seq on every turn (GRPO's credit without the per-turn penalties): the chance line, 0.5 exactly."""


def run_config(run: Path) -> dict:
    path = run / ".hydra" / "config.yaml"
    if not path.is_file():
        raise SystemExit(f"{run}: no .hydra/config.yaml; pass the output folder of a train.py run")
    return yaml.safe_load(path.read_text())


def load_run(run: Path) -> tuple[dict, list[LoggedTrajectory]]:
    cfg = run_config(run)
    shards = sorted((run / "rollouts").glob("rollouts-*.tar"))
    if not shards:
        raise SystemExit(f"{run}: no rollouts/rollouts-*.tar; was the run made with the rollout logging callback?")
    trajs = []
    for shard in shards:
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    rec = json.loads(tar.extractfile(member).read())
                    trajs.append(LoggedTrajectory.from_record(rec, run=run.name, algorithm=cfg["algorithm"]["name"]))
    return cfg, trajs


def stage_of(iteration: int, last: int) -> str:
    """Thirds of the run's logged iterations: early (right after the warm start), mid, late."""
    return STAGES[min(2, (iteration - 1) * 3 // max(last, 1))]


def label_run(cfg: dict, trajs: list[LoggedTrajectory]) -> list[tuple[LoggedTrajectory, list[float], list[str]]]:
    max_turns = int(cfg["env"]["max_turns"])
    env = make_env(cfg["env"]["id"], max_turns, {**cfg["env"].get("kwargs", {}), "compute_expert_steps": False})
    out = []
    for traj in trajs:
        path = expert_path(replay(env, traj, max_turns))
        pairs = list(zip(path[:-1], path[1:]))
        out.append((traj, [expert_gain(b, a) for b, a in pairs], [expert_label(b, a) for b, a in pairs]))
    env.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run output folders (with .hydra/ and rollouts/)")
    parser.add_argument("--margin", type=float, default=0.0, help="pairs count when their ground truth differs by more")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples over trajectories")
    parser.add_argument("--out", type=Path, default=None, help="folder for table.md and table.csv")
    args = parser.parse_args()

    # (algorithm, env, stage, signal) -> per-trajectory signal and truth rows
    cells: dict[tuple[str, str, str, str], tuple[list, list]] = defaultdict(lambda: ([], []))
    label_signal: dict[tuple[str, str], list[float]] = defaultdict(list)
    label_count: dict[tuple[str, str], int] = defaultdict(int)
    n_traj = 0
    for run in args.runs:
        cfg, trajs = load_run(run)
        last = max(t.iteration for t in trajs)
        for traj, gains, labels in label_run(cfg, trajs):
            n_traj += 1
            level = traj.env_id.split("/")[-1]
            stage = stage_of(traj.iteration, last)
            signals = {name: [t.signals[name] for t in traj.turns] for name in SIGNAL_ORDER[1:]
                       if all(name in t.signals for t in traj.turns)}
            signals["uniform"] = [traj.seq_advantage] * len(traj.turns)
            for name, values in signals.items():
                sig, tru = cells[(traj.algorithm, level, stage, name)]
                sig.append(values)
                tru.append(gains)
            for turn, label in zip(traj.turns, labels):
                label_count[(traj.algorithm, label)] += 1
                if "evidence" in turn.signals:
                    label_signal[(traj.algorithm, label)].append(turn.signals["evidence"])

    rows = []
    for (alg, level, stage, name), (sig, tru) in sorted(cells.items(), key=lambda kv: (
            kv[0][0], kv[0][1], STAGES.index(kv[0][2]), SIGNAL_ORDER.index(kv[0][3]))):
        q = credit_quality(sig, tru, margin=args.margin, resamples=args.resamples)
        rows.append({"algorithm": alg, "env": level, "stage": stage, "signal": name, "trajectories": len(sig),
                     "rank_corr": q.rank_correlation.fmt(), "rank_corr_n": q.rank_correlation.n,
                     "pairwise_acc": q.pairwise_accuracy.fmt(), "pairwise_n": q.pairwise_accuracy.n, "pairs": q.pairs})

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    command = "python scripts/credit_quality.py " + " ".join(sys.argv[1:])
    head = list(rows[0]) if rows else []
    lines = [f"Credit quality against the expert-progress ground truth ({n_traj} trajectories; margin {args.margin}; "
             f"95% bootstrap over trajectories). Commit {commit}.", "", f"    {command}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    lines += ["", "Turn labels (all stages): count and mean evidence e_k where logged.", "",
              "| algorithm | label | turns | mean evidence |", "|---|---|---|---|"]
    for (alg, label), count in sorted(label_count.items()):
        ev = label_signal.get((alg, label), [])
        lines.append(f"| {alg} | {label} | {count} | {np.mean(ev):.3f} |" if ev else f"| {alg} | {label} | {count} | n/a |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(text)
        with open(args.out / "table.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=head)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
