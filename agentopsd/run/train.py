"""Train an agent: compose, validate, seed, instantiate, fit, evaluate, report.

The same run two ways: ``python train.py`` in a checkout, or ``agentopsd-train`` (the console command
of an installed wheel, the Hydra configs shipped inside it) from any folder.

    python train.py                              # the embedded default (experiment=quickstart)
    python train.py +experiment=webshop_3b       # the paper's WebShop setup on GPUs
    python train.py algorithm=grpo env=searchqa  # swap any config group (the quickstart's tiny model follows the env)
    python train.py ckpt_path=last               # resume the latest run of this name
    agentopsd-train experiment=babyai_tiny       # the same, installed

Each run writes its own folder under the current one, runs/<name>/<YYYY-MM-DD_HH-MM-SS>/; runs/<name>/latest
points at the newest.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

# Before torch loads its OpenMP runtime (lightning imports torch below; the package's __init__ imports nothing): OpenMP threads that spin while
# they wait for work fight any other process for the cores. 3 quickstart iterations beside one busy
# process on a loaded 2-core machine: 418 s spinning (2 threads), 23 s waiting passively (2 threads),
# 36 s with 1 thread (benchmarks/shared_cpu.py). The tiny model gains nothing past a few threads.
# Values already in the user's environment win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", str(min(4, os.cpu_count() or 1)))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tokenizer forks nothing here; silences its warning

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import agentopsd.envs  # noqa: F401  (registers the agentopsd/* environments)
from agentopsd.models.loading import ModelNotFoundError
from agentopsd.run import folders as runs
from agentopsd.run.composition import check_composition
from agentopsd.run.validation import ConfigError, resolve_ckpt_path, validate_config
from agentopsd.training.preemption import Preempted

log = logging.getLogger("agentopsd")


# The repository's conf/ (agentopsd/conf links to it) or the wheel's copy. An absolute path: Hydra reads a
# relative one as the package `agentopsd.conf`, which is a plain folder of YAML files, not a package.
CONF_DIR = Path(__file__).parent.parent / "conf"


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> dict[str, float]:
    runs.silence_known_noise()
    hydra_cfg = HydraConfig.get()
    # the folder Hydra made: the processes of one launch all get rank 0's (Lightning passes it on)
    output_dir = Path(hydra_cfg.runtime.output_dir)
    cfg.output_dir = str(output_dir)
    try:  # every check that can fail, before any weights load or work starts
        runs.check_group_swaps(hydra_cfg.runtime.choices.get("experiment"), list(hydra_cfg.overrides.task), CONF_DIR)
        validate_config(cfg)
        ckpt_path = resolve_ckpt_path(cfg.ckpt_path, output_dir)
    except (ConfigError, ModelNotFoundError) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)  # one line naming the field and the fix
        runs.remove_if_unused(output_dir)  # nothing ran: no folder left behind
        sys.exit(2)
    from agentopsd.tools.memory import print_memory_plan

    # per-GPU memory for weights, gradients, optimizer, activations and vLLM, before any weights load
    print_memory_plan(cfg, force=bool(cfg.get("memory_plan_only", False)))
    if cfg.get("memory_plan_only", False):  # python train.py +experiment=webshop_7b +memory_plan_only=true
        return {}
    L.seed_everything(cfg.seed, workers=True)
    if cfg.trainer.get("deterministic"):  # from the warm start on, not only inside the Trainer (which sets it again)
        import torch

        torch.use_deterministic_algorithms(True)

    model, tokenizer = instantiate(cfg.model)
    from agentopsd.training.precision import compute_in_half, plan_for_config

    if plan_for_config(cfg).frozen_half:  # a LoRA policy over a bf16 base: the warm start trains it in bf16 too
        compute_in_half(model)
    if cfg.warm_start:
        from agentopsd.models.warmstart import warm_start

        warm_start(model, tokenizer, cfg.env, cfg.warm_start, runs.warm_start_dir(output_dir, Path(cfg.runs_dir)))

    from agentopsd.training.data import TaskDataModule
    from agentopsd.training.module import AgentRLModule

    module = AgentRLModule.from_config(cfg, model, tokenizer, model_path=cfg.model.get("path"))
    datamodule = TaskDataModule(cfg.env.id, cfg.data.tasks_per_batch, cfg.data.group_size, cfg.num_iterations, seed=cfg.seed)

    from agentopsd.callbacks import default_callbacks

    trainer = instantiate(
        cfg.trainer,
        callbacks=default_callbacks(cfg, output_dir),
        logger=[instantiate(lg) for lg in cfg.logger],
        default_root_dir=str(output_dir),
    )
    for logger in trainer.loggers:  # the resolved config, so a run's folder says how it was made
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    if trainer.is_global_zero:
        runs.mark_latest(output_dir)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except Preempted as stop:
        if trainer.is_global_zero:
            print(
                f"\nstopped by {stop.signal_name} after {module.iterations_done} completed iterations"
                + ("" if stop.update_done else f" (iteration {stop.iteration} abandoned: it runs again on resume)")
                + f"; checkpoint: {(output_dir / 'checkpoints' / 'last.ckpt').resolve()}\n"
                f"resume: {_command()} {' '.join([a for a in sys.argv[1:] if not a.startswith('ckpt_path=')] + ['ckpt_path=last'])}"
            )
        sys.exit(stop.exit_code)
    except Exception as err:
        from agentopsd.training.distributed import is_collective_timeout, is_distributed, timeout_message
        from agentopsd.training.oom import EXIT_CODE, DeviceOutOfMemory

        if isinstance(err, DeviceOutOfMemory) and os.environ.get("HYDRA_FULL_ERROR") != "1":
            sys.exit(EXIT_CODE)  # its one line is printed already (naming the rank, the phase and what to lower)

        if is_distributed() and is_collective_timeout(err) and os.environ.get("HYDRA_FULL_ERROR") != "1":
            print(timeout_message(err), file=sys.stderr, flush=True)  # one line: which rank, where it waited
            os._exit(1)  # a normal exit would wait on the process group that just failed
        raise

    # the end-of-run steps run once, on rank 0, after every rank has finished training
    trainer.strategy.barrier("run over")
    history = module.eval_history
    if cfg.report and trainer.is_global_zero:
        from agentopsd.tools.report import write_report

        write_report(output_dir, config=OmegaConf.to_container(cfg, resolve=True))
    if trainer.is_global_zero:
        from agentopsd.callbacks import EvaluationCallback

        trained = sum(cb.iterations_trained for cb in trainer.callbacks if isinstance(cb, EvaluationCallback))
        print("\n" + runs.summary(history, trained=trained, done=module.iterations_done, planned=cfg.num_iterations))
        print(f"outputs: {output_dir.resolve()} (checkpoints/, rollouts/, csv/, tensorboard/" + (", report/index.html)" if cfg.report else ")"))
    return history[-1] if history else {}


def _accept_plus_experiment(argv: list[str]) -> list[str]:
    # the root config already has an experiment default, so Hydra would reject `+experiment=X`;
    # both spellings mean the same here
    return [a.replace("+experiment=", "experiment=", 1) if a.startswith("+experiment=") else a for a in argv]


def _command() -> str:
    """How this run was started, for the resume hint: ``python train.py`` or ``agentopsd-train``."""
    program = Path(sys.argv[0]).name
    return "python train.py" if program == "train.py" else program


def cli() -> None:
    """``python train.py`` and the ``agentopsd-train`` console command."""
    from agentopsd.training.distributed import exit_process

    sys.argv = _accept_plus_experiment(sys.argv)
    try:  # Hydra would report a typo'd key or option in several lines and exit 1: one line and exit 2 instead
        check_composition(sys.argv[1:], CONF_DIR)
    except ConfigError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        exit_process(2)
    try:
        main()
    except SystemExit as stop:  # a preempted or out-of-memory run's exit status, or Hydra's on a bad config
        exit_process(stop.code)
    exit_process(0)  # not a plain return: after a multi-process run, see exit_process


runs.register_resolvers()  # before Hydra composes: output_dir is ${run_dir:...}

if __name__ == "__main__":
    cli()
