"""The SmolLM2 recipe (``python train.py +experiment=smollm2``) run once and measured: where the time goes, peak RSS,
greedy success before and after.

    python benchmarks/smollm2_recipe.py [--out DIR] [--threads N] [--json PATH] [--report PATH]
                                        [-- train.py overrides ...]

One ``train.py`` subprocess (its own process group, so a stop kills nothing else). Measured:

- wall seconds and peak RSS of that process (``os.wait4``'s rusage of the child itself: ``ru_maxrss``);
- when each output line arrived (seconds since the start), kept in ``<out>/train.out`` as ``[   12.3] line``;
- the warm start: its steps and seconds from its own closing line (``warm start: N steps in Xs``), the
  demonstrations' seconds from theirs;
- per RL iteration, from the run's CSV: ``perf/rollout_seconds`` (generation and env steps), ``perf/teacher_seconds``
  (the no-grad scoring: the teacher view), ``perf/update_seconds`` (forward and backward of every row), the rows
  (turns) of the batch and the rollout's success;
- the evaluations' greedy success (``eval/success`` by completed iterations), and the seconds each took: from the
  line before it (the warm start's end, or the last iteration's rollout shard) to its own result line, so they
  include what ran between (the Trainer's setup before the first one, the final checkpoint before the last).

Threads: ``--threads`` sets ``OMP_NUM_THREADS`` for the run (default: as the caller's environment has it).

    python benchmarks/smollm2_recipe.py --compare [--out DIR] [--threads N] [--json PATH] [--report PATH] [-- overrides]

``--compare`` runs the recipe twice, one after the other, each with its own fresh warm start: ``model.dtype=float32``
in ``DIR/float32``, then the default (``model.dtype=auto``) in ``DIR/auto``; it prints every phase of both side by side
with the ratio float32 s / auto s (above 1: auto is faster). Both runs meet the same machine one after the other,
so run it on a quiet one. ``--compare --from-json JSON`` renders such a run's report again from its JSON, no run.

    python benchmarks/smollm2_recipe.py --micro [--model smollm2|tiny] [--repeats N] [--json PATH] [--report PATH]

``--micro`` times each phase's unit of work in this process instead, on real PickupObj rows (4 training tasks x 4
expert turns, the model's chat template), in float32 and in bf16 side by side (LoRA r=16 both ways; bf16: the
frozen base stored in bf16, the adapters float32, and the rollout turn and teacher scoring on a plain bf16 copy with
the adapters merged: what ``model.dtype=auto`` gives where the CPU has avx512_bf16 or AMX), printed as a table with their ratio: one rollout turn (16 prompts, 8 new tokens, KV cache), teacher scoring of
the 16 teacher views (shared prefixes once), one update micro-batch (8 rows, forward and backward) and one
warm-start step (4 samples). A few minutes on SmolLM2; ``--model tiny`` runs it in seconds on the tiny Qwen2.
Whether bf16 pays depends on the processor: the table names its native bf16 flags. ``--busy N`` times the phases
with N processes spinning beside them (the models load first, alone): how a thread count and ``OMP_WAIT_POLICY``
(set by the caller; the micro-benchmark does not go through train.py, which sets PASSIVE) fare on a shared machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "teacher", "update")
WARM_DONE = re.compile(r"warm start: (\d+) steps in (\d+)s, final loss ([\d.naninf]+)")
WARM_CACHED = re.compile(r"warm start: loaded ")
DEMOS = re.compile(r"wrote (\d+) demonstration turns to .* in ([\d.]+)s")
EVAL = re.compile(r"eval \((before training|periodic|end), after (\d+) iterations?\): success ([\d.]+) on (\d+) episodes")
STAMP = re.compile(r"^\[\s*([\d.]+)\] (.*)$")


@dataclass
class Iteration:
    """One RL iteration's split, from the run's CSV."""

    iteration: int
    rollout: float
    teacher: float
    update: float
    rows: float
    """Turns in the batch: each is one row through generation, scoring and the update."""
    success: float
    """The training rollout's success (sampled at the rollout temperature)."""
    trained: float = float("nan")
    """Rows the update trained on: under ``optim.skip_zero_advantage`` a row whose advantage is 0 costs it nothing, so
    its time follows how the run learns (a group all won or all lost) as much as the precision."""

    @property
    def total(self) -> float:
        return self.rollout + self.teacher + self.update


