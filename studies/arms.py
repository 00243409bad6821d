"""Paired arms on one task: GRPO against turn-level credit, one warm start and one task stream per seed.

    python studies/arms.py --seeds 0-9 --jobs 2                  # the SmolLM2 KeyDoor study (results/smollm2_keydoor)
    python studies/arms.py --table-only                           # rewrite the tables from the committed summaries
    python studies/arms.py --seeds 0 1 --iterations 2 --out /tmp/arms experiment=babyai_tiny   # a quick look

Every run is ``train.py <overrides> algorithm=<arm's file> <arm's overrides> seed=S`` (default overrides:
``experiment=smollm2_keydoor``). Pairing: the runs of one seed load one warm start (trained once per seed, by a
one-iteration run whose evaluation before training is the warm start's, shared by every arm) through
``warm_start.weights``, and draw one task stream (the seed fixes it), so a difference between arms at a seed is the
arms' alone. Each run evaluates greedily on the task's fixed list every ``evaluation.every_n_iterations``.

Resumable: a finished run is summarised in ``<out>/summaries/<arm>-s<seed>.json`` (committed; run folders are not)
and never trained again; a run cut short goes on from its last checkpoint when the trained code is the same (else
it starts over from the seed's warm start). Every sitting trains the commit the first one pinned in ``<out>/commit.txt``
(``--commit`` moves the pin), so that every arm of every seed trains one code. After every run ``runs.csv`` and ``table.md`` are rewritten: per arm the
final greedy success and the area under the success curve, each arm minus GRPO as a paired difference with its 95%
t interval and the Bonferroni interval over the comparisons to GRPO, and success by the expert's path length with
the slope per extra turn.

The instrument: each finished run of an arm that logs the evidence (every arm but GRPO) is archived under
``<out>/credit_data/<run>`` (its rollout shards and their ground truth: the expert's paths, and on ``--mc-seeds`` the
Monte Carlo truth of iteration 1), so the credit-quality table over every run is one command at any later sitting:

    python studies/credit_quality.py results/smollm2_keydoor/credit_data/* --out results/smollm2_keydoor/credit
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
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

from agentopsd.study.stats import t_interval  # noqa: E402
from studies.common import export_code, head_commit, log_rows, parse_seeds, slope  # noqa: E402
from studies.ladder import WIDE, _fmt, _write_json, code_identity, credit_archive, file_digest  # noqa: E402

ARMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "grpo": ("grpo", ()),
    "agentopsd": ("agentopsd", ()),
    "agentopsd_wide": ("agentopsd", ("algorithm.name=agentopsd_wide", *WIDE)),
    "stepopsd": ("stepopsd", ()),
}
"""Arm -> (conf/algorithm file, overrides). ``agentopsd`` is the paper's lever (lam 0.5, band 0.2: a turn's advantage
moves by at most 10%); ``agentopsd_wide`` the widest lever that keeps the sign (lam 1, band 0.5: up to 50%);
``stepopsd`` the rule that keeps the evidence's own ordering best on SmolLM2 (pairwise accuracy 0.750 against the
raw gap's 0.747 and AgentOPSD's 0.633, results/smollm2_paired). Any other arm name is a conf/algorithm file."""
BASELINE = "grpo"
DEFAULT_OVERRIDES = ["experiment=smollm2_keydoor"]
DIAGNOSTICS = ("rollout/success", "credit/evidence_outcome_corr", "credit/mean_abs_revision", "credit/multiplier_std")


def arm_overrides(arm: str) -> list[str]:
    base, extra = ARMS.get(arm, (arm, ()))
    return [f"algorithm={base}", *extra]


def _train(code: Path, run_dir: Path, overrides: list[str], arm: str, seed: int, iterations: int, extra: list[str]) -> int:
    cmd = [sys.executable, "train.py", *overrides, *arm_overrides(arm), f"seed={seed}", f"num_iterations={iterations}",
           f"output_dir={run_dir}", "trainer.enable_progress_bar=false", "report=false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HYDRA_FULL_ERROR": "1"}
    with (run_dir / "stdout.log").open("a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        timer = ["/usr/bin/time", "-f", "%M", "-o", str(run_dir / "peak_rss_kb")] if Path("/usr/bin/time").exists() else []
        return subprocess.run(timer + cmd, cwd=code, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def _peak_rss_mb(run_dir: Path) -> float:
    words = (run_dir / "peak_rss_kb").read_text().split() if (run_dir / "peak_rss_kb").exists() else []
    return int(words[-1]) / 1024 if words and words[-1].isdigit() else float("nan")


def eval_rows(rows: list[dict[str, float]]) -> dict[int, dict[str, float]]:
    """iteration -> its evaluation row (a later log wins: a resumed run evaluates again)."""
    return {int(r["eval/iteration"]): r for r in rows if "eval/success" in r and "eval/iteration" in r}


def by_length(row: dict[str, float]) -> dict[int, tuple[float, float]]:
    """An evaluation's success by the expert's exact path length: length -> (success, episodes)."""
    prefix = "eval/success/expert_steps/"
    return {int(k[len(prefix):]): (v, row[f"eval/episodes/expert_steps/{k[len(prefix):]}"])
            for k, v in row.items() if k.startswith(prefix)}


def study_commit(out: Path, requested: str | None) -> str:
    """The commit every run of the study trains: pinned in ``<out>/commit.txt`` by its first sitting, so a study that
    spans sittings trains one code for every arm and seed, whatever main has gained since (a speed-up that changes the
    rounding would otherwise split a seed's arms across two codes). ``requested`` (``--commit``) moves the pin."""
    pin = out / "commit.txt"
    if requested is None and pin.exists():
        return pin.read_text().strip()
    commit = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{requested or 'HEAD'}^{{commit}}"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    if not commit:
        raise SystemExit(f"--commit {requested}: not a commit of this repository; give a hash from git log")
    pin.write_text(commit + "\n")
    return commit


def warm(out: Path, code: Path, seed: int, overrides: list[str]) -> tuple[Path, dict]:
    """The seed's warm start (``out/warm/s<seed>/policy.pt``) and its evaluation (``before.json``): one run of one
    tiny iteration trains it (its cache) and evaluates it before training; made once, shared by every arm."""
    folder = out / "warm" / f"s{seed}"
    weights, before_path = folder / "policy.pt", folder / "before.json"
    if weights.exists() and before_path.exists():
        before = json.loads(before_path.read_text())
        if before.get("warm") == file_digest(weights):
            return weights, before
    run_dir = out / "runs" / f"warm-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if weights.exists():  # weights placed by hand (or made before its evaluation was): evaluate those, train nothing
        extra = [f"warm_start.weights={weights}"]
    else:
        extra = []
    rc = _train(code, run_dir, overrides, BASELINE, seed, 1, ["data.tasks_per_batch=1", "data.group_size=2",
                "evaluation.before_training=true", "evaluation.at_end=false", *extra])
    made = sorted((run_dir / "warm_start").glob("policy-*.pt"))
    row = eval_rows(log_rows(run_dir)).get(0)
    if rc != 0 or row is None or (not extra and len(made) != 1):
        raise RuntimeError(f"warm start seed {seed} failed (exit {rc}); see {run_dir / 'stdout.log'}")
    if not extra:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = weights.with_suffix(".tmp")
        shutil.copy(made[0], tmp)
        os.replace(tmp, weights)
    before = {"seed": seed, "warm": file_digest(weights), "success": row["eval/success"],
              "by_length": {str(n): list(v) for n, v in sorted(by_length(row).items())}}
    _write_json(before_path, before)
    shutil.rmtree(run_dir, ignore_errors=True)  # its cache is copied; the folder holds another copy of the weights
    return weights, before


def summarize(run_dir: Path, arm: str, seed: int, iterations: int, meta: dict, before: dict) -> dict:
    """What the tables need of a finished run (its folder is not committed)."""
    rows = log_rows(run_dir)
    evals = eval_rows(rows)
    curve = {"0": {"success": before["success"], "by_length": before["by_length"]}}
    for it, row in sorted(evals.items()):
        if it > 0:
            curve[str(it)] = {"success": row["eval/success"], "by_length": {str(n): list(v) for n, v in sorted(by_length(row).items())}}
    diagnostics = {key: [r[key] for r in rows if key in r and r[key] == r[key]] for key in DIAGNOSTICS}
    return {"arm": arm, "seed": seed, "iterations": iterations, "commit": meta["commit"], "code": meta["code"],
            "warm": meta["warm"], "wall_s": round(meta["wall_s"], 1), "resumed": meta["resumed"],
            "peak_rss_mb": meta.get("peak_rss_mb", float("nan")), "evals": curve,
            "diagnostics": {k: v for k, v in diagnostics.items() if v}}


def unrecorded_stretch(meta: dict, run_dir: Path) -> float:
    """Seconds a stretch of training ran before it was killed with its driver (the end of a sitting), so that
    ``wall_s`` counts every stretch: from the stretch's recorded start to the last write to the run's logs. 0 when
    the last stretch returned and recorded its own time (``started`` is then None)."""
    started = meta.get("started")
    if started is None:
        return 0.0
    writes = [p.stat().st_mtime for p in (run_dir / "stdout.log", run_dir / "train.log") if p.exists()]
    return max(0.0, max(writes, default=started) - started)


def run_arm(out: Path, code: Path, commit: str, identity: str, arm: str, seed: int, iterations: int,
            overrides: list[str], weights: Path, before: dict, keep_policies: bool) -> dict:
    """Train (or resume) one arm at one seed and summarise it; a summary made earlier is read back."""
    summary_path = out / "summaries" / f"{arm}-s{seed}.json"
    run_dir = out / "runs" / f"{arm}-s{seed}"
    meta_path = run_dir / "meta.json"
    if iterations not in eval_rows(log_rows(run_dir)):
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        last = run_dir / "checkpoints" / "last.ckpt"
        resume = last.exists() and meta.get("code") == identity and meta.get("warm") == file_digest(weights)
        if not resume:
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            meta = {}
        # written before training too: a run killed with this process (the end of a sitting) resumes next time, and
        # ``started`` lets that next time count the killed stretch's seconds, which this process never recorded
        meta = {"commit": commit, "code": identity, "warm": file_digest(weights),
                "wall_s": meta.get("wall_s", 0.0) + unrecorded_stretch(meta, run_dir),
                "resumed": meta.get("resumed", 0) + resume, "peak_rss_mb": meta.get("peak_rss_mb", 0.0), "started": time.time()}
        _write_json(meta_path, meta)
        extra = ["evaluation.before_training=false", f"warm_start.weights={weights}",
                 f"checkpoint.keep_policies={str(keep_policies).lower()}", *([f"ckpt_path={last}"] if resume else [])]
        start = time.monotonic()
        rc = _train(code, run_dir, overrides, arm, seed, iterations, extra)
        rss = _peak_rss_mb(run_dir)  # NaN when the run was killed by a signal: the earlier stretch's peak stands
        meta.update(wall_s=meta["wall_s"] + time.monotonic() - start, started=None,
                    peak_rss_mb=max(meta["peak_rss_mb"], rss) if rss == rss else meta["peak_rss_mb"])
        _write_json(meta_path, meta)
        if rc != 0 or iterations not in eval_rows(log_rows(run_dir)):
            raise RuntimeError(f"{arm} seed {seed} failed (exit {rc}); see {run_dir / 'stdout.log'}")
    summary = summarize(run_dir, arm, seed, iterations, json.loads(meta_path.read_text()), before)
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(summary_path, summary)
    return summary


def recorded(out: Path, arm: str, seed: int, iterations: int) -> dict | None:
    """The summary of a finished run (committed: a fresh checkout has it, not the run's folder or warm start)."""
    path = out / "summaries" / f"{arm}-s{seed}.json"
    done = json.loads(path.read_text()) if path.exists() else None
    return done if done and done["iterations"] == iterations else None


def archived(out: Path, arm: str, seed: int) -> bool:
    """The run's credit archive is complete (:func:`studies.ladder.credit_archive` writes ``done.json`` last)."""
    return (out / "credit_data" / f"{arm}-s{seed}" / "done.json").is_file()


def unpaired(out: Path, seed: int, digest: str) -> list[str]:
    """The finished runs of ``seed`` that started from another warm start than ``digest`` (``warm/`` is not committed:
    a later sitting on a fresh checkout retrains it, which gives the same bytes only on the same kind of processor at
    one thread); the tables leave them out of every pair."""
    return sorted(p.stem for p in (out / "summaries").glob(f"*-s{seed}.json") if json.loads(p.read_text())["warm"] != digest)


def prune(run_dir: Path) -> None:
    """A summarised and archived run keeps its logs and drops its weights (a SmolLM2 checkpoint is ~330 MB)."""
    for path in [*(run_dir / "checkpoints").glob("*.ckpt"), *(run_dir / "checkpoints").glob("policy-*.pt")]:
        path.unlink()


# ------------------------------------------------------------------ statistics


def auc(evals: dict[str, dict]) -> float:
    """The area under the greedy success curve over iterations, divided by the last iteration (trapezoids; the warm
    start's evaluation at 0 is every arm's first point): a mean success over the run, in [0, 1]."""
    pts = sorted((int(it), e["success"]) for it, e in evals.items())
    if len(pts) < 2:
        return float("nan")
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(pts, pts[1:]))
    return area / (pts[-1][0] - pts[0][0])


