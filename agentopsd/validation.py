"""Fail fast, in one line, on configurations that would fail minutes later."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the fix."""


def validate_config(cfg: DictConfig) -> None:
    import gymnasium as gym

    import envs  # noqa: F401

    env_id = cfg.env.id
    if env_id not in gym.registry:
        known = sorted(k for k in gym.registry if k.startswith("agentopsd/"))
        raise ConfigError(f"env.id={env_id!r} is not registered; choose one of {known} (or env=<babyai|alfworld|webshop|searchqa>)")
    algo = cfg.algorithm
    if cfg.data.group_size < 2:  # every algorithm here takes GRPO's group-relative advantage
        raise ConfigError(f"data.group_size={cfg.data.group_size}: GRPO-family advantages need groups of >= 2 copies; set data.group_size=8")
    if cfg.data.tasks_per_batch < 1:
        raise ConfigError(f"data.tasks_per_batch must be >= 1, got {cfg.data.tasks_per_batch}")
    if "mult_band" in algo and not 0 < algo.mult_band < 1:
        raise ConfigError(f"algorithm.mult_band={algo.mult_band} must be in (0, 1); the paper uses 0.2")
    if "mult_lambda" in algo and not 0 <= algo.mult_lambda <= 1:
        raise ConfigError(f"algorithm.mult_lambda={algo.mult_lambda} must be in [0, 1]; 0 is GRPO, the paper uses 0.5")
    if "gap_decay_gamma" in algo and not 0 <= algo.gap_decay_gamma <= 1:
        raise ConfigError(f"algorithm.gap_decay_gamma={algo.gap_decay_gamma} must be in [0, 1]; the paper uses 0.95")
    _validate_baseline_knobs(algo)
    rows = cfg.data.tasks_per_batch * cfg.data.group_size
    if cfg.optim.num_mini_batches > rows:
        raise ConfigError(
            f"optim.num_mini_batches={cfg.optim.num_mini_batches} exceeds the {rows} trajectories of a batch "
            "(data.tasks_per_batch x data.group_size); lower it"
        )
    devices = cfg.trainer.get("devices", 1)
    world = (devices if isinstance(devices, int) else 1) * int(cfg.trainer.get("num_nodes", 1))
    if world > 1 and cfg.data.tasks_per_batch % world:
        raise ConfigError(
            f"data.tasks_per_batch={cfg.data.tasks_per_batch} does not divide across {world} processes "
            "(trainer.devices x trainer.num_nodes): each process plays whole task groups; use a multiple"
        )
    if cfg.num_iterations < 1:
        raise ConfigError(f"num_iterations must be >= 1, got {cfg.num_iterations}")
    if cfg.model.get("path"):
        from agentopsd.models import resolve_model_path

        resolve_model_path(cfg.model.path)  # raises ModelNotFoundError in seconds


def _validate_baseline_knobs(algo: DictConfig) -> None:
    """The knobs of the baselines (RLSD, SDAR, Skill-SD, GRPO+OPSD, GiGPO) and the shared loss terms."""
    for key in ("kl_coef", "entropy_coef", "distill_coef", "gate_beta", "step_weight"):
        if key in algo and algo[key] < 0:
            raise ConfigError(f"algorithm.{key}={algo[key]} must be >= 0 (0 turns the term off)")
    if "lambda_warmdown_steps" in algo and algo.lambda_warmdown_steps < 0:
        raise ConfigError(f"algorithm.lambda_warmdown_steps={algo.lambda_warmdown_steps} must be >= 0; 0 keeps lambda constant, RLSD's public runs use 100")
    if "gamma" in algo and not 0 <= algo.gamma <= 1:
        raise ConfigError(f"algorithm.gamma={algo.gamma} must be in [0, 1]; GiGPO uses 0.95")
    if "norm" in algo and algo.norm not in ("mean_std", "mean"):
        raise ConfigError(f"algorithm.norm={algo.norm!r} must be 'mean_std' or 'mean'")


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> str | None:
    """``last`` -> ``<output_dir>/checkpoints/last.ckpt`` (``output_dir`` is then the latest run of the name, see
    ``agentopsd.runs.run_dir``); a missing file is an error, not a fresh start."""
    if ckpt_path is None:
        return None
    path = output_dir / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    if ckpt_path == "last" and not path.exists() and path.with_name(".last.ckpt.old").exists():
        path = path.with_name(".last.ckpt.old")  # killed between the two renames of a checkpoint swap
    if not path.exists():  # a file, or a directory of shards under FSDP
        if ckpt_path == "last":  # output_dir is the latest run of the name, or a new folder when there is none
            raise ConfigError(f"ckpt_path=last: no run with a checkpoint in {output_dir.parent} (looked for {path}); "
                              "run without ckpt_path to start fresh")
        raise ConfigError(f"ckpt_path={ckpt_path!r}: no checkpoint at {path}; run without ckpt_path to start fresh")
    return str(path)
