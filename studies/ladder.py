"""The credit ladder: GRPO against turn-level credit methods on BabyAI KeyDoorBox rungs of growing horizon.

    python studies/ladder.py --jobs 2                                   # the whole grid (resumable)
    python studies/ladder.py --levels KeyDoorBoxS5 --seeds 0 1 --iterations 2 --out /tmp/ladder   # a quick look
    python studies/ladder.py --table-only                               # rewrite the tables from finished runs
    python studies/ladder.py --jobs 1 --seeds 4-13 --levels KeyDoorBoxS9 --methods grpo oracle oracle_wide agentopsd_wide
                                                                        # the ceiling study (STUDY_METHODS)

Every run is ``train.py experiment=keydoor`` with the rung, algorithm and seed swapped. Pairing: the
runs of one seed share one warm start (trained once on demonstrations from every rung, loaded by
every rung and method through ``warm_start.weights``) and one task stream per rung (the seed fixes
it), so a difference between methods at a seed is the methods' alone. Each run ends with two evaluations on the rung's 256 fixed evaluation tasks: greedy, and one
episode per task at temperature 1 (the smooth measure: greedy success of a small policy tends to
be all or nothing). The warm start's own evaluation is made once per (rung, seed).
Rows of runs.csv carry the commit they ran on.

Resumable: a finished run is read back (from its folder, or from runs.csv when the folder is gone);
a run cut short goes on from its last checkpoint when the code is the same commit (else it starts
over from the shared warm start). The code trained is the
commit checked out, exported once with ``git archive``: edits to the working tree while the grid
runs cannot leak into it. After every run ``runs.csv`` and ``table.md`` (means with 95% bootstrap
intervals over seeds, paired differences to GRPO and horizon slopes with t intervals, the ceiling study's
contrasts) and ``horizon.png``
are rewritten under ``--out``.

Credit data: each finished AgentOPSD run is archived under ``--out/credit_data/<run>`` (its config, its rollout
shards xz-compressed, and its ground truth: the expert's paths and the Monte Carlo truth of the first and the
midway iteration, computed right away while the run's kept policies exist). The archives are committed, so the
credit-quality table over the whole grid is one command in any later sitting:

    python studies/credit_quality.py results/ladder/credit_data/* --mc-samples 8 --mc-iterations 1 9 --out results/ladder/credit_quality/grid
"""

from __future__ import annotations

import argparse
import csv
import hashlib
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: studies/ is a package under the repository root
    sys.path.insert(0, str(ROOT))

from agentopsd.study.credit_quality import bootstrap  # noqa: E402
from agentopsd.study.stats import t_coverage, t_interval, t_quantile  # noqa: E402,F401  (the drivers' shared intervals)
from studies.common import export_code, head_commit, log_rows, parse_seeds, read_runs_csv, slope  # noqa: E402

# rung -> turn limit: the expert's longest path on the 256 evaluation tasks plus room for the habits' wasted turns
LEVELS = {"KeyDoorBoxS5": 32, "KeyDoorBoxS7": 44, "KeyDoorBoxS9": 60}
METHODS = ["grpo", "agentopsd", "stepopsd", "gigpo"]
ITERATIONS = 16
CODE_PATHS = ("agentopsd", "envs", "callbacks", "conf", "train.py", "pyproject.toml")
"""The trained code (agentopsd/envs, /callbacks and /conf link to the top-level folders)."""
CREDIT_METHODS = ("agentopsd",)
"""Methods whose runs ``credit_archive`` keeps: AgentOPSD's shards log the evidence every credit rule is recomputed from."""
ORACLE = ("algorithm._target_=agentopsd.study.oracle.OracleOPSD", "+algorithm.max_turns=${env.max_turns}",
          "+algorithm.env_kwargs=${oc.select:env.kwargs,null}")