def length_slope(lengths: dict[str, list[float]]) -> float:
    """Success lost per extra expert turn: the least-squares slope of each episode's success on its expert path
    length (each length weighted by its episodes), NaN with fewer than two lengths."""
    xs, ys = [], []
    for n, (rate, episodes) in lengths.items():
        k = int(round(episodes))
        wins = int(round(rate * k))
        xs += [float(n)] * k
        ys += [1.0] * wins + [0.0] * (k - wins)
    return slope(xs, ys) if len(set(xs)) > 1 else float("nan")


def measures(summary: dict) -> dict[str, float]:
    last = summary["evals"][str(summary["iterations"])]
    return {"final": last["success"], "auc": auc(summary["evals"]), "slope": length_slope(last["by_length"])}


def paired_differences(summaries: list[dict], arm: str, measure: str, baseline: str = BASELINE) -> dict[int, float]:
    """Per seed, ``arm``'s measure minus the baseline's, over the seeds where both started from one warm start."""
    cell = {(s["arm"], s["seed"]): s for s in summaries}
    return {seed: measures(s)[measure] - measures(cell[(baseline, seed)])[measure]
            for (a, seed), s in sorted(cell.items())
            if a == arm and (baseline, seed) in cell and cell[(baseline, seed)]["warm"] == s["warm"]}


