"""`agentopsd-eval ckpt_path=<run>` evaluates the run on its own recorded config (environment, model, rollout, evaluation
list), not on the command line's defaults; the keys the command line names itself still apply (issue 49, item 3)."""

from __future__ import annotations

import pytest

from agentopsd.tools import eval_cli
from tests.agentopsd.tools.test_export import trained_run  # noqa: F401  (the session's 2-iteration babyai_tiny run)
from tests.test_resume import fake_run

TRAINED_ON = "agentopsd/BabyAI-GoToLocal-v0"  # babyai_tiny's env; the command line's default (the quickstart) is PickupObj


def test_the_runs_config_replaces_the_command_lines_defaults(tmp_path):
    run = fake_run(tmp_path / "run", "experiment=babyai_tiny", "algorithm=grpo", "seed=7")
    overrides = [f"ckpt_path={run}", "evaluation.num_tasks=2", "env.max_turns=5"]
    cfg = eval_cli.run_eval_config(eval_cli.compose(overrides), run, overrides)
    assert cfg.env.id == TRAINED_ON and cfg.seed == 7 and cfg.algorithm.name == "grpo"
    assert cfg.model.hidden_size == 64  # babyai_tiny's tiny model, not the quickstart's
    assert cfg.evaluation.num_tasks == 2 and cfg.env.max_turns == 5  # named on the command line: applied on top
    assert cfg.ckpt_path == str(run)
    same_env = [f"ckpt_path={run}", "env=babyai"]  # the run's own option: babyai_tiny's env.max_turns=8 stays
    assert eval_cli.run_eval_config(eval_cli.compose(same_env), run, same_env).env.max_turns == 8
    swapped = [f"ckpt_path={run}", "experiment=none", "env=webshop"]
    with pytest.raises(eval_cli.EvalError, match="experiment=none: the run"):
        eval_cli.run_eval_config(eval_cli.compose(swapped), run, swapped)
    other = [f"ckpt_path={run}", "rollout=hf_short", "rollout.max_new_tokens=7"]  # another option, then a key on top
    cfg = eval_cli.run_eval_config(eval_cli.compose(other), run, other)
    assert cfg.rollout.max_new_tokens == 7 and cfg.env.id == TRAINED_ON


def test_another_experiment_than_the_runs_is_refused_in_one_line(tmp_path):
    run = fake_run(tmp_path / "run", "experiment=babyai_tiny")
    overrides = ["experiment=quickstart", f"ckpt_path={run}"]
    with pytest.raises(eval_cli.EvalError) as err:
        eval_cli.run_eval_config(eval_cli.compose(overrides), run, overrides)
    line = str(err.value)
    assert "\n" not in line and line.startswith("experiment=quickstart: the run") and "experiment=babyai_tiny" in line
    same = ["experiment=babyai_tiny", f"ckpt_path={run}"]
    assert eval_cli.run_eval_config(eval_cli.compose(same), run, same).env.id == TRAINED_ON


def test_a_run_folder_is_evaluated_on_its_own_task(trained_run, tmp_path):  # noqa: F811
    res = eval_cli.evaluate([f"ckpt_path={trained_run}", "evaluation.num_tasks=2", f"eval_dir={tmp_path / 'ev'}"])
    assert res["protocol"]["env_id"] == TRAINED_ON
    assert res["protocol"]["max_turns"] == 8 and res["protocol"]["num_tasks"] == 2  # the run's max_turns, the line's num_tasks
