"""Why a quickstart run unlearns: per iteration, what the update saw and what the policy does at the decisive turn.

    python train.py seed=0 checkpoint.every_n_iterations=1 checkpoint.keep_policies=true rollout_log.max_samples=64
    python studies/quickstart_diagnose.py runs/quickstart/latest [more run folders] --out OUT

The run must keep its policy at every iteration (``checkpoint.every_n_iterations=1
checkpoint.keep_policies=true``) and log every trajectory of the batch (``rollout_log.max_samples=64``,
tasks x copies); neither setting changes what is trained. Per iteration it reads:

- from the CSV log: training success (sampled), greedy evaluation success, clip fraction, gradient
  norm, approximate KL and learning rate of the update;
- from the rollout shard (the batch the update trained on): the share of groups whose members all won
  or all lost (zero advantage: no gradient), the share of groups with exactly one failure, and the sign
  balance of the advantages that remain, summed over turns (each turn's action is a few tokens, so
  turns stand for the token-mean's weights): what share of the advantage mass is negative, and the net
  advantage put on the "pick up" turns;
- from the kept policy (``checkpoints/policy-<iteration>.pt``; the warm start's for iteration 0): on
  the warm start's demonstration states where the expert picks the object up (the decisive turn, the
  one the demonstrator's habit gets wrong), the probability of "pick up" and of "toggle" among the
  admissible replies, the entropy of that distribution (nats) and the share of those states where
  "pick up" is the greedy choice; and the mean probability of "pick up" on the other states (a policy
  collapsing onto "pick up everywhere" shows there first).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: studies/ is a package under the repository root
    sys.path.insert(0, str(ROOT))

from studies.common import log_rows  # noqa: E402

DECISIVE = "pick up"  # the expert's action at the decisive turn of PickupObj
HABIT = "toggle"  # what the flawed demonstrator does there instead



# ------------------------------------------------------------------ the batch the update saw (pure)


def group_stats(records: list[dict]) -> dict[str, float]:
    """What one iteration's batch gave the update, from its logged trajectories (every one of the batch).

    ``zero_adv_groups``: share of groups whose members all won or all lost (all advantages 0);
    ``one_failure_groups``: share with exactly one failure among two or more members;
    ``neg_mass``: negative share of the summed |turn advantage| (0.5 = balanced);
    ``pickup_net``: summed advantage of the turns whose action was "pick up", per trajectory;
    ``failure_turn_share``: share of the non-zero-advantage turns that belong to failed episodes.
    """
    groups: dict[object, list[bool]] = defaultdict(list)
    for rec in records:
        groups[rec["group"]].append(bool(rec["success"]))
    pos = neg = pickup = 0.0
    fail_turns = live_turns = 0
    for rec in records:
        for turn in rec["turns"]:
            adv = float(turn.get("advantage", rec.get("seq_advantage", 0.0)))
            pos += max(adv, 0.0)
            neg += max(-adv, 0.0)
            if adv != 0.0:
                live_turns += 1
                fail_turns += not rec["success"]
            if turn.get("action") == DECISIVE:
                pickup += adv
    sizes = [len(v) for v in groups.values()]
    n_groups = max(len(groups), 1)
    return {
        "trajectories": float(len(records)),
        "groups": float(len(groups)),
        "group_size": float(statistics.fmean(sizes)) if sizes else float("nan"),
        "zero_adv_groups": sum(len(set(v)) == 1 for v in groups.values()) / n_groups,
        "one_failure_groups": sum(len(v) > 1 and v.count(False) == 1 for v in groups.values()) / n_groups,
        "neg_mass": neg / (pos + neg) if pos + neg > 0 else float("nan"),
        "pickup_net": pickup / max(len(records), 1),
        "failure_turn_share": fail_turns / live_turns if live_turns else float("nan"),
    }


def action_stats(probs: list[dict[str, float]]) -> dict[str, float]:
    """Mean over states of each state's distribution over its admissible actions: p(pick up), p(toggle),
    the entropy (nats) and the share of states whose most likely action is "pick up"."""
    if not probs:
        return {"p_pickup": float("nan"), "p_toggle": float("nan"), "entropy": float("nan"), "greedy_pickup": float("nan")}
    return {
        "p_pickup": statistics.fmean(p.get(DECISIVE, 0.0) for p in probs),
        "p_toggle": statistics.fmean(p.get(HABIT, 0.0) for p in probs),
        "entropy": statistics.fmean(-sum(q * math.log(q) for q in p.values() if q > 0) for p in probs),
        # strictly above every other action: a tie is not yet the flip
        "greedy_pickup": statistics.fmean(p.get(DECISIVE, 0.0) > max((q for a, q in p.items() if a != DECISIVE), default=0.0)
                                          for p in probs),
    }


# ------------------------------------------------------------------ reading a run


def read_shard(path: Path) -> list[dict]:
    """The trajectory records of one rollout shard (callbacks/rollout_logging.py)."""
    import tarfile

    with tarfile.open(path) as tar:
        return [json.loads(tar.extractfile(m).read()) for m in tar.getmembers() if m.name.endswith(".json")]


def log_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """iteration -> the CSV log's metrics of that iteration's update and evaluation."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for row in log_rows(run_dir):
        if "rollout/iteration" in row:
            it = int(row["rollout/iteration"])
            for key in ("rollout/success", "loss/clip_frac", "loss/grad_norm", "loss/approx_kl", "loss/lr", "loss/entropy"):
                if key in row:
                    out[it][key] = row[key]
        if "eval/iteration" in row and "eval/success" in row:
            out[int(row["eval/iteration"])]["eval/success"] = row["eval/success"]
    return dict(out)


