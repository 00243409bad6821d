"""Credit quality of finished runs: each logged turn signal against the BabyAI expert's ground truth.

    python studies/credit_quality.py results/quickstart_seeds/runs/agentopsd-s* results/quickstart_seeds/runs/grpo-s* \\
        --out results/credit_quality

Every trajectory in a run's rollout shards is replayed from its task index (each observation
checked against the log), the bot's remaining path is measured before and after every turn, and
each turn's ground truth is the path it saved (fatal turns far below). For every logged signal
(the turn advantage; the evidence e_k and revision dB_k where the algorithm logs them) the table
gives the within-trajectory rank correlation and pairwise accuracy with 95% bootstrap intervals,
by algorithm x env x training stage (thirds of the run's logged iterations). ``uniform`` (A_seq on
every turn) is the chance line; the logged GRPO advantage is not uniform, because invalid-action and
format penalties belong to the turn that earned them. ``credit`` (sign(A_seq) * w_k) is the credit
method's own ordering, without those penalties.
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

import agentopsd.envs  # noqa: E402,F401  (registers the agentopsd/* env ids)
from agentopsd.study.credit_quality import (  # noqa: E402
    cluster_bootstrap_mean,
    credit_quality,
    pair_classes,
    paired_accuracy_difference,
    pairwise_accuracy,
)
from agentopsd.study.credit_rules import RULES, LoggedGroup, rule_orderings  # noqa: E402
from agentopsd.study.groundtruth import (  # noqa: E402
    FORMAT_ERROR_PREFIX,
    LoggedTrajectory,
    LoggedTurn,
    expert_gain,
    expert_label,
    expert_path,
    format_note,
    generator_policy,
    make_env,
    mc_values,
    replay,
)

STAGES = ("early", "mid", "late")
EXPERT_CACHE = "expert-v2.json"
"""Where a run keeps its expert paths (``groundtruth/``). v2: a bot planned from a mid-episode state keeps a
key that opens a locked door and drops what it carries nearby; v1 dropped the key and fetched it again, so
picking up the key measured as a step backwards. A v1 file is never read."""
SIGNAL_ORDER = ("uniform", "advantage", "credit", "evidence", "revision")
"""``uniform``: A_seq on every turn (GRPO's credit without the per-turn penalties): the chance line, 0.5 exactly."""


def run_config(run: Path) -> dict:
    path = run / ".hydra" / "config.yaml"
    if not path.is_file():
        raise SystemExit(f"{run}: no .hydra/config.yaml; pass the output folder of a train.py run")
    return yaml.safe_load(path.read_text())


def load_run(run: Path) -> tuple[dict, list[LoggedTrajectory]]:
    cfg = run_config(run)
    # a run folder holds rollouts-*.tar; an archived run (studies/ladder.py's credit_data/) the same shards xz-compressed
    shards = sorted((run / "rollouts").glob("rollouts-*.tar")) or sorted((run / "rollouts").glob("rollouts-*.tar.xz"))
    if not shards:
        raise SystemExit(f"{run}: no rollouts/rollouts-*.tar(.xz); was the run made with the rollout logging callback?")
    trajs = []
    for shard in shards:
        with tarfile.open(shard) as tar:  # mode "r": plain or compressed, whichever the file is
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    rec = json.loads(tar.extractfile(member).read())
                    if not rec.get("teacher_scored", True):
                        # rollout.teacher_skip_zero_advantage: a group with A_seq = 0 logged no evidence, so every
                        # signal is read on the groups that have it (whole groups: A_seq = 0 is a group's property)
                        continue
                    trajs.append(LoggedTrajectory.from_record(rec, run=run.name, algorithm=cfg["algorithm"]["name"]))
    return cfg, trajs


def run_env(cfg: dict):
    """The run's env (its id, kwargs and turn limit), for replays."""
    kwargs = dict(cfg["env"].get("kwargs") or {})
    if "BabyAI" in cfg["env"]["id"]:
        kwargs["compute_expert_steps"] = False  # the label measures its own paths; the reset-time one is not needed
    return make_env(cfg["env"]["id"], int(cfg["env"]["max_turns"]), kwargs)


def stage_of(iteration: int, last: int) -> str:
    """Thirds of the run's logged iterations: early (right after the warm start), mid, late."""
    return STAGES[min(2, (iteration - 1) * 3 // max(last, 1))]


def turn_kind(bank, observation: str) -> str:
    """What the teacher view knew on a turn: the situations a turn-scoped skill bank saw in the observation
    (``routine`` when none: the two views were the same tokens), or ``skill`` for a bank that informs every turn."""
    if bank is None:
        return "none"
    if bank.scope != "turn":
        return "skill"
    return "+".join(bank.situational(observation).categories) or "routine"


def action_name(turn: LoggedTurn) -> str:
    """The action a turn took, for the evidence-by-action table: the env's action, ``(format error)``, or
    ``(invalid action)`` for text the env does not know (each garbled reply would be a row of its own)."""
    if not turn.stepped:
        return "(format error)"
    return turn.action if turn.valid else "(invalid action)"


def evidence_by_action(evidence: dict[tuple[str, str, str, str], list[float]]) -> list[str]:
    """Markdown rows of the mean evidence per (algorithm, informed turn kind, action), one column per stage.

    ``evidence[(algorithm, kind, action, stage)]``: the evidence e_k of those turns. Routine turns are left
    out (their two views are the same tokens: e_k = 0). A cell reads ``mean (turns)``; ``-`` where the stage
    had no such turn. This is where a teacher view shows what it knows: a skill that helps raises the right
    action's probability (e_k > 0) and lowers the wrong one's (e_k < 0) on the turns it is shown.
    """
    rows: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(dict)
    for (alg, kind, action, stage), values in evidence.items():
        if kind not in ("routine", "none") and values:
            rows[(alg, kind, action)][stage] = values
    out = ["| algorithm | kind | action | " + " | ".join(STAGES) + " | all |", "|---|---|---|" + "---|" * (len(STAGES) + 1)]
    for (alg, kind, action), by_stage in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                               -sum(map(len, kv[1].values())), kv[0][2])):
        cells = [f"{np.mean(by_stage[st]):+.2f} ({len(by_stage[st])})" if st in by_stage else "-" for st in STAGES]
        pooled = [v for values in by_stage.values() for v in values]
        out.append(f"| {alg} | {kind} | {action} | " + " | ".join(cells) + f" | {np.mean(pooled):+.2f} ({len(pooled)}) |")
    return out


def anchor_states(observations: list[str]) -> list[str]:
    """The environment state each turn acted on, from the observations shown before each turn: a format
    error's note is not a state (the env did not step), so the turn after one acted on the last real one."""
    out: list[str] = []
    for obs in observations:
        out.append(out[-1] if obs.startswith(FORMAT_ERROR_PREFIX) and out else obs)
    return out


def label_run(cfg: dict, trajs: list[LoggedTrajectory], run: Path | None = None,
              ) -> list[tuple[LoggedTrajectory, list[float], list[str], list[str], list[str]]]:
    """Per trajectory: the expert gain and label of every turn, the turn's kind (``turn_kind``) and the
    environment state it acted on (``anchor_states``). With ``run``, the expert's paths (the costly part)
    are kept in ``run/groundtruth/`` (``EXPERT_CACHE``) and read back."""
    from agentopsd.rollout.skills import SkillBank

    max_turns = int(cfg["env"]["max_turns"])
    env = run_env(cfg)
    skills = cfg["env"].get("skills")
    bank = SkillBank.for_env(skills) if skills else None
    cache = run / "groundtruth" / EXPERT_CACHE if run is not None else None
    saved: dict[str, list[int]] = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    fresh = False
    out = []
    for n, traj in enumerate(trajs):
        states = replay(env, traj, max_turns)
        key = f"{traj.iteration}:{n}:{traj.task_index}:{len(traj.turns)}"
        if key not in saved:
            saved[key], fresh = expert_path(states), True
        path = saved[key]
        pairs = list(zip(path[:-1], path[1:]))
        kinds = [turn_kind(bank, s.observation) for s in states[:-1]]
        out.append((traj, [expert_gain(b, a) for b, a in pairs], [expert_label(b, a) for b, a in pairs], kinds,
                    anchor_states([s.observation for s in states[:-1]])))
    env.close()
    if cache is not None and fresh:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.with_suffix(".tmp").write_text(json.dumps(saved))
        cache.with_suffix(".tmp").replace(cache)
    return out


def sampling_weights(run: Path, iteration: int) -> Path:
    """The weights that sampled ``iteration``: the warm start for iteration 1, else the policy kept after
    iteration - 1 (``checkpoint.keep_policies``)."""
    if iteration == 1:
        loaded = (run_config(run).get("warm_start") or {}).get("weights")
        if loaded:  # the run loaded a shared warm start (warm_start.weights) rather than training its own
            return Path(loaded)
        weights = sorted((run / "warm_start").glob("policy-*.pt"))
        if len(weights) != 1:
            raise SystemExit(f"{run}: expected one warm_start/policy-*.pt for the Monte Carlo truth, found {len(weights)}")
        return weights[0]
    path = run / "checkpoints" / f"policy-{iteration - 1:06d}.pt"
    if not path.is_file():
        kept = sorted(p.name for p in (run / "checkpoints").glob("policy-*.pt"))
        raise SystemExit(f"{run}: no {path.name} for the Monte Carlo truth of iteration {iteration} (kept: {kept or 'none'}); "
                         "train with checkpoint.keep_policies=true and pick iterations right after a checkpoint")
    return path


def warm_start_policy(run: Path, cfg: dict, seed: int, iteration: int = 1):
    """The policy that sampled ``iteration`` of the run (iteration 1: its warm start), behind the trainer's prompts."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from agentopsd.rollout.base import SamplingConfig
    from agentopsd.rollout.hf import HFGenerator
    from agentopsd.rollout.prompts import PromptBuilder

    weights = sampling_weights(run, iteration)
    full = OmegaConf.load(run / ".hydra" / "config.yaml")
    model, tokenizer = instantiate(OmegaConf.to_container(full.model, resolve=True))
    model.load_state_dict(torch.load(weights, map_location="cpu"))
    model.eval()
    env = cfg["env"]
    prompts = PromptBuilder(tokenizer, output_format=env["output_format"], history_window=env["history_window"],
                            max_prompt_tokens=env["max_prompt_tokens"], show_admissible=env["show_admissible"],
                            **({"system_prompt": env["system_prompt"]} if env.get("system_prompt") is not None else {}))
    roll = cfg["rollout"]
    sampling = SamplingConfig(max_new_tokens=roll["max_new_tokens"], temperature=roll["temperature"], top_p=roll["top_p"],
                              stop_strings=prompts.stop_strings)
    torch.manual_seed(seed)
    return generator_policy(HFGenerator(model, tokenizer), prompts, sampling), format_note(prompts)


def token_counter(run: Path, cfg: dict):
    """turn -> tokens its reply took, re-tokenised with the run's tokenizer from the logged action
    (``<action>a</action>``; a format error's raw text), or None where the run's format or model is not
    one this can rebuild (StepOPSD's mean gap divides by the count)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    if cfg.get("env", {}).get("output_format") != "action" or "model" not in cfg:
        return None
    full = OmegaConf.load(run / ".hydra" / "config.yaml")
    _, tokenizer = instantiate(OmegaConf.to_container(full.model, resolve=True))
    cap = int(cfg.get("rollout", {}).get("max_new_tokens", 10**6))

    def count(turn) -> int:
        text = f"<action>{turn.action}</action>" if turn.stepped else turn.action
        return min(cap, len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return count


def rule_rows(cfg: dict, labelled: list, make_counter) -> tuple[dict[int, dict[str, list]], float]:
    """Every credit rule recomputed on the run's whole logged groups (``credit_rules``): id(traj) -> rule ->
    the turn ordering, and the largest gap between the recomputed AgentOPSD ordering and the logged one
    (sign(A) * w_k; a fidelity check: the rules see what training saw).

    Turn token counts come from the logged token gaps, or, for runs that predate them, from
    ``make_counter()`` (``token_counter``; built once, when first needed; groups it cannot count are skipped)."""
    counter: list = []
    size = int(cfg.get("data", {}).get("group_size", 0))
    # the rules run at the shipped configs' settings; the check recomputes at the run's own (a wide lever's band)
    algo = cfg.get("algorithm") or {}
    own = {"gamma": float(algo.get("gap_decay_gamma", 0.95)), "band": float(algo.get("mult_band", 0.2))}
    groups: dict[tuple[int, int], list] = defaultdict(list)
    for item in labelled:
        traj = item[0]
        if traj.group >= 0 and all("evidence" in t.signals for t in traj.turns):
            groups[(traj.iteration, traj.group)].append(item)
    out: dict[int, dict[str, list]] = {}
    worst = 0.0
    for members in groups.values():
        if len(members) != size:  # the prior and GiGPO's step groups need the whole group
            continue
        trajs = [m[0] for m in members]
        logged_gaps = all(u.gaps for t in trajs for u in t.turns)  # runs from before the shards kept them lack them
        if not logged_gaps:
            if not counter:
                counter.append(make_counter())
            if counter[0] is None:
                continue
        count = counter[0] if not logged_gaps else None
        group = LoggedGroup(success=[t.success for t in trajs], seq_advantages=[t.seq_advantage for t in trajs],
                            evidence=[[u.signals["evidence"] for u in t.turns] for t in trajs],
                            tokens=[[len(u.gaps) if logged_gaps else count(u) for u in t.turns] for t in trajs],
                            states=[m[4] for m in members],
                            token_gaps=[[list(u.gaps) for u in t.turns] for t in trajs] if logged_gaps else None)
        orders = rule_orderings(group)
        check = orders if own == {"gamma": 0.95, "band": 0.2} else rule_orderings(group, **own)
        for i, traj in enumerate(trajs):
            out[id(traj)] = {rule: orders[rule][i].tolist() for rule in RULES if rule in orders}
            if all("multiplier" in u.signals for u in traj.turns):
                logged = np.sign(traj.seq_advantage) * np.asarray([u.signals["multiplier"] for u in traj.turns])
                worst = max(worst, float(np.max(np.abs(logged - check["agentopsd"][i]))))
    return out, worst


def mc_truths(run: Path, cfg: dict, trajs: list[LoggedTrajectory], samples: int, iteration: int = 1,
              every: bool = False) -> dict[int, list[float]]:
    """Monte Carlo turn advantages (id(traj) -> [K]) for the trajectories of ``iteration``, under the policy that sampled them.

    Iteration 1 was sampled by the warm start; a later one needs the policy the run kept after the
    iteration before (``checkpoint.keep_policies``). Unless ``every``, only trajectories with A_seq != 0:
    where A_seq = 0 (a group that all won or all lost) every credit rule gives each turn one value, so its
    ordering is chance by construction, and the continuations (the costly part) would change no credit row.
    """
    import torch

    logged = [t for t in trajs if t.iteration == iteration]
    if not logged:
        raise SystemExit(f"{run}: no logged trajectories of iteration {iteration}")
    # the continuations cost minutes to hours: kept beside the run, one entry per trajectory
    cache = run / "groundtruth" / f"mc-iter{iteration:04d}-m{samples}.json"
    saved: dict[str, list[float]] = json.loads(cache.read_text()) if cache.is_file() else {}
    key = {id(t): f"{n}:{t.task_index}:{len(t.turns)}" for n, t in enumerate(logged)}
    wanted = [t for t in logged if every or t.seq_advantage != 0]
    todo = [t for t in wanted if key[id(t)] not in saved]
    if todo:
        max_turns = int(cfg["env"]["max_turns"])
        env = run_env(cfg)
        policy, note = warm_start_policy(run, cfg, seed=int(cfg.get("seed", 0)), iteration=iteration)
        states = [replay(env, t, max_turns) for t in todo]
        flat = [s for group in states for s in group]
        with torch.no_grad():
            values = mc_values(flat, policy, samples, max_turns, note)
        at = 0
        for traj, group in zip(todo, states):
            v = values[at:at + len(group)]
            at += len(group)
            saved[key[id(traj)]] = [after - before for before, after in zip(v[:-1], v[1:])]
    if todo or not cache.is_file():  # also when nothing was wanted: the file says this truth was made
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(saved))
        tmp.replace(cache)
    return {id(t): saved[key[id(t)]] for t in wanted}


def pair_class_table(pair_scores: dict[tuple[str, ...], list[float]], top: int = 12) -> list[str]:
    """Markdown lines: per algorithm and rung, the most frequent classes of pairs touching an informed turn
    (against the expert label, all stages), with the share the evidence and the credit order as the truth does."""
    groups: dict[tuple[str, str], dict[tuple[str, str], dict[str, list[float]]]] = defaultdict(lambda: defaultdict(dict))
    for (alg, level, a, b, signal), scores in pair_scores.items():
        groups[(alg, level)][(a, b)][signal] = scores
    if not groups:
        return []
    lines = ["", "Pairs that touch an informed turn, by class, against the expert label (all stages): the informed turn's "
                 "situation and the sign of its expert gain, then the other turn's (`routine`: the teacher view knew nothing "
                 "there); pairs, and the share ordered as the label orders them (ties 1/2) by the evidence e_k and by the "
                 f"credit sign(A) w_k. The {top} most frequent classes per algorithm and rung.", "",
             "| algorithm | env | informed turn | other turn | pairs | evidence right | credit right |", "|---|---|---|---|---|---|---|"]
    for (alg, level), classes in sorted(groups.items()):
        ranked = sorted(classes.items(), key=lambda kv: -max(len(v) for v in kv[1].values()))[:top]
        for (a, b), by_signal in ranked:
            n = max(len(v) for v in by_signal.values())
            share = {sig: f"{np.mean(by_signal[sig]):.2f}" if sig in by_signal else "n/a" for sig in ("evidence", "credit")}
            lines.append(f"| {alg} | {level} | {a} | {b} | {n} | {share['evidence']} | {share['credit']} |")
    return lines


def stage_key(stage: str) -> tuple[int, int]:
    """Thirds of a run in order, then Monte Carlo iterations in order."""
    if stage in STAGES:
        return (0, STAGES.index(stage))
    return (2, 0) if stage == "rl" else (1, int(stage.removeprefix("iter")))


def rules_table(rule_cells: dict, args: argparse.Namespace) -> list[dict]:
    """One row per (truth, env, stage, rule): the rule's quality and AgentOPSD's paired advantage over it."""
    rows = []
    for (truth, level, stage), items in sorted(rule_cells.items(), key=lambda kv: (kv[0][0], kv[0][1], stage_key(kv[0][2]))):
        margin = args.margin if truth.startswith("expert") else args.mc_margin
        for rule in RULES:
            have = [item for item in items if rule in item[1]]  # the token rules: only where token gaps were logged
            if not have:
                continue
            runs = [item[0] for item in have]
            tru = [item[2] for item in have]
            informed = [item[3] for item in have]
            paper = [item[1]["agentopsd"] for item in have]
            sig = [item[1][rule] for item in have]
            q = credit_quality(sig, tru, margin=margin, resamples=args.resamples)
            qi = credit_quality(sig, tru, margin=margin, resamples=args.resamples, among=informed)
            accs = [(run, pairwise_accuracy(s_, t_, margin)) for run, s_, t_ in zip(runs, sig, tru)]
            by_run_acc = cluster_bootstrap_mean([a[0] for _, a in accs if a], [run for run, a in accs if a],
                                                resamples=args.resamples)
            row = {"truth": truth, "env": level, "stage": stage, "rule": rule, "trajectories": len(sig),
                   "rank_corr": q.rank_correlation.fmt(), "pairwise_acc": q.pairwise_accuracy.fmt(),
                   "pairwise_n": q.pairwise_accuracy.n, "pairwise_acc_over_runs": f"{by_run_acc.fmt()} ({by_run_acc.n} runs)",
                   "agentopsd_minus_rule": "", "over_runs": "",
                   "informed_acc": f"{qi.pairwise_accuracy.fmt()} ({qi.pairwise_accuracy.n}; {qi.pairs} pairs)",
                   "informed_agentopsd_minus_rule": ""}
            if rule != "agentopsd":
                row["agentopsd_minus_rule"] = paired_accuracy_difference(
                    paper, sig, tru, margin=margin, resamples=args.resamples).fmt()
                by_run = paired_accuracy_difference(paper, sig, tru, margin=margin, clusters=runs, resamples=args.resamples)
                row["over_runs"] = f"{by_run.fmt()} ({by_run.n} runs)"
                row["informed_agentopsd_minus_rule"] = paired_accuracy_difference(
                    paper, sig, tru, margin=margin, resamples=args.resamples, among=informed).fmt()
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run output folders (with .hydra/ and rollouts/)")
    parser.add_argument("--margin", type=float, default=0.0, help="pairs count when their ground truth differs by more")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples over trajectories")
    parser.add_argument("--mc-samples", type=int, default=0,
                        help="also the Monte Carlo ground truth (M continuations per state) for iteration 1 under the warm start")
    parser.add_argument("--mc-iterations", type=int, nargs="+", default=[1],
                        help="iterations whose trajectories get the Monte Carlo truth (after 1, each needs the policy kept "
                             "after the iteration before: checkpoint.keep_policies)")
    parser.add_argument("--mc-every", action="store_true",
                        help="the Monte Carlo truth also for trajectories with A_seq = 0 (every credit rule ties there)")
    parser.add_argument("--mc-margin", type=float, default=0.25,
                        help="pairs count under the Monte Carlo truth when it differs by more (sampling noise)")
    parser.add_argument("--no-rules", action="store_true",
                        help="skip recomputing every credit rule on the logged groups of runs that log the evidence")
    parser.add_argument("--out", type=Path, default=None, help="folder for table.md, table.csv and rules.csv")
    args = parser.parse_args()

    # (truth, algorithm, env, stage, signal) -> per-trajectory signal and truth rows
    cells: dict[tuple[str, str, str, str, str], tuple[list, list]] = defaultdict(lambda: ([], []))
    label_signal: dict[tuple[str, str], list[float]] = defaultdict(list)
    label_count: dict[tuple[str, str], int] = defaultdict(int)
    kind_signal: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    kind_count: dict[tuple[str, str, str], int] = defaultdict(int)
    action_evidence: dict[tuple[str, str, str, str], list[float]] = defaultdict(list)
    pair_scores: dict[tuple[str, ...], list[float]] = defaultdict(list)
    # (truth, env, stage) -> (run, rule -> ordering, truth) per trajectory: every rule on the same rollouts
    rule_cells: dict[tuple[str, str, str], list[tuple[str, dict[str, list[float]], list[float]]]] = defaultdict(list)
    rule_runs: list[tuple[str, int, float]] = []
    n_traj = 0
    for run in args.runs:
        cfg, trajs = load_run(run)
        last = max(t.iteration for t in trajs)
        mc: dict[int, list[float]] = {}
        mc_iteration: dict[int, int] = {}
        for it in args.mc_iterations if args.mc_samples > 0 else []:
            got = mc_truths(run, cfg, trajs, args.mc_samples, it, every=args.mc_every)
            mc.update(got)
            mc_iteration.update({key: it for key in got})
        labelled = label_run(cfg, trajs, run)
        rules, worst = ({}, 0.0) if args.no_rules else rule_rows(cfg, labelled, lambda run=run, cfg=cfg: token_counter(run, cfg))
        if rules:
            rule_runs.append((run.name, len(rules), worst))
        for traj, gains, labels, kinds, _ in labelled:
            n_traj += 1
            level = traj.env_id.split("/")[-1]
            signals = {name: [t.signals[name] for t in traj.turns] for name in ("advantage", "evidence", "revision")
                       if all(name in t.signals for t in traj.turns)}
            signals["uniform"] = [traj.seq_advantage] * len(traj.turns)
            if all("multiplier" in t.signals for t in traj.turns):
                # the credit alone, without the per-turn penalties the advantage also carries
                signals["credit"] = [float(np.sign(traj.seq_advantage)) * t.signals["multiplier"] for t in traj.turns]
            truths = {("expert", stage_of(traj.iteration, last)): gains}
            if traj.seq_advantage != 0:  # where the credit acts: with A_seq = 0 every credit signal is 0 and ties
                truths[("expert_nonzero", stage_of(traj.iteration, last))] = gains
            if id(traj) in mc:
                truths[("mc", f"iter{mc_iteration[id(traj)]}")] = mc[id(traj)]
                if mc_iteration[id(traj)] > 1:  # during RL: every Monte Carlo iteration after the first, pooled
                    truths[("mc", "rl")] = mc[id(traj)]
            for (truth, stage), values_t in truths.items():
                for name, values in signals.items():
                    sig, tru = cells[(truth, traj.algorithm, level, stage, name)]
                    sig.append(values)
                    tru.append(values_t)
                if id(traj) in rules and truth != "expert_nonzero":  # every rule ties at A_seq = 0: no new ordering
                    # informed turns: the teacher view held something the student view did not
                    rule_cells[(truth, level, stage)].append((run.name, rules[id(traj)], values_t,
                                                              [kind != "routine" for kind in kinds]))
            for signal in ("evidence", "credit"):
                if signal in signals and any(kind != "routine" for kind in kinds):
                    for cls, scores in pair_classes(signals[signal], gains, kinds, margin=args.margin).items():
                        pair_scores[(traj.algorithm, level, *cls, signal)] += scores
            for turn, label, kind in zip(traj.turns, labels, kinds):
                label_count[(traj.algorithm, label)] += 1
                kind_count[(traj.algorithm, kind, label)] += 1
                if "evidence" in turn.signals:
                    label_signal[(traj.algorithm, label)].append(turn.signals["evidence"])
                    kind_signal[(traj.algorithm, kind, label)].append(turn.signals["evidence"])
                    action_evidence[(traj.algorithm, kind, action_name(turn), stage_of(traj.iteration, last))].append(
                        turn.signals["evidence"])

    rows = []
    for (truth, alg, level, stage, name), (sig, tru) in sorted(cells.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2], stage_key(kv[0][3]), SIGNAL_ORDER.index(kv[0][4]))):
        margin = args.margin if truth.startswith("expert") else args.mc_margin
        q = credit_quality(sig, tru, margin=margin, resamples=args.resamples)
        rows.append({"truth": truth, "algorithm": alg, "env": level, "stage": stage, "signal": name,
                     "trajectories": len(sig), "rank_corr": q.rank_correlation.fmt(), "rank_corr_n": q.rank_correlation.n,
                     "pairwise_acc": q.pairwise_accuracy.fmt(), "pairwise_n": q.pairwise_accuracy.n, "pairs": q.pairs})

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    command = "python studies/credit_quality.py " + " ".join(sys.argv[1:])
    head = list(rows[0]) if rows else []
    lines = [f"Credit quality: within-trajectory rank correlation and pairwise accuracy of each logged turn signal "
             f"against the ground truth ({n_traj} trajectories; 95% bootstrap intervals over trajectories). "
             f"Commit {commit}.", "",
             f"Truth `expert`: the BabyAI bot's remaining path saved by the turn (margin {args.margin}); stages are thirds "
             f"of each run's logged iterations. Truth `expert_nonzero`: the same, over the trajectories with A_seq != 0 "
             "only, where the credit acts: with A_seq = 0 every credit signal (`credit`, `advantage`) is 0 on every turn "
             "and ties at 0.5, while `evidence` and `revision` still order the turns, so only these rows compare them "
             "on equal terms. Truth `mc`: Monte Carlo turn advantage V(s_k+1) - V(s_k) with "
             f"{args.mc_samples} continuations per state under the policy that sampled the iteration (iterations "
             f"{', '.join(map(str, args.mc_iterations))}; margin {args.mc_margin}"
             f"{'' if args.mc_every else '; only trajectories with A_seq != 0, the others tie under every credit rule'}). "
             "Signal `uniform` (A_seq on every turn) is the chance line: 0.5 exactly; `advantage` is the logged turn "
             "advantage (it carries the per-turn invalid-action and format penalties, so even GRPO's is not uniform); "
             "`credit` = sign(A_seq) * w_k, the credit method's own ordering without penalties.", "", f"    {command}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    lines += ["", "Turn labels (all stages): count and mean evidence e_k where logged.", "",
              "| algorithm | label | turns | mean evidence |", "|---|---|---|---|"]
    for (alg, label), count in sorted(label_count.items()):
        ev = label_signal.get((alg, label), [])
        lines.append(f"| {alg} | {label} | {count} | {np.mean(ev):.3f} |" if ev else f"| {alg} | {label} | {count} | n/a |")
    lines += ["", "Evidence e_k by turn kind (what the teacher view knew on the turn: a turn-scoped skill's situation, "
                  "`routine` where the two views were the same tokens, `skill` where every turn held the skill block) and "
                  "expert label: turns, mean, standard deviation, share with |e_k| > 0.1.", "",
              "| algorithm | kind | label | turns | mean evidence | std | share |e| > 0.1 |", "|---|---|---|---|---|---|---|"]
    for (alg, kind, label), count in sorted(kind_count.items()):
        ev = np.asarray(kind_signal.get((alg, kind, label), []))
        cells = f"{ev.mean():.3f} | {ev.std():.3f} | {np.mean(np.abs(ev) > 0.1):.2f}" if ev.size else "n/a | | "
        lines.append(f"| {alg} | {kind} | {label} | {count} | {cells} |")
    by_action = evidence_by_action(action_evidence)
    if len(by_action) > 2:
        lines += ["", "Evidence e_k on the informed turns by the action taken and the stage (thirds of each run's logged "
                      "iterations): mean (turns), most frequent actions first. A skill that helps gives the right action "
                      "e_k > 0 and the wrong one e_k < 0.", ""] + by_action
    lines += pair_class_table(pair_scores)
    rule_table = rules_table(rule_cells, args)
    if rule_table:
        lines += ["", "## Every credit rule on the same rollouts", "",
                  f"The runs that log the evidence e_k ({', '.join(f'{name}: {n} trajectories' for name, n, _ in rule_runs)}): "
                  "on each whole logged task group, every turn-level rule recomputed from the logged evidence, outcomes and "
                  "A_seq (`agentopsd.study.credit_rules`): the paper's method, its ablations without the prior, without the "
                  "accumulator (`raw_gap`) and without the outcome sign (`magnitude`), StepOPSD (each turn's own mean gap; "
                  "tokens counted from the logged token gaps, or re-counted from the logged action where a run predates "
                  "them) and GiGPO (anchor states from the replayed observations); where the shards hold each token's gap, "
                  "also the per-token accumulation (`token`) and RLSD, each turn ordered by its tokens' mean multiplier. "
                  "The rules run at the shipped settings (the paper's gamma 0.95 and band 0.2) on every run; "
                  "recomputed at each run's own gamma and band, AgentOPSD's ordering sign(A) w_k matches the logged one to "
                  f"{max(w for _, _, w in rule_runs):.1e}. Last two columns: AgentOPSD's pairwise accuracy minus the "
                  "rule's, paired per trajectory, with 95% bootstrap intervals over trajectories and over runs (whole "
                  "runs resampled). Stage `rl`: every Monte Carlo iteration after the first, pooled. `informed_acc`: the "
                  "pairwise accuracy over only the pairs with at least one informed turn (one where the teacher view "
                  "held a skill the student view did not; with a turn-scoped skill bank the other turns' evidence is 0 "
                  "by construction), with its trajectories and pairs, and AgentOPSD's paired advantage there.", "",
                  "| " + " | ".join(rule_table[0]) + " |", "|" + "---|" * len(rule_table[0])]
        lines += ["| " + " | ".join(str(r[h]) for h in rule_table[0]) + " |" for r in rule_table]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(text)
        with open(args.out / "table.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=head)
            writer.writeheader()
            writer.writerows(rows)
        if rule_table:
            with open(args.out / "rules.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rule_table[0]))
                writer.writeheader()
                writer.writerows(rule_table)


if __name__ == "__main__":
    main()