def build_table(summaries: list[dict], arms: list[str], command_line: str) -> str:
    # a seed is complete when it has every arm of the study, not only the arms some run has finished so far
    study = list(dict.fromkeys([*arms, *(s["arm"] for s in summaries)]))
    arms = [a for a in study if any(s["arm"] == a for s in summaries)]
    others = [a for a in arms if a != BASELINE]
    family = 1 - 0.05 / max(1, len(others))
    seeds = sorted({s["seed"] for s in summaries})
    complete = [seed for seed in seeds if all(any(s["arm"] == a and s["seed"] == seed for s in summaries) for a in study)]
    lines = [f"Command: `{command_line}`  ", f"Commit: {', '.join(sorted({s['commit'][:12] for s in summaries}))}", "",
             f"Seeds with every arm ({', '.join(study)}): {len(complete)} ({', '.join(map(str, complete)) or 'none'}); "
             f"runs: {len(summaries)}.", "",
             "## Per arm: mean [95% t interval over seeds] (seeds)", "",
             "| arm | greedy success at the end, % | area under the curve, % | slope, points per extra expert turn |",
             "|---|---|---|---|"]
    for arm in arms:
        vals = [measures(s) for s in summaries if s["arm"] == arm]
        cells = []
        for key in ("final", "auc", "slope"):
            xs = [v[key] for v in vals if v[key] == v[key]]
            cells.append(_fmt(t_interval(xs, bounds=(0.0, 1.0) if key != "slope" else None), digits=1 if key != "slope" else 2)
                         + f" ({len(xs)})" if xs else "")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", f"## Each arm minus {BASELINE}, paired by seed (points): mean [95% t interval] (pairs); Bonferroni "
                  f"over the {len(others)} comparisons ({100 * family:.2f}% each)", "",
              "| arm | end | end, Bonferroni | area | area, Bonferroni | slope | slope, Bonferroni |", "|---|---|---|---|---|---|---|"]
    for arm in others:
        cells = []
        for key in ("final", "auc", "slope"):
            d = [v for v in paired_differences(summaries, arm, key).values() if v == v]
            bounds = (-1.0, 1.0) if key != "slope" else None
            digits = 1 if key != "slope" else 2
            cells += [_fmt(t_interval(d, bounds=bounds), digits=digits) + f" ({len(d)})" if d else "",
                      _fmt(t_interval(d, bounds=bounds, coverage=family), digits=digits) if d else ""]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lengths = sorted({int(n) for s in summaries for n in s["evals"][str(s["iterations"])]["by_length"]})
    if lengths:
        lines += ["", "## Greedy success at the end by the expert's path length, % (episodes pooled over seeds)", "",
                  "| arm | " + " | ".join(str(n) for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
        for arm in ["warm start", *arms]:
            pooled = {}
            for s in summaries:
                if s["arm"] == (arms[0] if arm == "warm start" else arm):
                    at = s["evals"]["0" if arm == "warm start" else str(s["iterations"])]["by_length"]
                    for n, (rate, k) in at.items():
                        won, total = pooled.get(int(n), (0.0, 0.0))
                        pooled[int(n)] = (won + rate * k, total + k)
            lines.append(f"| {arm} | " + " | ".join(f"{100 * pooled[n][0] / pooled[n][1]:.0f} ({pooled[n][1]:.0f})"
                                                    if n in pooled and pooled[n][1] else "" for n in lengths) + " |")
    lines += ["", "## Per run", "", "| arm | seed | greedy success by evaluation, % | train success by iteration, % | "
              "evidence-outcome corr | wall s | peak RSS MB |", "|---|---|---|---|---|---|---|"]
    # the evaluations a run of this length makes (every run's own, pooled): one a run lacks shows as a hole
    due = {n: sorted({int(it) for s in summaries if s["iterations"] == n for it in s["evals"]}) for n in {s["iterations"] for s in summaries}}
    holes = False
    for s in sorted(summaries, key=lambda s: (s["seed"], arms.index(s["arm"]))):
        curve = " → ".join(f"{100 * s['evals'][str(it)]['success']:.0f}" if str(it) in s["evals"] else "–" for it in due[s["iterations"]])
        train_rows = s["diagnostics"].get("rollout/success", [])
        train = " ".join(f"{100 * v:.0f}" for v in train_rows)
        if len(train_rows) < s["iterations"]:
            train += f" ({len(train_rows)} of {s['iterations']} logged)"
        holes = holes or "–" in curve or len(train_rows) < s["iterations"]
        corr = s["diagnostics"].get("credit/evidence_outcome_corr")
        lines.append(f"| {s['arm']} | {s['seed']} | {curve} | {train} | {f'{statistics.fmean(corr):.3f}' if corr else ''} | "
                     f"{s['wall_s']:.0f} | {s['peak_rss_mb']:.0f} |")
    if holes:
        lines += ["", "–: an evaluation the run never made. A stop (SIGTERM) that came during a periodic evaluation dropped it, "
                      "and a resume at the study's commit did not make it up; the same stop lost that iteration's row of "
                      "train success. The area interpolates across the hole; the end is unaffected."]
    return "\n".join(lines) + "\n"


def read_summaries(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "summaries").glob("*.json"))]


