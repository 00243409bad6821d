"""Export a trained policy as a Hugging Face model folder that transformers, vLLM and the Hub load.

    agentopsd-export runs/quickstart/latest exported/           # a run folder: its checkpoints/last.ckpt
    agentopsd-export runs/x/2025-01-01_00-00-00/checkpoints/policy-000008.pt exported/
    agentopsd-export path/to/last.ckpt exported/ --adapter      # LoRA kept apart (merged by default)
    python -m agentopsd.tools.export RUN_OR_CHECKPOINT OUT_DIR

The source may be a run folder (``runs/<name>/<stamp>``, ``runs/<name>`` or its ``latest``), Lightning's
``last.ckpt`` (one file from a 1-process or DDP run, a folder of shards from an FSDP2 run), or a kept
``policy-<iteration>.pt``. Everything happens on one process: an FSDP2 checkpoint's shards are read whole
(torch.distributed.checkpoint without a process group), weights only, never the optimizer's state.

The architecture and tokenizer come from the run's own config (``<run>/.hydra/config.yaml``; ``--run``
names the run for a checkpoint kept elsewhere): the tiny model's tokenizer is the one it trained with.
The folder holds ``config.json``, ``model.safetensors``, the tokenizer with its chat template, a
``generation_config.json`` with the stops the trainer uses (eos, ``<|im_end|>``, and the output
format's stop strings such as ``</action>``) and its evaluation sampling, and ``agentopsd.json``: the
source, the iterations trained and the prompt settings (environment, output format, history window)
the policy was trained with, which ``agentopsd-eval`` needs to play it as it was trained.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import shutil
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("agentopsd.tools.export")

TINY_TARGET = "agentopsd.models.tiny.tiny_policy"
HF_TARGET = "agentopsd.models.loading.load_policy"
METADATA = "agentopsd.json"
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


class ExportError(ValueError):
    """A source that cannot be exported; the message says why and what to give instead."""


# ------------------------------------------------------------------ finding the checkpoint and its run


def _is_run_dir(path: Path) -> bool:
    return (path / ".hydra" / "config.yaml").is_file()


def find_run_dir(path: Path) -> Path | None:
    """The run folder a path belongs to: the folder itself, the run ``latest`` points at, or the nearest
    parent with ``.hydra/config.yaml`` (``<run>/checkpoints/last.ckpt`` -> ``<run>``)."""
    from agentopsd.run.folders import latest_run

    path = Path(path).resolve()
    if path.is_dir() and not _is_run_dir(path) and not _is_sharded(path):
        found = latest_run(path)  # runs/<name>: its latest run
        if found is not None and _is_run_dir(found):
            return found
    for candidate in (path, *path.parents):
        if _is_run_dir(candidate):
            return candidate
    return None


def _is_sharded(path: Path) -> bool:
    """A torch.distributed.checkpoint folder (FSDP2's ``last.ckpt``)."""
    return path.is_dir() and (path / ".metadata").is_file()


def resolve_source(source: str | Path, run: str | Path | None = None) -> tuple[Path, Path]:
    """``(checkpoint, run folder)`` of what the user named. Raises :class:`ExportError` in one line."""
    path = Path(source)
    if not path.exists():
        raise ExportError(f"{source}: no such run folder or checkpoint")
    run_dir = Path(run).resolve() if run else find_run_dir(path)
    if run_dir is None or not _is_run_dir(run_dir):
        raise ExportError(f"{source}: no run folder (with .hydra/config.yaml) holds it, so its model and tokenizer are unknown; "
                          "give the run it came from with --run RUN_DIR")
    if path.is_file() or _is_sharded(path):
        return path.resolve(), run_dir
    ckpts = run_dir / "checkpoints"
    for name in ("last.ckpt", "previous.ckpt"):  # previous.ckpt: killed between the two renames of a checkpoint swap
        if (ckpts / name).exists():
            return (ckpts / name).resolve(), run_dir
    kept = sorted(ckpts.glob("policy-*.pt"))
    if kept:
        return kept[-1].resolve(), run_dir
    raise ExportError(f"{source}: the run {run_dir} has no checkpoint (checkpoints/last.ckpt or policy-*.pt)")


def run_config(run_dir: Path):
    """The run's composed config, interpolations left to resolve on access: its latest record (a resume's
    ``.hydra/resume-<n>/config.yaml``, else ``.hydra/config.yaml``; see :mod:`agentopsd.run.resume`)."""

    from agentopsd.run import folders as runs
    from agentopsd.run.resume import load_recorded

    runs.register_resolvers()
    return load_recorded(run_dir)


# ------------------------------------------------------------------ reading the weights


def _torch_load(path: Path) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # a checkpoint with objects beyond tensors and plain types: the user's own file
        return torch.load(path, map_location="cpu", weights_only=False)


def _read_sharded(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full ``state_dict`` of a torch.distributed.checkpoint folder on one process (no process group),
    and the Lightning extras (``meta.pt``). The optimizer's entries are not read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    loaded: dict[str, Any] = {}
    _load_state_dict(loaded, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(keys={"state_dict"}), no_dist=True)
    state = loaded.get("state_dict")
    if not isinstance(state, dict):
        raise ExportError(f"{path}: a distributed checkpoint without a state_dict entry (keys {sorted(loaded)[:5]})")
    meta = path / "meta.pt"
    return state, (_torch_load(meta) if meta.is_file() else {})


def read_policy_state(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The policy's weights as the model's own ``state_dict`` keys, and the checkpoint's ``agentopsd`` extras
    (iterations done, ...; empty for a kept policy).

    Lightning's ``last.ckpt`` holds the LightningModule's state: ``model.<key>`` is the policy,
    ``ref_model.<key>`` the frozen KL reference (dropped). A ``policy-*.pt`` is the policy's state dict.
    """
    path = Path(path)
    if _is_sharded(path):
        state, extra = _read_sharded(path)
    elif path.is_file():
        loaded = _torch_load(path)
        if not isinstance(loaded, dict):
            raise ExportError(f"{path}: not a checkpoint (a {type(loaded).__name__})")
        if "state_dict" in loaded:
            state, extra = loaded["state_dict"], loaded
        else:
            return dict(loaded), {}
    else:
        raise ExportError(f"{path}: neither a checkpoint file nor a folder of distributed-checkpoint shards")
    policy = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    if not policy:
        raise ExportError(f"{path}: no policy weights (no 'model.' keys among {sorted(state)[:5]})")
    return policy, dict(extra.get("agentopsd") or {})


# ------------------------------------------------------------------ the model skeleton


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            import contextlib

            return contextlib.nullcontext()
    return no_init_weights()


def _hf_skeleton(model_cfg: dict[str, Any]):
    """The policy's architecture from its folder or hub id (its weights neither read nor initialised), LoRA
    wrapped as in training; the checkpoint's tensors are copied into it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from agentopsd.models.loading import (
        _dtype_kwargs,
        apply_lora,
        ensure_pad_token,
        resolve_model_path,
        set_chat_stops,
    )

    remote = bool(model_cfg.get("trust_remote_code", False))
    resolved = resolve_model_path(str(model_cfg["path"]))
    tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=remote)
    config = AutoConfig.from_pretrained(resolved, trust_remote_code=remote)
    with _no_init_weights():  # the checkpoint overwrites every weight: a 7B init would cost minutes
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=remote, **_dtype_kwargs("float32"))
    # built without initialising, the head is its own tensor: tie it to the embeddings as the config says (a tied
    # model exported untied grows by a vocabulary x hidden matrix, and LoRA warns that the ties broke)
    model.tie_weights()
    try:
        model.generation_config = GenerationConfig.from_pretrained(resolved)
    except OSError:  # no generation_config.json in the folder
        pass
    ensure_pad_token(tokenizer, model)
    if not isinstance(model.generation_config.eos_token_id, list) or len(model.generation_config.eos_token_id) < 2:
        set_chat_stops(model, tokenizer)
    if model_cfg.get("lora"):
        model = apply_lora(model, dict(model_cfg["lora"]))
    return model, tokenizer


