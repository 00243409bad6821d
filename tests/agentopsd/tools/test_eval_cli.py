"""agentopsd-eval: evaluation only, on an experiment's fixed list, of an exported folder or a run's checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentopsd.tools import eval_cli, export
from tests.agentopsd.tools.test_export import trained_run  # noqa: F401  (the session's 2-iteration babyai_tiny run)

ROOT = Path(__file__).resolve().parents[3]


def test_split_args_keeps_train_overrides_and_takes_its_own():
    overrides, own = eval_cli.split_args(["+experiment=babyai_tiny", "model.path=/x", "eval_dir=/out", "seed=3", "+model.path=/y"])
    assert overrides == ["experiment=babyai_tiny", "++model.path=/x", "seed=3", "++model.path=/y"]
    assert own == {"eval_dir": "/out"}


def test_the_readme_command_on_an_exported_folder(trained_run, tmp_path):  # noqa: F811
    """`agentopsd-eval +experiment=babyai_tiny model.path=DIR evaluation.num_tasks=10`, as the console command."""
    folder = tmp_path / "hf"
    assert export.main([str(trained_run), str(folder)]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "agentopsd.tools.eval_cli", "+experiment=babyai_tiny", f"model.path={folder}", "evaluation.num_tasks=10",
               f"eval_dir={tmp_path / 'ev'}"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("eval: success"))
    assert "(greedy, 10 tasks, seed 0)" in line and "by horizon" in line
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    m = result["metrics"]
    assert m["eval/episodes"] == 10 and 0 <= m["eval/success"] <= 1
    assert any(k.startswith("eval/success/type/") for k in m) and any(k.startswith("eval/success/horizon/") for k in m)
    assert result["protocol"] == {**result["protocol"], "env_id": "agentopsd/BabyAI-GoToLocal-v0", "num_tasks": 10, "greedy": True,
                                  "temperature": 0.0, "sampled_copies": 0, "seed": 0, "backend": "hf"}
    assert result["model"]["iterations_done"] == 2  # read from the folder's agentopsd.json
    md = (tmp_path / "ev" / "eval.markdown").read_text()
    assert "| task type | success |" in md and "| expert steps | episodes | success |" in md
    episodes = [json.loads(x) for x in (tmp_path / "ev" / "episodes.jsonl").read_text().splitlines()]
    assert [e["task_index"] for e in episodes] == list(range(10))
    assert all(e["turns"] == len(e["actions"]) for e in episodes)


def test_a_checkpoint_with_sampled_copies_writes_beside_the_run(trained_run, tmp_path):  # noqa: F811
    res = eval_cli.evaluate(["+experiment=babyai_tiny", f"ckpt_path={trained_run / 'checkpoints' / 'last.ckpt'}", "evaluation.num_tasks=3",
                             "evaluation.sampled_copies=2", "seed=5"])
    out = Path(res["eval_dir"])
    try:
        assert out.parent == trained_run.resolve() / "eval"  # <run>/eval/<stamp>
        assert {"eval.json", "eval.markdown", "episodes.jsonl"} <= {p.name for p in out.iterdir()}
        m = res["metrics"]
        assert m["eval/episodes"] == 3 and m["eval/sampled/episodes"] == 6
        assert [e["kind"] for e in res["episodes"]].count("sampled") == 6
        assert res["protocol"]["seed"] == 5 and res["model"]["iterations_done"] == 2
        assert "sampled x2" in eval_cli.summary_line(res)
        # the same protocol and seed: the same sampled episodes
        again = eval_cli.evaluate(["+experiment=babyai_tiny", f"ckpt_path={trained_run}", "evaluation.num_tasks=3", "evaluation.sampled_copies=2",
                                   "seed=5", f"eval_dir={tmp_path / 'again'}"])
        assert again["episodes"] == res["episodes"]
    finally:
        import shutil

        shutil.rmtree(trained_run / "eval", ignore_errors=True)


def test_nothing_to_evaluate_is_one_line(capsys, tmp_path):
    assert eval_cli.main(["+experiment=babyai_tiny", f"eval_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: nothing to evaluate") and "\n" not in err
    assert eval_cli.main(["+experiment=babyai_tiny", f"model.path={tmp_path / 'missing'}"]) == 2
    assert "model.path=" in capsys.readouterr().err


def test_the_summary_and_markdown_read_the_metrics():
    result = {
        "metrics": {"eval/success": 0.5, "eval/episodes": 4.0, "eval/score": 0.5, "eval/turns": 3.0, "eval/faults": 0.0,
                    "eval/success/type/goto": 0.5, "eval/success/horizon/1-5": 1.0, "eval/success/horizon/6-10": 0.0,
                    "eval/episodes/horizon/1-5": 2.0, "eval/episodes/horizon/6-10": 2.0},
        "protocol": {"env_id": "e", "num_tasks": 4, "greedy": False, "temperature": 0.4, "sampled_copies": 0, "sampled_temperature": 1.0,
                     "max_new_tokens": 8, "seed": 0, "backend": "vllm"},
        "model": {"name": "m", "source": "m", "iterations_done": None}, "world_size": 2, "seconds": 1.0, "command": "agentopsd-eval x",
    }
    line = eval_cli.summary_line(result)
    assert line.startswith("eval: success 50.0% (2/4) on e (temperature 0.4, 4 tasks, seed 0); by horizon 1-5 100%, 6-10 0%")
    md = eval_cli.markdown(result)
    assert "| 1-5 | 2 | 100.0% |" in md and "| goto | 50.0% |" in md and "2 process(es)" in md


@pytest.mark.slow
def test_two_processes_split_the_evaluation_and_agree_with_one(trained_run, tmp_path):  # noqa: F811
    """trainer=ddp trainer.devices=2: Lightning launches both processes; rank 0 writes the pooled result."""
    common = ["+experiment=babyai_tiny", f"ckpt_path={trained_run}", "evaluation.num_tasks=4"]
    one = eval_cli.evaluate([*common, f"eval_dir={tmp_path / 'one'}"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "agentopsd.tools.eval_cli", *common, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                           f"eval_dir={tmp_path / 'two'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "eval.json").read_text())
    assert two["world_size"] == 2
    assert two["metrics"] == pytest.approx({k: v for k, v in one["metrics"].items()}, abs=1e-6)
    episodes = [json.loads(x) for x in (tmp_path / "two" / "episodes.jsonl").read_text().splitlines()]
    assert [e["actions"] for e in episodes] == [e["actions"] for e in one["episodes"]]