"""AgentOPSD with the teacher-student gap replaced by the expert's path saved by each turn (agentopsd/study/oracle.py)."""
WIDE = ("algorithm.mult_lambda=1.0", "algorithm.mult_band=0.5")
"""The widest lever: the multiplier alone (no GRPO half) in [0.5, 1.5]; a turn's advantage moves by up to 50%, never
across 0 (the paper's lam 0.5 and b 0.2 move it by at most 10%)."""
STUDY_METHODS = {
    "oracle": ("agentopsd", (*ORACLE, "algorithm.name=oracle")),
    "oracle_wide": ("agentopsd", (*ORACLE, "algorithm.name=oracle_wide", *WIDE)),
    "agentopsd_wide": ("agentopsd", ("algorithm.name=agentopsd_wide", *WIDE)),
}
"""The ceiling study's cells (``--methods oracle oracle_wide agentopsd_wide``): a conf/algorithm file and overrides;
any other method name is a conf/algorithm file of its own."""
DIAGNOSTICS = ["rollout/success", "credit/evidence_outcome_corr", "credit/mean_abs_revision", "credit/evidence_mean"]


def evals(rows: list[dict[str, float]]) -> dict[int, dict[str, float]]:
    """iteration -> its evaluation row (a later log wins: a resumed run evaluates again)."""
    return {int(r["eval/iteration"]): r for r in rows if "eval/success" in r and "eval/iteration" in r}


def method_overrides(method: str) -> list[str]:
    """The train.py overrides that select ``method``: its conf/algorithm file, or a study cell's file and overrides."""
    base, extra = STUDY_METHODS.get(method, (method, ()))
    return [f"algorithm={base}", *extra]


