"""The colocated vLLM engine around real updates, per rank, with assertions that can fail.

Run under torchrun, one process per device (``scripts/gpu_check.sh`` runs it)::

    torchrun --nproc-per-node N scripts/vllm_colocate_check.py --device cuda --json-out DIR   # GPUs: bf16, CUDA graphs, sleep
    .venv-vllm/bin/torchrun --nproc-per-node 2 scripts/vllm_colocate_check.py --json-out DIR  # the vLLM CPU build (gloo)
    torchrun --nproc-per-node 2 scripts/vllm_colocate_check.py --engine fake --json-out DIR    # sleep against the fake engine

Each rank starts its own engine (``external_launcher``, in this process), shards the policy with FSDP2 and
runs ``--cycles`` full cycles of what the trainer does (:mod:`agentopsd.rollout.factory`'s ``engine_sync``
and ``engine_sleep``, the calls :class:`agentopsd.training.module.AgentRLModule` makes): generate, sleep, ``--train-steps``
AdamW steps at ``--lr``, the update's peak left in PyTorch's cache, sync (cache released, weights woken and
loaded, KV cache woken), generate again. What it asserts, each a named check in ``DIR/rank<r>.json``:

- ``own_device``: the engine runs in this process on this rank's device (CUDA: its weights sit on
  ``cuda:LOCAL_RANK``; everywhere: one process per rank, the executor is ``external_launcher``);
- ``sleep_frees``: sleep frees at least 90% of the device memory the engine took (the fake engine: of
  what it holds), every cycle;
- ``cache_filled_sync``: with the update's peak cached by PyTorch (on CUDA: a block that leaves half of what
  the engine needs free; the fake engine: its simulated cache), the sync still wakes the engine (defect 1
  of issue 36: no cache release before ``wake_up``);
- ``logprobs_match``: after the sync, the engine's log-probs of its greedy samples match the sharded
  trainer's forward: mean < ``--mean-tol`` and max < ``--max-tol`` nats, every cycle;
- ``stale_control``: the same check on the engine's samples from before the update against the trainer
  after it (what a stale engine would report) must fail: the check can tell a synced engine from a stale one;
- ``cycles``: every cycle ran to its end.

``--plant stale-engine`` skips the sync (and sleep, which would leave undefined weights); ``--plant
skip-cache-release`` makes the trainer's cache release a no-op: each must fail its check and no other (the
rehearsal's controls). Exit 1 when a check fails.
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

from agentopsd.run.process_env import set_vllm_defaults  # noqa: E402  (imports neither torch nor vllm)

set_vllm_defaults()

CHECKS = ("own_device", "sleep_frees", "cache_filled_sync", "logprobs_match", "stale_control", "cycles")
"""Every check a rank reports, in order."""
PLANTS = ("stale-engine", "skip-cache-release")
SLEEP_FREED_MIN = 0.90
TARGET = "<action>go forward</action>"


def logprob_gap(engine: list[list[float]], trainer: list[list[float]]) -> tuple[float, float]:
    """Mean and max |engine - trainer| over every sampled token (nats); (inf, inf) when there is none."""
    diffs = [abs(a - b) for e, t in zip(engine, trainer) for a, b in zip(e, t)]
    if not diffs:
        return float("inf"), float("inf")
    return sum(diffs) / len(diffs), max(diffs)


def gap_ok(mean: float, worst: float, mean_tol: float, max_tol: float) -> bool:
    """The engine agrees with the trainer: mean below ``mean_tol`` and max below ``max_tol`` (NaN fails)."""
    return mean < mean_tol and worst < max_tol


def sleep_share(freed: float, engine: float) -> float:
    """The share of the engine's memory a sleep freed (0 when the engine took nothing measurable)."""
    return freed / engine if engine > 0 else 0.0


def trainer_logprobs(model: Any, prompts: list[list[int]], gens: list[Any], device: Any, autocast: Any) -> list[list[float]]:
    """log_softmax of each sampled token from one forward of the (sharded) policy, in its compute precision."""
    import torch

    out = []
    with torch.no_grad():
        for prompt, gen in zip(prompts, gens):
            ids = torch.tensor([list(prompt) + list(gen.token_ids)], device=device)
            with autocast():
                logits = model(input_ids=ids).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 : -1]
            out.append(logp.gather(-1, torch.tensor(gen.token_ids, device=device)[:, None]).squeeze(-1).tolist())
    return out