def build_policy(model_cfg: dict[str, Any]):
    """``(model, tokenizer)`` of the run's model config, ready to take its checkpoint's weights."""
    from hydra.utils import instantiate

    target = model_cfg.get("_target_")
    if target == HF_TARGET:
        model, tokenizer = _hf_skeleton(model_cfg)
        return model, tokenizer
    if target == TINY_TARGET:
        model, tokenizer = instantiate(model_cfg)  # the cached tokenizer it trained with (or the same one, rebuilt)
        return model, tokenizer
    model, tokenizer = instantiate(model_cfg)  # any other (model, tokenizer) factory
    return model, tokenizer


def load_policy_from_checkpoint(source: str | Path, run: str | Path | None = None):
    """``(model, tokenizer, info)``: the run's policy with the checkpoint's weights, on CPU in float32
    (the master weights), LoRA still wrapped. ``info`` says what was read."""
    from omegaconf import OmegaConf

    ckpt, run_dir = resolve_source(source, run)
    cfg = run_config(run_dir)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model, tokenizer = build_policy(model_cfg)
    state, extra = read_policy_state(ckpt)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]  # the embedding's own tensor
    if missing or unexpected:
        raise ExportError(f"{ckpt}: its weights do not fit the run's model ({model_cfg.get('_target_')}): "
                          f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                          f"{'...' if len(unexpected) > 4 else ''}")
    model = model.float().eval()
    info = {
        "source": str(Path(source).resolve()),
        "checkpoint": str(ckpt),
        "run_dir": str(run_dir),
        "iterations_done": int(extra["iterations_done"]) if "iterations_done" in extra else None,
        "eval_history": extra.get("eval_history"),
    }
    del state
    return model, tokenizer, cfg, info


