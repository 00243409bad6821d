"""Multi-node launch as the README writes it: the rank, world size, local rank and node Lightning sees under
its own launcher, torchrun (c10d rendezvous) and SLURM (environment variables set by the test), and a
two-"node" torchrun run of babyai_tiny on one machine, to the end."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_PROCID", "SLURM_LOCALID",
               "SLURM_NODEID", "SLURM_JOB_NAME", "SLURM_NODELIST", "SLURM_JOB_NUM_NODES")


def _trainer(monkeypatch, env: dict[str, str], devices: int, num_nodes: int) -> L.Trainer:
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="ddp", logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _seen(trainer: L.Trainer) -> tuple[str, int, int, int, int]:
    env = trainer.strategy.cluster_environment
    return type(env).__name__, trainer.global_rank, trainer.world_size, trainer.local_rank, trainer.node_rank


def test_lightning_launcher(monkeypatch):
    # python train.py trainer=ddp trainer.devices=2: Lightning starts the other process itself
    assert _seen(_trainer(monkeypatch, {}, devices=2, num_nodes=1)) == ("LightningEnvironment", 0, 2, 0, 0)


def test_torchrun_with_c10d_rendezvous(monkeypatch):
    # torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d ...: the 14th process (node 1, local 5)
    env = {"RANK": "13", "LOCAL_RANK": "5", "WORLD_SIZE": "16", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "8",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7"}
    assert _seen(_trainer(monkeypatch, env, devices=8, num_nodes=2)) == ("TorchElasticEnvironment", 13, 16, 5, 1)


def test_slurm(monkeypatch):
    # srun --nodes 2 --ntasks-per-node 8 python train.py ... trainer.devices=8 trainer.num_nodes=2: task 13
    env = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "SLURM_PROCID": "13",
           "SLURM_LOCALID": "5", "SLURM_NODEID": "1", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "node[0-1]",
           "SLURM_JOB_NUM_NODES": "2"}
    assert _seen(_trainer(monkeypatch, env, devices=8, num_nodes=2)) == ("SLURMEnvironment", 13, 16, 5, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_node_torchrun_on_one_machine(tmp_path):
    """Two torchrun launches, one per "node", meet at a c10d rendezvous and train babyai_tiny to the end,
    in one run folder (the runs_dir every node shares)."""
    port, runs = _free_port(), tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "train.py", "experiment=babyai_tiny", "trainer=ddp",
           "trainer.accelerator=cpu", "trainer.devices=1", "trainer.num_nodes=2", "trainer.precision=32-true",
           "trainer.enable_progress_bar=false", "trainer.strategy.timeout.seconds=60", f"runs_dir={runs}", "evaluation.num_tasks=3"]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for node in nodes:
        try:
            outs.append(node.communicate(timeout=600))
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.kill()
            pytest.fail("the two-node run did not finish in 600 s")
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err[-4000:]
    assert sum(out.count("eval success:") for out, _ in outs) == 1  # the closing lines, once, on global rank 0
    (run,) = [p for p in runs.iterdir() if p.is_dir() and not p.is_symlink()]
    assert run.name == "torchrun-two-nodes" and (run / "checkpoints" / "last.ckpt").is_file()
