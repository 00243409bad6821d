"""Two (or more) ranks, each with its own colocated vLLM engine, on the vLLM CPU build (gloo).

Run with the vLLM venv's torchrun (``bash scripts/build_vllm_cpu_env.sh`` builds it)::

    .venv-vllm/bin/torchrun --nproc-per-node 2 scripts/vllm_colocate_check.py --json-out DIR

What each rank checks, on the tiny policy (``agentopsd.tiny``) that rank 0 saves:

(a) its engine sits in its own process: vLLM's worker is reachable in this process (no engine-core
    process), ``distributed_executor_backend="external_launcher"``, the process ids differ by rank;
(b) it samples with its own seed (``seed + rank``): the same prompts give different samples per rank,
    and the same samples again when asked again with the same per-request seed;
(c) after optimizer steps on the FSDP2-sharded training copy, the streamed ``sync_weights`` (every rank
    gathers every parameter, in order) changes the engine's greedy outputs, and their log-probs match
    the sharded model's own forward within ``--tolerance`` (both float32).

Each rank writes ``DIR/rank<r>.json``; rank 0 also prints the merged summary. Exit 1 when a check fails.

``--device cuda`` (``scripts/gpu_check.sh --gpus 2`` runs it, NCCL, one GPU per rank; never run yet)
also records the device memory in use (``torch.cuda.mem_get_info``, every process on the GPU) with the
engine awake, during the update (asleep with ``--sleep``) and after the sync, and the sync's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from agentopsd.process_env import set_vllm_defaults  # noqa: E402  (imports neither torch nor vllm)

set_vllm_defaults()


def run(args: argparse.Namespace, out: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import vllm_check
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import agentopsd.envs  # noqa: F401  (registers the agentopsd/* ids)
    from agentopsd.rollout.base import SamplingConfig
    from agentopsd.rollout.vllm_backend import VLLMGenerator

    fail = out["failures"].append
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", rank)) if args.device == "cuda" else None)

    def used_gib() -> float | None:
        if device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        return round((total - free) / 2**30, 3)
    workdir = Path(args.workdir)
    path = workdir / "policy"
    if rank == 0:
        torch.manual_seed(0)
        vllm_check.build_policy(workdir, vllm_check.ENV_ID)
    dist.barrier()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    _, prompts = vllm_check.env_prompts(vllm_check.ENV_ID, tokenizer, args.batch)

    t0 = time.perf_counter()
    extra = {} if args.sleep is None else {"enable_sleep_mode": args.sleep}
    if device.type == "cuda":
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    gen = VLLMGenerator(str(path), tokenizer, dtype="float32", enforce_eager=True, max_model_len=1024,
                        max_num_seqs=args.batch, seed=args.seed, loaded_step=0, **extra)
    out["sleep_mode"] = gen.sleep_mode
    out["engine_start_s"] = round(time.perf_counter() - t0, 2)
    worker = gen._in_process_worker()
    out["pid"] = os.getpid()
    out["engine_seed"] = gen.engine_seed
    out["executor"] = gen.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    out["engine_in_process"] = worker is not None
    out["environ"] = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    if worker is None:
        fail("(a) the engine's worker is not in this process")
    if out["executor"] != "external_launcher":
        fail(f"(a) executor {out['executor']!r}, not external_launcher")
    if gen.engine_seed != args.seed + rank:
        fail(f"(b) engine seed {gen.engine_seed} != seed + rank {args.seed + rank}")

    # (b) per-rank sampling: same prompts on every rank, no per-request seed (the engine's seed decides)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_strings=())
    samples = [g.token_ids for g in gen.generate(prompts, sampling)]
    every = [None] * world
    dist.all_gather_object(every, (os.getpid(), samples))
    out["pids"] = [p for p, _ in every]
    out["samples_differ_from_rank0"] = [s != every[0][1] for _, s in every]
    if len(set(out["pids"])) != world:
        fail(f"(a) ranks share a process: {out['pids']}")
    if rank > 0 and samples == every[0][1]:
        fail("(b) this rank sampled exactly what rank 0 did: the seeds are not per rank")

    # (c) FSDP2 shards, real optimizer steps, the streamed sync, log-probs against the sharded forward
    greedy = SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=True, stop_strings=())
    gen.sync_weights(model, step=0)  # the loaded weights: skipped
    out["first_sync_bytes"] = gen.synced_bytes
    before = [g.token_ids for g in gen.generate(prompts, greedy)]
    out["memory_gib"] = {"engine_awake": used_gib()}
    gen.sleep()  # after the rollout (a no-op without sleep mode)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out["sharded"] = type(next(model.parameters())).__name__
    with torch.device(device):  # the helpers make their tensors on the default device
        out["losses"] = vllm_check.train_towards(model, tokenizer, prompts[: max(1, args.batch // 2)], args.target,
                                                 args.train_steps, args.lr)
    out["memory_gib"]["update"] = used_gib()
    if device.type == "cuda":
        out["memory_gib"]["training_peak_allocated"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    t0 = time.perf_counter()
    gen.sync_weights(model, step=1)
    out["sync_s"] = round(time.perf_counter() - t0, 3)
    out["sync_bytes"] = gen.synced_bytes
    out["memory_gib"]["after_sync"] = used_gib()
    after = gen.generate(prompts, greedy)
    out["changed"] = sum(a.token_ids != b for a, b in zip(after, before))
    model.eval()
    with torch.device(device):  # one sharded forward per prompt, on every rank
        diff = vllm_check.max_logprob_diff(model, prompts, after, 1.0)
    out["max_abs_logprob_diff_after_sync"] = diff
    if out["first_sync_bytes"] != 0:
        fail("(c) the first sync (the loaded weights) was not skipped")
    if out["changed"] == 0:
        fail("(c) the sync changed no greedy output")
    if not diff <= args.tolerance:
        fail(f"(c) log-probs after the sync differ from the sharded model's forward by {diff:.3g} > {args.tolerance}")
    gen.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--target", default="<action>go forward</action>")
    p.add_argument("--train-steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    p.add_argument("--sleep", action=argparse.BooleanOptionalAction, default=None,
                   help="enable_sleep_mode (default: auto, on where the platform has it)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--workdir", required=True, help="shared by the ranks: rank 0 saves the policy there")
    p.add_argument("--json-out", required=True, help="a folder: rank<r>.json per rank")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")  # before the engine: external_launcher joins it
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank, "failures": []}
    t0 = time.perf_counter()
    try:
        run(args, out)
    except Exception as exc:
        traceback.print_exc()
        out["failures"].append(f"crashed: {type(exc).__name__}: {exc}")
    out["ok"] = not out["failures"]
    out["total_s"] = round(time.perf_counter() - t0, 2)
    Path(args.json_out).mkdir(parents=True, exist_ok=True)
    (Path(args.json_out) / f"rank{rank}.json").write_text(json.dumps(out, sort_keys=True) + "\n")
    print(json.dumps(out, sort_keys=True), flush=True)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
