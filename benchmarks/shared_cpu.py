"""Wall time of 3 quickstart iterations alone and beside a busy process, per thread setting.

    python benchmarks/shared_cpu.py                       # train.py's defaults, alone and beside one busy process
    python benchmarks/shared_cpu.py --settings 2:ACTIVE 2:PASSIVE 1:PASSIVE --busy 1

A laptop runs other things: OpenMP threads that spin while they wait for work (the ACTIVE wait
policy) fight a busy neighbour for the cores. Each setting ``threads:policy`` runs ``train.py``
(3 iterations, no warm start, a short evaluation) in a fresh process, with ``--busy`` processes
spinning beside it; ``default`` leaves both variables unset, so train.py's own defaults apply.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["num_iterations=3", "warm_start=null", "evaluation.before_training=false", "evaluation.num_tasks=8", "report=false",
       "trainer.enable_progress_bar=false"]


def timed_run(setting: str, runs_dir: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if setting != "default":
        threads, policy = setting.split(":")
        env.update(OMP_NUM_THREADS=threads, OMP_WAIT_POLICY=policy)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "train.py", *RUN, f"runs_dir={runs_dir}"], cwd=ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["default"], help="threads:policy pairs, or default")
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="numbers of busy neighbour processes")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "bench_shared_cpu")
    args = parser.parse_args()
    for busy in args.busy:
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            for setting in args.settings:
                print(f"busy neighbours {busy}  {setting:>10}: {timed_run(setting, args.runs_dir):6.1f} s", flush=True)
        finally:
            for p in spinners:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
