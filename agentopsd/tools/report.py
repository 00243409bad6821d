"""The run report: learning curve, success by horizon, and the credit each turn got.

``write_report(run_dir)`` reads what a run left in its folder (``csv/``, ``rollouts/``, ``.hydra/``)
and writes ``report/`` with PNG figures and one ``index.html`` that shows them. Every title names
the run (experiment, algorithm, seed, commit), so a figure copied elsewhere still says where it
came from. Iterations are counted as everywhere else: completed iterations, 0 before training.
"""

from __future__ import annotations

import csv
import html
import json
import math
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: the report is written on servers and CI machines
import matplotlib.pyplot as plt  # noqa: E402
import webdataset as wds  # noqa: E402
import yaml  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from agentopsd.credit import PRIOR_CLIP, applied_multiplier  # noqa: E402
from agentopsd.envs.base import has_state_snapshot  # noqa: E402
from agentopsd.study.credit_quality import pairwise_accuracy  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LABEL_COLOURS = {"progress": "tab:green", "wasted": "tab:orange", "fatal": "tab:red", "lost": "tab:grey"}


@dataclass(frozen=True)
class RunInfo:
    """What names a run in titles and captions."""

    experiment: str
    algorithm: str
    seed: str
    commit: str
    folder: str
    config: dict
    """The resolved config (empty when the run folder has none)."""

    @property
    def label(self) -> str:
        return f"{self.experiment} · {self.algorithm} · seed {self.seed} · commit {self.commit}"


def source_commit(repo: Path = REPO) -> str:
    """The short commit of the code, ``+local`` when tracked files differ from it; ``unknown`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+local" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def run_info(run_dir: Path, config: dict | None = None, commit: str | None = None) -> RunInfo:
    """From ``config`` (train.py passes the resolved one) or the run's ``.hydra/`` files."""
    hydra_dir = run_dir / ".hydra"
    choices: dict = {}
    if (hydra_dir / "hydra.yaml").is_file():
        choices = (yaml.safe_load((hydra_dir / "hydra.yaml").read_text()) or {}).get("hydra", {}).get("runtime", {}).get("choices", {})
    if config is None and (hydra_dir / "config.yaml").is_file():
        config = yaml.safe_load((hydra_dir / "config.yaml").read_text()) or {}
    config = config or {}
    name = str(config.get("name", "")) if "${" not in str(config.get("name", "")) else ""
    algorithm = (config.get("algorithm") or {}).get("name") or choices.get("algorithm", "?")
    return RunInfo(experiment=name or choices.get("experiment", run_dir.parent.name), algorithm=str(algorithm), seed=str(config.get("seed", "?")),
                   commit=commit or source_commit(), folder=run_dir.name, config=config)


