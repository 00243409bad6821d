"""Every config group composes and instantiates; bad values fail fast with one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from agentopsd.config import EnvConfig, EvalConfig, OptimConfig, RolloutConfig
from agentopsd.credit.algorithms import Algorithm
from agentopsd.run.folders import SWAPPABLE, check_group_swaps, pinned_keys, register_resolvers
from agentopsd.run.validation import ConfigError, resolve_ckpt_path, validate_config

CONF = Path(__file__).resolve().parents[1] / "conf"
register_resolvers()  # output_dir is ${run_dir:...}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def cfg_for(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def _resolve(cfg):
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)
    return cfg


@pytest.mark.parametrize("name", options("algorithm"))
def test_algorithms_instantiate(name):
    algo = instantiate(_resolve(cfg_for(f"algorithm={name}")).algorithm)
    assert isinstance(algo, Algorithm) and algo.name == name
    assert algo.eps_high == 0.24 and algo.eps_low == 0.2


@pytest.mark.parametrize("name", options("env"))
def test_envs_instantiate(name):
    cfg = _resolve(cfg_for(f"env={name}"))
    env = instantiate(cfg.env)
    assert isinstance(env, EnvConfig)
    validate_config(cfg)  # the id is registered


@pytest.mark.parametrize("name", options("rollout"))
def test_rollouts_instantiate(name):
    assert isinstance(instantiate(_resolve(cfg_for(f"rollout={name}")).rollout), RolloutConfig)


@pytest.mark.parametrize("name", options("trainer"))
def test_trainers_compose(name):
    cfg = _resolve(cfg_for(f"trainer={name}"))
    assert cfg.trainer._target_ == "lightning.Trainer"
    if name == "cpu":
        trainer = instantiate(cfg.trainer, logger=False)
        assert trainer.max_epochs == 1


@pytest.mark.parametrize("name", options("logger"))
def test_loggers_compose(name, tmp_path):
    cfg = _resolve(cfg_for(f"logger={name}", f"output_dir={tmp_path}"))
    assert len(cfg.logger) >= 1
    if name == "default":
        assert [type(instantiate(lg)).__name__ for lg in cfg.logger] == ["TensorBoardLogger", "CSVLogger"]


@pytest.mark.parametrize("name", options("model"))
def test_models_compose(name):
    cfg = _resolve(cfg_for(f"model={name}"))
    assert cfg.model._target_ in ("agentopsd.models.tiny.tiny_policy", "agentopsd.models.loading.load_policy")


@pytest.mark.parametrize("name", options("experiment"))
def test_experiments_compose(name):
    cfg = _resolve(cfg_for(f"experiment={name}"))
    assert cfg.name == name
    for key in ("optim", "evaluation", "rollout", "env", "algorithm"):
        instantiate(cfg[key])
    assert isinstance(instantiate(cfg.optim), OptimConfig) and isinstance(instantiate(cfg.evaluation), EvalConfig)
    if name.endswith(("_3b", "_7b")):
        # the paper's setups (Appendix F)
        assert cfg.data.group_size == 8 and cfg.data.tasks_per_batch == 16 and cfg.optim.lr == 1e-6
        assert cfg.algorithm.mult_lambda == 0.5 and cfg.algorithm.mult_band == 0.2 and cfg.algorithm.gap_decay_gamma == 0.95
        assert cfg.rollout.backend == "vllm" and cfg.trainer.strategy._target_.endswith("FSDP2Strategy")
        assert cfg.env.max_turns == {"alfworld": 50, "webshop": 15, "searchqa": 4}[name.split("_")[0]]


def test_default_is_quickstart():
    assert _resolve(cfg_for()).name == "quickstart"


def test_plus_experiment_spelling_is_accepted():
    from agentopsd.run.train import _accept_plus_experiment

    assert _accept_plus_experiment(["train.py", "+experiment=webshop_3b", "seed=1"]) == ["train.py", "experiment=webshop_3b", "seed=1"]


def test_tools_composing_like_train_py_take_plus_experiment_too():
    """studies/hint_table.py and agentopsd-eval compose through eval_cli.compose: ``+experiment=`` works there too."""
    from agentopsd.tools.eval_cli import compose

    cfg = compose(["+experiment=babyai_tiny", "seed=3"])
    assert cfg.hydra.runtime.choices.experiment == "babyai_tiny" and cfg.seed == 3


@pytest.mark.parametrize(
    "override, field",
    [
        ("data.group_size=1", "data.group_size"),
        ("algorithm.mult_band=1.5", "algorithm.mult_band"),
        ("algorithm.mult_band=0", "algorithm.mult_band"),
        ("algorithm.mult_lambda=2", "algorithm.mult_lambda"),
        ("env.id=agentopsd/Nope-v0", "env.id"),
        ("optim.num_mini_batches=1000", "optim.num_mini_batches"),
        ("num_iterations=0", "num_iterations"),
        ("trainer.devices=2 data.tasks_per_batch=3", "data.tasks_per_batch"),
        ("rollout.overlap_waves=0", "rollout.overlap_waves"),
        ("rollout.overlap_waves=true", "rollout.overlap_waves"),
    ],
)
def test_bad_values_fail_fast(override, field):
    with pytest.raises(ConfigError) as err:
        validate_config(_resolve(cfg_for(*override.split())))
    message = str(err.value)
    assert field in message and "\n" not in message


def test_missing_weights_fail_in_seconds(monkeypatch):
    import time

    from agentopsd.models.loading import ModelNotFoundError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # rollout=hf: the missing vllm would fail first on a machine without it
    cfg = _resolve(cfg_for("experiment=webshop_3b", "rollout=hf", "model.path=/nonexistent/Qwen2.5-3B-Instruct"))
    t0 = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="model.path"):
        validate_config(cfg)
    assert time.perf_counter() - t0 < 10


def test_ckpt_path_last_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="ckpt_path"):
        resolve_ckpt_path("last", tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"x")  # not a checkpoint: refused, naming the file
    with pytest.raises(ConfigError, match="last.ckpt is unreadable"):
        resolve_ckpt_path("last", tmp_path)
    import torch

    torch.save({"state_dict": {}}, tmp_path / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path("last", tmp_path).endswith("last.ckpt")


@pytest.mark.parametrize("group", ["algorithm", "model", "env"])
def test_unknown_group_option_names_the_choices(group):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException) as err:
        cfg_for(f"{group}=nope")
    assert f"{group}/nope" in str(err.value) and "Available options" in str(err.value)


# ------------------------------------------------------------------ swapping a group swaps it


@pytest.fixture(scope="module")
def plain_groups() -> dict[tuple[str, str], dict]:
    """Each group option as it composes with no experiment: what a swap must give."""
    from omegaconf import OmegaConf

    return {(g, o): OmegaConf.to_container(cfg_for("experiment=none", f"{g}={o}")[g]) for g in SWAPPABLE for o in options(g)}


@pytest.mark.parametrize("experiment", ["quickstart", "babyai_tiny", "webshop_3b"])
def test_a_swapped_group_is_that_groups_file_or_fails_naming_the_experiment(experiment, plain_groups):
    from omegaconf import OmegaConf

    pinned = pinned_keys(CONF / "experiment" / f"{experiment}.yaml")
    for (group, option), want in plain_groups.items():
        swap = [f"experiment={experiment}", f"{group}={option}"]
        if group in pinned:
            with pytest.raises(ConfigError) as err:
                check_group_swaps(experiment, swap, CONF)
            message = str(err.value)
            assert f"experiment={experiment} pins {group}" in message and "experiment=none" in message and "\n" not in message
        else:
            check_group_swaps(experiment, swap, CONF)
            assert OmegaConf.to_container(cfg_for(*swap)[group]) == want, f"{experiment} + {group}={option} is a mix"


def test_the_default_experiment_pins_no_group():
    # so that every swap onto a bare `python train.py` works (the test above composes each one)
    assert pinned_keys(CONF / "experiment" / "quickstart.yaml") == {}


@pytest.mark.parametrize("name", options("env"))
def test_an_env_swapped_onto_the_default_brings_its_id_skills_and_format(name):
    from omegaconf import OmegaConf

    env_file = OmegaConf.to_container(cfg_for("experiment=none", f"env={name}").env)
    cfg = _resolve(cfg_for(f"env={name}"))
    assert cfg.name == "quickstart"
    for key in ("id", "skills", "output_format", "max_turns", "history_window"):
        assert cfg.env[key] == env_file[key], key
    # the tiny model's tokenizer is trained on that environment's text, in its output format
    assert (cfg.model.env_id, cfg.model.skills, cfg.model.output_format) == (cfg.env.id, cfg.env.skills, cfg.env.output_format)
    validate_config(cfg)


def test_command_line_keys_are_not_swaps():
    check_group_swaps("babyai_tiny", ["env.max_turns=3", "model.hidden_size=32", "+rollout.malformed_rate=0.1", "seed=1"], CONF)


@pytest.mark.parametrize("user_env", [{}, {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}])
def test_train_sets_threads_before_torch_unless_the_user_did(user_env):
    import os
    import subprocess
    import sys

    code = ("import importlib.util, os; spec = importlib.util.spec_from_file_location('t', 'train.py'); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); import torch; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['OMP_NUM_THREADS'], torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")} | user_env
    out = subprocess.run([sys.executable, "-c", code], cwd=CONF.parent, env=env, capture_output=True, text=True, timeout=300)
    policy, threads, torch_threads = out.stdout.split()
    want = (user_env.get("OMP_WAIT_POLICY", "PASSIVE"), user_env.get("OMP_NUM_THREADS", str(min(4, os.cpu_count() or 1))))
    assert (policy, threads) == want and torch_threads == threads  # torch took the value: it was set before torch loaded


def test_a_refused_swap_names_the_experiments_made_for_that_option():
    with pytest.raises(ConfigError) as err:
        check_group_swaps("babyai_tiny", ["env=webshop"], CONF)
    assert "experiment=webshop_tiny" in str(err.value) and "env.max_turns" in str(err.value)


# ------------------------------------------------------------------ optim.scale_by_std


@pytest.mark.parametrize(("algorithm", "want"), [("agentopsd", {"scale_by_std": False}), ("grpo", {"scale_by_std": False}),
                                                 ("gigpo", {"norm": "mean"})])
def test_the_quickstart_centres_group_advantages_for_any_algorithm(algorithm, want, tiny_walk_policy):
    from agentopsd.training.module import AgentRLModule

    cfg = _resolve(cfg_for(f"algorithm={algorithm}"))
    model, tokenizer = tiny_walk_policy
    algo = AgentRLModule.from_config(cfg, model, tokenizer).algorithm
    assert {k: getattr(algo, k) for k in want} == want
    # every other experiment keeps the paper's scaling (divided by the group's std)
    paper = AgentRLModule.from_config(_resolve(cfg_for("experiment=babyai_tiny", f"algorithm={algorithm}")), model, tokenizer).algorithm
    assert paper.scale_by_std and getattr(paper, "norm", "mean_std") == "mean_std"


def test_scale_by_std_refuses_what_is_not_a_bool():
    from agentopsd.config import advantage_scaling_overrides

    assert advantage_scaling_overrides({"name": "grpo"}, None) == {}
    assert advantage_scaling_overrides({"name": "grpo"}, True) == {"scale_by_std": True}
    with pytest.raises(ValueError, match="optim.scale_by_std must be true, false or null"):
        advantage_scaling_overrides({"name": "grpo"}, "false")