# ------------------------------------------------------------------ writing the folder


def _export_dtype(dtype: str, model_cfg: dict[str, Any]):
    import torch

    if dtype == "auto":  # the dtype the policy was loaded in (bf16 for Qwen2.5), float32 for the tiny model
        dtype = model_cfg.get("dtype") if model_cfg.get("dtype") in ("bfloat16", "float16") else "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def prompt_settings(cfg) -> dict[str, Any]:
    """How the trainer renders and stops a turn: what an evaluation of the export must reproduce."""
    from omegaconf import OmegaConf

    env = OmegaConf.to_container(cfg.env, resolve=True)
    rollout = OmegaConf.to_container(cfg.rollout, resolve=True)
    from agentopsd.rollout.prompts import FORMATS

    return {
        "env_id": env.get("id"),
        "output_format": env.get("output_format", "action"),
        "stop_strings": list(FORMATS[env.get("output_format", "action")][1]),
        "history_window": env.get("history_window"),
        "max_prompt_tokens": env.get("max_prompt_tokens"),
        "show_admissible": env.get("show_admissible", True),
        "system_prompt": env.get("system_prompt"),
        "max_turns": env.get("max_turns"),
        "max_new_tokens": rollout.get("max_new_tokens"),
        "eval_temperature": rollout.get("eval_temperature", 0.0),
    }


def _generation_config(model, tokenizer, settings: dict[str, Any]) -> None:
    gen = model.generation_config
    gen.stop_strings = settings["stop_strings"] or None
    gen.max_new_tokens = settings["max_new_tokens"]
    gen.pad_token_id = tokenizer.pad_token_id
    temperature = float(settings["eval_temperature"] or 0.0)
    if temperature > 0:
        gen.do_sample, gen.temperature, gen.top_p = True, temperature, 1.0
    else:
        gen.do_sample, gen.temperature, gen.top_p, gen.top_k = False, None, None, None


