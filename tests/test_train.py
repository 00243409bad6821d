"""End to end: every *_tiny experiment runs 2 iterations on CPU through train.py, and resumes."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import webdataset as wds

ROOT = Path(__file__).resolve().parents[1]
TINY = ["babyai_tiny", "webshop_tiny", "searchqa_tiny", "alfworld_tiny"]


def run_train(*overrides: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("AGENTOPSD_TEST_THREADS", "1"), "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def metrics_rows(out: Path) -> list[dict[str, str]]:
    rows = []
    for path in sorted((out / "csv").glob("version_*/metrics.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    return rows


def shard_records(out: Path) -> dict[str, list[dict]]:
    return {p.name: [json.loads(s["json"]) for s in wds.WebDataset(str(p), shardshuffle=False)] for p in sorted((out / "rollouts").glob("*.tar"))}


def check_belief_recursion(turns: list[dict], group_size: int, gamma: float = 0.95) -> None:
    """The logged beliefs and revisions, recomputed from the logged evidence by the paper's recursion:
    l0 = logit(prior), c_k = gamma c_{k-1} + e_k, B_k = sigmoid(l0 + c_k), dB_k = B_k - B_{k-1}, B_{-1} = sigmoid(l0),
    with the prior the group's success rate j / group_size clipped to [1e-4, 1 - 1e-4] (read back from turn 0)."""
    l0 = math.log(turns[0]["belief"] / (1 - turns[0]["belief"])) - turns[0]["evidence"]
    rates = [min(max(j / group_size, 1e-4), 1 - 1e-4) for j in range(group_size + 1)]
    assert min(abs(l0 - math.log(r / (1 - r))) for r in rates) < 1e-3, (l0, rates)
    acc, previous = 0.0, 1 / (1 + math.exp(-l0))
    for turn in turns:
        acc = gamma * acc + turn["evidence"]
        belief = 1 / (1 + math.exp(-(l0 + acc)))
        assert turn["belief"] == pytest.approx(belief, rel=1e-3, abs=1e-7)
        assert turn["revision"] == pytest.approx(belief - previous, rel=1e-2, abs=1e-7)
        assert 0.8 - 1e-6 <= turn["multiplier"] <= 1.2 + 1e-6  # the band b = 0.2
        previous = belief


@pytest.mark.slow
@pytest.mark.parametrize("experiment", TINY)
def test_tiny_experiment_end_to_end(experiment, tiny_runs):
    if experiment == "alfworld_tiny":
        pytest.importorskip("alfworld")
    out, stdout = tiny_runs(experiment)
    assert "eval success:" in stdout
    assert (out / "checkpoints" / "last.ckpt").is_file()
    rows = metrics_rows(out)
    from tests.test_docs import documented_metric_keys, metric_documented

    columns = {k for r in rows for k in r if k != "step"}
    assert not [k for k in columns if not metric_documented(k, documented_metric_keys())], "add them to docs/metrics.md"
    trained = [r for r in rows if r.get("rollout/iteration")]
    assert [float(r["rollout/iteration"]) for r in trained] == [1.0, 2.0]
    for row in trained:
        assert math.isfinite(float(row["loss/pg_loss"]))
        # the first mini-batch is on-policy: new / old log-prob ratio 1 up to float rounding
        assert 0 <= float(row["loss/first_ratio_dev"]) < 1e-4
        tasks, copies = 2, (4 if experiment == "babyai_tiny" else 2)  # the experiments' data settings
        success = float(row["rollout/success"])
        assert any(success == pytest.approx(k / (tasks * copies)) for k in range(tasks * copies + 1)), success
        assert float(row["perf/rollout_seconds"]) > 0 and float(row["perf/teacher_seconds"]) > 0
        assert 0 < float(row["credit/mean_abs_revision"]) < 1  # the teacher and student views differ; dB in (-1, 1)
    evals = [float(r["eval/success"]) for r in rows if r.get("eval/success")]
    assert evals and all(0.0 <= e <= 1.0 for e in evals)
    assert re.search(rf"eval success: {evals[0] * 100:.1f}% before RL -> {evals[-1] * 100:.1f}% after 2 iterations", stdout)
    shards = shard_records(out)
    assert list(shards) == ["rollouts-000001.tar", "rollouts-000002.tar"]  # iterations 1 and 2, numbered like every log
    for name, records in shards.items():
        assert records and all(r["iteration"] == int(name[9:15]) for r in records)
        for record in records:
            turns = record["turns"]
            assert turns and {"belief", "revision", "multiplier", "advantage"} <= set(turns[0])
            check_belief_recursion(turns, copies)
            # each action token's gap is logged, and the turn's evidence is their sum
            for turn in turns:
                assert turn["gaps"] and turn["evidence"] == pytest.approx(sum(turn["gaps"]), abs=1e-4)