@dataclass
class Result:
    command: str
    commit: str
    threads: str
    returncode: int
    wall_seconds: float
    peak_rss_mib: float
    warm_start_steps: int | None = None
    warm_start_seconds: float | None = None
    demos_seconds: float | None = None
    evals: list[dict[str, float]] = field(default_factory=list)
    iterations: list[Iteration] = field(default_factory=list)
    iteration_ends_s: dict[int, float] = field(default_factory=dict)
    """Iteration -> seconds since the start when its rollout shard was written."""
    wait_policy: str = ""
    """``OMP_WAIT_POLICY`` of the run ("" where a JSON predates it). It matters beyond one thread: waiting passively
    (train.py's default, right beside other work) costs every small parallel op a thread wake-up on a quiet machine."""

    @classmethod
    def from_dict(cls, d: dict) -> Result:
        """A :class:`Result` from its JSON (``--json``)."""
        return cls(**{**d, "iterations": [Iteration(**it) for it in d.get("iterations", [])],
                      "iteration_ends_s": {int(k): v for k, v in d.get("iteration_ends_s", {}).items()}})


def parse_output(stamped: list[tuple[float, str]]) -> dict:
    """What the run's output lines say: the warm start's steps and seconds, the demonstrations' seconds, and each
    evaluation ``{when, iteration, success, episodes, at}`` (``at``: seconds since the start its line came)."""
    out: dict = {"evals": []}
    for at, line in stamped:
        if m := WARM_DONE.search(line):
            out["warm_start_steps"], out["warm_start_seconds"], out["warm_start_done_at"] = int(m.group(1)), float(m.group(2)), at
        elif WARM_CACHED.search(line):
            out["warm_start_done_at"] = at
        elif m := DEMOS.search(line):
            out["demos_seconds"] = float(m.group(2))
        elif m := EVAL.search(line):
            out["evals"].append({"when": m.group(1), "iteration": int(m.group(2)), "success": float(m.group(3)),
                                 "episodes": int(m.group(4)), "at": at})
    return out


def eval_seconds(evals: list[dict], warm_done_at: float | None, iteration_ends: dict[int, float],
                 phases: dict[int, float]) -> list[dict]:
    """Each evaluation with ``seconds`` (None where unknown), all times in seconds since the start.

    Before training: from the warm start's end to its line (the Trainer's setup included). Periodic, after
    iteration i: it runs at i's end after i's rollout shard is written, so from that shard to its line. A run from
    before the shard writer moved ahead of the evaluation (its line comes before i's shard) wrote the shard after
    it: there it is i's span (the shard before to i's shard) less i's phases (``phases[i]``: rollout + teacher +
    update). At the end: after the last shard, so from that shard to its line (the final checkpoint included)."""
    out = []
    before = next((e["at"] for e in evals if e["iteration"] == 0), warm_done_at)
    last = max(iteration_ends) if iteration_ends else None
    for e in evals:
        i, seconds = e["iteration"], None
        if i == 0:
            seconds = None if warm_done_at is None else e["at"] - warm_done_at
        elif e["when"] == "periodic" and i in iteration_ends and e["at"] >= iteration_ends[i]:
            seconds = e["at"] - iteration_ends[i]
        elif e["when"] == "periodic":
            start = iteration_ends.get(i - 1) if i > 1 else before
            if start is not None and i in iteration_ends and i in phases:
                seconds = iteration_ends[i] - start - phases[i]
        elif last is not None:
            seconds = e["at"] - iteration_ends[last]
        out.append({**e, "seconds": None if seconds is None else round(seconds, 1)})
    return out


def csv_iterations(rows: list[dict[str, str]]) -> list[Iteration]:
    """The update rows of a run's CSV (the ones with ``perf/update_seconds``), one :class:`Iteration` each."""
    found = []
    for row in rows:
        if not row.get("perf/update_seconds"):
            continue
        turns = float(row.get("rollout/turns") or "nan")
        episodes = float(row.get("rollout/trajectories") or "nan")
        skipped = float(row.get("update/zero_advantage_share") or 0.0)
        found.append(Iteration(int(float(row["step"])), *(float(row[f"perf/{p}_seconds"]) for p in PHASES),
                               rows=turns * episodes, success=float(row.get("rollout/success") or "nan"),
                               trained=turns * episodes * (1.0 - skipped)))
    return sorted(found, key=lambda it: it.iteration)


