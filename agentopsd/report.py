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
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: the report is written on servers and CI machines
import matplotlib.pyplot as plt  # noqa: E402
import webdataset as wds  # noqa: E402
import yaml  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

PRIOR_CLIP = 1e-4  # the success prior's clip: an all-won group starts at B_0 = 1 - 1e-4
REPO = Path(__file__).resolve().parents[1]


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


def read_shards(run_dir: Path) -> list[dict]:
    records = []
    for path in sorted((run_dir / "rollouts").glob("rollouts-*.tar")):
        records += [json.loads(s["json"]) for s in wds.WebDataset(str(path), shardshuffle=False)]
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


def plot_credit(record: dict, path: Path, info: RunInfo, lam: float | None) -> None:
    turns = record["turns"]
    k = list(range(len(turns)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7, 0.6 * len(turns)), 6.2), sharex=True)
    top.bar(k, [t["revision"] for t in turns], color=["tab:green" if t["revision"] >= 0 else "tab:red" for t in turns], alpha=0.6,
            label="belief revision dB_k = B_k - B_(k-1)")
    top.plot(k, [t["belief"] for t in turns], "k.-", label="success belief B_k after turn k")
    top.axhline(0, color="grey", lw=0.5)
    top.set(ylabel="belief, revision")
    top.legend(fontsize=7, loc="best")
    w = [t["multiplier"] for t in turns]
    bottom.plot(k, w, "b^", label="w_k (bounded multiplier)")
    if lam is not None:
        bottom.bar(k, [(1 - lam) + lam * x for x in w], color="tab:purple", alpha=0.4, label=f"applied: (1 - lam) + lam·w_k, lam = {lam:g}")
        low = min(min(w), 1.0) - 0.05
        bottom.set_ylim(low, max(max(w), 1.0) + 0.05)
    bottom.axhline(1, color="grey", lw=0.5)
    bottom.set(ylabel="advantage multiplier", xlabel="turn k: the action taken")
    bottom.set_xticks(k, [_label(t["action"]) for t in turns], rotation=60, ha="right", fontsize=7)
    bottom.legend(fontsize=7, loc="best")
    outcome = "won" if record["success"] else "lost"
    fig.suptitle(f"{credit_title(record)} ({outcome}, iteration {record['iteration']}, A_seq = {record['seq_advantage']:.2f})\n{info.label}",
                 fontsize=9)
    fig.text(0.01, 0.005, credit_caption(record, lam), fontsize=6.5, wrap=True, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ the page


def _credit_table(record: dict, lam: float | None) -> str:
    applied = (lambda w: f"{(1 - lam) + lam * w:.3f}") if lam is not None else (lambda w: "")
    rows = "".join(
        f"<tr><td>{t['k']}</td><td>{html.escape(_label(t['action'], 60))}</td><td>{t['belief']:.3f}</td><td>{t['revision']:+.3f}</td>"
        f"<td>{t['multiplier']:.3f}</td><td>{applied(t['multiplier'])}</td><td>{t.get('advantage', 0):+.3f}</td></tr>"
        for t in record["turns"]
    )
    return ("<table><tr><th>k</th><th>action</th><th>B_k</th><th>dB_k</th><th>w_k</th><th>(1-lam)+lam·w_k</th><th>At_k</th></tr>"
            f"{rows}</table>")


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
    for i, rec in enumerate(pick_credit_examples(records)):
        plot_credit(rec, out / f"credit_{i}.png", info, lam)
        task = html.escape(f"{rec['env']} task {rec['task_index']} ({rec['task_type']}), iteration {rec['iteration']}: "
                           f"{'won' if rec['success'] else 'lost'}, A_seq = {rec['seq_advantage']:.2f}")
        sections.append(f"<h3>{html.escape(credit_title(rec))}</h3><p>{task}</p>"
                        f"<img src='credit_{i}.png'><p>{html.escape(credit_caption(rec, lam))}</p>{_credit_table(rec, lam)}")
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
teacher view gave), the bounded multiplier w_k and the multiplier applied to the GRPO advantage, (1 - lam) + lam·w_k.</p>
{''.join(sections) or '<p>No rollout shard with credit values (GRPO runs have none).</p>'}
<h2>Credit statistics</h2>{stats_html}
<h2>Config</h2><details><summary>the resolved config of this run (seed {html.escape(info.seed)})</summary><pre>{html.escape(config_text)}</pre></details>
</body></html>"""
    (out / "index.html").write_text(page)
    return out / "index.html"