@pytest.mark.slow
def test_resume_continues_the_task_stream(tmp_path):
    out = tmp_path / "run"
    common = ["experiment=babyai_tiny", f"output_dir={out}", "num_iterations=4", "trainer.enable_progress_bar=false", "evaluation.num_tasks=2"]
    # 2 mini-batches per iteration: max_steps=4 stops after iteration 1, as a crash would
    run_train(*common, "+trainer.max_steps=4")
    before = shard_records(out)
    assert list(before) == ["rollouts-000001.tar", "rollouts-000002.tar"]
    stamp = (out / "rollouts" / "rollouts-000001.tar").stat().st_mtime_ns
    proc = run_train(*common, "ckpt_path=last")
    assert "trained 2 iterations (3-4), resumed after 2" in proc.stdout
    after = shard_records(out)
    assert list(after) == [f"rollouts-00000{i}.tar" for i in range(1, 5)]
    assert (out / "rollouts" / "rollouts-000001.tar").stat().st_mtime_ns == stamp  # not replayed

    import gymnasium as gym

    import agentopsd.envs  # noqa: F401
    from agentopsd.training.data import sample_tasks

    env_id = "agentopsd/BabyAI-GoToLocal-v0"
    num_tasks = gym.make(env_id, split="train").unwrapped.num_tasks
    for it in (2, 3):  # the task stream's index of the 3rd and 4th iterations
        # the resumed iterations trained on exactly the tasks an uninterrupted run draws there
        want = {(t.group_id, t.task_index) for t in sample_tasks(env_id, num_tasks, 2, 4, it, seed=0)}
        got = {(r["group"], r["task_index"]) for r in after[f"rollouts-00000{it + 1}.tar"]}
        assert got and got <= want
    iterations = [int(float(r["rollout/iteration"])) for r in metrics_rows(out) if r.get("rollout/iteration")]
    assert iterations == [1, 2, 3, 4]  # the resumed run continued with iteration 3 instead of restarting
    steps = [int(r["step"]) for r in metrics_rows(out) if r.get("rollout/iteration")]
    assert steps == iterations  # the loggers' x axis is iterations too, not optimizer steps


@pytest.mark.slow
def test_a_finished_run_trains_on_to_a_larger_num_iterations(tmp_path):
    """`ckpt_path=last num_iterations=4` on a finished 2-iteration run: iterations 3-4 in the same folder, on the
    tasks and at the learning rates a run planned for 4 iterations has there (cosine: the schedule is rebuilt)."""
    common = ["experiment=babyai_tiny", "trainer.enable_progress_bar=false", "evaluation.num_tasks=2", "report=false",
              "optim.schedule=cosine"]
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    run_train(*common, f"output_dir={straight}", "num_iterations=4")
    first = run_train(*common, f"output_dir={extended}", "num_iterations=2")
    assert "trained" not in first.stdout.split("eval success")[0].splitlines()[-1]  # a plain 2-iteration run
    proc = run_train(*common, f"output_dir={extended}", "num_iterations=4", "ckpt_path=last")
    assert "trained 2 iterations (3-4), resumed after 2" in proc.stdout and "after 4 iterations" in proc.stdout
    assert "nothing trained" not in proc.stdout
    assert list(shard_records(extended)) == [f"rollouts-00000{i}.tar" for i in range(1, 5)]
    rows = {name: [r for r in metrics_rows(out) if r.get("rollout/iteration")] for name, out in
            (("straight", straight), ("extended", extended))}
    assert [int(float(r["rollout/iteration"])) for r in rows["extended"]] == [1, 2, 3, 4]
    lr = {name: [float(r["loss/lr"]) for r in got] for name, got in rows.items()}
    assert lr["extended"][2:] == pytest.approx(lr["straight"][2:], rel=1e-6)  # the 4-iteration plan from step 4 on
    assert lr["extended"][1] < lr["straight"][1]  # while iteration 2 ran on the 2-iteration plan's decay
    for it in (3, 4):  # the same tasks as the straight run's
        name = f"rollouts-00000{it}.tar"
        assert {(r["group"], r["task_index"]) for r in shard_records(extended)[name]} == \
            {(r["group"], r["task_index"]) for r in shard_records(straight)[name]}
    # the end evaluation ran again, at 4 iterations, beside the first run's at 2
    evals = [int(float(r["eval/iteration"])) for r in metrics_rows(extended) if r.get("eval/iteration")]
    assert evals[-1] == 4 and 2 in evals