def read_csv(folder: Path) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for path in sorted((folder / "csv").glob("version_*/metrics.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    return rows


def shard_ends(folder: Path, started: float) -> dict[int, float]:
    """Iteration (1-based) -> seconds since the start when its rollout shard was written (the iteration's end)."""
    return {int(p.stem.split("-")[1]): p.stat().st_mtime - started for p in (folder / "rollouts").glob("rollouts-*.tar")}


def run(overrides: list[str], out: Path, threads: str | None) -> tuple[int, float, float, list[tuple[float, str]], float]:
    """``train.py +experiment=smollm2 overrides output_dir=out``: (exit code, wall s, peak RSS MiB, stamped lines,
    start time as a Unix time). Output goes on to this terminal and into ``out/train.out``."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = threads
    cmd = [sys.executable, str(ROOT / "train.py"), "+experiment=smollm2", *overrides, f"output_dir={out}",
           "trainer.enable_progress_bar=false"]
    out.mkdir(parents=True, exist_ok=True)
    stamped: list[tuple[float, str]] = []
    started_unix, started = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        with (out / "train.out").open("w") as log:
            for line in proc.stdout:
                at = time.perf_counter() - started
                stamped.append((at, line.rstrip("\n")))
                log.write(f"[{at:8.1f}] {line}")
                log.flush()
                print(f"[{at:8.1f}] {line}", end="", flush=True)
        _, status, usage = os.wait4(proc.pid, 0)
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGINT)  # train.py's own handler checkpoints and stops between turns
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    scale = 1024 if sys.platform != "darwin" else 1024 * 1024  # ru_maxrss: KiB on Linux, bytes on macOS
    return proc.returncode, time.perf_counter() - started, usage.ru_maxrss / scale, stamped, started_unix


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout
    return f"{head or 'unknown'}{' plus uncommitted changes' if dirty.strip() else ''}"


def _threads(result: Result) -> str:
    return f"OMP_NUM_THREADS={result.threads}" + (f", OMP_WAIT_POLICY={result.wait_policy}" if result.wait_policy else "")


def markdown(result: Result) -> str:
    """The run's figures as markdown: the split per iteration, the evaluations, wall time and peak RSS."""
    lines = [f"`{result.command}` at {result.commit}, {_threads(result)}, exit code {result.returncode}",
             "", f"wall {result.wall_seconds:.0f} s ({result.wall_seconds / 60:.1f} min), peak RSS {result.peak_rss_mib:.0f} MiB", ""]
    if result.warm_start_seconds is not None and result.warm_start_steps:
        lines.append(f"warm start: {result.warm_start_steps} steps in {result.warm_start_seconds:.0f} s "
                     f"({result.warm_start_seconds / result.warm_start_steps:.1f} s a step)"
                     + (f"; demonstrations {result.demos_seconds:.1f} s" if result.demos_seconds is not None else ""))
        lines.append("")
    if result.iterations:
        lines += ["| iteration | rows | rollout s | teacher scoring s | update s | total s | s per row | training success |",
                  "|---|---|---|---|---|---|---|---|"]
        for it in result.iterations:
            lines.append(f"| {it.iteration} | {it.rows:.0f} | {it.rollout:.1f} | {it.teacher:.1f} | {it.update:.1f} | "
                         f"{it.total:.1f} | {it.total / max(it.rows, 1):.2f} | {it.success:.2f} |")
        n = len(result.iterations)
        sums = {p: sum(getattr(it, p) for it in result.iterations) for p in PHASES}
        total = sum(sums.values())
        lines.append(f"| all {n} | {sum(it.rows for it in result.iterations):.0f} | "
                     + " | ".join(f"{sums[p]:.0f} ({100 * sums[p] / max(total, 1e-9):.0f}%)" for p in PHASES)
                     + f" | {total:.0f} | | |")
        lines.append("")
    if result.evals:
        lines += ["| evaluation | after iterations | greedy success | episodes | seconds |", "|---|---|---|---|---|"]
        for e in result.evals:
            lines.append(f"| {e['when']} | {e['iteration']} | {e['success']:.2f} | {e['episodes']} | {e['seconds']} |")
        lines.append("")
    return "\n".join(lines)


def _phase_sums(result: Result) -> dict[str, float | None]:
    """Seconds per part of a run: the warm start, the RL phases summed over iterations, the evaluations summed
    (None where the run gave no figure)."""
    evals = [e["seconds"] for e in result.evals if e.get("seconds") is not None]
    out: dict[str, float | None] = {"wall": result.wall_seconds, "warm start": result.warm_start_seconds}
    for p in PHASES:
        out[p] = sum(getattr(it, p) for it in result.iterations) if result.iterations else None
    out["evaluations"] = sum(evals) if evals else None
    trained = sum(it.trained for it in result.iterations)
    out["update per trained row"] = out["update"] / trained if out["update"] is not None and trained > 0 else None
    return out


COMPARE_ROWS = {"wall": "wall (whole recipe)", "warm start": "warm start", "rollout": "RL rollout",
                "teacher": "teacher scoring (with any recompute)", "update": "update",
                "update per trained row": "update per row trained (nonzero advantage)", "evaluations": "evaluations"}


def _seconds(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _curve(result: Result) -> str:
    return " / ".join(f"{100 * e['success']:.0f}%" for e in result.evals) or "-"


def compare_table(float32: Result, auto: Result) -> str:
    """The two runs of ``--compare`` side by side: seconds per part and float32 s / auto s, then peak RSS and each
    evaluation's greedy success."""
    a, b = _phase_sums(float32), _phase_sums(auto)
    lines = [f"float32: `{float32.command}`; auto: `{auto.command}`; at {auto.commit}, {_threads(auto)}, "
             f"exit codes {float32.returncode} and {auto.returncode}", "",
             "| part | float32 s | auto s | float32 s / auto s |", "|---|---|---|---|"]
    for key, name in COMPARE_ROWS.items():
        x, y = a[key], b[key]
        digits = 3 if key == "update per trained row" else 0  # seconds per row are fractions; the rest are whole
        ratio = f"{x / y:.2f}x" if x and y else "-"
        ratio = f"**{ratio}**" if key == "wall" and x and y else ratio
        lines.append(f"| {name} | {_seconds(x, digits)} | {_seconds(y, digits)} | {ratio} |")
    lines.append(f"| peak RSS MiB | {float32.peak_rss_mib:.0f} | {auto.peak_rss_mib:.0f} | |")
    lines.append(f"| greedy success at each evaluation | {_curve(float32)} | {_curve(auto)} | |")
    trained = [sum(it.trained for it in r.iterations) for r in (float32, auto)]
    lines += ["", f"Rows the update trained on: {trained[0]:.0f} (float32) and {trained[1]:.0f} (auto). Rows whose advantage "
              "is 0 (a group all won or all lost) cost the update nothing, so its time, and the wall's, also follows how "
              "each run learned; the time per row trained does not."]
    return "\n".join(lines)


# ---------------------------------------------------------------- --micro: each phase's unit of work, timed here

LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}


def micro_rows(tokenizer) -> tuple[list[list[int]], list[list[int]], list[list[int]], list[tuple[list[int], list[int]]]]:
    """Student prompts, teacher prompts and replies of 4 PickupObj training tasks x 4 expert turns (the recipe's
    prompt settings), and warm-start samples (each student row, every other one also as its teacher view)."""
    import gymnasium as gym

    import agentopsd.envs  # noqa: F401
    from agentopsd.models.warmstart import _reply
    from agentopsd.rollout.prompts import PromptBuilder
    from agentopsd.rollout.skills import SkillBank

    builder = PromptBuilder(tokenizer, output_format="action", history_window=0, show_admissible=False,
                            system_prompt="Act in the grid world.")
    bank = SkillBank.for_env("babyai", max_general=0)
    env = gym.make("agentopsd/BabyAI-PickupObj-v0", split="train", disable_env_checker=True)
    students, teachers, replies = [], [], []
    for task in range(4):
        obs, info = env.reset(seed=task, options={"task_index": task})
        for _ in range(4):
            views = builder.build_views(info["task"], [], obs, None, bank.block(info["skill_key"], info["task"], obs))
            action = env.unwrapped.expert_action()
            students.append(list(views.student))
            teachers.append(list(views.teacher))
            replies.append(_reply(tokenizer, action))
            obs, _, term, trunc, info = env.step(action)
            if term or trunc:
                obs, info = env.reset(seed=task + 100, options={"task_index": task})
    env.close()
    samples = [(s, r) for s, r in zip(students, replies)] + [(t, r) for t, r in zip(teachers[::2], replies[::2])]
    return students, teachers, replies, samples


def _best(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls, in seconds: on a shared machine the other runs only ever add time."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _update_step(model, pad_id: int, prompts: list[list[int]], replies: list[list[int]]) -> None:
    """One update micro-batch's work: the student log-probs at the action tokens with gradient, and a backward."""
    import torch

    from agentopsd.rollout.scoring import Scorer

    width = max(len(p) + len(r) for p, r in zip(prompts, replies))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    amask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, replies)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        amask[i, len(p) : len(p) + len(r)] = True
    scorer = Scorer(model, pad_id, 1.0, micro_batch_size=len(prompts), max_tokens_per_micro_batch=0, device=torch.device("cpu"))
    model.train()
    lp, _ = scorer.action_scores(ids, attn, amask, entropy=False)
    (-lp.float().mean()).backward()
    model.zero_grad(set_to_none=True)


MICRO_PHASES = {
    "rollout turn": "16 prompts, 8 new tokens, KV cache",
    "teacher scoring": "16 teacher views + replies, no grad",
    "update micro-batch": "8 rows, forward + backward, LoRA",
    "warm-start step": "4 samples, forward + backward + AdamW, LoRA",
}
"""Each phase's unit of work, timed in float32 and in bf16 (see the module's docstring)."""

MICRO_DTYPES = ("float32", "bfloat16")
TINY_MODEL = {"vocab_size": 512, "hidden_size": 192, "num_layers": 3, "num_heads": 4, "intermediate_size": 768}
"""``--model tiny``: the quickstart's default tiny Qwen2 (no download), so that CI checks the code runs."""


def _phases(path: str, dtype: str) -> tuple[dict[str, object], dict[str, int]]:
    """The policy loaded in ``dtype`` with LoRA (bf16: the frozen base in bf16, the adapters float32, as
    ``model.dtype=auto`` gives on a CPU with native bf16) and a callable per phase; the rows' mean lengths."""
    import torch

    from agentopsd.models.loading import load_policy
    from agentopsd.models.warmstart import _train
    from agentopsd.rollout.base import SamplingConfig
    from agentopsd.rollout.hf import HFGenerator
    from agentopsd.rollout.scoring import continuation_logprobs
    from agentopsd.training.precision import compute_in_half

    model, tokenizer = load_policy(path, dtype=dtype, lora=LORA)
    if dtype == "bfloat16":
        compute_in_half(model)  # as the run's WeightPlan has it: the adapters in bf16 too, attention in float32
    pad = tokenizer.pad_token_id
    students, teachers, replies, samples = micro_rows(tokenizer)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, stop_strings=("</action>",), seed=0)
    # as the run holds them: bf16 generates and scores the teacher view on a plain copy with the adapters merged
    half = torch.bfloat16 if dtype == "bfloat16" else None
    generator = HFGenerator(model, tokenizer, weights_dtype=half)
    scorer = generator.model

    def rollout_turn() -> None:
        torch.manual_seed(0)  # the same draws in both precisions, as far as their numbers allow
        generator.generate(students, sampling)

    def teacher_scoring() -> None:
        model.eval()
        with torch.no_grad():
            continuation_logprobs(scorer, teachers, replies, pad_id=pad, temperature=1.0)

    phases = {
        "rollout turn": rollout_turn,
        "teacher scoring": teacher_scoring,
        "update micro-batch": lambda: _update_step(model, pad, students[:8], replies[:8]),
        "warm-start step": lambda: _train(model, tokenizer, samples, steps=1, lr=1e-5, warmup=1, batch_size=4, seconds=1e9, seed=0),
    }
    lengths = {"student_tokens_mean": round(sum(map(len, students)) / len(students)),
               "teacher_tokens_mean": round(sum(map(len, teachers)) / len(teachers))}
    return phases, lengths


@contextmanager
def busy_neighbours(count: int):
    """``count`` processes that spin on a core each until the block ends: a shared machine's other work."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def micro(model: str = "smollm2", repeats: int = 3, busy: int = 0) -> dict[str, object]:
    """Seconds of each phase's unit of work in float32 and in bf16, one process: both models loaded side by side and
    the phases run alternately (float32, bf16, float32, ...), so a busy spell on the machine hits both; the best of
    ``repeats`` each (the first call of each also pays one-off setup); ``busy`` processes spin beside the timing."""
    import tempfile

    import torch

    from agentopsd.training.precision import NATIVE_BF16_FLAGS, read_cpu_flags

    with tempfile.TemporaryDirectory() as tmp:
        path = "smollm2-135m"
        if model == "tiny":
            import agentopsd.envs  # noqa: F401  (the tokenizer is trained on PickupObj's text)
            from agentopsd.models.tiny import tiny_policy

            tiny, tokenizer = tiny_policy("agentopsd/BabyAI-PickupObj-v0", skills="babyai", **TINY_MODEL)
            tiny.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            path = tmp
        loaded = {dtype: _phases(path, dtype) for dtype in MICRO_DTYPES}
    seconds: dict[str, dict[str, float]] = {phase: {} for phase in MICRO_PHASES}
    with busy_neighbours(busy):
        for phase in MICRO_PHASES:
            for _ in range(repeats):
                for dtype in MICRO_DTYPES:
                    took = _best(loaded[dtype][0][phase], 1)
                    seconds[phase][dtype] = round(min(seconds[phase].get(dtype, float("inf")), took), 4)
    flags = read_cpu_flags()
    return {"model": model, "threads": torch.get_num_threads(), "repeats": repeats, "busy": busy,
            "wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"), "spin_count": os.environ.get("GOMP_SPINCOUNT", "unset"),
            "native_bf16_flags": [f for f in NATIVE_BF16_FLAGS if f in flags],
            "avx512_flags": sorted(f for f in flags if f.startswith("avx512")), **loaded["float32"][1],
            "seconds": seconds}


def speedup(seconds: dict[str, float]) -> float:
    """bf16's speed-up on one phase: float32 seconds over bf16 seconds (above 1: bf16 is faster)."""
    return seconds["float32"] / max(seconds["bfloat16"], 1e-12)


def micro_table(figures: dict[str, object]) -> str:
    """The ``--micro`` figures as a markdown table, float32 and bf16 side by side with their ratio."""
    flags = ", ".join(figures["native_bf16_flags"]) or "none"
    waits = f"OMP_WAIT_POLICY {figures.get('wait_policy', 'unset')}" + (
        f", GOMP_SPINCOUNT {figures['spin_count']}" if figures.get("spin_count", "unset") != "unset" else "")
    lines = [f"model {figures['model']}, {figures['threads']} thread(s), {waits}, {figures.get('busy', 0)} busy "
             f"neighbour(s), best of {figures['repeats']}; native bf16 flags: {flags}",
             "", "| phase | work | float32 s | bf16 s | bf16 speed-up (float32 s / bf16 s) |", "|---|---|---|---|---|"]
    for phase, work in MICRO_PHASES.items():
        s = figures["seconds"][phase]
        lines.append(f"| {phase} | {work} | {s['float32']:.3f} | {s['bfloat16']:.3f} | {speedup(s):.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # under runs/smollm2/: the warm start is cached in runs/smollm2/warm_start, shared with `train.py +experiment=smollm2`
    parser.add_argument("--out", type=Path, default=None, help="the run's folder (default runs/smollm2/bench-<UTC time>)")
    parser.add_argument("--threads", default=None, help="OMP_NUM_THREADS for the run (default: as set here)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--report", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--compare", action="store_true",
                        help="run the recipe with model.dtype=float32, then with the default (auto), and print them side by side")
    parser.add_argument("--micro", action="store_true", help="time each phase's unit of work here, float32 and bf16 (no train.py run)")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                        help="--micro: SmolLM2-135M, or the tiny from-scratch Qwen2 (seconds, no download: CI)")
    parser.add_argument("--repeats", type=int, default=3, help="--micro: calls per phase and precision (the best is kept)")
    parser.add_argument("--busy", type=int, default=0, help="--micro: processes spinning beside the timing (a shared machine)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="--compare: no run; the report again from this JSON, the evaluations' seconds recomputed")
    parser.add_argument("overrides", nargs="*", help="train.py overrides after --, e.g. num_iterations=2")
    args = parser.parse_args(argv)
    if args.micro:
        figures = micro(args.model, args.repeats, args.busy)
        text = micro_table(figures)
        print("\n" + text)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"commit": commit(), **figures}, indent=1) + "\n")
        if args.report:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            args.report.write_text(text + "\n")
        return 0
    threads = args.threads or os.environ.get("OMP_NUM_THREADS") or "unset"
    if args.out is None:
        args.out = ROOT / "runs" / "smollm2" / time.strftime("bench-%Y-%m-%d_%H-%M-%S", time.gmtime())
    if args.compare and args.from_json:
        results = {k: rescore(Result.from_dict(v)) for k, v in json.loads(args.from_json.read_text()).items()}
        return write_compare(results, args.json, args.report)
    if args.compare:
        # the output folder is outside runs_dir, so each run's warm start is its own (no cache shared between them)
        results = {label: measure(args.overrides + extra, args.out / label, args.threads, threads)
                   for label, extra in (("float32", ["model.dtype=float32"]), ("auto", []))}
        return write_compare(results, args.json, args.report)
    result = measure(args.overrides, args.out, args.threads, threads)
    text = markdown(result)
    print("\n" + text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(result), indent=1) + "\n")
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text + "\n")
    return result.returncode