# ------------------------------------------------------------------ reading a run


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """Every logged row, oldest version first (a resumed run adds ``version_1``, ...)."""
    rows: list[dict[str, float]] = []
    versions = sorted((run_dir / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    for path in versions:
        with path.open() as f:
            for row in csv.DictReader(f):
                rows.append({k: float(v) for k, v in row.items() if v not in ("", None)})
    return rows


def _every_shard(urls):
    """This reader takes every shard (webdataset's default splits them by rank once a process group exists)."""
    return urls


def read_shards(run_dir: Path) -> list[dict]:
    records = []
    for path in sorted((run_dir / "rollouts").glob("rollouts-*.tar")):
        records += [json.loads(s["json"]) for s in wds.WebDataset(str(path), shardshuffle=False, nodesplitter=_every_shard)]
    return records


def series(rows: list[dict[str, float]], key: str, x_key: str | None = None) -> tuple[list[float], list[float]]:
    """``key`` against the iteration (``eval/iteration`` or ``rollout/iteration``, both completed iterations).

    A resumed run logs again the iterations after its checkpoint: the later row of an iteration wins,
    so a curve never jumps back.
    """
    x_key = x_key or ("eval/iteration" if key.startswith("eval/") else "rollout/iteration")
    points = {r[x_key]: r[key] for r in rows if key in r and x_key in r}
    xs = sorted(points)
    return xs, [points[x] for x in xs]


def wilson_interval(p: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a success rate ``p`` over ``n`` episodes: it never leaves [0, 1]."""
    if n <= 0:
        return 0.0, 1.0
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _label(text: str, width: int = 18) -> str:
    """A tick label: printable characters only (generations can hold control bytes no font draws)."""
    clean = "".join(c if c.isprintable() else "?" for c in str(text)).strip()
    return clean[:width] if len(clean) <= width else clean[: width - 1] + "…"


# ------------------------------------------------------------------ figures


def plot_learning_curve(rows: list[dict[str, float]], path: Path, info: RunInfo) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    x, y = series(rows, "rollout/success")
    if x:
        ax[0].plot(x, y, "-", color="tab:blue", label="training rollouts (sampled)")
    x, y = series(rows, "eval/success")
    _, n = series(rows, "eval/episodes")
    if x:
        lo_hi = [wilson_interval(p, k) for p, k in zip(y, n if len(n) == len(y) else [0] * len(y))]
        err = [[p - lo for p, (lo, _) in zip(y, lo_hi)], [hi - p for p, (_, hi) in zip(y, lo_hi)]]
        episodes = f"{int(n[-1])} episodes per point" if n else "episodes unknown"
        ax[0].errorbar(x, y, yerr=err, fmt="o-", color="tab:orange", capsize=3, label=f"evaluation (fixed list, {episodes}, 95% interval)")
    ax[0].set(xlabel="completed RL iterations", ylabel="success rate", title="Success", ylim=(-0.02, 1.02))
    if ax[0].get_legend_handles_labels()[0]:
        ax[0].legend(fontsize=8)
    x, y = series(rows, "rollout/reward")
    ax[1].plot(x, y, color="tab:green")
    ax[1].set(xlabel="completed RL iterations", ylabel="mean episode reward (training rollouts)", title="Reward")
    for a in ax:  # iterations are whole numbers
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(info.label, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def horizon_table(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """``{bucket: {"before", "after", "n"}}`` from the first evaluation before RL and the last one."""
    evals = [r for r in rows if "eval/success" in r]
    if not evals:
        return {}
    before = next((r for r in evals if r.get("eval/iteration") == 0), None)
    last = evals[-1]

    def lower_bound(bucket: str) -> int:  # "6-10" -> 6, "41+" -> 41, "unknown" last
        head = bucket.split("-")[0].rstrip("+")
        return int(head) if head.isdigit() else 10**6

    buckets = sorted({k.rsplit("/", 1)[1] for r in (before or {}, last) for k in r if k.startswith("eval/success/horizon/")}, key=lower_bound)
    table = {}
    for b in buckets:
        entry = {"after": last.get(f"eval/success/horizon/{b}", float("nan")), "n": last.get(f"eval/episodes/horizon/{b}", float("nan"))}
        if before is not None and before is not last:
            entry["before"] = before.get(f"eval/success/horizon/{b}", float("nan"))
        table[b] = entry
    return table


def plot_horizon(table: dict[str, dict[str, float]], path: Path, info: RunInfo, after_iterations: int) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    xs = list(range(len(table)))
    has_before = any("before" in v for v in table.values())
    width = 0.4 if has_before else 0.6
    bars = []
    if has_before:  # no legend entry without bars
        bars.append(ax.bar([x - 0.2 for x in xs], [v.get("before", float("nan")) for v in table.values()], width=width, label="before RL"))
    bars.append(ax.bar([x + (0.2 if has_before else 0) for x in xs], [v["after"] for v in table.values()], width=width, color="tab:orange",
                       label=f"after {after_iterations} iterations"))
    for group in bars:  # the value on each bar: a 0% bar is otherwise invisible
        ax.bar_label(group, labels=[f"{h.get_height():.0%}" if h.get_height() == h.get_height() else "" for h in group], fontsize=7)
    ticks = [f"{b}\n(n={int(v['n'])})" if v["n"] == v["n"] else b for b, v in table.items()]
    ax.set_xticks(xs, ticks)
    ax.set(xlabel="expert path length in turns (n = evaluation episodes in the bucket)", ylabel="success rate", ylim=(0, 1.05))
    ax.set_title(f"Success by horizon\n{info.label}", fontsize=9)
    if table:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pick_credit_examples(records: list[dict]) -> list[dict]:
    """The latest won and the latest lost trajectory with several turns and credit values.

    Trajectories whose group had mixed outcomes (A_seq != 0) come first: their multipliers
    act. When no group had mixed outcomes yet (an early or short run), the latest trajectory
    with credit values is shown anyway, with a caption saying why its revisions are near zero.
    """
    with_credit = [r for r in records if len(r["turns"]) >= 3 and "belief" in r["turns"][0]]
    usable = [r for r in with_credit if r["seq_advantage"] != 0]
    won = [r for r in usable if r["success"]]
    lost = [r for r in usable if not r["success"]]
    return (won[-1:] + lost[-1:]) or with_credit[-1:]


# ------------------------------------------------------------------ ground truth of a plotted trajectory


@dataclass(frozen=True)
class ExpertTruth:
    """The env's expert's verdict on every turn of one logged trajectory, or why there is none."""

    path: tuple[int, ...]
    """d(s_0) .. d(s_K) [K+1]: the bot's remaining path before each turn and after the last; -1: no way to win."""
    labels: tuple[str, ...]
    """[K] progress / wasted / fatal / lost (``groundtruth.expert_label``)."""
    gains: tuple[float, ...]
    """[K] the path each turn saved (``groundtruth.expert_gain``: fatal far below any real change)."""
    missing: str
    """Why there is no ground truth; empty when there is one."""

    @classmethod
    def unavailable(cls, reason: str) -> ExpertTruth:
        return cls(path=(), labels=(), gains=(), missing=reason)


def expert_truths(records: list[dict], env_config: dict) -> list[ExpertTruth]:
    """Replay each record from its task index and label its turns by the expert's remaining path.

    ``env_config``: the run's ``env`` config (``max_turns``, optional ``kwargs``). A record of an env
    without an expert, or one whose replay fails, gets ``ExpertTruth.unavailable`` with the reason:
    the report is written whatever the log holds. One env per id serves every record (building
    one costs ~0.3 s; a replay with its labels ~5 ms per turn on PickupObj).
    """
    made: dict = {}
    try:
        return [_expert_truth(rec, env_config, made) for rec in records]
    finally:
        for env in made.values():
            env.close()


def _expert_truth(record: dict, env_config: dict, made: dict) -> ExpertTruth:
    env_id = str(record.get("env", "?"))
    try:
        replayable = has_state_snapshot(env_id)
    except Exception as err:  # noqa: BLE001  (an id this install does not register)
        return ExpertTruth.unavailable(f"{env_id} is not a registered env ({type(err).__name__})")
    if not replayable:
        return ExpertTruth.unavailable(f"{env_id} has none (only envs with a cheap state snapshot and an expert replay "
                                       "from a task index: TextEnv.state_snapshot)")
    if env_config.get("max_turns") is None:
        return ExpertTruth.unavailable("the run's config has no env.max_turns to replay the trajectory with")
    if not all("observation" in t for t in record["turns"]):
        return ExpertTruth.unavailable("the log holds no observations to check a replay against")
    max_turns = int(env_config["max_turns"])
    try:
        from agentopsd.study.groundtruth import (
            LoggedTrajectory,
            expert_gain,
            expert_label,
            expert_path,
            make_env,
            replay,
        )

        if env_id not in made:
            # the bot's path at reset is not needed here: expert_path measures every state itself
            made[env_id] = make_env(env_id, max_turns, {**(env_config.get("kwargs") or {}), "compute_expert_steps": False})
        traj = LoggedTrajectory.from_record(record, run="report", algorithm="")
        path = expert_path(replay(made[env_id], traj, max_turns))
    except Exception as err:  # noqa: BLE001  (a figure says why; the rest of the report still gets written)
        return ExpertTruth.unavailable(f"the replay failed ({type(err).__name__}: {err})")
    pairs = list(zip(path[:-1], path[1:]))
    return ExpertTruth(path=tuple(path), labels=tuple(expert_label(b, a) for b, a in pairs),
                       gains=tuple(expert_gain(b, a) for b, a in pairs), missing="")


def credit_accuracy(record: dict, truth: ExpertTruth) -> tuple[float, int] | None:
    """Pairwise accuracy of the credit sign(A_seq)·w_k [K] against the expert gain, with its pair count.

    None without a ground truth, without multipliers, or when no two turns differ in expert gain.
    A_seq = 0 makes the credit constant: exactly 0.5 (chance), as for GRPO.
    """
    turns = record["turns"]
    if truth.missing or not all("multiplier" in t for t in turns):
        return None
    sign = math.copysign(1.0, record["seq_advantage"]) if record["seq_advantage"] != 0 else 0.0
    return pairwise_accuracy([sign * t["multiplier"] for t in turns], list(truth.gains))


def truth_caption(record: dict, truth: ExpertTruth) -> str:
    """What a good credit method would do here, and how this trajectory's credit did."""
    if truth.missing:
        return f"Ground truth not available: {truth.missing}."
    scored = credit_accuracy(record, truth)
    score = (f"here the credit sign(A_seq)·w_k orders {scored[0]:.2f} of the {scored[1]} turn pairs that differ in expert "
             "gain as the expert does (pairwise accuracy, 0.5 = chance)" if scored is not None
             else "here no two turns differ in expert gain, so the credit's ordering cannot be scored")
    return ("Ground truth, the env expert's remaining path before -> after each turn: a good credit method gives the "
            f"largest |credit| to the turns that shortened it in a won game and to the fatal turn in a lost one; {score}.")


def _path_text(d: int) -> str:
    return str(d) if d >= 0 else "none"


def credit_title(record: dict) -> str:
    """What the picture answers: which turn won a won game, which turn lost a lost one, and, when every
    copy of the task ended the same way, that there was no credit to assign."""
    if record["seq_advantage"] == 0:
        return f"No credit to assign: every copy of this task {'won' if record['success'] else 'lost'}"
    return "Which turn won the game?" if record["success"] else "Which turn lost the game?"


def credit_caption(record: dict, lam: float | None) -> str:
    lam_text = f"{lam:g}" if lam is not None else "lam"
    text = ("w_k = clip(1 + b·z_k, 1-b, 1+b), with z_k the outcome-aligned revision sign(A_seq)·dB_k standardised within "
            "this episode: a negative revision that is less negative than the episode's others still gets w_k > 1. "
            f"The advantage of turn k is A_seq·((1 - lam) + lam·w_k), lam = {lam_text}.")
    if record["seq_advantage"] == 0:
        b0 = 1 - PRIOR_CLIP if record["success"] else PRIOR_CLIP
        text += (f" Here every copy of the task {'won' if record['success'] else 'lost'}: the group's success prior B_0 = {b0:.4f} is "
                 "saturated, so the teacher's evidence barely moves the belief (revisions near 0), and A_seq = 0 gives every "
                 "turn a zero advantage from the outcome whatever w_k (a turn's format or action penalty still applies).")
    return text


def plot_credit(record: dict, path: Path, info: RunInfo, lam: float | None, truth: ExpertTruth) -> None:
    turns = record["turns"]
    k = list(range(len(turns)))
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(max(7, 0.6 * len(turns)), 8.4), sharex=True,
                                              gridspec_kw={"height_ratios": (3, 2.4, 2)})
    top.bar(k, [t["revision"] for t in turns], color=["tab:green" if t["revision"] >= 0 else "tab:red" for t in turns], alpha=0.6,
            label="belief revision dB_k = B_k - B_(k-1)")
    top.plot(k, [t["belief"] for t in turns], "k.-", label="success belief B_k after turn k")
    top.axhline(0, color="grey", lw=0.5)
    top.set(ylabel="belief, revision")
    top.legend(fontsize=7, loc="best")
    w = [t["multiplier"] for t in turns]
    middle.plot(k, w, "b^", label="w_k (bounded multiplier)")
    if lam is not None:
        middle.bar(k, [applied_multiplier(x, lam) for x in w], color="tab:purple", alpha=0.4, label=f"applied: (1 - lam) + lam·w_k, lam = {lam:g}")
        low = min(min(w), 1.0) - 0.05
        middle.set_ylim(low, max(max(w), 1.0) + 0.05)
    middle.axhline(1, color="grey", lw=0.5)
    middle.set(ylabel="advantage multiplier")
    middle.legend(fontsize=7, loc="best")
    _plot_truth(bottom, truth)
    bottom.set_xticks(k, [_label(t["action"]) for t in turns], rotation=60, ha="right", fontsize=7)
    for tick, label in zip(bottom.get_xticklabels(), truth.labels):  # the expert's verdict, at a glance
        tick.set_color(LABEL_COLOURS[label])
    bottom.set_xlabel("turn k: the action taken" + ("" if truth.missing else " (coloured by the expert's label)"))
    outcome = "won" if record["success"] else "lost"
    fig.suptitle(f"{credit_title(record)} ({outcome}, iteration {record['iteration']}, A_seq = {record['seq_advantage']:.2f})\n{info.label}",
                 fontsize=9)
    fig.text(0.01, 0.005, credit_caption(record, lam) + " " + truth_caption(record, truth), fontsize=6.5, wrap=True, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_truth(ax, truth: ExpertTruth) -> None:
    """The expert path each turn saved (+1 progress, 0 or less wasted); a fatal turn as a hatched bar below the rest."""
    if truth.missing:
        ax.set_yticks([])
        width = int(ax.get_window_extent().width / 6)  # characters of 7-point text that fit across the panel
        ax.text(0.5, 0.5, textwrap.fill(f"Ground truth not available: {truth.missing}", max(width, 40)), transform=ax.transAxes,
                ha="center", va="center", fontsize=7, color="dimgrey")
        return
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_ylabel("expert path saved")
    real = [g for g, label in zip(truth.gains, truth.labels) if label != "fatal"]
    fatal_depth = -max(2.0, max((abs(g) for g in real), default=0.0) + 1.0)  # below every real change, not at -100
    heights = [fatal_depth if label == "fatal" else g for g, label in zip(truth.gains, truth.labels)]
    bars = ax.bar(range(len(heights)), heights, color=[LABEL_COLOURS[label] for label in truth.labels], alpha=0.8,
                  hatch=["xx" if label == "fatal" else "" for label in truth.labels])
    texts = [f"{_path_text(b)}→{_path_text(a)}" for b, a in zip(truth.path[:-1], truth.path[1:])]
    ax.bar_label(bars, labels=texts, fontsize=6, padding=1)
    for k, (height, label) in enumerate(zip(heights, truth.labels)):
        if height == 0:  # a zero bar is invisible: mark it ("x": played after the game was already lost)
            ax.plot([k], [0], "x" if label == "lost" else "_", ms=10, mew=2.5, color=LABEL_COLOURS[label])
    ax.set_ylim(min(heights + [0.0]) - 0.8, max(heights + [0.0]) + 0.8)
    present = [name for name in LABEL_COLOURS if name in truth.labels]
    ax.legend(handles=[Patch(color=LABEL_COLOURS[n], hatch="xx" if n == "fatal" else "", label=n) for n in present],
              fontsize=7, loc="best", ncol=len(present), title="expert label (path before→after)", title_fontsize=7)


# ------------------------------------------------------------------ the page


def _credit_table(record: dict, lam: float | None, truth: ExpertTruth) -> str:
    applied = (lambda w: f"{applied_multiplier(w, lam):.3f}") if lam is not None else (lambda w: "")

    def expert(k: int) -> str:
        if truth.missing:
            return "<td>n/a</td><td>n/a</td>"
        label = truth.labels[k]
        return (f"<td>{_path_text(truth.path[k])} -> {_path_text(truth.path[k + 1])}</td>"
                f"<td style='color:{LABEL_COLOURS[label].removeprefix('tab:')}'>{label}</td>")

    rows = "".join(
        f"<tr><td>{t['k']}</td><td>{html.escape(_label(t['action'], 60))}</td><td>{t['belief']:.3f}</td><td>{t['revision']:+.3f}</td>"
        f"<td>{t['multiplier']:.3f}</td><td>{applied(t['multiplier'])}</td><td>{t.get('advantage', 0):+.3f}</td>{expert(i)}</tr>"
        for i, t in enumerate(record["turns"])
    )
    return ("<table><tr><th>k</th><th>action</th><th>B_k</th><th>dB_k</th><th>w_k</th><th>(1-lam)+lam·w_k</th><th>At_k</th>"
            f"<th>expert path before -> after</th><th>label</th></tr>{rows}</table>")


def credit_statistics(rows: list[dict[str, float]]) -> dict[str, tuple[float, float, int]]:
    """``{credit/<stat>: (mean over iterations, last value, iterations)}``; NaN rows (no mixed group) skipped."""
    keys = sorted({k for r in rows for k in r if k.startswith("credit/")})
    out = {}
    for key in keys:
        _, values = series(rows, key)
        values = [v for v in values if v == v]
        if values:
            out[key] = (sum(values) / len(values), values[-1], len(values))
    return out


def _summary(rows: list[dict[str, float]]) -> str:
    evals = [r for r in rows if "eval/success" in r]
    if not evals:
        return "<p>No evaluation was logged.</p>"
    by_iteration = dict(zip(*series(rows, "eval/success")))
    last_it = max(by_iteration)
    _, n = series(rows, "eval/episodes")
    after = f"{by_iteration[last_it]:.1%} after {int(last_it)} iterations"
    episodes = f" (fixed list of {int(n[-1])} episodes, greedy)" if n else ""
    if 0.0 in by_iteration and last_it != 0:
        return f"<p><b>Evaluation success:</b> {by_iteration[0.0]:.1%} before RL, {after}{episodes}.</p>"
    return f"<p><b>Evaluation success:</b> {after}{episodes}; no evaluation before RL.</p>"


def write_report(run_dir: str | Path, config: dict | None = None) -> Path:
    """Write ``run_dir/report/`` (figures and ``index.html``); ``config``: the run's resolved config."""
    run_dir = Path(run_dir).resolve()  # runs/<name>/latest names the run by its own folder
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    info = run_info(run_dir, config)
    rows, records = read_metrics(run_dir), read_shards(run_dir)
    _, lams = series(rows, "credit/lambda")
    lam = lams[-1] if lams else (info.config.get("algorithm") or {}).get("mult_lambda")
    plot_learning_curve(rows, out / "learning_curve.png", info)
    table = horizon_table(rows)
    evals_x, _ = series(rows, "eval/success")
    plot_horizon(table, out / "horizon.png", info, int(evals_x[-1]) if evals_x else 0)
    sections = []
    examples = pick_credit_examples(records)
    for i, (rec, truth) in enumerate(zip(examples, expert_truths(examples, info.config.get("env") or {}))):
        plot_credit(rec, out / f"credit_{i}.png", info, lam, truth)
        task = html.escape(f"{rec['env']} task {rec['task_index']} ({rec['task_type']}), iteration {rec['iteration']}: "
                           f"{'won' if rec['success'] else 'lost'}, A_seq = {rec['seq_advantage']:.2f}")
        captions = f"{html.escape(credit_caption(rec, lam))}</p><p>{html.escape(truth_caption(rec, truth))}"
        sections.append(f"<h3>{html.escape(credit_title(rec))}</h3><p>{task}</p>"
                        f"<img src='credit_{i}.png'><p>{captions}</p>{_credit_table(rec, lam, truth)}")
    has_before = any("before" in v for v in table.values())
    horizon_rows = "".join(
        f"<tr><td>{b}</td><td>{int(v['n']) if v['n'] == v['n'] else '?'}</td>" + (f"<td>{v.get('before', float('nan')):.2f}</td>" if has_before else "")
        + f"<td>{v['after']:.2f}</td></tr>" for b, v in table.items()
    )
    stats = credit_statistics(rows)
    stats_rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{m:.4f}</td><td>{last:.4f}</td><td>{n}</td></tr>" for k, (m, last, n) in stats.items())
    stats_html = (f"<table><tr><th>statistic</th><th>mean over iterations</th><th>last</th><th>iterations</th></tr>{stats_rows}</table>"
                  if stats else "<p>No credit statistics (this algorithm assigns none, or no group had mixed outcomes).</p>")
    config_text = yaml.safe_dump(info.config, sort_keys=False) if info.config else "(no config found in the run folder)"
    title = html.escape(f"{info.experiment} / {info.folder}")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>agentopsd report: {title}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px}}img{{max-width:100%}}pre{{font-size:11px;background:#f6f6f6;padding:6px}}</style></head><body>
<h1>Run report: {title}</h1>
<p>Experiment <b>{html.escape(info.experiment)}</b>, algorithm <b>{html.escape(info.algorithm)}</b>, seed <b>{html.escape(info.seed)}</b>,
commit <b>{html.escape(info.commit)}</b>, folder <code>{html.escape(str(run_dir))}</code>.
Iterations are counted as completed iterations everywhere (0 = before training).</p>{_summary(rows)}
<h2>Learning curve</h2><img src="learning_curve.png"><p>Evaluation points carry 95% Wilson intervals for their number of episodes.</p>
<h2>Success by horizon</h2><img src="horizon.png">
<table><tr><th>expert turns</th><th>episodes</th>{'<th>before RL</th>' if has_before else ''}<th>after</th></tr>{horizon_rows}</table>
<h2>Credit per turn</h2><p>Per turn: the success belief B_k after the turn, its revision dB_k (the evidence the skill-aware
teacher view gave), the bounded multiplier w_k and the multiplier applied to the GRPO advantage, (1 - lam) + lam·w_k;
beside them the ground truth where the env has one (a cheap state snapshot and an expert, e.g. BabyAI): the expert's remaining path before and after the turn and its
label (progress: the path shrank; wasted: it did not; fatal: the game could no longer be won; lost: it already could not).</p>
{''.join(sections) or '<p>No rollout shard with credit values (GRPO runs have none).</p>'}
<h2>Credit statistics</h2>{stats_html}
<h2>Config</h2><details><summary>the resolved config of this run (seed {html.escape(info.seed)})</summary><pre>{html.escape(config_text)}</pre></details>
</body></html>"""
    (out / "index.html").write_text(page)
    return out / "index.html"