def first_arrival(sample: dict) -> bool:
    """The expert picks up here and the demonstrator has just arrived (its last action was a move, not a toggle
    or a pick-up that the habit or the noise spoiled): the decisive turn as the student meets it."""
    return sample["expert"] == DECISIVE and (not sample["history"] or sample["history"][-1]["action"] not in (DECISIVE, HABIT))


def probe_states(run_dir: Path, count: int) -> tuple[list[dict], list[dict]]:
    """Up to ``count`` demonstration states of the decisive turn (first arrivals) and as many where the expert moves."""
    shards = sorted((run_dir / "warm_start").glob("demos-*.tar"))
    if not shards:
        raise SystemExit(f"{run_dir}: no warm_start/demos-*.tar (the warm start's demonstrations) to probe the policy on")
    samples = [s for s in read_shard(shards[0]) if s.get("admissible")]
    decisive = [s for s in samples if first_arrival(s)][:count]
    other = [s for s in samples if s["expert"] not in (DECISIVE, HABIT)][:count]
    return decisive, other


def policy_paths(run_dir: Path) -> dict[int, Path]:
    """iteration -> kept policy (the warm start's cached weights are iteration 0)."""
    paths = {int(p.stem.split("-")[1]): p for p in (run_dir / "checkpoints").glob("policy-*.pt") if p.stem.split("-")[1].isdigit()}
    warm = sorted((run_dir / "warm_start").glob("policy-*.pt"))
    if warm:
        paths.setdefault(0, warm[0])
    return dict(sorted(paths.items()))


def distributions(run_dir: Path, policies: dict[int, Path], states: list[dict]) -> dict[int, list[dict[str, float]]]:
    """Per kept policy, each state's distribution over its admissible actions (reply log-probabilities, softmax at temperature 1)."""
    import torch

    from agentopsd.models.warmstart import action_scores
    from agentopsd.rollout.prompts import HistoryEntry, PromptBuilder
    from agentopsd.tools.export import load_policy_from_checkpoint

    out: dict[int, list[dict[str, float]]] = {}
    model = tokenizer = builder = None
    for it, path in policies.items():
        if model is None:
            model, tokenizer, cfg, _ = load_policy_from_checkpoint(path, run_dir)
            env = cfg.env
            builder = PromptBuilder(tokenizer, output_format=env.output_format, history_window=env.history_window,
                                    max_prompt_tokens=env.max_prompt_tokens, show_admissible=env.get("show_admissible", True),
                                    **({"system_prompt": env.system_prompt} if env.get("system_prompt") is not None else {}))
            prompts = [builder.build(s["task"], [HistoryEntry(h["observation"], h["action"]) for h in s["history"]], s["observation"],
                                     s["admissible"]) for s in states]
        else:
            from agentopsd.tools.export import read_policy_state

            model.load_state_dict(read_policy_state(path)[0], strict=False)
        rows = []
        for prompt, s in zip(prompts, states):
            p = torch.softmax(action_scores(model, tokenizer, prompt, s["admissible"]).double(), 0).tolist()
            rows.append(dict(zip(s["admissible"], p)))
        out[it] = rows
    return out