def _train(code: Path, run_dir: Path, level: str, method: str, seed: int, iterations: int, extra: list[str]) -> int:
    cmd = [sys.executable, "train.py", "experiment=keydoor", f"env.id={env_id(level)}", f"env.max_turns={LEVELS[level]}",
           *method_overrides(method), f"seed={seed}", f"num_iterations={iterations}", f"output_dir={run_dir}",
           "trainer.enable_progress_bar=false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HYDRA_FULL_ERROR": "1"}
    with (run_dir / "stdout.log").open("a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        return subprocess.run(cmd, cwd=code, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def env_id(level: str) -> str:
    return f"agentopsd/BabyAI-{level}-v0"


def shared(warm_level: str) -> list[str]:
    """Overrides of every run: one tokenizer (built from the warm rung's text) so that one warm start fits every rung."""
    return [f"model.env_id={env_id(warm_level)}"]


WARM_LEVEL = max(LEVELS, key=lambda lv: LEVELS[lv])
"""The rung whose text builds the one tokenizer every run of the grid shares (the longest: it shows every word)."""


def warm_weights(out: Path, code: Path, seed: int, overrides: list[str]) -> Path:
    """The seed's warm start, trained once on demonstrations from every rung in turn and shared by every rung and
    method (a warm start made on the longest rung alone played the shortest at 6% against 20% for one of its own);
    each rung evaluates the shared weights for itself (``before``). Always every rung, whatever ``--levels`` says:
    a run of a few rungs into the grid's folder must not make a seed's warm start by another recipe."""
    weights = out / "warm" / f"s{seed}" / "policy.pt"
    if weights.exists():
        return weights
    run_dir = out / "runs" / f"warm-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    mixed = "warm_start.env_ids=[" + ",".join(f'"{env_id(lv)}"' for lv in LEVELS) + "]"
    rc = _train(code, run_dir, WARM_LEVEL, "grpo", seed, 1, ["data.tasks_per_batch=1", "data.group_size=2",
                "evaluation.before_training=false", "evaluation.num_tasks=1", mixed, *shared(WARM_LEVEL), *overrides])
    made = sorted((run_dir / "warm_start").glob("policy-*.pt"))
    if rc != 0 or len(made) != 1:
        raise RuntimeError(f"warm start seed {seed} failed (exit {rc}); see {run_dir / 'stdout.log'}")
    weights.parent.mkdir(parents=True, exist_ok=True)
    tmp = weights.with_suffix(".tmp")
    shutil.copy(made[0], tmp)
    os.replace(tmp, weights)
    return weights


def file_digest(path: Path) -> str:
    """A file's sha256, first 12 hex digits: which warm start a run started from (a pair must share it)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def before(out: Path, code: Path, commit: str, level: str, seed: int, overrides: list[str]) -> dict:
    """The shared warm start evaluated on one rung (greedy and sampled), once per (rung, seed)."""
    path = out / "warm" / f"s{seed}" / f"before-{level}.json"
    weights = warm_weights(out, code, seed, overrides)
    if path.exists():
        done = json.loads(path.read_text())
        if done.get("warm", file_digest(weights)) == file_digest(weights):  # else the warm start was made again
            return done
    run_dir = out / "runs" / f"{level}-before-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # one tiny iteration: its evaluation before training is the warm start's on this rung
    rc = _train(code, run_dir, level, "grpo", seed, 1, ["data.tasks_per_batch=1", "data.group_size=2", f"warm_start.weights={weights}",
                                                       "evaluation.at_end=false", *shared(WARM_LEVEL), *overrides])
    row = evals(log_rows(run_dir)).get(0)
    if rc != 0 or row is None:
        raise RuntimeError(f"warm start evaluation {level} seed {seed} failed (exit {rc}); see {run_dir / 'stdout.log'}")
    path.write_text(json.dumps({"commit": commit, "warm": file_digest(weights), **row}))
    return row


def code_identity(commit: str, root: Path = ROOT) -> str:
    """What a run's numbers depend on: the git trees of the trained code at ``commit``. A commit that changes only
    scripts, tests, docs or results keeps it, so a run cut short resumes across such commits."""
    trees = [subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{commit}:{path}"], cwd=root, capture_output=True, text=True).stdout.strip()
             for path in CODE_PATHS]
    return hashlib.sha1(" ".join(trees).encode()).hexdigest()[:12]


def run_one(out: Path, code: Path, commit: str, level: str, method: str, seed: int, iterations: int,
            overrides: list[str], identity: str = "") -> dict:
    weights = warm_weights(out, code, seed, overrides)
    run_dir = out / "runs" / f"{level}-{method}-s{seed}"
    meta_path = run_dir / "meta.json"
    if iterations not in evals(log_rows(run_dir)):
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        last = run_dir / "checkpoints" / "last.ckpt"
        resume = (last.exists() and meta.get("code", meta.get("commit")) == (identity or commit)
                  and meta.get("warm", file_digest(weights)) == file_digest(weights))
        if not resume:
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            meta = {}
        extra = ["evaluation.before_training=false", "checkpoint.keep_policies=true", f"warm_start.weights={weights}",
                 *shared(WARM_LEVEL), *overrides]
        # written before training too: a run killed together with this process (the end of a sitting) leaves
        # checkpoints and this, and resumes next time (its wall time then misses the killed stretch)
        meta = {"commit": commit, "code": identity or commit, "warm": file_digest(weights),
                "wall_s": meta.get("wall_s", 0.0), "resumed": meta.get("resumed", 0) + resume}
        _write_json(meta_path, meta)
        start = time.monotonic()
        rc = _train(code, run_dir, level, method, seed, iterations, extra + ([f"ckpt_path={last}"] if resume else []))
        _write_json(meta_path, {**meta, "wall_s": meta["wall_s"] + time.monotonic() - start})
        if rc != 0 or iterations not in evals(log_rows(run_dir)):
            raise RuntimeError(f"{level} {method} seed {seed} failed (exit {rc}); see {run_dir / 'stdout.log'}")
    return run_row(out, level, method, seed, iterations)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def mc_iterations(iterations: int) -> list[int]:
    """The iterations whose trajectories get the Monte Carlo truth: the first (sampled by the warm start) and the
    one midway through RL (sampled by the policy kept after the iteration before it)."""
    return sorted({1, iterations // 2 + 1})


def credit_archive(out: Path, code: Path, run_dir: Path, iterations: int, mc_samples: int, mc_its: list[int] | None = None) -> Path:
    """What the credit-quality table needs of a finished run, kept under ``out/credit_data/<run>`` (committed: run
    folders are not, and the policies the Monte Carlo truth runs are gone with them): the run's config, its rollout
    shards xz-compressed (~25 KB an iteration against ~450 KB), and the ground truth computed now while the kept
    policies exist (the expert's paths, and ``mc_samples`` continuations per state at ``mc_iterations``), which
    ``studies/credit_quality.py`` reads back instead of recomputing. Made once; an archive cut short is made again.
    ``mc_its`` replaces :func:`mc_iterations` (a real model's Monte Carlo truth costs too much for two iterations)."""
    import lzma

    dest = out / "credit_data" / run_dir.name
    if (dest / "done.json").is_file():
        return dest
    its = mc_its or mc_iterations(iterations)
    cmd = [sys.executable, "studies/credit_quality.py", str(run_dir), "--no-rules", "--resamples", "10"]
    if mc_samples > 0:
        cmd += ["--mc-samples", str(mc_samples), "--mc-iterations", *map(str, its)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with (run_dir / "credit.log").open("a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, cwd=code, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"credit archive of {run_dir.name} failed (exit {rc}); see {run_dir / 'credit.log'}")
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / ".hydra").mkdir(parents=True)
    shutil.copy(run_dir / ".hydra" / "config.yaml", tmp / ".hydra" / "config.yaml")
    (tmp / "rollouts").mkdir()
    for shard in sorted((run_dir / "rollouts").glob("rollouts-*.tar")):
        (tmp / "rollouts" / f"{shard.name}.xz").write_bytes(lzma.compress(shard.read_bytes(), preset=9))
    shutil.copytree(run_dir / "groundtruth", tmp / "groundtruth")
    meta = json.loads((run_dir / "meta.json").read_text())
    _write_json(tmp / "done.json", {"commit": meta["commit"], "warm": meta.get("warm", ""), "mc_samples": mc_samples,
                                    "mc_iterations": its if mc_samples > 0 else []})
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def run_row(out: Path, level: str, method: str, seed: int, iterations: int) -> dict:
    run_dir = out / "runs" / f"{level}-{method}-s{seed}"
    rows = log_rows(run_dir)
    after = evals(rows)[iterations]
    before = json.loads((out / "warm" / f"s{seed}" / f"before-{level}.json").read_text())
    meta = json.loads((run_dir / "meta.json").read_text())
    row = {"level": level, "method": method, "seed": seed, "iterations": iterations, "commit": meta["commit"],
           "warm": meta.get("warm", ""),
           "greedy_before": before["eval/success"], "sampled_before": before.get("eval/sampled/success", float("nan")),
           "greedy_after": after["eval/success"], "sampled_after": after.get("eval/sampled/success", float("nan")),
           "wall_s": round(meta["wall_s"], 1), "resumed": meta["resumed"]}
    for key in DIAGNOSTICS:
        vals = [r[key] for r in rows if key in r and r[key] == r[key]]
        if vals:
            row[key.replace("/", "_") + "_mean"] = statistics.fmean(vals)
    return row


# ------------------------------------------------------------------ statistics



def seed_slopes(by_seed: dict[int, dict[str, float]], levels: list[str], horizon: dict[str, float]) -> tuple[float, float, float]:
    """The horizon slope per seed (seeds with every rung), mean and 95% t interval over seeds."""
    xs = [horizon[lv] for lv in levels]
    return t_interval([slope(xs, [v[lv] for lv in levels]) for v in by_seed.values() if all(lv in v for lv in levels)])


def _fmt(est: tuple[float, float, float], scale: float = 100.0, digits: int = 1) -> str:
    p, lo, hi = est
    if p != p:
        return ""
    return f"{scale * p:.{digits}f} [{scale * lo:.{digits}f}, {scale * hi:.{digits}f}]" if lo == lo else f"{scale * p:.{digits}f}"


def paired(a: dict, b: dict) -> bool:
    """Two runs of one rung and seed form a pair when they started from the same warm start: equal digests (rows
    recorded before the digest was, all empty, shared one warm folder; a warm start made again on another machine
    is not bitwise the same, so an empty digest never pairs with a recorded one)."""
    return a.get("warm", "") == b.get("warm", "")


def paired_diffs(cell: dict[tuple[str, str, int], dict], level: str, a: str, b: str, measure: str) -> dict[int, float]:
    """Per seed, method ``a``'s success after RL minus method ``b``'s on one rung, over the seeds where both ran
    from the same warm start."""
    return {s: cell[(level, a, s)][f"{measure}_after"] - cell[(level, b, s)][f"{measure}_after"]
            for (lv, m, s) in cell if lv == level and m == a and (level, b, s) in cell
            and paired(cell[(level, a, s)], cell[(level, b, s)])}


CONTRASTS = (
    ("oracle", "grpo", "perfect evidence at the paper's lever"),
    ("oracle_wide", "grpo", "perfect evidence at the wide lever"),
    ("agentopsd_wide", "grpo", "the real evidence at the wide lever"),
    ("oracle", "agentopsd", "the evidence, at the paper's lever"),
    ("oracle_wide", "agentopsd_wide", "the evidence, at the wide lever"),
    ("oracle_wide", "oracle", "the lever, with perfect evidence"),
    ("agentopsd_wide", "agentopsd", "the lever, with the real evidence"),
)
"""The ceiling study's paired contrasts: each isolates one factor (the evidence or the lever) or sets a cell against
GRPO."""


def contrast_table(cell: dict[tuple[str, str, int], dict], levels: list[str]) -> list[str]:
    """The ceiling study's contrasts on every rung where both of a contrast's methods have pairs, each with its 95% t
    interval and its Bonferroni interval over every interval in the table (rows x two measures): reading several
    intervals at 95%, one clears 0 by chance more often than one time in twenty."""
    found = [(a, b, what, lv) for a, b, what in CONTRASTS for lv in levels
             if any(len(paired_diffs(cell, lv, a, b, m)) >= 2 for m in ("sampled", "greedy"))]
    if not found:
        return []
    reads = 2 * len(found)
    family = 1 - 0.05 / reads
    lines = ["## The ceiling study: paired contrasts", "",
             f"Per seed one cell's success after RL minus another's on the same warm start and task stream, points: "
             f"mean [95% t interval] (pairs), then the Bonferroni interval over the table's {reads} intervals "
             f"({100 * family:.2f}% each).", "",
             "| contrast | what differs | rung | sampled | sampled, Bonferroni | greedy | greedy, Bonferroni |",
             "|---|---|---|---|---|---|---|"]
    for a, b, what, lv in found:
        cells = []
        for measure in ("sampled", "greedy"):
            diffs = list(paired_diffs(cell, lv, a, b, measure).values())
            cells += [_fmt(t_interval(diffs, bounds=(-1.0, 1.0))) + f" ({len(diffs)})",
                      _fmt(t_interval(diffs, bounds=(-1.0, 1.0), coverage=family))]
        lines.append(f"| {a} − {b} | {what} | {lv} | " + " | ".join(cells) + " |")
    return lines + [""]


def build_tables(rows: list[dict], horizon: dict[str, float], command_line: str) -> str:
    levels = sorted({r["level"] for r in rows}, key=lambda lv: horizon[lv])
    methods = [m for m in dict.fromkeys([*METHODS, *(r["method"] for r in rows)]) if any(r["method"] == m for r in rows)]
    cell = {(r["level"], r["method"], r["seed"]): r for r in rows}
    commits = sorted({r["commit"] for r in rows})
    lines = [f"Command: `{command_line}`  ", f"Commit: {', '.join(c[:12] for c in commits)}", "",
             "Rungs (the expert's mean path on the 256 evaluation tasks, turns): "
             + ", ".join(f"{lv} {horizon[lv]:.1f}" for lv in levels), ""]
    for measure, title in (("sampled", "Success at temperature 1 (one episode per evaluation task)"), ("greedy", "Greedy success")):
        lines += [f"## {title}, % after RL: mean [95% bootstrap interval over seeds] (seeds)", "",
                  "| method | " + " | ".join(levels) + " | slope, points per extra turn [95% t interval] |", "|---" * (len(levels) + 2) + "|"]
        warm = {lv: [r[f"{measure}_before"] for r in rows if r["level"] == lv and r["method"] == methods[0]] for lv in levels}
        lines.append("| warm start | " + " | ".join(_fmt(bootstrap(statistics.fmean, warm[lv])) + f" ({len(warm[lv])})" if warm[lv] else ""
                                                   for lv in levels) + " | |")
        for m in methods:
            by_seed: dict[int, dict[str, float]] = {}
            for (lv, mm, s), r in cell.items():
                if mm == m:
                    by_seed.setdefault(s, {})[lv] = r[f"{measure}_after"]
            cells = []
            for lv in levels:
                vals = [v[lv] for v in by_seed.values() if lv in v]
                cells.append(_fmt(bootstrap(statistics.fmean, vals)) + f" ({len(vals)})" if vals else "")
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {_fmt(seed_slopes(by_seed, levels, horizon), digits=2)} |")
        lines += ["", f"Paired difference to GRPO ({measure}, points): per seed the method's success minus GRPO's on the "
                      "same warm start and task stream; mean [95% t interval] (pairs).", "",
                  "| method | " + " | ".join(levels) + " | slope difference |", "|---" * (len(levels) + 2) + "|"]
        for m in methods:
            if m == "grpo":
                continue
            cells = []
            diffs_by_seed: dict[int, dict[str, float]] = {}
            for lv in levels:
                diffs = paired_diffs(cell, lv, m, "grpo", measure)
                for s, d in diffs.items():
                    diffs_by_seed.setdefault(s, {})[lv] = d
                cells.append(_fmt(t_interval(list(diffs.values()), bounds=(-1.0, 1.0))) + f" ({len(diffs)})" if diffs else "")
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {_fmt(seed_slopes(diffs_by_seed, levels, horizon), digits=2)} |")
        lines.append("")
    lines += contrast_table(cell, levels)
    lines += ["## Per run", "", "| rung | method | seed | greedy before → after | sampled before → after | train success | "
              "evidence-outcome corr | wall s |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (horizon[r["level"]], r["seed"], methods.index(r["method"]))):
        corr = r.get("credit_evidence_outcome_corr_mean")
        lines.append(f"| {r['level']} | {r['method']} | {r['seed']} | {100 * r['greedy_before']:.1f} → {100 * r['greedy_after']:.1f} | "
                     f"{100 * r['sampled_before']:.1f} → {100 * r['sampled_after']:.1f} | "
                     f"{100 * r.get('rollout_success_mean', float('nan')):.1f} | {'' if corr is None else f'{corr:.3f}'} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], horizon: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["level"] for r in rows}, key=lambda lv: horizon[lv])
    methods = [m for m in dict.fromkeys([*METHODS, *(r["method"] for r in rows)]) if any(r["method"] == m for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, measure in zip(axes, ("sampled", "greedy")):
        for k, m in enumerate(methods):
            xs, ys, lo, hi = [], [], [], []
            for lv in levels:
                vals = [r[f"{measure}_after"] for r in rows if r["level"] == lv and r["method"] == m]
                if vals:
                    p, a, b = bootstrap(statistics.fmean, vals)
                    a, b = (p, p) if a != a else (a, b)
                    xs.append(horizon[lv] + 0.15 * (k - (len(methods) - 1) / 2))
                    ys.append(100 * p)
                    lo.append(100 * (p - a))
                    hi.append(100 * (b - p))
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=3, label=m)
        ax.set(xlabel="horizon: the expert's mean path (turns)", title=f"{measure} success after RL, 95% bootstrap intervals",
               ylim=(-2, 102))
        ax.legend(fontsize=8)
    axes[0].set_ylabel("success (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def expert_horizon(level: str) -> float:
    """The expert's mean path on the rung's evaluation list (the horizon axis)."""
    sys.path.insert(0, str(ROOT))
    import gymnasium as gym

    import agentopsd.envs  # noqa: F401  (registers the ids)

    env = gym.make(f"agentopsd/BabyAI-{level}-v0", split="eval", disable_env_checker=True)
    n = env.unwrapped.num_tasks
    mean = statistics.fmean(env.reset(options={"task_index": k})[1]["expert_steps"] for k in range(n))
    env.close()
    return mean


def write_results(rows: list[dict], out: Path, command_line: str) -> None:
    horizon_path = out / "horizon.json"
    horizon = json.loads(horizon_path.read_text()) if horizon_path.exists() else {}
    for lv in {r["level"] for r in rows} - set(horizon):
        horizon[lv] = expert_horizon(lv)
    horizon_path.write_text(json.dumps(horizon, indent=1))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with (out / "runs.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: (horizon[r["level"]], r["seed"], r["method"])))
    (out / "table.md").write_text(build_tables(rows, horizon, command_line))
    plot(rows, horizon, out / "horizon.png")


def read_rows(out: Path) -> list[dict]:
    return read_runs_csv(out / "runs.csv", text=lambda key: key in ("level", "method", "commit", "warm"),
                         ints=("seed", "iterations"), empty=float("nan"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", nargs="+", default=list(LEVELS), choices=list(LEVELS))
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--seeds", nargs="+", default=["0-9"], help="seeds or ranges: 0-9, or 0 3 7")
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "ladder")
    parser.add_argument("--table-only", action="store_true", help="rewrite the tables from runs.csv, train nothing")
    parser.add_argument("--code", type=Path, default=None,
                        help="train from this checkout instead of an export of HEAD (e.g. . for uncommitted edits)")
    parser.add_argument("--credit-methods", nargs="*", default=list(CREDIT_METHODS),
                        help="methods whose finished runs are archived under OUT/credit_data with their ground truth "
                             "(AgentOPSD's logged evidence lets every credit rule be recomputed on its rollouts)")
    parser.add_argument("--credit-mc-samples", type=int, default=8,
                        help="Monte Carlo continuations per state for the archived runs' ground truth (0: expert truth only)")
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for every run")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    command_line = "python studies/ladder.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.table_only:
        write_results(read_rows(args.out), args.out, command_line)
        return
    seeds = parse_seeds(args.seeds)
    commit = head_commit()
    code = args.code.resolve() if args.code else export_code(commit, Path(os.environ.get("TMPDIR", "/tmp")) / "ladder_src")
    identity = code_identity(commit)
    if args.code:
        commit += "+worktree"
        identity = commit  # uncommitted edits: resume only within this invocation's own runs
    # rows of runs made earlier (other rungs, seeds or methods) stay in the table
    earlier = read_rows(args.out)
    keep = [r for r in earlier if (r["level"], r["method"], r["seed"]) not in
            {(lv, m, s) for lv in args.levels for m in args.methods for s in seeds}]
    # a finished run whose folder is gone (a fresh checkout: run folders are not committed) stands as recorded
    recorded = {(r["level"], r["method"], r["seed"]): r for r in earlier if r["iterations"] == args.iterations}
    rows: list[dict] = list(keep)
    failures: list[str] = []
    lock = threading.Lock()
    # seed-major, then rung: a grid cut short holds every method of its first seeds (pairs complete);
    # --jobs seeds at a time, their runs interleaved, so that their warm starts train side by side
    per_seed = [[(lv, m, s) for lv in args.levels for m in args.methods] for s in seeds]
    jobs = [job for k in range(0, len(per_seed), args.jobs) for turn in zip(*per_seed[k:k + args.jobs]) for job in turn]
    seed_locks = {s: threading.Lock() for s in seeds}
    rung_locks = {(lv, s): threading.Lock() for lv in args.levels for s in seeds}

    def one(job: tuple[str, str, int]) -> None:
        lv, m, s = job
        if (lv, m, s) in recorded and not (args.out / "runs" / f"{lv}-{m}-s{s}").exists():
            with lock:
                rows.append(recorded[(lv, m, s)])
            return
        try:
            with seed_locks[s]:  # the first run of a seed makes its warm start, the others wait
                warm_weights(args.out, code, s, args.overrides)
            with rung_locks[(lv, s)]:
                before(args.out, code, commit, lv, s, args.overrides)
            row = run_one(args.out, code, commit, lv, m, s, args.iterations, args.overrides, identity)
        except RuntimeError as error:
            failures.append(str(error))
            print(error, file=sys.stderr, flush=True)
            return
        with lock:
            rows.append(row)
            write_results(list(rows), args.out, command_line)
        print(f"{lv} {m} seed {s}: greedy {100 * row['greedy_before']:.0f} -> {100 * row['greedy_after']:.0f}, sampled "
              f"{100 * row['sampled_before']:.1f} -> {100 * row['sampled_after']:.1f} in {row['wall_s']:.0f} s", flush=True)
        if m in args.credit_methods:  # after the row is recorded: a sitting that ends meanwhile keeps the run
            try:
                credit_archive(args.out, code, args.out / "runs" / f"{lv}-{m}-s{s}", args.iterations, args.credit_mc_samples)
            except RuntimeError as error:  # the run stands; the next invocation makes its archive again
                failures.append(str(error))
                print(error, file=sys.stderr, flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, jobs))
    if failures:
        raise SystemExit(f"{len(failures)} run(s) failed; rerun the same command to retry them")


if __name__ == "__main__":
    main()
