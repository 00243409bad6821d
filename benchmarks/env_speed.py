"""Environment steps per second with each environment's expert, and the expert's success on
the fixed evaluation list.

    python benchmarks/env_speed.py [--episodes 100] [--skip-alfworld]
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym

import agentopsd.envs  # noqa: F401


def run_expert(env_id: str, episodes: int) -> tuple[float, float, int]:
    env = gym.make(env_id, split="eval", disable_env_checker=True)
    n = min(episodes, env.unwrapped.num_tasks)
    wins, steps, t0 = 0, 0, time.perf_counter()
    for i in range(n):
        _, info = env.reset(seed=i, options={"task_index": i})
        done = False
        while not done:
            _, _, term, trunc, info = env.step(env.unwrapped.expert_action())
            steps += 1
            done = term or trunc
        wins += bool(info["won"])
    seconds = time.perf_counter() - t0
    env.close()
    return steps / seconds, wins / n, n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--skip-alfworld", action="store_true", help="ALFWorld's engine runs ~60 steps/s; its eval list takes minutes")
    args = parser.parse_args()
    ids = sorted(k for k in gym.registry if k.startswith("agentopsd/"))
    print(f"{'environment':40s} {'episodes':>8s} {'steps/s':>9s} {'expert success':>15s}")
    for env_id in ids:
        if args.skip_alfworld and "ALFWorld" in env_id:
            continue
        rate, success, n = run_expert(env_id, args.episodes)
        print(f"{env_id:40s} {n:8d} {rate:9.0f} {success:15.1%}")


if __name__ == "__main__":
    main()
