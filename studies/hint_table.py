"""What the hint does: on the expert's states, the expert action's log-prob with and without the skill block.

    python studies/hint_table.py --tasks 50 --out results/hint_table                        # tiny, initial weights
    python studies/hint_table.py --tasks 50 --weights results/.../warm_start/policy-X.pt --out results/hint_table
    python studies/hint_table.py --tasks 10 model=smollm2-135m --out results/hint_table      # SmolLM2 zero-shot

The config is the one ``train.py`` composes from the same overrides (default: the quickstart, BabyAI
PickupObj with the tiny model), the model is built as train.py builds it (seeded, then ``--weights``
loaded, as ``warm_start.weights=`` does), and the environment's expert plays training tasks 0..N-1. On
every state it acts in, both prompt views are built by the trainer's own PromptBuilder and skill bank,
and the expert's reply ``<action>a</action>`` is scored under each by the scorer's no-grad forward
(``agentopsd.rollout.scoring.continuation_logprobs``) at ``--temperature``. The table splits turns by
whether a skill applies (the block names the expert's action; see ``agentopsd.study.hint_table``) and
by decisive turn (the expert's action wins) vs the others.

Appends: each policy's rows replace that policy's earlier rows in ``<out>/table.csv`` (same label, env,
tasks and temperature), the others stay; ``table.md`` is rewritten from the whole CSV, and every turn's
numbers go to ``<out>/turns/<label>.csv``.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentopsd.study.hint_table import SPLITS, ScoredTurn, SplitSummary, in_split, summarize  # noqa: E402

FIELDS = ["label", "model", "stage", "weights", "env", "tasks", "temperature", "split", "turns", "tasks_with_turns",
          "lp_without", "lp_with", "diff", "diff_low", "diff_high", "share_raised", "rel_diff", "rel_low", "rel_high",
          "top_without", "top_with", "named_diff", "named_low", "named_high", "named_turns", "commit"]
PENDING = {"smollm2-135m": "not yet run (needs the smollm2 recipe's warm start)"}
"""Rows the table must show as missing, by model, until an after-warm-start row of that model exists."""


def row_key(row: dict) -> tuple[str, str, str, str]:
    """A policy's identity in table.csv: its rows replace earlier rows with the same key."""
    return (str(row["label"]), str(row["env"]), str(row["tasks"]), f"{float(row['temperature']):g}")


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` without the policies ``new`` measures again, then ``new`` (a rerun replaces, never duplicates)."""
    fresh = {row_key(r) for r in new}
    return [r for r in old if row_key(r) not in fresh] + list(new)


def summary_row(base: dict, s: SplitSummary, named_turns: int) -> dict:
    return {**base, "split": s.split, "turns": s.turns, "tasks_with_turns": s.tasks,
            "lp_without": f"{s.lp_without:.4f}", "lp_with": f"{s.lp_with:.4f}", "diff": f"{s.diff.mean:.4f}",
            "diff_low": f"{s.diff.low:.4f}", "diff_high": f"{s.diff.high:.4f}", "share_raised": f"{s.share_raised:.3f}",
            "rel_diff": f"{s.rel_diff.mean:.4f}", "rel_low": f"{s.rel_diff.low:.4f}", "rel_high": f"{s.rel_diff.high:.4f}",
            "top_without": f"{s.top_without:.3f}", "top_with": f"{s.top_with:.3f}", "named_diff": f"{s.named_diff.mean:.4f}",
            "named_low": f"{s.named_diff.low:.4f}", "named_high": f"{s.named_diff.high:.4f}", "named_turns": named_turns}


def _num(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def same_turns(a: dict | None, b: dict | None) -> bool:
    """Two splits of one policy that hold the same turns (their counts and means agree): one line shows both."""
    keys = ("turns", "tasks_with_turns", "lp_without", "lp_with", "diff", "rel_diff")
    return a is not None and b is not None and all(a.get(k) == b.get(k) for k in keys)


def markdown(rows: list[dict]) -> str:
    """table.md: per env, one line per (policy, split), and the pending rows (``PENDING``) still missing. Where a
    policy's decisive turns are exactly its applies turns (PickupObj: the pick-up wins), one line says both."""
    lines = ["# What the hint does", "",
             "On the expert's states: the expert reply's log-prob (summed over its tokens) without the skill block "
             "(student view) and with it (teacher view), their mean difference with a 95% bootstrap interval "
             "resampling whole tasks, and the share of turns where the block raised it; then the same difference "
             "for the expert's log-prob among the env's actions' replies only (log-softmax over the seven "
             "`<action>a</action>` replies: what is left once a block that makes every reply likelier or "
             "unlikelier is factored out), and the share of turns where the expert's reply is the likeliest of "
             "them without and with the block; last, the shift of the log share the actions the block names (quoted) "
             "hold among the replies, over the split's turns whose block names one: on the `none` turns (the block "
             "names an action the expert does not take there) a positive shift is the block pulling toward what it "
             "names whatever the state, i.e. copying, not reading the hint's condition. `applies`: the block names the expert's action; `decisive`: the "
             "expert's action wins the episode. Written by "
             "`studies/hint_table.py`; see README.md for the commands and what this can and cannot say.", ""]
    head = ("| model | stage | weights | split | turns (tasks) | log p without | log p with | difference [95% CI] | share raised "
            "| difference among actions [95% CI] | expert on top: without -> with | named actions' shift [95% CI] |")
    for env in sorted({r["env"] for r in rows}):
        mine = [r for r in rows if r["env"] == env]
        temps = sorted({f"{float(r['temperature']):g}" for r in mine})
        lines += [f"## {env} (temperature {', '.join(temps)}; {', '.join(sorted({r['tasks'] for r in mine}))} training tasks)",
                  "", head, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        by_split = {(r["label"], r["split"]): r for r in mine}
        for r in mine:
            twin = {"decisive": "applies", "other": "none"}.get(r["split"])
            if twin and same_turns(r, by_split.get((r["label"], twin))):
                continue  # said on the twin's line
            split = r["split"]
            if r["split"] in ("applies", "none") and same_turns(r, by_split.get((r["label"], {"applies": "decisive", "none": "other"}[split]))):
                split += " = decisive" if split == "applies" else " = other"
            if int(r["turns"]) == 0:
                cells = "0 | - | - | - | - | - | - | -"
            else:
                cells = (f"{r['turns']} ({r['tasks_with_turns']}) | {_num(r['lp_without']):.3f} | {_num(r['lp_with']):.3f} | "
                         f"{_num(r['diff']):+.3f} [{_num(r['diff_low']):+.3f}, {_num(r['diff_high']):+.3f}] | "
                         f"{_num(r['share_raised']):.2f} | {_num(r['rel_diff']):+.3f} [{_num(r['rel_low']):+.3f}, "
                         f"{_num(r['rel_high']):+.3f}] | {_num(r['top_without']):.2f} -> {_num(r['top_with']):.2f} | "
                         + (f"{_num(r['named_diff']):+.3f} [{_num(r['named_low']):+.3f}, {_num(r['named_high']):+.3f}]"
                            if int(r.get("named_turns") or 0) else "-"))
            lines.append(f"| {r['model']} | {r['stage']} | {short_path(r['weights'])} | {split} | {cells} |")
        for model, why in PENDING.items():
            if not any(r["model"] == model and r["stage"] == "after warm start" for r in mine):
                lines.append(f"| {model} | after warm start | - | all | {why} | | | | | | | |")
        lines.append("")
    return "\n".join(lines)


def short_path(path: str, parts: int = 3) -> str:
    """The last ``parts`` components of a weights path (the run, its folder, the file): the CSV keeps it whole."""
    return "/".join(Path(path).parts[-parts:])


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_outputs(out: Path, new: list[dict], turns: list[ScoredTurn], label: str) -> str:
    """Merge ``new`` into table.csv, rewrite table.md, and keep this policy's turns; returns table.md's text."""
    out.mkdir(parents=True, exist_ok=True)
    rows = merge_rows(read_rows(out / "table.csv"), new)
    with open(out / "table.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    text = markdown(rows)
    (out / "table.md").write_text(text)
    (out / "turns").mkdir(exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")
    with open(out / "turns" / f"{slug}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task_index", "turn", "expert", "block", "applies", "decisive", "lp_without", "lp_with", "diff",
                         "reply_tokens", "rel_without", "rel_with", "top_without", "top_with", "named_without", "named_with"])
        for t in turns:
            writer.writerow([t.task_index, t.turn, t.expert, int(bool(t.skill)), int(t.applies), int(t.decisive), f"{t.lp_without:.5f}",
                             f"{t.lp_with:.5f}", f"{t.diff:.5f}", t.reply_tokens, f"{t.rel_without:.5f}", f"{t.rel_with:.5f}",
                             int(t.top_without), int(t.top_with), f"{t.named_without:.5f}", f"{t.named_with:.5f}"])
    return text


def describe_weights(weights: Path | None) -> str:
    """The weights column: a path relative to the repository where it lies inside it."""
    if weights is None:
        return "initial"
    try:
        return str(weights.resolve().relative_to(ROOT))
    except ValueError:
        return str(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=50, help="training tasks 0..N-1 the expert plays")
    parser.add_argument("--weights", type=Path, default=None,
                        help="a policy-*.pt to load after the model is built (a warm start); default warm_start.weights, else none")
    parser.add_argument("--label", default=None, help="the policy's name in the table (default: model, stage and weights)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="log softmax(logits / T); 1 is the model's own distribution (the trainer scores at rollout.temperature)")
    parser.add_argument("--max-seconds", type=float, default=0.0,
                        help="stop after the task in progress once this many seconds have passed and write the tasks done (0: no limit)")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples over tasks")
    parser.add_argument("--out", type=Path, default=None, help="folder for table.csv, table.md and turns/")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as train.py takes them (model=smollm2-135m, seed=1, ...)")
    args = parser.parse_args()
    if args.tasks < 1:
        parser.error(f"--tasks must be >= 1, got {args.tasks}")

    import lightning as L
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import agentopsd.envs  # noqa: F401  (registers the agentopsd/* env ids)
    from agentopsd.rollout.factory import prompt_builder, skill_bank
    from agentopsd.study.groundtruth import make_env
    from agentopsd.study.hint_table import expert_turns, score_turns
    from agentopsd.tools.eval_cli import compose

    cfg = compose(args.overrides)
    env_cfg = instantiate(cfg.env)
    weights = args.weights or (Path(cfg.warm_start.weights) if cfg.get("warm_start") and cfg.warm_start.get("weights") else None)
    if weights is not None and not weights.is_file():
        raise SystemExit(f"--weights {weights}: no such file (pass a policy-*.pt a warm start saved)")
    L.seed_everything(cfg.seed, workers=True)  # as train.py: the initial weights are the run's own
    model, tokenizer = instantiate(OmegaConf.to_container(cfg.model, resolve=True))
    if weights is not None:
        model.load_state_dict(torch.load(weights, map_location="cpu"))
    model.eval()
    model_name = str(cfg.hydra.runtime.choices.model)
    stage = "after warm start" if weights is not None else "before warm start"
    label = args.label or f"{model_name} {stage} {describe_weights(weights) if weights is not None else f'seed {cfg.seed}'}"
    builder = prompt_builder(tokenizer, env_cfg)
    bank = skill_bank(env_cfg)
    if bank is None:
        raise SystemExit(f"env {env_cfg.id} has no skill bank (env.skills): there is no hint to measure")
    kwargs = dict(env_cfg.kwargs or {})
    if "BabyAI" in env_cfg.id:
        kwargs["compute_expert_steps"] = False  # the reset-time path length is not needed here
    env = make_env(env_cfg.id, env_cfg.max_turns, kwargs)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    t0 = time.perf_counter()
    turns: list[ScoredTurn] = []
    done = 0
    for i in range(args.tasks):
        turns += score_turns(model, tokenizer, builder, expert_turns(env, i, env_cfg.max_turns, bank), pad_id=pad_id,
                             temperature=args.temperature)
        done = i + 1
        if done % max(1, args.tasks // 10) == 0:
            print(f"{label}: {done}/{args.tasks} tasks, {len(turns)} turns ({time.perf_counter() - t0:.0f}s)", flush=True)
        if args.max_seconds and time.perf_counter() - t0 > args.max_seconds and done < args.tasks:
            print(f"{label}: --max-seconds {args.max_seconds:g} passed after {done} tasks; the table holds those", flush=True)
            break
    env.close()
    if builder.stats.get("skill_trimmed"):
        print(f"note: {builder.stats['skill_trimmed']} teacher views had their skill block shortened to fit env.max_prompt_tokens")
    longest = max(t.reply_tokens for t in turns)
    if longest > int(cfg.rollout.max_new_tokens):
        print(f"note: the longest expert reply is {longest} tokens, over rollout.max_new_tokens={cfg.rollout.max_new_tokens}: "
              "the generator could not emit it whole")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    mine = ["studies/hint_table.py", "agentopsd/study/hint_table.py"]  # this table's own code, edited but not committed
    if subprocess.run(["git", "status", "--porcelain", "--", *mine], cwd=ROOT, capture_output=True, text=True).stdout.strip():
        commit += "+dirty"
    start = "pretrained" if cfg.model.get("path") else f"initial (seed {cfg.seed})"  # before any warm start
    base = {"label": label, "model": model_name, "stage": stage, "weights": describe_weights(weights) if weights else start,
            "env": env_cfg.id.split("/")[-1], "tasks": str(done), "temperature": f"{args.temperature:g}", "commit": commit}
    new = [summary_row(base, summarize(turns, split, resamples=args.resamples),
                       sum(1 for t in turns if in_split(t, split) and not math.isnan(t.named_diff))) for split in SPLITS]
    text = markdown(new)
    if args.out is not None:
        text = write_outputs(args.out, new, turns, label)
    print(text)


if __name__ == "__main__":
    main()