def adamw_steps(model: Any, optimizer: Any, prompts: list[list[int]], target: list[int], steps: int, device: Any,
                autocast: Any) -> list[float]:
    """``steps`` AdamW steps on -log p(target | prompt): real updates that move the engine's log-probs."""
    import torch

    model.train()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for prompt in prompts:
            with autocast():
                logits = model(input_ids=torch.tensor([prompt + target], device=device)).logits[0]
            logp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
            total = total - logp.gather(-1, torch.tensor(target, device=device)[:, None]).mean() / len(prompts)
        total.backward()
        optimizer.step()
        losses.append(round(float(total.detach()), 4))
    model.eval()
    return losses


def run(args: argparse.Namespace, plant: str, out: dict[str, Any]) -> None:
    """One leg: the engine, the sharded policy and ``--cycles`` cycles, with ``plant`` ("none" or one of
    :data:`PLANTS`) planted; the checks go to ``out["checks"]``."""
    import contextlib

    import torch
    import torch.distributed as dist
    import vllm_check
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    import agentopsd.envs  # noqa: F401  (registers the agentopsd/* ids)
    from agentopsd.models.loading import load_tokenizer
    from agentopsd.rollout import base as rollout_base
    from agentopsd.rollout import factory
    from agentopsd.rollout.base import SamplingConfig
    from agentopsd.rollout.vllm_backend import VLLMGenerator, _runner

    checks: dict[str, dict[str, Any]] = out["checks"]

    def record(name: str, ok: bool, detail: str) -> None:
        prior = checks.get(name)
        if prior is None or prior["ok"]:  # the first failure is the one that says why
            checks[name] = {"ok": bool(ok), "detail": detail}

    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    on_cuda = device.type == "cuda"
    if plant == "skip-cache-release":
        rollout_base.release_device_cache = lambda: None  # the planted defect: the update's cache stays when vLLM wakes

    def used() -> float:
        """Bytes in use on this rank's device by every process (CUDA), else 0."""
        if not on_cuda:
            return 0.0
        free, total = torch.cuda.mem_get_info(device)
        return float(total - free)

    path = Path(args.model_path) if args.model_path else Path(args.workdir) / "policy"
    if not args.model_path and rank == 0 and not path.is_dir():
        torch.manual_seed(0)
        vllm_check.build_policy(Path(args.workdir), vllm_check.ENV_ID)
    dist.barrier()
    tokenizer = load_tokenizer(str(path))
    _, prompts = vllm_check.env_prompts(args.env_id, tokenizer, args.batch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    compute = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def autocast():  # FSDP2's policy computes in bf16 already; the head's output as the trainer takes it
        return contextlib.nullcontext()

    before_engine = used()
    t0 = time.perf_counter()
    stale_plant = plant == "stale-engine"
    sleep = args.sleep and not stale_plant  # a stale engine must keep its (old) weights: level 2 would drop them
    gen = VLLMGenerator(str(path), tokenizer, dtype=args.dtype, enforce_eager=args.enforce_eager,
                        max_model_len=max(map(len, prompts)) + args.max_new_tokens + 16,
                        max_num_seqs=args.batch, seed=args.seed, loaded_step=0, enable_sleep_mode=sleep,
                        gpu_memory_utilization=args.gpu_memory_utilization)
    out["engine_start_s"] = round(time.perf_counter() - t0, 2)
    out["sleep_mode"] = gen.sleep_mode
    awake = used()
    engine_bytes = awake - before_engine
    out["engine_gib"] = round(engine_bytes / 2**30, 3)
    timings: dict[str, list[float]] = {"sync": [], "sleep": [], "wake": []}
    wake_up = gen.llm.wake_up

    def timed_wake(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return wake_up(*a, **kw)
        finally:
            timings["wake"].append(time.perf_counter() - t)

    gen.llm.wake_up = timed_wake
    out["timings_s"] = timings

    # own_device: this process, this rank's device
    worker = gen._in_process_worker()
    engine_model = getattr(_runner(worker), "model", None) if worker is not None else None
    engine_model = getattr(engine_model, "owner", None) and engine_model.owner.model or engine_model  # the fake's
    where = engine_weights_device(engine_model)
    if where == "unknown" and on_cuda and engine_bytes > 2**28:  # a wrapper hides the weights: the memory tells
        where = f"{device} (by memory: {engine_bytes / 2**30:.2f} GiB taken on it)"
    executor = getattr(getattr(getattr(getattr(gen.llm, "llm_engine", None), "vllm_config", None), "parallel_config", None),
                       "distributed_executor_backend", None)
    every = [None] * world
    dist.all_gather_object(every, (os.getpid(), where))
    out["pids"], out["engine_devices"] = [p for p, _ in every], [w for _, w in every]
    problems = []
    if worker is None:
        problems.append("the engine's worker is not in this process")
    if len(set(out["pids"])) != world:
        problems.append(f"ranks share a process: {out['pids']}")
    if args.engine == "real" and world > 1 and executor != "external_launcher":
        problems.append(f"executor {executor!r}, not external_launcher")
    if on_cuda and not where.startswith(str(device)):
        problems.append(f"the engine's weights are on {where}, not {device}")
    if on_cuda and len(set(out["engine_devices"])) != world:
        problems.append(f"engines share a device: {out['engine_devices']}")
    record("own_device", not problems, "; ".join(problems) or f"engine on {where} in process {os.getpid()} ({executor})")

    target = tokenizer.encode(TARGET, add_special_tokens=False)
    greedy = SamplingConfig(max_new_tokens=args.max_new_tokens, greedy=True, stop_strings=())
    cycles_done = 0
    out["cycles"] = []
    for cycle in range(1, args.cycles + 1):
        info: dict[str, Any] = {"cycle": cycle}
        out["cycles"].append(info)
        rollout = gen.generate(prompts, greedy)  # the rollout, with the weights of step cycle - 1
        engine_old = [list(g.logprobs) for g in rollout]
        asleep_before = used()
        if sleep:
            t = time.perf_counter()
            factory.engine_sleep(gen)
            timings["sleep"].append(time.perf_counter() - t)
            if args.engine == "fake":
                from tests.fakes import fake_engine

                share = fake_engine.DEVICE.freed_by_sleep[-1]
            else:
                share = sleep_share(asleep_before - used(), engine_bytes)
            info["sleep_freed_share"] = round(share, 4)
            record("sleep_frees", share >= SLEEP_FREED_MIN,
                   f"cycle {cycle}: sleep freed {share:.1%} of the engine's memory (need >= {SLEEP_FREED_MIN:.0%})")
        info["losses"] = adamw_steps(model, optimizer, prompts[: max(1, args.batch // 2)], target, args.train_steps, device,
                                     autocast)
        # what a stale engine reports: its samples from before the update against the trainer after it
        stale_mean, stale_max = logprob_gap(engine_old, trainer_logprobs(model, prompts, rollout, device, autocast))
        info["stale_gap"] = [stale_mean, stale_max]
        record("stale_control", not gap_ok(stale_mean, stale_max, args.mean_tol, args.max_tol),
               f"cycle {cycle}: a stale engine's gap mean {stale_mean:.4f} / max {stale_max:.4f} nats "
               f"(must fail mean < {args.mean_tol} and max < {args.max_tol})")
        if sleep:  # the update's peak stays in PyTorch's cache, as after the trainer's update
            info["cached_gib"] = round(fill_device_cache(device, engine_bytes) / 2**30, 3) if on_cuda else None
        t = time.perf_counter()
        try:
            if not stale_plant:
                factory.engine_sync(gen, model, step=cycle)
            if sleep:
                record("cache_filled_sync", True, f"cycle {cycle}: the sync woke the engine beside the update's cache")
        except Exception as err:  # out of memory waking the engine: the check fails; recover to go on
            record("cache_filled_sync", False, f"cycle {cycle}: the sync failed after a cache-filling update: "
                   f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            _empty_cache(device)
            if args.engine == "fake":
                from tests.fakes import fake_engine

                fake_engine.DEVICE.release()
            gen.asleep = True  # it woke nothing: wake and load again
            gen.sync_weights(model, step=cycle)
        timings["sync"].append(time.perf_counter() - t)
        after = gen.generate(prompts, greedy)
        mean, worst = logprob_gap([list(g.logprobs) for g in after], trainer_logprobs(model, prompts, after, device, autocast))
        info["synced_gap"] = [mean, worst]
        record("logprobs_match", gap_ok(mean, worst, args.mean_tol, args.max_tol),
               f"cycle {cycle}: engine vs trainer after {args.train_steps} AdamW steps at lr {args.lr}: mean {mean:.4f} "
               f"(< {args.mean_tol}), max {worst:.4f} (< {args.max_tol}) nats")
        cycles_done = cycle
    record("cycles", cycles_done == args.cycles, f"{cycles_done} of {args.cycles} cycles ran")
    if not sleep:
        record("sleep_frees", True, "not applicable: " + ("the stale-engine plant runs without sleep" if stale_plant
                                                         else "this engine runs without sleep mode"))
        record("cache_filled_sync", True, "not applicable: without sleep the engine never wakes")
    out["sync_bytes"] = gen.synced_bytes
    gen.close()


def engine_weights_device(model: Any) -> str:
    """The device of the engine's weights, looking through wrappers (a CUDA-graph runner keeps the model in
    an attribute); ``unknown`` when none holds parameters."""
    for candidate in (model, *(getattr(model, a, None) for a in ("runnable", "model", "module"))):
        params = getattr(candidate, "parameters", None)
        if callable(params):
            first = next(iter(params()), None)
            if first is not None:
                return str(first.device)
    return "unknown"


def fill_device_cache(device: Any, engine_bytes: float) -> int:
    """Leave PyTorch's cache holding all free memory but half of what the engine needs (bytes cached): without
    the trainer's cache release, waking the engine beside it runs out of memory."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    size = int(free - engine_bytes / 2)
    if size <= 0:
        return 0
    block = torch.empty(size, dtype=torch.uint8, device=device)
    del block  # freed to PyTorch's caching allocator, not to the device
    return int(torch.cuda.memory_reserved(device))


def _empty_cache(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
    p.add_argument("--engine", choices=("real", "fake"), default="real",
                   help="fake: tests.fakes.fake_engine (sleep mode on CPU)")
    p.add_argument("--model-path", default=None, help="a model folder (default: the tiny BabyAI policy, built here)")
    p.add_argument("--env-id", default=None,
                   help="the prompts' environment (default: BabyAI, the tiny policy's; WebShop needs no minigrid)")
    p.add_argument("--dtype", default=None, help="the engine's dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="default: CUDA graphs on CUDA, eager on CPU")
    p.add_argument("--sleep", action=argparse.BooleanOptionalAction, default=None,
                   help="enable_sleep_mode (default: on with CUDA or the fake engine; the vLLM CPU build has none)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--mean-tol", type=float, default=0.02)
    p.add_argument("--max-tol", type=float, default=0.5)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--legs", default="none",
                   help=f"comma-separated legs, each a fresh engine and policy: none, or a defect to plant ({', '.join(PLANTS)})")
    p.add_argument("--workdir", required=True, help="shared by the ranks: rank 0 builds the tiny policy there")
    p.add_argument("--json-out", required=True, help="a folder: rank<r>.json per rank")
    args = p.parse_args(argv)
    args.legs = tuple(x for x in args.legs.split(",") if x) or ("none",)
    unknown = [x for x in args.legs if x not in ("none", *PLANTS)]
    if unknown:
        p.error(f"--legs takes none, {', '.join(PLANTS)}; got {', '.join(unknown)}")
    cuda = args.device == "cuda"
    if args.env_id is None:
        import vllm_check

        args.env_id = vllm_check.ENV_ID
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.enforce_eager = (not cuda) if args.enforce_eager is None else args.enforce_eager
    args.sleep = (cuda or args.engine == "fake") if args.sleep is None else args.sleep
    return args


EXPECTED_FAILURES = {"none": frozenset(), "stale-engine": frozenset({"logprobs_match"}),
                     "skip-cache-release": frozenset({"cache_filled_sync"})}
"""Per leg, the checks that must fail: none without a plant, exactly the planted defect's check with one."""


def failed_checks(checks: dict[str, dict[str, Any]]) -> frozenset[str]:
    """The names of the checks that failed."""
    return frozenset(name for name, c in checks.items() if not c["ok"])


def leg_behaved(leg: str, checks: dict[str, dict[str, Any]]) -> bool:
    """A leg passed every check (no plant), or failed exactly its planted defect's check (a control)."""
    return failed_checks(checks) == EXPECTED_FAILURES[leg]


def run_leg(args: argparse.Namespace, leg: str) -> dict[str, Any]:
    """One leg, never raising: a crash fails every check it did not reach."""
    from agentopsd.rollout import base as rollout_base

    out: dict[str, Any] = {"checks": {}}
    release = rollout_base.release_device_cache
    if args.engine == "fake":
        from tests.fakes import fake_engine

        fake_engine.reset()
    t0 = time.perf_counter()
    try:
        run(args, leg, out)
    except Exception as exc:
        traceback.print_exc()
        out["crashed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        rollout_base.release_device_cache = release  # undo a plant
    for name in CHECKS:  # a check the run never reached fails, saying so
        out["checks"].setdefault(name, {"ok": False, "detail": f"not reached ({out.get('crashed', 'no reason')})"})
    out["behaved"] = leg_behaved(leg, out["checks"])
    out["total_s"] = round(time.perf_counter() - t0, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")  # before the engine: external_launcher joins it
    if args.engine == "fake":
        from tests.fakes import fake_engine

        fake_engine.install(sleep_available=True)
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank, "engine": args.engine, "device": args.device, "dtype": args.dtype,
                           "enforce_eager": args.enforce_eager, "legs": {}}
    for leg in args.legs:
        out["legs"][leg] = run_leg(args, leg)
    out["ok"] = all(leg["behaved"] for leg in out["legs"].values())
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
