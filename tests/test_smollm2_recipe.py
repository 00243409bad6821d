"""``+experiment=smollm2`` (conf/experiment/smollm2.yaml): it composes with the real model and the settings its
comments argue for, its validation passes without loading any weights, and benchmarks/smollm2_recipe.py reads a
run's figures right. Seconds: no weights load here (the tokenizer test reads only the prepared folder's tokenizer,
and skips where the model was never prepared)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig
from agentopsd.run.folders import register_resolvers
from agentopsd.run.validation import validate_config

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
register_resolvers()  # output_dir is ${run_dir:...}


def recipe(*overrides: str):
    """``train.py +experiment=smollm2 overrides`` as train.py composes it (it reads ``+experiment=`` as ``experiment=``)."""
    from hydra.core.hydra_config import HydraConfig

    from agentopsd.run.train import _accept_plus_experiment

    args = _accept_plus_experiment(["train.py", "+experiment=smollm2", *overrides])[1:]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=args, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def test_the_recipe_composes_with_smollm2_lora_on_pickupobj_s5_and_its_settings():
    cfg = recipe()
    assert cfg.name == "smollm2"
    assert cfg.model._target_ == "agentopsd.models.loading.load_policy" and cfg.model.path == "smollm2-135m"
    assert cfg.model.dtype == "auto"  # bf16 where the CPU has it natively (agentopsd/training/precision.py)
    assert dict(cfg.model.lora) == {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
    env = instantiate(cfg.env)
    assert isinstance(env, EnvConfig) and env.id == "agentopsd/BabyAI-PickupObjS5-v0"
    assert env.max_turns == 8 and env.history_window == 0 and not env.show_admissible
    rollout = instantiate(cfg.rollout)
    assert isinstance(rollout, RolloutConfig) and rollout.backend == "hf"
    assert rollout.max_new_tokens == 8 and rollout.temperature == 0.7 and rollout.eval_temperature == 0.0
    optim = instantiate(cfg.optim)
    assert isinstance(optim, OptimConfig) and optim.micro_batch_size == 8 and optim.scale_by_std is False
    assert optim.lr == 1e-4 and optim.skip_zero_advantage
    evaluation = instantiate(cfg.evaluation)
    assert isinstance(evaluation, EvalConfig) and evaluation.num_tasks == 50 and evaluation.before_training
    assert evaluation.every_n_iterations == 2 and cfg.num_iterations == 6
    assert instantiate(cfg.algorithm).name == "agentopsd"
    assert (cfg.data.tasks_per_batch, cfg.data.group_size) == (6, 4)
    ws = cfg.warm_start
    assert dict(ws.habits) == {"pick up": "toggle"} and ws.habit_prob == 0.85 and ws.teacher_fraction == 0.5
    assert ws.weights is None and ws.steps * ws.batch_size <= ws.episodes * 4  # fewer samples drawn than demo turns
    assert cfg.trainer.accelerator == "cpu"


def test_the_recipe_validates_without_loading_weights(monkeypatch, tmp_path):
    """validate_config resolves model.path through the prepared-model cache; here that lookup is replaced, so no
    download and no weights: what is checked is that the recipe asks for the prepared SmolLM2 and passes every check."""
    from agentopsd.models import pretrained

    asked: list[str] = []

    def prepared(name: str, **_: object) -> Path:
        asked.append(name)
        return tmp_path

    monkeypatch.setattr(pretrained, "prepare", prepared)
    validate_config(recipe(f"output_dir={tmp_path / 'run'}"))
    assert asked == ["smollm2-135m"]


def test_max_new_tokens_holds_every_babyai_action_in_smollm2s_tokenizer():
    """The recipe cuts generation at rollout.max_new_tokens: every action's reply must fit, or the longest
    actions could never be generated whole. Needs only the prepared folder's tokenizer (skips when absent)."""
    from agentopsd.models.pretrained import SMOLLM2_135M, is_prepared, prepared_dir

    folder = prepared_dir(SMOLLM2_135M)
    if not is_prepared(folder):
        pytest.skip(f"{folder} not prepared (python -m agentopsd.models.pretrained smollm2-135m)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    actions = ["turn left", "turn right", "go forward", "pick up", "drop", "toggle", "done"]
    lengths = {a: len(tokenizer.encode(f"<action>{a}</action>", add_special_tokens=False)) for a in actions}
    assert max(lengths.values()) <= recipe().rollout.max_new_tokens, lengths


def test_the_benchmark_reads_the_warm_start_the_evaluations_and_the_split(smollm2_recipe_bench):
    stamped = [
        (5.0, "[..][agentopsd.models.warmstart][INFO] - wrote 1200 demonstration turns to /x/demos.tar in 3.4s"),
        (200.0, "warm start: 48 steps in 190s, final loss 0.512"),
        (260.5, "[..][agentopsd.callbacks.evaluation][INFO] - eval (before training, after 0 iterations): success 0.050 on 20 episodes"),
        (700.0, "[..][agentopsd.callbacks.evaluation][INFO] - eval (periodic, after 1 iteration): success 0.100 on 20 episodes"),
        (900.0, "[..][agentopsd.callbacks.evaluation][INFO] - eval (end, after 2 iterations): success 0.450 on 20 episodes"),
    ]
    parsed = smollm2_recipe_bench.parse_output(stamped)
    assert (parsed["warm_start_steps"], parsed["warm_start_seconds"], parsed["demos_seconds"]) == (48, 190.0, 3.4)
    # iteration 1: 260.5 -> its shard at 710 holds 400 s of phases and the periodic evaluation (written after it)
    evals = smollm2_recipe_bench.eval_seconds(parsed["evals"], parsed["warm_start_done_at"], {1: 710.0, 2: 840.0}, {1: 400.0, 2: 120.0})
    assert [(e["when"], e["iteration"], e["success"], e["seconds"]) for e in evals] == [
        ("before training", 0, 0.05, 60.5), ("periodic", 1, 0.1, 49.5), ("end", 2, 0.45, 60.0)]
    rows = [{"step": "2.0", "perf/rollout_seconds": "30", "perf/teacher_seconds": "10", "perf/update_seconds": "60",
             "rollout/turns": "8.5", "rollout/trajectories": "16", "rollout/success": "0.25"},
            {"step": "0", "eval/success": "0.05"},  # an evaluation row: not an iteration
            {"step": "1.0", "perf/rollout_seconds": "40", "perf/teacher_seconds": "12", "perf/update_seconds": "70",
             "rollout/turns": "10", "rollout/trajectories": "16", "rollout/success": "0.125"}]
    its = smollm2_recipe_bench.csv_iterations(rows)
    assert [(it.iteration, it.rollout, it.teacher, it.update, it.rows, it.success) for it in its] == [
        (1, 40.0, 12.0, 70.0, 160.0, 0.125), (2, 30.0, 10.0, 60.0, 136.0, 0.25)]
    text = smollm2_recipe_bench.markdown(smollm2_recipe_bench.Result("python train.py +experiment=smollm2", "abc", "1", 0, 960.0, 3000.0, 48, 190.0, 3.4,
                                       evals, its))
    assert "| all 2 | 296 | 70 (32%) | 22 (10%) | 130 (59%) | 222 | | |" in text
    assert "48 steps in 190 s (4.0 s a step)" in text and "| end | 2 | 0.45 | 20 | 60.0 |" in text
    assert "| periodic | 1 | 0.10 | 20 | 49.5 |" in text
    # today's order: iteration 1's shard at 650.5, then its periodic evaluation (its line at 700), which iteration
    # 2's span holds; it is not iteration 2's span less its phases (0.5 s here)
    evals = smollm2_recipe_bench.eval_seconds(parsed["evals"], parsed["warm_start_done_at"], {1: 650.5, 2: 840.0},
                                              {1: 390.0, 2: 139.5})
    assert [e["seconds"] for e in evals] == [60.5, 49.5, 60.0]


def test_a_compare_report_is_rendered_again_from_its_json(smollm2_recipe_bench, tmp_path):
    """``--compare --from-json``: each run's evaluations' seconds recomputed from the times the JSON kept (a report
    written while the benchmark misread the order of shard and evaluation gets them right), and the wait policy
    named beside the threads."""
    import json
    from dataclasses import asdict

    bench = smollm2_recipe_bench
    its = [bench.Iteration(1, 40.0, 10.0, 50.0, 100.0, 0.5, 80.0), bench.Iteration(2, 30.0, 10.0, 40.0, 90.0, 0.8, 60.0)]
    evals = [{"when": "before training", "iteration": 0, "success": 0.0, "episodes": 50, "at": 300.0, "seconds": 60.0},
             {"when": "periodic", "iteration": 1, "success": 0.5, "episodes": 50, "at": 430.0, "seconds": 0.1},
             {"when": "end", "iteration": 2, "success": 1.0, "episodes": 50, "at": 560.0, "seconds": 20.0}]
    runs = {k: bench.Result(f"python train.py +experiment=smollm2 {k}", "abc", "2", 0, 600.0, 4000.0, 96, 180.0, 0.3,
                            evals, its, {1: 400.0, 2: 510.0}, wait_policy="ACTIVE") for k in ("float32", "auto")}
    path = tmp_path / "compare.json"
    path.write_text(json.dumps({k: asdict(v) for k, v in runs.items()}))
    assert bench.main(["--compare", "--from-json", str(path), "--json", str(tmp_path / "out.json"),
                       "--report", str(tmp_path / "report")]) == 0
    again = json.loads((tmp_path / "out.json").read_text())
    assert [e["seconds"] for e in again["auto"]["evals"]] == [60.0, 30.0, 50.0]  # periodic: shard 400 -> line 430
    report = (tmp_path / "report").read_text()
    assert "OMP_NUM_THREADS=2, OMP_WAIT_POLICY=ACTIVE" in report and "| evaluations | 140 | 140 | 1.00x |" in report
    assert bench.Result.from_dict(again["auto"]).iterations == its
