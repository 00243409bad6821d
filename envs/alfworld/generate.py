"""Write generated ALFWorld tasks ahead of time, e.g. before many workers start.

    python -m agentopsd.envs.alfworld.generate --split eval
    python -m agentopsd.envs.alfworld.generate --split train --limit 600 --cache-dir /data/alfworld-cache

The env generates each task on first use anyway; this only moves that cost (~1.5 s a task,
most of it the expert's verification run) out of the first episodes.
"""

from __future__ import annotations

import argparse
import time

from agentopsd.envs.alfworld.engine import play_expert
from agentopsd.envs.alfworld.scenes import CACHE_ENV, EXPERT_STEP_LIMIT, SIZES, cache_root, ensure_task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate ALFWorld scenes into the cache folder.")
    parser.add_argument("--split", choices=sorted(SIZES), default="eval")
    parser.add_argument("--cache-dir", default=None, help=f"default: ${CACHE_ENV} or ~/.cache/agentopsd/alfworld")
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks of the split")
    parser.add_argument("--scene-seed", type=int, default=0, help="another set of scenes (default 0)")
    args = parser.parse_args(argv)
    root = cache_root(args.cache_dir)
    count = min(SIZES[args.split], args.limit or SIZES[args.split])
    start = time.perf_counter()
    for index in range(count):
        ensure_task(root, args.split, index, lambda game: play_expert(game, EXPERT_STEP_LIMIT), args.scene_seed)
    print(f"{count} {args.split} tasks under {root / args.split} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
