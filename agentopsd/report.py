"""The run report: learning curve, success by horizon, and which turn won the game.

``write_report(run_dir)`` reads what a run left behind (``csv/``, ``rollouts/``) and writes
``report/`` with PNG figures and one ``index.html`` that shows them.
"""

from __future__ import annotations

import csv
import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: the report is written on servers and CI machines
import matplotlib.pyplot as plt  # noqa: E402
import webdataset as wds  # noqa: E402


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = []
    for path in sorted((run_dir / "csv").glob("version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                rows.append({k: float(v) for k, v in row.items() if v not in ("", None)})
    return rows


def read_shards(run_dir: Path) -> list[dict]:
    records = []
    for path in sorted((run_dir / "rollouts").glob("rollouts-*.tar")):
        records += [json.loads(s["json"]) for s in wds.WebDataset(str(path), shardshuffle=False)]
    return records


def _series(rows: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    """``key`` against the iteration: rollout rows carry ``rollout/iteration`` (the iteration trained),
    evaluation rows ``eval/iteration`` (iterations completed, 0 before training)."""
    x_key = "eval/iteration" if key.startswith("eval/") else "rollout/iteration"
    pts = [(r[x_key], r[key]) for r in rows if key in r and x_key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_learning_curve(rows: list[dict[str, float]], path: Path) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    for key, label in (("rollout/success", "training rollouts"), ("eval/success", "evaluation (fixed list)")):
        x, y = _series(rows, key)
        ax[0].plot(x, y, "o-" if key.startswith("eval") else "-", label=label)
    ax[0].set(xlabel="RL iteration", ylabel="success rate", title="Success", ylim=(-0.02, 1.02))
    ax[0].legend()
    x, y = _series(rows, "rollout/reward")
    ax[1].plot(x, y, color="tab:green")
    ax[1].set(xlabel="RL iteration", ylabel="mean episode reward", title="Reward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_horizon(rows: list[dict[str, float]], path: Path) -> dict[str, tuple[float, float]]:
    evals = [r for r in rows if "eval/success" in r]
    if not evals:
        return {}
    first, last = evals[0], evals[-1]
    def lower_bound(key: str) -> int:  # "6-10" -> 6, "41+" -> 41, "unknown" last
        head = key.rsplit("/", 1)[1].split("-")[0].rstrip("+")
        return int(head) if head.isdigit() else 10**6

    keys = sorted({k for r in (first, last) for k in r if k.startswith("eval/success/horizon/")}, key=lower_bound)
    table = {k.rsplit("/", 1)[1]: (first.get(k, float("nan")), last.get(k, float("nan"))) for k in keys}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = range(len(table))
    ax.bar([x - 0.2 for x in xs], [v[0] for v in table.values()], width=0.4, label="before RL")
    ax.bar([x + 0.2 for x in xs], [v[1] for v in table.values()], width=0.4, label="after RL")
    ax.set_xticks(list(xs), list(table), rotation=0)
    ax.set(xlabel="expert path length (turns)", ylabel="success rate", title="Success by horizon", ylim=(0, 1.02))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return table


def pick_credit_examples(records: list[dict]) -> list[dict]:
    """The latest won and the latest lost trajectory with several turns and credit values.

    Trajectories whose group had mixed outcomes (A_seq != 0) come first: their multipliers
    act. When no group had mixed outcomes yet (an early or short run), the latest trajectory
    with credit values is shown anyway: its beliefs and revisions are still what the teacher saw.
    """
    with_credit = [r for r in records if len(r["turns"]) >= 3 and "belief" in r["turns"][0]]
    usable = [r for r in with_credit if r["seq_advantage"] != 0]
    won = [r for r in usable if r["success"]]
    lost = [r for r in usable if not r["success"]]
    return (won[-1:] + lost[-1:]) or with_credit[-1:]


def plot_credit(record: dict, path: Path) -> None:
    turns = record["turns"]
    k = list(range(len(turns)))
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(turns)), 4.2))
    ax.bar(k, [t["revision"] for t in turns], color=["tab:green" if t["revision"] >= 0 else "tab:red" for t in turns], alpha=0.6, label="belief revision dB_k")
    ax.plot(k, [t["belief"] for t in turns], "k.-", label="belief B_k")
    ax.plot(k, [t["multiplier"] - 1 for t in turns], "b^", label="multiplier w_k - 1")
    ax.set_xticks(k, [t["action"][:18] for t in turns], rotation=60, ha="right", fontsize=7)
    outcome = "won" if record["success"] else "lost"
    ax.set(title=f"Which turn won the game? ({outcome}, iteration {record['iteration']}, A_seq={record['seq_advantage']:.2f})")
    ax.axhline(0, color="grey", lw=0.5)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _credit_table(record: dict) -> str:
    rows = "".join(
        f"<tr><td>{t['k']}</td><td>{html.escape(t['action'])}</td><td>{t['belief']:.3f}</td><td>{t['revision']:+.3f}</td>"
        f"<td>{t['multiplier']:.3f}</td><td>{t.get('advantage', 0):+.3f}</td></tr>"
        for t in record["turns"]
    )
    return f"<table><tr><th>k</th><th>action</th><th>B_k</th><th>dB_k</th><th>w_k</th><th>At_k</th></tr>{rows}</table>"


def write_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    rows, records = read_metrics(run_dir), read_shards(run_dir)
    plot_learning_curve(rows, out / "learning_curve.png")
    horizon = plot_horizon(rows, out / "horizon.png")
    sections = []
    for i, rec in enumerate(pick_credit_examples(records)):
        plot_credit(rec, out / f"credit_{i}.png")
        task = html.escape(f"{rec['env']} task {rec['task_index']} ({rec['task_type']})")
        sections.append(f"<h3>{task}: {'won' if rec['success'] else 'lost'}</h3><img src='credit_{i}.png'>{_credit_table(rec)}")
    evals = [r for r in rows if "eval/success" in r]
    summary = ""
    if evals:
        summary = f"<p><b>Evaluation success:</b> {evals[0]['eval/success']:.1%} before RL, {evals[-1]['eval/success']:.1%} after.</p>"
    horizon_rows = "".join(f"<tr><td>{b}</td><td>{v[0]:.2f}</td><td>{v[1]:.2f}</td></tr>" for b, v in horizon.items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>agentopsd report: {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px}}img{{max-width:100%}}</style></head><body>
<h1>Run report: {html.escape(run_dir.name)}</h1>{summary}
<h2>Learning curve</h2><img src="learning_curve.png">
<h2>Success by horizon</h2><img src="horizon.png"><table><tr><th>expert turns</th><th>before</th><th>after</th></tr>{horizon_rows}</table>
<h2>Which turn won the game</h2><p>Per turn: the success belief B_k after the turn, its revision dB_k (the
evidence the skill-aware teacher view gave), and the bounded multiplier w_k applied to the GRPO advantage.</p>
{''.join(sections) or '<p>No rollout shard with credit values (GRPO runs have none).</p>'}
</body></html>"""
    (out / "index.html").write_text(page)
    return out / "index.html"
