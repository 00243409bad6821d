"""Train an agent: compose, validate, seed, instantiate, fit, evaluate, report.

    python train.py                              # the embedded default (experiment=quickstart)
    python train.py +experiment=webshop_3b       # the paper's WebShop setup on GPUs
    python train.py algorithm=grpo env=searchqa  # swap any config group
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import envs  # noqa: F401  (registers the agentopsd/* environments)
from agentopsd.models import ModelNotFoundError
from agentopsd.preemption import Preempted
from agentopsd.validation import ConfigError, resolve_ckpt_path, validate_config

log = logging.getLogger("agentopsd")


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict[str, float]:
    output_dir = Path(cfg.output_dir)
    try:  # every check that can fail, before any weights load or work starts
        validate_config(cfg)
        ckpt_path = resolve_ckpt_path(cfg.ckpt_path, output_dir)
    except (ConfigError, ModelNotFoundError) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)  # one line naming the field and the fix
        sys.exit(2)
    L.seed_everything(cfg.seed, workers=True)

    model, tokenizer = instantiate(cfg.model)
    if cfg.warm_start:
        from agentopsd.warmstart import warm_start

        warm_start(model, tokenizer, cfg.env, cfg.warm_start, output_dir / "warm_start")

    from agentopsd.data import TaskDataModule
    from agentopsd.module import AgentRLModule

    module = AgentRLModule(
        model,
        tokenizer,
        algorithm=instantiate(cfg.algorithm),
        env=instantiate(cfg.env),
        rollout=instantiate(cfg.rollout),
        optim=instantiate(cfg.optim),
        evaluation=instantiate(cfg.evaluation),
        num_iterations=cfg.num_iterations,
        seed=cfg.seed,
        model_path=cfg.model.get("path"),
    )
    datamodule = TaskDataModule(cfg.env.id, cfg.data.tasks_per_batch, cfg.data.group_size, cfg.num_iterations, seed=cfg.seed)

    from callbacks import default_callbacks

    trainer = instantiate(
        cfg.trainer,
        callbacks=default_callbacks(cfg, output_dir),
        logger=[instantiate(lg) for lg in cfg.logger],
        default_root_dir=str(output_dir),
    )
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except Preempted as stop:
        if trainer.is_global_zero:
            print(
                f"\nstopped by {stop.signal_name} after {module.iterations_done} completed iterations"
                + ("" if stop.update_done else f" (iteration {stop.iteration} abandoned: it runs again on resume)")
                + f"; checkpoint: {(output_dir / 'checkpoints' / 'last.ckpt').resolve()}\n"
                f"resume: python train.py {' '.join([a for a in sys.argv[1:] if not a.startswith('ckpt_path=')] + ['ckpt_path=last'])}"
            )
        sys.exit(stop.exit_code)

    history = module.eval_history
    if cfg.report and trainer.is_global_zero:
        from agentopsd.report import write_report

        write_report(output_dir)
    if trainer.is_global_zero and history:
        first, last = history[0]["eval/success"], history[-1]["eval/success"]
        print(f"\neval success: {first:.1%} before RL -> {last:.1%} after {cfg.num_iterations} iterations")
        print(f"outputs: {output_dir.resolve()} (checkpoints/, rollouts/, csv/, tensorboard/" + (", report/index.html)" if cfg.report else ")"))
    return history[-1] if history else {}


def _accept_plus_experiment(argv: list[str]) -> list[str]:
    # the root config already has an experiment default, so Hydra would reject `+experiment=X`;
    # both spellings mean the same here
    return [a.replace("+experiment=", "experiment=", 1) if a.startswith("+experiment=") else a for a in argv]


if __name__ == "__main__":
    sys.argv = _accept_plus_experiment(sys.argv)
    OmegaConf.register_new_resolver("eval", eval, replace=True)
    main()