def diagnose(run_dir: Path, probe: int) -> list[dict[str, float]]:
    """One row per iteration: the log's metrics, the batch's group statistics, the policy at the decisive turn."""
    metrics = log_metrics(run_dir)
    decisive, other = probe_states(run_dir, probe)
    policies = policy_paths(run_dir)
    dec = distributions(run_dir, policies, decisive)
    oth = distributions(run_dir, policies, other)
    rows = []
    for it in sorted(set(metrics) | set(policies)):
        row: dict[str, float] = {"iteration": float(it), **metrics.get(it, {})}
        shard = run_dir / "rollouts" / f"rollouts-{it:06d}.tar"
        if shard.exists():
            row.update({f"batch/{k}": v for k, v in group_stats(read_shard(shard)).items()})
        if it in dec:
            row.update({f"decisive/{k}": v for k, v in action_stats(dec[it]).items()})
            row["other/p_pickup"] = action_stats(oth[it])["p_pickup"]
        rows.append(row)
    return rows


# ------------------------------------------------------------------ the table


COLUMNS = [  # (key, header, format)
    ("iteration", "it", "{:.0f}"), ("eval/success", "greedy eval", "pct"), ("rollout/success", "train success", "pct"),
    ("decisive/p_pickup", "p(pick up) decisive", "{:.2f}"), ("decisive/p_toggle", "p(toggle) decisive", "{:.2f}"),
    ("decisive/entropy", "entropy decisive", "{:.2f}"), ("decisive/greedy_pickup", "greedy pick up", "pct"),
    ("other/p_pickup", "p(pick up) elsewhere", "{:.2f}"),
    ("batch/zero_adv_groups", "zero-adv groups", "pct"), ("batch/one_failure_groups", "1-failure groups", "pct"),
    ("batch/neg_mass", "neg. adv mass", "pct"), ("batch/failure_turn_share", "failed turns", "pct"),
    ("batch/pickup_net", "net adv on pick up", "{:+.2f}"),
    ("loss/clip_frac", "clip frac", "{:.3f}"), ("loss/grad_norm", "grad norm", "{:.2f}"), ("loss/approx_kl", "approx KL", "{:.4f}"),
    ("loss/lr", "lr", "{:.2g}"),
]


def _cell(value: float | None, fmt: str) -> str:
    if value is None or value != value:
        return ""
    return f"{100 * value:.0f}" if fmt == "pct" else fmt.format(value)


def markdown(name: str, rows: Iterable[dict[str, float]]) -> str:
    """One run's rows as a markdown table (percentages as whole numbers)."""
    rows = list(rows)
    cols = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    lines = [f"### {name}", "", "| " + " | ".join(h for _, h, _ in cols) + " |", "|---" * len(cols) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(k), f) for k, _, f in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (output_dir of train.py)")
    parser.add_argument("--probe", type=int, default=200, help="decisive (and other) demonstration states to probe each policy on")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here (and <out>.csv beside it)")
    args = parser.parse_args(argv)
    text, flat = [], []
    for run in args.runs:
        rows = diagnose(run.resolve(), args.probe)
        text.append(markdown(run.name, rows))
        flat += [{"run": run.name, **r} for r in rows]
    print("\n".join(text))
    if args.out:
        args.out.write_text("\n".join(text))
        keys = list(dict.fromkeys(k for r in flat for k in r))
        with args.out.with_suffix(".csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(flat)


if __name__ == "__main__":
    sys.exit(main())