def write_results(out: Path, arms: list[str], command_line: str) -> None:
    summaries = read_summaries(out)
    if not summaries:
        return
    with (out / "runs.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "commit", "warm", "iterations", "final", "auc", "slope", "wall_s", "peak_rss_mb", "resumed"])
        for s in summaries:
            m = measures(s)
            w.writerow([s["arm"], s["seed"], s["commit"], s["warm"], s["iterations"], f"{m['final']:.4f}", f"{m['auc']:.4f}",
                        f"{m['slope']:.5f}", s["wall_s"], f"{s['peak_rss_mb']:.0f}", s["resumed"]])
    (out / "table.md").write_text(build_table(summaries, arms, command_line))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", default=["0-9"], help="seeds or ranges: 0-9, or 0 3 7")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "smollm2_keydoor")
    parser.add_argument("--table-only", action="store_true", help="rewrite the tables from the summaries, train nothing")
    parser.add_argument("--commit", default=None,
                        help="train this commit's code and pin it for later sittings (default: the pinned one, else HEAD)")
    parser.add_argument("--code", type=Path, default=None,
                        help="train from this checkout instead of an export of HEAD (e.g. . for uncommitted edits)")
    parser.add_argument("--mc-seeds", nargs="*", default=["0-2"],
                        help="seeds whose agentopsd run keeps its policies for the Monte Carlo truth of iteration 1")
    parser.add_argument("--mc-samples", type=int, default=4, help="Monte Carlo continuations per state")
    parser.add_argument("--keep-weights", action="store_true", help="keep each finished run's checkpoints")
    parser.add_argument("overrides", nargs="*", help=f"train.py overrides of every run (default: {' '.join(DEFAULT_OVERRIDES)})")
    args = parser.parse_args(argv)
    if BASELINE not in args.arms:
        raise SystemExit(f"--arms: {args.arms} lacks {BASELINE}, the baseline every arm is paired with; add it")
    overrides = args.overrides or list(DEFAULT_OVERRIDES)
    args.out = args.out.resolve()  # the runs' working directory is the exported code, not here
    args.out.mkdir(parents=True, exist_ok=True)
    command_line = "python studies/arms.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.table_only:  # the tables keep naming the command that trained the runs
        table = args.out / "table.md"
        first = table.read_text().splitlines()[0] if table.exists() else ""
        trained_by = re.fullmatch(r"Command: `(.*)`\s*", first)
        write_results(args.out, args.arms, trained_by.group(1) if trained_by else command_line)
        return
    seeds = parse_seeds(args.seeds)
    mc_seeds = set(parse_seeds(args.mc_seeds)) if args.mc_seeds else set()
    commit = head_commit() if args.code else study_commit(args.out, args.commit)
    code = args.code.resolve() if args.code else export_code(commit, Path(os.environ.get("TMPDIR", "/tmp")) / "arms_src")
    identity = code_identity(commit)
    if args.code:
        commit += "+worktree"
        identity = commit  # uncommitted edits: resume only within this invocation's own runs
    # seed-major: a study cut short holds every arm of its first seeds (pairs complete); --jobs seeds at a time,
    # their runs interleaved, so that their warm starts train side by side
    per_seed = [[(a, s) for a in args.arms] for s in seeds]
    jobs = [job for k in range(0, len(per_seed), args.jobs) for turn in zip(*per_seed[k:k + args.jobs]) for job in turn]
    seed_locks = {s: threading.Lock() for s in seeds}
    lock = threading.Lock()
    failures: list[str] = []

    def one(job: tuple[str, int]) -> None:
        arm, seed = job
        try:
            mc = arm == "agentopsd" and seed in mc_seeds and args.mc_samples > 0
            summary = recorded(args.out, arm, seed, args.iterations)
            if summary is not None and arm != BASELINE and not archived(args.out, arm, seed) \
                    and not (args.out / "runs" / f"{arm}-s{seed}").exists():
                # summarised, but the sitting ended before its instrument's data was archived, and the rollouts
                # that archive needs went with the run's folder: train it again rather than lose them
                print(f"{arm} seed {seed}: summarised but not archived, and its run folder is gone: training it again",
                      file=sys.stderr, flush=True)
                summary = None
            if summary is None:
                with seed_locks[seed]:  # the first run of a seed makes its warm start, the others wait
                    weights, before = warm(args.out, code, seed, overrides)
                    stale = unpaired(args.out, seed, before["warm"])
                    if stale:
                        print(f"warning: seed {seed}'s warm start {before['warm']} is not the one {', '.join(stale)} "
                              "started from, so the tables pair none of them with this sitting's runs; restore "
                              f"{args.out / 'warm' / f's{seed}'} from the machine that made it, or move those summaries "
                              "aside to rerun them", file=sys.stderr, flush=True)
                summary = run_arm(args.out, code, commit, identity, arm, seed, args.iterations, overrides, weights, before, mc)
            run_dir = args.out / "runs" / f"{arm}-s{seed}"
            if arm != BASELINE and run_dir.exists():  # the arms that log the evidence: their instrument's data
                credit_archive(args.out, code, run_dir, args.iterations, args.mc_samples if mc else 0, mc_its=[1])
            if not args.keep_weights and run_dir.exists():
                prune(run_dir)
        except RuntimeError as error:
            failures.append(str(error))
            print(error, file=sys.stderr, flush=True)
            return
        with lock:
            write_results(args.out, args.arms, command_line)
        m = measures(summary)
        print(f"{arm} seed {seed}: greedy {100 * summary['evals']['0']['success']:.0f} -> {100 * m['final']:.0f} (area {100 * m['auc']:.0f}) "
              f"in {summary['wall_s']:.0f} s", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, jobs))
    if failures:
        raise SystemExit(f"{len(failures)} run(s) failed; rerun the same command to retry them")


if __name__ == "__main__":
    main()