def write_compare(results: dict[str, Result], json_path: Path | None, report: Path | None) -> int:
    """``--compare``'s side-by-side table printed, and written with each run's own figures; the worst exit code."""
    text = compare_table(results["float32"], results["auto"])
    print("\n" + text)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({k: asdict(v) for k, v in results.items()}, indent=1) + "\n")
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(text + "\n\n" + "\n\n".join(f"## {k}\n\n{markdown(v)}" for k, v in results.items()))
    return max(r.returncode for r in results.values())


def rescore(result: Result) -> Result:
    """``result`` with its evaluations' seconds computed again (:func:`eval_seconds`) from the times it kept."""
    evals = eval_seconds(result.evals, None, result.iteration_ends_s, {it.iteration: it.total for it in result.iterations})
    before = {e["iteration"]: e["seconds"] for e in result.evals if e["iteration"] == 0}
    # the warm start's end is not kept: an evaluation before training keeps the seconds it was given
    return replace(result, evals=[{**e, "seconds": before[0]} if e["iteration"] == 0 else e for e in evals])


def measure(overrides: list[str], out: Path, threads: str | None, threads_shown: str) -> Result:
    """One recipe run (:func:`run`) and its figures."""
    code, wall, rss, stamped, started_unix = run(overrides, out, threads)
    parsed = parse_output(stamped)
    ends = shard_ends(out, started_unix)
    iterations = csv_iterations(read_csv(out))
    return Result(command="python train.py +experiment=smollm2 " + shlex.join(overrides), commit=commit(),
                  threads=threads_shown, returncode=code, wall_seconds=wall, peak_rss_mib=rss,
                  warm_start_steps=parsed.get("warm_start_steps"), warm_start_seconds=parsed.get("warm_start_seconds"),
                  demos_seconds=parsed.get("demos_seconds"),
                  evals=eval_seconds(parsed["evals"], parsed.get("warm_start_done_at"), ends,
                                     {it.iteration: it.total for it in iterations}),
                  iterations=iterations, iteration_ends_s=ends,
                  wait_policy=os.environ.get("OMP_WAIT_POLICY") or "PASSIVE (train.py's default)")


if __name__ == "__main__":
    raise SystemExit(main())