@pytest.mark.slow
def test_shortened_quickstart_writes_the_report(tmp_path):
    """`python train.py` (the quickstart) cut to a couple of iterations: warm start, RL, report."""
    root = tmp_path / "quickstart"
    proc = run_train(
        f"runs_dir={root}", "num_iterations=2", "data.tasks_per_batch=2", "data.group_size=4", "evaluation.num_tasks=8",
        "evaluation.every_n_iterations=1", "warm_start.episodes=40", "warm_start.steps=4", "trainer.enable_progress_bar=false",
    )
    assert "warm start: 4 steps" in proc.stdout
    assert "eval success: " in proc.stdout and "after 2 iterations" in proc.stdout and "report/index.html" in proc.stdout
    assert "warm start: step 2/4" in proc.stdout + proc.stderr  # progress while it trains, not only at the end
    # the warm start's cache is shared by the runs of the name; the run has a folder of its own
    shard = list((root / "warm_start").glob("demos-BabyAI-PickupObj-v0-40-*.tar"))
    assert len(shard) == 1 and list((root / "warm_start").glob("policy-*.pt"))
    out = (root / "latest").resolve()
    assert out.parent == root and str(out) in proc.stdout
    hparams = (out / "tensorboard" / "version_0" / "hparams.yaml").read_text()
    assert "PickupObj" in hparams and "num_iterations: 2" in hparams  # the resolved config, not {}
    page = (out / "report" / "index.html").read_text()
    images = re.findall(r"src=['\"]([^'\"]+)['\"]", page)
    assert {"learning_curve.png", "horizon.png", "credit_0.png"} <= set(images)
    for image in images:
        data = (out / "report" / image).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    assert "Credit per turn" in page
    from agentopsd.tools.report import pick_credit_examples, read_shards

    # each plotted trajectory's heading says what its picture answers: which turn won (or lost) where the group's
    # outcomes were mixed (A_seq != 0), that there was no credit to assign where every copy ended alike
    headings = re.findall(r"<h3>([^<]*)</h3>", page)
    expected = [("Which turn won the game?" if r["success"] else "Which turn lost the game?") if r["seq_advantage"] != 0
                else f"No credit to assign: every copy of this task {'won' if r['success'] else 'lost'}"
                for r in pick_credit_examples(read_shards(out))]
    assert expected and headings[: len(expected)] == expected
    assert "seed <b>0</b>" in page and "commit <b>" in page and "Credit statistics" in page
    assert page.count("</td></tr>") >= 3  # per-turn rows of a real trajectory: action, B_k, dB_k, w_k
    evals = [r for r in metrics_rows(out) if r.get("eval/success")]
    assert [float(r["eval/iteration"]) for r in evals] == [0.0, 1.0, 2.0]


NOISE = ("Tip:", "litlogger", "LeafSpec", "overridden `on_after_batch_transfer`", "weights_only", "module(s) in eval mode", "DEBUG", "Glyph")


@pytest.mark.slow
@pytest.mark.parametrize("env_name", sorted(p.stem for p in (ROOT / "conf" / "env").glob("*.yaml")))
def test_every_env_swapped_onto_the_default_runs_one_iteration(env_name, tmp_path):
    """`python train.py env=X`: X's id, skills and output format, the tiny model and the warm start on X."""
    if env_name == "alfworld":
        pytest.importorskip("alfworld")
    from omegaconf import OmegaConf

    root = tmp_path / "runs"
    proc = run_train(
        f"env={env_name}", f"runs_dir={root}", "num_iterations=1", "data.tasks_per_batch=1", "data.group_size=2", "env.max_turns=2",
        "optim.num_mini_batches=1", "evaluation.num_tasks=1", "+model.text_episodes=2", "warm_start.episodes=2", "warm_start.steps=1",
        "warm_start.batch_size=2", "rollout_log.max_samples=2", "report=false", "trainer.enable_progress_bar=false",
    )
    out = (root / "latest").resolve()
    cfg = OmegaConf.load(out / ".hydra" / "config.yaml")
    env_file = OmegaConf.load(ROOT / "conf" / "env" / f"{env_name}.yaml")
    if "defaults" in env_file:  # a file that extends another (babyai_pickupobj extends babyai)
        base = OmegaConf.load(ROOT / "conf" / "env" / f"{env_file.defaults[0]}.yaml")
        env_file = OmegaConf.merge(base, {k: v for k, v in env_file.items() if k != "defaults"})
    assert (cfg.env.id, cfg.env.skills, cfg.env.output_format) == (env_file.id, env_file.skills, env_file.output_format)
    assert "warm start: 1 steps" in proc.stdout
    assert [r["rollout/iteration"] for r in metrics_rows(out) if r.get("rollout/iteration")] == ["1.0"]
    assert "after 1 iteration" in proc.stdout
    assert not [n for n in NOISE if n in proc.stdout + proc.stderr], (proc.stdout + proc.stderr)[-3000:]