def export(source: str | Path, out_dir: str | Path, *, adapter: bool = False, dtype: str = "auto",
           run: str | Path | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write the Hugging Face folder; returns what ``agentopsd.json`` records."""
    from omegaconf import OmegaConf

    if dtype not in DTYPE_CHOICES:
        raise ExportError(f"--dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty; choose a new folder or pass --overwrite")
    t0 = time.perf_counter()
    model, tokenizer, cfg, info = load_policy_from_checkpoint(source, run)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    torch_dtype = _export_dtype(dtype, model_cfg)
    settings = prompt_settings(cfg)
    is_peft = hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")
    if adapter and not is_peft:
        raise ExportError(f"--adapter: the run's model has no LoRA adapter (model.lora is {model_cfg.get('lora')}); export without it")
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if is_peft and adapter:
        base_dir = None
        if model_cfg.get("_target_") != HF_TARGET:  # no folder or hub id holds the base: it goes beside the adapter
            base_dir = out.resolve() / "base"
        for peft_cfg in model.peft_config.values():
            peft_cfg.base_model_name_or_path = str(base_dir) if base_dir else str(model_cfg["path"])
        model.to(torch_dtype).save_pretrained(tmp)
        base = model.unload()
        if base_dir is not None:
            _generation_config(base, tokenizer, settings)
            base.save_pretrained(tmp / "base")
            tokenizer.save_pretrained(tmp / "base")
        model = base
    else:
        if is_peft:
            model = model.merge_and_unload()
        model = model.to(torch_dtype)
        _generation_config(model, tokenizer, settings)
        model.save_pretrained(tmp)
    if adapter:
        _generation_config(model, tokenizer, settings)
        model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    meta = {
        **{k: v for k, v in info.items() if k != "eval_history"},
        "model": model_cfg,
        "adapter": bool(adapter),
        "lora_merged": bool(is_peft and not adapter),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "prompt": settings,
        "last_eval": (info.get("eval_history") or [None])[-1],
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (tmp / METADATA).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    meta["seconds"] = time.perf_counter() - t0
    return meta


def read_metadata(folder: str | Path) -> dict[str, Any] | None:
    """``agentopsd.json`` of an exported folder (None for any other model folder or hub id)."""
    path = Path(folder) / METADATA
    return json.loads(path.read_text()) if path.is_file() else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="agentopsd-export",
        description="Write a Hugging Face model folder (config, safetensors, tokenizer with chat template, generation "
                    "config with the trainer's stops) from a run folder, last.ckpt (a file, or FSDP2's folder of shards) "
                    "or a kept policy-<iteration>.pt.",
    )
    p.add_argument("source", help="a run folder (runs/<name>/<stamp>, runs/<name>, runs/<name>/latest), last.ckpt, or policy-*.pt")
    p.add_argument("out_dir", help="the folder to write (must be new or empty unless --overwrite)")
    p.add_argument("--adapter", action="store_true", help="keep a LoRA adapter separate (adapter_config.json + adapter_model.safetensors) "
                   "instead of merging it into the weights")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights' dtype (auto: the dtype the run loaded the model in, float32 for the tiny model)")
    p.add_argument("--run", default=None, help="the run folder a checkpoint came from, when it is kept outside it")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per export, not a bar per shard
    from agentopsd.models.loading import ModelNotFoundError

    try:
        meta = export(args.source, args.out_dir, adapter=args.adapter, dtype=args.dtype, run=args.run, overwrite=args.overwrite)
    except (ExportError, ModelNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    done = meta["iterations_done"]
    print(f"exported {meta['checkpoint']} ({'' if done is None else f'{done} iterations, '}{meta['parameters']:,} parameters, "
          f"{meta['dtype']}{', LoRA merged' if meta['lora_merged'] else ''}{', LoRA adapter apart' if meta['adapter'] else ''}) "
          f"to {Path(args.out_dir).resolve()} in {meta['seconds']:.1f}s")
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
